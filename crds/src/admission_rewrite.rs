//! The privileged-GPU rewrite in CEL, for the MutatingAdmissionPolicy rendered from a GpuPolicy
//! in Enforce mode (docs/design.md, "Inside the API server").
//!
//! The API server rewrites a pod itself only where CEL gives exactly the engine's answer,
//! byte for byte in the `gpuwarden.io/rewritten` report: every privileged container names its
//! GPUs plainly (a GPU limit, one GPU request, or `NVIDIA_VISIBLE_DEVICES` with a list of IDs
//! or `all`), nothing else in the pod reaches GPUs around the kubelet, and no rule that needs
//! more than the pod and its namespace's labels applies (hostPath volumes, ResourceClaims,
//! count annotations, exempt images, `restricted` Pod Security, a denial). Every other pod is
//! left as it is by this mutation, and the webhook, whose matchConditions still send any
//! privileged pod, rewrites or denies it. A pod the API server rewrote is no longer
//! privileged and names no GPU through the runtime, so the webhook is not called for it.
//!
//! The differential test in `e2e/tests/admission_cel.rs` holds this CEL to the engine.

use crate::cel::{device_list_mount, env, has_env, list, literal, privileged};
use crate::gpu::{
    CountFrom, ENV_MIG_CONFIG_DEVICES, ENV_MIG_MONITOR_DEVICES, ENV_VISIBLE_DEVICES,
    shared_gpus_text,
};
use crate::pod_security::{BASELINE_CAPABILITIES, LABEL_PSA_ENFORCE};
use crate::policy::{GpuPolicy, RequestAs, VisibleDevicesAll};
use crate::{ANNOTATION_POLICY, ANNOTATION_PREFIX, ANNOTATION_REWRITTEN};

/// The variables of the rewrite (name, CEL), in the order they are declared: each may read
/// those before it.
pub type Variables = Vec<(&'static str, String)>;

/// The GPU quantities the API server's rewrite reads: a positive whole number as the API
/// server writes a quantity. Anything else (`0`, `500m`, `1e3`) is the webhook's.
const WHOLE: &str = "^[1-9][0-9]{0,3}$";
/// Container names the report writes as they are (a DNS label).
const NAME: &str = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$";
/// Capability names the rewrite reads as they are: already upper case, without `CAP_`.
const CAPABILITY: &str = "^[A-Z][A-Z0-9_]*$";
/// `NVIDIA_VISIBLE_DEVICES` values the report writes as they are.
const VISIBLE: &str = "^[A-Za-z0-9,._:/ -]*$";
/// GPU resource names the report writes as they are.
const RESOURCE: &str = "^[A-Za-z0-9._/-]+$";

/// The rewrite's variables and its JSONPatch expression for `policy`, whose GPU resource test
/// is `gpu` (a CEL expression of `r`); `None` when the policy asks for what CEL cannot do
/// (`gpu.requestAs: ResourceClaim`, which needs the namespace's ResourceClaimTemplates) or
/// names capabilities, a resource or driver capabilities the report could not write as they
/// are.
pub fn rewrite(policy: &GpuPolicy, gpu: &str) -> Option<(Variables, String)> {
    if !renders(policy) {
        return None;
    }
    let r = Rewrite { policy, gpu };
    // Each is evaluated once per pod, on first use: the pod's parts the rewrite reads more
    // than once are variables (lists by container index), not repeated expressions.
    let variables = vec![
        ("psa", r.psa()),
        ("visible", r.visible()),
        ("ids", r.ids()),
        ("all", r.all()),
        ("gpuLimits", r.gpu_limits()),
        ("gpuRequests", r.gpu_requests()),
        ("shapes", r.shapes()),
        ("cases", r.cases()),
        ("keys", r.keys()),
        ("holders", r.holders()),
        ("eligible", r.eligible()),
        ("counts", r.counts()),
        ("rewrite", r.within_max_per_pod()),
        ("kept", r.kept()),
        ("added", r.added()),
        ("first", r.first()),
        ("anew", r.set_anew()),
        ("report", r.report()),
    ];
    Some((variables, r.patch()))
}

/// Whether the API server can do the rewrite for `policy` (see [`rewrite`]).
pub fn renders(policy: &GpuPolicy) -> bool {
    let spec = &policy.spec;
    let plain = |caps: &[String]| {
        caps.iter().all(|c| {
            !c.is_empty()
                && !c.starts_with("CAP_")
                && c.bytes()
                    .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')
                && c.as_bytes()[0].is_ascii_uppercase()
        })
    };
    // The report writes the resource name and the driver capabilities as they are.
    let resource =
        (spec.gpu.resource_name.bytes()).all(|b| b.is_ascii_alphanumeric() || b"._/-".contains(&b));
    let driver = (spec.driver_capabilities.iter())
        .all(|c| c.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'));
    spec.gpu.request_as != RequestAs::ResourceClaim
        && plain(&spec.capabilities.default)
        && plain(&spec.capabilities.allowed)
        && resource
        && driver
}

/// CEL for one policy. Container fragments take the container as a CEL expression `c`.
struct Rewrite<'p> {
    policy: &'p GpuPolicy,
    /// CEL of `r`: a GPU resource name under the policy.
    gpu: &'p str,
}

/// The regular containers.
const C: &str = "object.spec.containers";
/// The init containers, or none.
const I: &str = "(has(object.spec.initContainers) ? object.spec.initContainers : [])";

fn claims(c: &str) -> String {
    format!("(has({c}.resources) && has({c}.resources.claims) && size({c}.resources.claims) > 0)")
}

fn asked(c: &str) -> String {
    format!(
        "(has({c}.securityContext) && has({c}.securityContext.capabilities) && has({c}.securityContext.capabilities.add) ? {c}.securityContext.capabilities.add : [])"
    )
}

fn whole(q: &str) -> String {
    format!("string({q}).matches({})", literal(WHOLE))
}

/// Not privileged and reaching no GPU around the kubelet: the rewrite leaves it as it is.
fn inert(c: &str) -> String {
    format!(
        "(!{} && !{} && !{})",
        privileged(c),
        has_env(
            c,
            &[
                ENV_VISIBLE_DEVICES,
                ENV_MIG_CONFIG_DEVICES,
                ENV_MIG_MONITOR_DEVICES
            ]
        ),
        device_list_mount(c)
    )
}

/// Its `NVIDIA_VISIBLE_DEVICES` entries.
fn visible_entries(c: &str) -> String {
    format!(
        "{}.filter(e, has(e.name) && e.name == {})",
        env(c),
        literal(ENV_VISIBLE_DEVICES)
    )
}

/// The IDs a value `v` names, trimmed.
fn ids(v: &str) -> String {
    format!("{v}.split(',').map(s, s.trim()).filter(s, s != '')")
}

/// Per regular container `i`: it is left without GPUs (it names the GPUs an earlier one holds).
const ZERO: &str = "(variables.cases[i] == 3 && variables.holders[i] >= 0)";
/// Stands for "no plain value" in `variables.visible`: outside [`VISIBLE`].
const NO_VALUE: &str = "?";

impl Rewrite<'_> {
    fn gpu_keys(&self, c: &str, field: &str) -> String {
        format!(
            "(has({c}.resources) && has({c}.resources.{field}) ? {c}.resources.{field}.filter(r, {}) : [])",
            self.gpu
        )
    }

    fn limits(&self, c: &str) -> String {
        self.gpu_keys(c, "limits")
    }

    fn requests(&self, c: &str) -> String {
        self.gpu_keys(c, "requests")
    }

    /// The sum of its GPU limits (each a whole number, see `eligible`).
    fn limited(&self, c: &str) -> String {
        format!(
            "([0] + {}.map(r, int(string({c}.resources.limits[r])))).sum()",
            self.limits(c)
        )
    }

    /// A privileged container the API server can rewrite, short of its GPU count.
    fn plain_privileged(&self, c: &str) -> String {
        format!(
            "({} && !(has({c}.envFrom) && size({c}.envFrom) > 0) && !{} && {}.all(e, has(e.name)) && !{} && {}.all(a, a.matches({}) && !a.startsWith('CAP_')) && has({c}.name) && {c}.name.matches({}))",
            privileged(c),
            device_list_mount(c),
            env(c),
            has_env(c, &[ENV_MIG_CONFIG_DEVICES, ENV_MIG_MONITOR_DEVICES]),
            asked(c),
            literal(CAPABILITY),
            literal(NAME),
        )
    }

    /// The level the namespace's Pod Security label enforces (`privileged` without one).
    fn psa(&self) -> String {
        let label = literal(LABEL_PSA_ENFORCE);
        format!(
            "has(namespaceObject.metadata.labels) && {label} in namespaceObject.metadata.labels ? namespaceObject.metadata.labels[{label}] : 'privileged'"
        )
    }

    /// Per regular container: the value of its last `NVIDIA_VISIBLE_DEVICES` entry (the
    /// kubelet's), or [`NO_VALUE`] without one that holds a value of its own.
    fn visible(&self) -> String {
        let last = "l[size(l) - 1]";
        format!(
            "{C}.map(c, {}).map(l, size(l) > 0 && has({last}.value) && !has({last}.valueFrom) ? {last}.value : {})",
            visible_entries("c"),
            literal(NO_VALUE)
        )
    }

    /// Per regular container: the IDs its value names, trimmed.
    fn ids(&self) -> String {
        format!("variables.visible.map(v, {})", ids("v"))
    }

    /// Per regular container: whether its value names `all`.
    fn all(&self) -> String {
        "variables.ids.map(l, l.exists(s, s.lowerAscii() == 'all'))".to_owned()
    }

    /// Container `i`'s value names GPUs the rewrite can count: IDs (at most
    /// `maxPerContainer` of them) or `all` where the policy counts it as its default.
    fn visible_countable(&self) -> String {
        let spec = &self.policy.spec.gpu;
        let all_ok = spec.visible_devices_all == VisibleDevicesAll::DefaultCount
            && spec.default_count <= spec.max_per_container;
        format!(
            "(variables.visible[i].matches({}) && !(variables.visible[i].trim().lowerAscii() in ['', 'none', 'void']) && size(variables.ids[i]) > 0 && (variables.all[i] ? {all_ok} : size(variables.ids[i].distinct()) <= {}))",
            literal(VISIBLE),
            spec.max_per_container,
        )
    }

    /// Container `i`'s count from its value.
    fn visible_count(&self) -> String {
        format!(
            "(variables.all[i] ? {} : size(variables.ids[i].distinct()))",
            self.policy.spec.gpu.default_count
        )
    }

    /// Per regular container: its GPU limits' names, and its GPU requests' names.
    fn gpu_limits(&self) -> String {
        format!("{C}.map(c, {})", self.limits("c"))
    }

    fn gpu_requests(&self) -> String {
        format!("{C}.map(c, {})", self.requests("c"))
    }

    /// Per regular container: 0 the rewrite leaves it, 9 privileged and plain (its case is
    /// read next), -1 the webhook's.
    fn shapes(&self) -> String {
        format!(
            "{C}.map(c, {} ? 0 : {} ? 9 : -1)",
            inert("c"),
            self.plain_privileged("c")
        )
    }

    /// Per regular container: 0 the rewrite leaves it, 1 privileged with a GPU limit, 2 with
    /// one GPU request, 3 with GPUs named in `NVIDIA_VISIBLE_DEVICES`, -1 the webhook's.
    fn cases(&self) -> String {
        let requests = "variables.gpuRequests[i]";
        format!(
            "lists.range(size({C})).map(i, variables.shapes[i] != 9 ? variables.shapes[i] : size(variables.gpuLimits[i]) > 0 ? 1 : size({requests}) == 1 ? ({} && {requests}[0].matches({}) ? 2 : -1) : size({requests}) == 0 && {} ? 3 : -1)",
            whole(&format!("{C}[i].resources.requests[{requests}[0]]")),
            literal(RESOURCE),
            self.visible_countable(),
        )
    }

    /// Per regular container of case 3: the GPUs it names, as a key two containers naming the
    /// same GPUs share (the sorted distinct IDs, or `all`).
    fn keys(&self) -> String {
        format!(
            "lists.range(size({C})).map(i, variables.cases[i] == 3 ? (variables.all[i] ? 'all' : variables.ids[i].distinct().sort().join(',')) : '')"
        )
    }

    /// Per regular container of case 3: the earlier one that holds the same GPUs, or -1.
    fn holders(&self) -> String {
        let same = "lists.range(i).filter(k, variables.cases[k] == 3 && variables.keys[k] == variables.keys[i])";
        format!(
            "lists.range(size({C})).map(i, variables.cases[i] == 3 && size({same}) > 0 ? {same}[0] : -1)"
        )
    }

    /// Whether the pod is one the API server rewrites, short of `maxPerPod`.
    fn eligible(&self) -> String {
        let every = |test: &dyn Fn(&str) -> String| {
            format!("{C}.all(c, {}) && {I}.all(c, {})", test("c"), test("c"))
        };
        let policy = &self.policy.spec;
        let mut all = vec![
            "variables.cases.exists(x, x > 0)".to_owned(),
            "!variables.cases.exists(x, x < 0)".to_owned(),
            format!("{I}.all(c, {})", inert("c")),
            format!(
                "lists.range(size({C})).all(i, variables.gpuLimits[i].all(r, {})) && {I}.all(c, {}.all(r, {}))",
                whole(&format!("{C}[i].resources.limits[r]")),
                self.limits("c"),
                whole("c.resources.limits[r]"),
            ),
            every(&|c| format!("!{}", claims(c))),
            "!(has(object.spec.ephemeralContainers) && size(object.spec.ephemeralContainers) > 0)"
                .to_owned(),
            "!(has(object.spec.resourceClaims) && size(object.spec.resourceClaims) > 0)".to_owned(),
            "!(has(object.spec.volumes) && object.spec.volumes.exists(v, has(v.hostPath)))"
                .to_owned(),
            format!(
                "!(has(object.metadata.annotations) && object.metadata.annotations.exists(k, k.startsWith({})))",
                literal(ANNOTATION_PREFIX)
            ),
            "variables.psa in ['privileged', 'baseline']".to_owned(),
            "(variables.psa == 'privileged' || !((has(object.spec.hostNetwork) && object.spec.hostNetwork) || (has(object.spec.hostPID) && object.spec.hostPID) || (has(object.spec.hostIPC) && object.spec.hostIPC)))".to_owned(),
            format!(
                "size(lists.range(size({C})).filter(i, variables.cases[i] > 0).map(i, {C}[i].name).distinct()) == size(variables.cases.filter(x, x > 0))"
            ),
        ];
        let exempt: Vec<String> = (policy.exemptions.containers.iter())
            .filter_map(|entry| crate::admission_policies::covers(entry, "c"))
            .collect();
        if !exempt.is_empty() {
            let any = exempt.join(" || ");
            all.push(format!("!{C}.exists(c, {any}) && !{I}.exists(c, {any})"));
        }
        all.join(" && ")
    }

    /// Per regular container, the GPUs it holds once rewritten (only for an eligible pod:
    /// every quantity read is then a whole number).
    fn counts(&self) -> String {
        let c = format!("{C}[i]");
        let requested = format!("{c}.resources.requests[variables.gpuRequests[i][0]]");
        format!(
            "variables.eligible ? lists.range(size({C})).map(i, variables.cases[i] == 2 ? int(string({requested})) : variables.cases[i] == 3 ? (variables.holders[i] >= 0 ? 0 : {}) : ([0] + variables.gpuLimits[i].map(r, int(string({c}.resources.limits[r])))).sum()) : []",
            self.visible_count(),
        )
    }

    /// Eligible, and the pod holds at most `maxPerPod` GPUs at once: its regular and sidecar
    /// containers together, and each other init container alone.
    fn within_max_per_pod(&self) -> String {
        let max = self.policy.spec.gpu.max_per_pod;
        let sidecar = "has(c.restartPolicy) && c.restartPolicy == 'Always'";
        format!(
            "variables.eligible && ([0] + variables.counts).sum() + ([0] + {I}.filter(c, {sidecar}).map(c, {})).sum() <= {max} && {I}.filter(c, !({sidecar})).all(c, {} <= {max})",
            self.limited("c"),
            self.limited("c"),
        )
    }

    /// Per regular container, the capabilities it keeps before Pod Security is applied: the
    /// policy's defaults, then those it asked for that the policy allows, each once.
    fn kept(&self) -> String {
        let caps = &self.policy.spec.capabilities;
        format!(
            "{C}.map(c, ({} + {}.filter(x, x in {})).distinct())",
            list(&caps.default),
            asked("c"),
            list(&caps.allowed)
        )
    }

    fn baseline(&self) -> String {
        let caps: Vec<String> = BASELINE_CAPABILITIES
            .iter()
            .map(|c| (*c).to_owned())
            .collect();
        list(&caps)
    }

    /// Per regular container, the capabilities added: those kept that Pod Security allows.
    fn added(&self) -> String {
        format!(
            "variables.kept.map(k, k.filter(a, variables.psa != 'baseline' || a in {}))",
            self.baseline()
        )
    }

    /// Container `i`'s kept capabilities that Pod Security withholds.
    fn withheld(&self) -> String {
        format!(
            "variables.kept[i].filter(a, variables.psa == 'baseline' && !(a in {}))",
            self.baseline()
        )
    }

    /// Container `i`'s asked capabilities that the policy refuses, sorted, each once.
    fn refused(&self) -> String {
        format!(
            "{}.filter(a, !(a in variables.kept[i])).distinct().sort()",
            asked(&format!("{C}[i]"))
        )
    }

    /// Container `c`'s `securityContext.capabilities` once rewritten.
    fn capabilities(&self, c: &str) -> String {
        let added = "variables.added[i]";
        if self.policy.spec.capabilities.drop_all {
            return format!(
                "(size({added}) > 0 ? {{'add': dyn({added}), 'drop': dyn(['ALL'])}} : {{'drop': dyn(['ALL'])}})"
            );
        }
        // Values typed `dyn`: the API server's type check wants one value type per map.
        let drop = format!("{c}.securityContext.capabilities.drop");
        format!(
            "(has({c}.securityContext.capabilities) && has({drop}) ? (size({added}) > 0 ? {{'add': dyn({added}), 'drop': dyn({drop})}} : {{'drop': dyn({drop})}}) : (size({added}) > 0 ? {{'add': dyn({added})}} : {{}}))"
        )
    }

    /// The GPU resource and quantity (CEL strings) of the limit added to container `C[i]`,
    /// for case 2 and case 3.
    fn limit(&self, case: u8) -> (String, String) {
        let c = format!("{C}[i]");
        if case == 2 {
            let r = "variables.gpuRequests[i][0]".to_owned();
            let q = format!("string({c}.resources.requests[{r}])");
            (r, q)
        } else {
            (
                literal(&self.policy.spec.gpu.resource_name),
                "string(variables.counts[i])".to_owned(),
            )
        }
    }

    /// The JSONPatch that adds the limit `(r, q)` to container `c` at `base`.
    fn limit_ops(c: &str, base: &str, (r, q): &(String, String)) -> String {
        format!(
            "(has({c}.resources) ? (has({c}.resources.limits) ? [JSONPatch{{op: 'add', path: {base} + '/resources/limits/' + {r}.replace('~', '~0').replace('/', '~1'), value: {q}}}] : [JSONPatch{{op: 'add', path: {base} + '/resources/limits', value: {{{r}: {q}}}}}]) : [JSONPatch{{op: 'add', path: {base} + '/resources', value: {{'limits': {{{r}: {q}}}}}}}])"
        )
    }

    /// The env pair set on container `i` (CEL strings): the driver capabilities on a GPU
    /// container, `NVIDIA_VISIBLE_DEVICES=void` on one left without GPUs. `None` for a GPU
    /// container when the policy names no driver capabilities.
    fn pair(&self) -> (String, String, bool) {
        let caps = self.policy.spec.driver_capabilities.join(",");
        let has_caps = !self.policy.spec.driver_capabilities.is_empty();
        (
            format!(
                "({ZERO} ? {} : {})",
                literal(ENV_VISIBLE_DEVICES),
                literal(crate::gpu::ENV_DRIVER_CAPABILITIES)
            ),
            format!(
                "({ZERO} ? {} : {})",
                literal(crate::admission_policies::VOID),
                literal(&caps)
            ),
            has_caps,
        )
    }

    /// Per regular container rewritten: the index of the env entry that already holds its
    /// pair (it stays), -1 when none does (the pair is appended), -2 when it has no pair.
    fn first(&self) -> String {
        let (key, value, has_caps) = self.pair();
        let e = env(&format!("{C}[i]"));
        let holding = format!(
            "lists.range(size({e})).filter(j, {e}[j].name == {key} && has({e}[j].value) && {e}[j].value == {value} && !has({e}[j].valueFrom))"
        );
        let no_pair = if has_caps {
            "false".to_owned()
        } else {
            format!("!{ZERO}")
        };
        format!(
            "lists.range(size({C})).map(i, variables.cases[i] <= 0 || {no_pair} ? -2 : size({holding}) > 0 ? {holding}[0] : -1)"
        )
    }

    /// Per regular container rewritten: whether its pair is set anew (appended, or other
    /// entries of its name removed).
    fn set_anew(&self) -> String {
        let (key, _, _) = self.pair();
        let e = env(&format!("{C}[i]"));
        format!(
            "lists.range(size({C})).map(i, variables.first[i] == -1 || (variables.first[i] >= 0 && lists.range(size({e})).exists(j, {e}[j].name == {key} && j != variables.first[i])))"
        )
    }

    /// Container `C[i]`'s edit: a list of JSONPatch operations.
    fn container_ops(&self) -> String {
        let c = format!("{C}[i]");
        let base = "('/spec/containers/' + string(i))";
        let security = format!(
            "[JSONPatch{{op: 'add', path: {base} + '/securityContext/privileged', value: false}}, JSONPatch{{op: 'add', path: {base} + '/securityContext/allowPrivilegeEscalation', value: false}}, JSONPatch{{op: 'add', path: {base} + '/securityContext/capabilities', value: {}}}]",
            self.capabilities(&c)
        );
        let requested = Self::limit_ops(&c, base, &self.limit(2));
        let visible = Self::limit_ops(&c, base, &self.limit(3));
        let (key, value, _) = self.pair();
        let e = env(&c);
        let visible_name = literal(ENV_VISIBLE_DEVICES);
        // A GPU container loses its NVIDIA_VISIBLE_DEVICES entries; the pair's other entries
        // go; the pair is appended when no entry held it. One operation sets the whole list:
        // each operation costs the API server a conversion of its value.
        let kept = format!(
            "lists.range(size({e})).filter(j, !((!{ZERO} && {e}[j].name == {visible_name}) || (variables.first[i] != -2 && {e}[j].name == {key} && j != variables.first[i])))"
        );
        let env_ops = format!(
            "(size({kept}) < size({e}) || variables.first[i] == -1 ? [JSONPatch{{op: 'add', path: {base} + '/env', value: dyn({kept}.map(j, dyn({e}[j]))) + (variables.first[i] == -1 ? [dyn({{'name': {key}, 'value': {value}}})] : [])}}] : [])"
        );
        format!(
            "{security} + (variables.cases[i] == 2 ? {requested} : variables.cases[i] == 3 && !{ZERO} ? {visible} : []) + {env_ops}"
        )
    }

    /// The `gpuwarden.io/rewritten` report as the engine writes it (JSON, containers sorted
    /// by name).
    fn report(&self) -> String {
        let c = format!("{C}[i]");
        let json_list = |name: &str, items: String| {
            format!("(size({items}) > 0 ? ',\"{name}\":[\"' + {items}.join('\",\"') + '\"]' : '')")
        };
        let raw = "variables.visible[i]";
        let text = |s: &str| {
            // Inside a JSON string: the fixed texts need no escaping beyond this.
            let quoted = serde_json::to_string(s).unwrap_or_default();
            literal(&quoted[1..quoted.len() - 1])
        };
        let limit_json =
            |(r, q): (String, String)| format!("',\"limits\":{{\"' + {r} + '\":\"' + {q} + '\"}}'");
        // CountFrom texts with a placeholder for what the pod wrote.
        const RAW: &str = "\u{1}";
        let split_raw = |t: String| -> String {
            let parts: Vec<String> = t.split(RAW).map(text).collect();
            parts.join(&format!(" + {raw} + "))
        };
        let from_request = text(&CountFrom::Request.to_string());
        let from_all = text(&CountFrom::VisibleAll.to_string());
        let from_ids = split_raw(CountFrom::Visible(RAW).to_string());
        let holder = format!("{C}[variables.holders[i]].name");
        let no_gpu = {
            const FIRST: &str = "\u{2}";
            let parts: Vec<String> = shared_gpus_text(FIRST, RAW)
                .split(FIRST)
                .map(|p| split_raw(p.to_owned()))
                .collect();
            parts.join(&format!(" + {holder} + "))
        };
        let counted = format!(
            "(variables.cases[i] == 2 ? {} + ',\"gpuCountFrom\":\"' + {from_request} + '\"' : variables.cases[i] == 3 && !{ZERO} ? {} + ',\"gpuCountFrom\":\"' + (variables.all[i] ? {from_all} : {from_ids}) + '\"' : variables.cases[i] == 3 ? ',\"noGpu\":\"' + {no_gpu} + '\"' : '')",
            limit_json(self.limit(2)),
            limit_json(self.limit(3)),
        );
        let (key, value, _) = self.pair();
        let visible_removed = format!(
            "(!{ZERO} && {}.exists(e, e.name == {}) ? ',\"envRemoved\":[\"' + {} + '\"]' : '')",
            env(&c),
            literal(ENV_VISIBLE_DEVICES),
            text(ENV_VISIBLE_DEVICES),
        );
        let dropped = if self.policy.spec.capabilities.drop_all {
            ",\"capabilitiesDropped\":[\"ALL\"]"
        } else {
            ""
        };
        let entry = format!(
            "'\"' + {c}.name + '\":{{\"privileged\":false,\"gpu\":' + ({ZERO} ? 'false' : 'true') + {} + {} + {} + {} + {counted} + {visible_removed} + (variables.anew[i] ? ',\"envSet\":{{\"' + {key} + '\":\"' + {value} + '\"}}' : '') + '}}'",
            json_list("capabilitiesAdded", "variables.added[i]".to_owned()),
            literal(dropped),
            json_list("capabilitiesRefused", self.refused()),
            json_list("capabilitiesWithheld", self.withheld()),
        );
        format!(
            "'{{\"containers\":{{' + lists.range(size({C})).filter(i, variables.cases[i] > 0).map(i, {entry}).sort().join(',') + '}}}}'"
        )
    }

    /// The whole JSONPatch: every rewritten container's edit, then the report and the
    /// policy reference; nothing unless the pod is one the API server rewrites.
    fn patch(&self) -> String {
        let reference = literal(&self.policy.reference());
        let key = |k: &str| {
            literal(&format!(
                "/metadata/annotations/{}",
                k.replace('~', "~0").replace('/', "~1")
            ))
        };
        let annotations = format!(
            "(has(object.metadata.annotations) ? [JSONPatch{{op: 'add', path: {}, value: variables.report}}, JSONPatch{{op: 'add', path: {}, value: {reference}}}] : [JSONPatch{{op: 'add', path: '/metadata/annotations', value: {{{}: variables.report, {}: {reference}}}}}])",
            key(ANNOTATION_REWRITTEN),
            key(ANNOTATION_POLICY),
            literal(ANNOTATION_REWRITTEN),
            literal(ANNOTATION_POLICY),
        );
        // A pod without a privileged container, most pods, reads none of the variables.
        format!(
            "({C}.exists(c, {}) && variables.rewrite ? lists.range(size({C})).filter(i, variables.cases[i] > 0).map(i, {}).flatten() + {annotations} : [])",
            privileged("c"),
            self.container_ops()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claims_mode_and_odd_capabilities_are_left_to_the_webhook() {
        let mut policy = GpuPolicy::default_policy();
        assert!(rewrite(&policy, "true").is_some());
        policy.spec.gpu.request_as = RequestAs::ResourceClaim;
        assert!(rewrite(&policy, "true").is_none());
        let mut policy = GpuPolicy::default_policy();
        policy.spec.capabilities.default = vec!["cap_net_raw".into()];
        assert!(rewrite(&policy, "true").is_none());
        let mut policy = GpuPolicy::default_policy();
        policy.spec.driver_capabilities = vec!["compute\"".into()];
        assert!(rewrite(&policy, "true").is_none());
    }

    #[test]
    fn the_report_texts_are_the_engines() {
        let (variables, _) = rewrite(&GpuPolicy::default_policy(), "true").unwrap();
        let report = &variables.iter().find(|(n, _)| *n == "report").unwrap().1;
        assert!(report.contains("NVIDIA_VISIBLE_DEVICES=all, policy default"));
        assert!(report.contains("names the same GPUs as container "));
        assert!(!report.contains('\u{1}') && !report.contains('\u{2}'));
    }
}
