//! The privileged-GPU rewrite in CEL, for the MutatingAdmissionPolicy rendered from a GpuPolicy
//! in Enforce mode (docs/design.md, "Inside the API server").
//!
//! The API server rewrites a pod itself only where CEL gives exactly the engine's answer,
//! byte for byte in the `gpuwarden.io/rewritten` report: every privileged container names its
//! GPUs plainly (a GPU limit, one GPU request, or `NVIDIA_VISIBLE_DEVICES` with a list of IDs,
//! none empty and none with a space inside, or `all`), nothing else in the pod reaches GPUs
//! around the kubelet, and no rule that needs more than the pod and its namespace's labels
//! applies (hostPath volumes, ResourceClaims, count annotations, exempt images, `restricted`
//! Pod Security, a denial), and nothing a container loses would go unsaid: every pod under a
//! policy that drops every capability (`capabilities.dropAll`) gets the webhook's warning of
//! what its containers lose. (What start-up steps keep and lose is warned of by the static
//! start-up ValidatingAdmissionPolicy, on the stored pod, whichever path rewrote it.) Every
//! other pod is
//! left as it is by this mutation, and the webhook, whose matchConditions still send any
//! privileged pod, rewrites or denies it. A pod the API server rewrote is no longer
//! privileged and names no GPU through the runtime, so the webhook is not called for it.
//!
//! The API server's cost is per evaluated node, path resolved from `object` and comprehension
//! (docs/design.md, "Inside the API server"): each container is read once, through the
//! comprehension's own variable (`transformList`, never `object.spec.containers[i]`), what
//! only some pods need is read only for them, and a pod without a privileged container reads
//! none of it.
//!
//! The differential test in `e2e/tests/admission_cel.rs` holds this CEL to the engine.

use super::cel::{device_list_mount, env, env_from_spells, has_env, list, literal, privileged};
use crate::gpu::{CountFrom, ENV_VISIBLE_DEVICES, Rules, shared_gpus_text};
use crate::pod_security::{BASELINE_CAPABILITIES, LABEL_PSA_ENFORCE, RUNTIME_DEFAULT_CAPABILITIES};
use crate::policy::{GpuPolicy, RequestAs, VisibleDevicesAll};
use crate::rdma;
use crate::{ANNOTATION_POLICY, ANNOTATION_PREFIX, ANNOTATION_REWRITTEN};

/// The variables of the rewrite (name, CEL), in the order they are declared: each may read
/// those before it.
pub type Variables = Vec<(&'static str, String)>;

/// The GPU quantities the API server's rewrite reads: a positive whole number as the API
/// server writes a quantity. Anything else (`0`, `500m`, `1e3`) is the webhook's.
const WHOLE: &str = "^[1-9][0-9]{0,3}$";
/// Container names the report writes as they are (a DNS label).
const NAME: &str = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$";
/// The capabilities a container asks for, joined by commas, that the rewrite reads as they
/// are: each already upper case (a `CAP_` prefix is tested apart).
const CAPABILITIES: &str = "^[A-Z][A-Z0-9_]*(,[A-Z][A-Z0-9_]*)*$";
/// `NVIDIA_VISIBLE_DEVICES` values the rewrite reads and the report writes as they are: IDs
/// without spaces in them, none empty, separated by commas with spaces at most around them,
/// so that removing the spaces trims each ID as the engine does.
const VISIBLE: &str = "^ *[A-Za-z0-9._:/-]+( *, *[A-Za-z0-9._:/-]+)* *$";
/// GPU resource names the report writes as they are.
const RESOURCE: &str = "^[A-Za-z0-9._/-]+$";

/// The rewrite's variables and its JSONPatch expression for `policy`, whose GPU resource test
/// is `gpu` (a CEL expression of `r`); `None` when the policy asks for what CEL cannot do
/// (`gpu.requestAs: ResourceClaim`, which needs the namespace's ResourceClaimTemplates),
/// drops every capability (whose losses the webhook's warning names), or names capabilities,
/// a resource or driver capabilities the report could not write as they are.
pub fn rewrite(policy: &GpuPolicy, gpu: &str) -> Option<(Variables, String)> {
    if !renders(policy) {
        return None;
    }
    let r = Rewrite { policy, gpu };
    // Each is evaluated once per pod, on first use, and the API server's cost is per
    // evaluated node and comprehension: a container's facts are read in one pass, what only
    // some pods need (the shared-GPU rule, an env entry that already holds the pair) is read
    // only for them, and a pod without a privileged container reads none of them.
    let variables = vec![
        ("psa", r.psa()),
        ("visible", r.visible()),
        ("cases", r.cases()),
        ("eligible", r.eligible()),
        (
            "multi",
            "size(variables.cases.filter(x, x == 3)) > 1".to_owned(),
        ),
        ("keys", r.keys()),
        ("holders", r.holders()),
        ("counts", r.counts()),
        ("rewrite", r.within_max_per_pod()),
        ("kept", r.kept()),
        ("added", r.added()),
        ("first", r.first()),
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
        && !spec.capabilities.drop_all
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
fn inert(policy: &GpuPolicy, c: &str) -> String {
    format!(
        "(!{} && !{} && !{})",
        privileged(c),
        reaches_gpus(policy, c),
        device_list_mount(c)
    )
}

/// Container `c` has an env entry that names GPUs or devices for the runtime (a leak under
/// `policy`), or an `envFrom` prefix that could spell one.
fn reaches_gpus(policy: &GpuPolicy, c: &str) -> String {
    format!(
        "({} || {})",
        has_env(c, &Rules::of(policy).judged_variables()),
        env_from_spells(c)
    )
}

/// The IDs value `v` names, trimmed.
fn split(v: &str) -> String {
    format!("{v}.replace(' ', '').split(',')")
}

/// Value `v` names `all`.
fn names_all(v: &str) -> String {
    format!("('all' in {v}.lowerAscii().replace(' ', '').split(','))")
}

/// The number of distinct IDs value `v` names.
fn distinct_ids(v: &str) -> String {
    format!("size({}.distinct())", split(v))
}

/// Per regular container `i`: it is left without GPUs (it names the GPUs an earlier one holds).
/// (Only a container of case 3 has a holder.)
const ZERO: &str = "(variables.multi && variables.holders[i] >= 0)";
/// Container `i`'s value of `NVIDIA_VISIBLE_DEVICES`.
const V: &str = "variables.visible[i]";
/// Stands for "no plain value" in `variables.visible`: outside [`VISIBLE`].
const NO_VALUE: &str = "?";

impl Rewrite<'_> {
    /// CEL: container `c` has a GPU limit for which `test` (of `r`) holds.
    fn gpu_limit(&self, c: &str, test: &str) -> String {
        format!(
            "(has({c}.resources) && has({c}.resources.limits) && {c}.resources.limits.exists(r, {} && {test}))",
            self.gpu
        )
    }

    /// Container `c`'s GPU resources among its `field` (limits or requests), there.
    fn gpu_keys(&self, c: &str, field: &str) -> String {
        format!("{c}.resources.{field}.filter(r, {})", self.gpu)
    }

    /// The sum of its GPU limits (each a whole number, see `cases`).
    fn limited(&self, c: &str) -> String {
        format!(
            "(has({c}.resources) && has({c}.resources.limits) ? ([0] + {}.map(r, int(string({c}.resources.limits[r])))).sum() : 0)",
            self.gpu_keys(c, "limits")
        )
    }

    /// A privileged container the API server can rewrite, short of its GPU count.
    fn plain_privileged(&self, c: &str) -> String {
        let add = format!("{c}.securityContext.capabilities.add");
        let device_variables: Vec<String> = (Rules::of(self.policy).device_variables().iter())
            .map(|v| (*v).to_owned())
            .collect();
        // What may show RDMA use is the webhook's to read (docs/design.md, "RDMA").
        let rdma_variables: Vec<String> = rdma::VARIABLES.map(str::to_owned).to_vec();
        let plugin_libraries: Vec<String> = (rdma::PLUGIN_LIBRARIES.iter())
            .map(|p| format!("e.value.contains({})", literal(p)))
            .collect();
        format!(
            "(!(has({c}.envFrom) && size({c}.envFrom) > 0) && !{} && (!has({c}.env) || {c}.env.all(e, has(e.name) && !(e.name in {}) && !e.name.startsWith({}) && !(e.name in {}) && !(e.name == {} && has(e.value) && ({})))) && !(has({c}.volumeMounts) && {c}.volumeMounts.exists(m, has(m.mountPath) && m.mountPath.startsWith({}))) && (!has({c}.securityContext.capabilities) || !has({add}) || size({add}) == 0 || ({add}.join(',').matches({}) && !(',' + {add}.join(',')).contains(',CAP_'))) && has({c}.name) && {c}.name.matches({}))",
            device_list_mount(c),
            list(&device_variables),
            literal(rdma::NCCL_IB_PREFIX),
            list(&rdma_variables),
            literal(rdma::LIBRARY_PATH),
            plugin_libraries.join(" || "),
            literal(rdma::PLUGIN_MOUNT),
            literal(CAPABILITIES),
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

    /// Per regular container: the value of a privileged one's last `NVIDIA_VISIBLE_DEVICES`
    /// entry (the kubelet's), or [`NO_VALUE`] without one that holds a value of its own.
    fn visible(&self) -> String {
        let no = literal(NO_VALUE);
        format!(
            "{C}.map(c, {} && has(c.env) ? ([{no}] + c.env.filter(e, has(e.name) && e.name == {}).map(e, has(e.value) && !has(e.valueFrom) ? e.value : {no})).reverse()[0] : {no})",
            privileged("c"),
            literal(ENV_VISIBLE_DEVICES),
        )
    }

    /// Container `i`'s value names GPUs the rewrite can count: IDs (at most
    /// `maxPerContainer` of them) or `all` where the policy counts it as its default.
    fn visible_countable(&self) -> String {
        let spec = &self.policy.spec.gpu;
        let all_ok = spec.visible_devices_all == VisibleDevicesAll::DefaultCount
            && spec.default_count <= spec.max_per_container;
        format!(
            "({V}.matches({}) && !({V}.replace(' ', '').lowerAscii() in ['none', 'void']) && ({} ? {all_ok} : {} <= {}))",
            literal(VISIBLE),
            names_all(V),
            distinct_ids(V),
            spec.max_per_container,
        )
    }

    /// Container `i`'s count from its value.
    fn visible_count(&self) -> String {
        format!(
            "({} ? {} : {})",
            names_all(V),
            self.policy.spec.gpu.default_count,
            distinct_ids(V)
        )
    }

    /// Per regular container: 0 the rewrite leaves it, 1 privileged with a GPU limit, 2 with
    /// one GPU request, 3 with GPUs named in `NVIDIA_VISIBLE_DEVICES`, -1 the webhook's (a
    /// resource claim, a GPU limit that is not a plain whole number, or a shape the rewrite
    /// does not read).
    fn cases(&self) -> String {
        let c = "c";
        let requests = self.gpu_keys(c, "requests");
        format!(
            "{C}.transformList(i, c, {} || {} ? -1 : !{} ? ({} || {} ? -1 : 0) : !{} ? -1 : {} ? 1 : !has({c}.resources) || !has({c}.resources.requests) ? ({} ? 3 : -1) : [{requests}].map(q, size(q) == 1 ? ({} && q[0].matches({}) ? 2 : -1) : size(q) == 0 && {} ? 3 : -1)[0])",
            claims(c),
            self.gpu_limit(
                c,
                &format!("!{}", whole(&format!("{c}.resources.limits[r]")))
            ),
            privileged(c),
            reaches_gpus(self.policy, c),
            device_list_mount(c),
            self.plain_privileged(c),
            self.gpu_limit(c, "true"),
            self.visible_countable(),
            whole(&format!("{c}.resources.requests[q[0]]")),
            literal(RESOURCE),
            self.visible_countable(),
        )
    }

    /// Per regular container of case 3, when two or more are: the GPUs it names, as a key two
    /// containers naming the same GPUs share (the sorted distinct IDs, or `all`).
    fn keys(&self) -> String {
        format!(
            "variables.multi ? lists.range(size({C})).map(i, variables.cases[i] == 3 ? ({} ? 'all' : {}.distinct().sort().join(',')) : '') : []",
            names_all(V),
            split(V)
        )
    }

    /// Per regular container of case 3, when two or more are: the earlier one that holds the
    /// same GPUs, or -1.
    fn holders(&self) -> String {
        let same = "lists.range(i).filter(k, variables.cases[k] == 3 && variables.keys[k] == variables.keys[i])";
        format!(
            "variables.multi ? lists.range(size({C})).map(i, variables.cases[i] == 3 && size({same}) > 0 ? {same}[0] : -1) : []"
        )
    }

    /// Whether the pod is one the API server rewrites, short of `maxPerPod`.
    fn eligible(&self) -> String {
        let policy = &self.policy.spec;
        let mut all = vec![
            "!(-1 in variables.cases) && (1 in variables.cases || 2 in variables.cases || 3 in variables.cases)".to_owned(),
            format!(
                "(!has(object.spec.initContainers) || object.spec.initContainers.all(c, {} && !{} && !{}))",
                inert(self.policy, "c"),
                claims("c"),
                self.gpu_limit("c", &format!("!{}", whole("c.resources.limits[r]"))),
            ),
            "!(has(object.spec.ephemeralContainers) && size(object.spec.ephemeralContainers) > 0)"
                .to_owned(),
            "!(has(object.spec.resourceClaims) && size(object.spec.resourceClaims) > 0)".to_owned(),
            // A DaemonSet's pod is the webhook's: it denies a GPU count the pod did not write.
            format!(
                "!(has(object.metadata.ownerReferences) && object.metadata.ownerReferences.exists(o, has(o.controller) && o.controller == true && o.kind == {}))",
                literal(crate::gpu::KIND_DAEMON_SET)
            ),
            "!(has(object.spec.volumes) && object.spec.volumes.exists(v, has(v.hostPath)))"
                .to_owned(),
            format!(
                "!(has(object.metadata.annotations) && object.metadata.annotations.exists(k, k.startsWith({})))",
                literal(ANNOTATION_PREFIX)
            ),
            "variables.psa in ['privileged', 'baseline']".to_owned(),
            "(variables.psa == 'privileged' || !((has(object.spec.hostNetwork) && object.spec.hostNetwork) || (has(object.spec.hostPID) && object.spec.hostPID) || (has(object.spec.hostIPC) && object.spec.hostIPC)))".to_owned(),
            format!(
                "(size({C}) == 1 || size({C}.transformList(i, c, variables.cases[i] > 0, c.name).distinct()) == size(variables.cases.filter(x, x > 0)))"
            ),
        ];
        // An exemption's namespaces and service accounts first: outside them no image is read.
        for entry in &policy.exemptions.containers {
            let Some(scope) = super::cel::exemption_applies(super::cel::POD, entry) else {
                continue;
            };
            let image = super::cel::image_matches(entry, "c");
            all.push(format!(
                "!({scope} && ({C}.exists(c, {image}) || {I}.exists(c, {image})))"
            ));
        }
        all.join(" && ")
    }

    /// Per regular container, the GPUs it holds once rewritten (only for an eligible pod:
    /// every quantity read is then a whole number).
    fn counts(&self) -> String {
        let requested = format!(
            "c.resources.requests[{}[0]]",
            self.gpu_keys("c", "requests")
        );
        format!(
            "variables.eligible ? {C}.transformList(i, c, variables.cases[i] == 2 ? int(string({requested})) : variables.cases[i] == 3 ? ({ZERO} ? 0 : {}) : {}) : []",
            self.visible_count(),
            self.limited("c"),
        )
    }

    /// Eligible, and the pod holds at most `maxPerPod` GPUs at once: its regular and sidecar
    /// containers together, and each other init container alone.
    fn within_max_per_pod(&self) -> String {
        let max = self.policy.spec.gpu.max_per_pod;
        let sidecar = "has(c.restartPolicy) && c.restartPolicy == 'Always'";
        format!(
            "variables.eligible && ([0] + variables.counts).sum() + (has(object.spec.initContainers) ? ([0] + object.spec.initContainers.filter(c, {sidecar}).map(c, {})).sum() : 0) <= {max} && (!has(object.spec.initContainers) || object.spec.initContainers.filter(c, !({sidecar})).all(c, {} <= {max}))",
            self.limited("c"),
            self.limited("c"),
        )
    }

    /// Per regular container, the capabilities it keeps before Pod Security is applied: the
    /// policy's defaults, then those it asked for that the policy allows or the runtime gives
    /// an ordinary container, each once.
    fn kept(&self) -> String {
        let caps = &self.policy.spec.capabilities;
        let defaults = list(&caps.default);
        let mut allowed = caps.allowed.clone();
        allowed.extend(RUNTIME_DEFAULT_CAPABILITIES.iter().map(|c| (*c).to_owned()));
        format!(
            "{C}.map(c, ({defaults} + {}.filter(x, x in {})).distinct())",
            asked("c"),
            list(&allowed)
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
            "variables.psa == 'baseline' ? variables.kept.map(k, k.filter(a, a in {})) : variables.kept",
            self.baseline()
        )
    }

    /// Container `i`'s kept capabilities that Pod Security withholds.
    fn withheld(&self) -> String {
        format!(
            "(variables.psa == 'baseline' ? variables.kept[i].filter(a, !(a in {})) : [])",
            self.baseline()
        )
    }

    /// Container `c`'s `securityContext.capabilities` once rewritten: what it adds, and its
    /// own `drop` (the policy does not drop every capability, see [`renders`]).
    fn capabilities(&self, c: &str) -> String {
        let added = "variables.added[i]";
        // Values typed `dyn`: the API server's type check wants one value type per map.
        let drop = format!("{c}.securityContext.capabilities.drop");
        format!(
            "(has({c}.securityContext.capabilities) && has({drop}) ? (size({added}) > 0 ? {{'add': dyn({added}), 'drop': dyn({drop})}} : {{'drop': dyn({drop})}}) : (size({added}) > 0 ? {{'add': dyn({added})}} : {{}}))"
        )
    }

    /// The GPU resource and quantity (CEL strings) of the limit added to container `c`, for
    /// case 2 and case 3.
    fn limit(&self, case: u8) -> (String, String) {
        if case == 2 {
            let r = format!("{}[0]", self.gpu_keys("c", "requests"));
            let q = format!("string(c.resources.requests[{r}])");
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
    /// container, `NVIDIA_VISIBLE_DEVICES=void` on one left without GPUs; and whether a GPU
    /// container has one (the policy names driver capabilities).
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
                literal(crate::gpu::VOID),
                literal(&caps)
            ),
            has_caps,
        )
    }

    /// Per regular container rewritten: the index of the env entry that already holds its
    /// pair (it stays), -1 when none does (the pair is appended), -2 when it has no pair.
    fn first(&self) -> String {
        let (key, value, has_caps) = self.pair();
        let e = env("c");
        let holding = format!(
            "lists.range(size({e})).filter(j, {e}[j].name == {key} && has({e}[j].value) && {e}[j].value == {value} && !has({e}[j].valueFrom))"
        );
        let no_pair = if has_caps {
            "false".to_owned()
        } else {
            format!("!{ZERO}")
        };
        format!(
            "{C}.transformList(i, c, variables.cases[i] <= 0 || {no_pair} ? -2 : !{e}.exists(e, e.name == {key}) ? -1 : size({holding}) > 0 ? {holding}[0] : -1)"
        )
    }

    /// Container `i`'s pair is set anew (appended, or other entries of its name removed).
    fn set_anew(&self) -> String {
        let (key, _, _) = self.pair();
        let e = env("c");
        format!(
            "(variables.first[i] == -1 || (variables.first[i] >= 0 && lists.range(size({e})).exists(j, {e}[j].name == {key} && j != variables.first[i])))"
        )
    }

    /// Container `c`'s edit (its index `i`): a list of JSONPatch operations.
    fn container_ops(&self) -> String {
        let c = "c";
        let base = "('/spec/containers/' + string(i))";
        // One operation where the security context holds nothing else: each operation costs
        // the API server a conversion of its value.
        // `allowPrivilegeEscalation` stays as the container wrote it, so setuid programs keep
        // working (docs/design.md, "What a rewritten container keeps").
        let set = ["privileged", "capabilities"];
        let security = format!(
            "({c}.securityContext.all(k, k in {}) ? [JSONPatch{{op: 'add', path: {base} + '/securityContext', value: {{'privileged': dyn(false), 'capabilities': dyn({caps})}}}}] : [JSONPatch{{op: 'add', path: {base} + '/securityContext/privileged', value: false}}, JSONPatch{{op: 'add', path: {base} + '/securityContext/capabilities', value: {caps}}}])",
            list(&set.map(str::to_owned)),
            caps = self.capabilities(c)
        );
        let requested = Self::limit_ops(c, base, &self.limit(2));
        let visible = Self::limit_ops(c, base, &self.limit(3));
        let (key, value, _) = self.pair();
        let e = env(c);
        let visible_name = literal(ENV_VISIBLE_DEVICES);
        // A GPU container loses its NVIDIA_VISIBLE_DEVICES entries; the pair's other entries
        // go; the pair is appended when no entry held it. One operation sets the whole list.
        let gone = format!("(!{ZERO} && e.name == {visible_name})");
        let by_index = format!(
            "lists.range(size({e})).filter(j, !((!{ZERO} && {e}[j].name == {visible_name}) || ({e}[j].name == {key} && j != variables.first[i]))).map(j, dyn({e}[j]))"
        );
        let env_op = |entries: String| {
            format!("[JSONPatch{{op: 'add', path: {base} + '/env', value: dyn({entries})}}]")
        };
        let env_ops = format!(
            "(variables.first[i] == -1 ? {} : variables.first[i] >= 0 ? (size({by_index}) < size({e}) ? {} : []) : {e}.exists(e, {gone}) ? {} : [])",
            env_op(format!(
                "{e}.filter(e, !({gone} || e.name == {key})).map(e, dyn(e)) + [dyn({{'name': {key}, 'value': {value}}})]"
            )),
            env_op(by_index.clone()),
            env_op(format!("{e}.filter(e, !{gone}).map(e, dyn(e))")),
        );
        format!(
            "{security} + (variables.cases[i] == 2 ? {requested} : variables.cases[i] == 3 && !{ZERO} ? {visible} : []) + {env_ops}"
        )
    }

    /// The `gpuwarden.io/rewritten` report as the engine writes it (JSON, containers sorted
    /// by name).
    fn report(&self) -> String {
        let c = "c";
        let json_list = |name: &str, items: String| {
            format!("(size({items}) > 0 ? ',\"{name}\":[\"' + {items}.join('\",\"') + '\"]' : '')")
        };
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
            parts.join(&format!(" + {V} + "))
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
            "(variables.cases[i] == 2 ? {} + ',\"gpuCountFrom\":\"' + {from_request} + '\"' : variables.cases[i] == 3 && !{ZERO} ? {} + ',\"gpuCountFrom\":\"' + ({} ? {from_all} : {from_ids}) + '\"' : variables.cases[i] == 3 ? ',\"noGpu\":\"' + {no_gpu} + '\"' : '')",
            limit_json(self.limit(2)),
            limit_json(self.limit(3)),
            names_all(V),
        );
        let (key, value, _) = self.pair();
        // A container of case 3 has an entry; one of case 1 or 2 may.
        let visible_removed = format!(
            "(!{ZERO} && (variables.cases[i] == 3 || {}.exists(e, e.name == {})) ? ',\"envRemoved\":[\"' + {} + '\"]' : '')",
            env(c),
            literal(ENV_VISIBLE_DEVICES),
            text(ENV_VISIBLE_DEVICES),
        );
        let asked = asked(c);
        let refused = format!(
            "({asked}.all(a, a in variables.kept[i]) ? '' : ',\"capabilitiesRefused\":[\"' + {asked}.filter(a, !(a in variables.kept[i])).distinct().sort().join('\",\"') + '\"]')"
        );
        let entry = format!(
            "'\"' + {c}.name + '\":{{\"privileged\":false,\"gpu\":' + ({ZERO} ? 'false' : 'true') + {} + {refused} + {} + {counted} + {visible_removed} + ({} ? ',\"envSet\":{{\"' + {key} + '\":\"' + {value} + '\"}}' : '') + '}}'",
            json_list("capabilitiesAdded", "variables.added[i]".to_owned()),
            json_list("capabilitiesWithheld", self.withheld()),
            self.set_anew(),
        );
        format!(
            "'{{\"containers\":{{' + {C}.transformList(i, c, variables.cases[i] > 0, {entry}).sort().join(',') + '}}}}'"
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
            "({C}.exists(c, {}) && variables.rewrite ? {C}.transformList(i, c, variables.cases[i] > 0, {}).flatten() + {annotations} : [])",
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
    fn containers_are_read_through_the_comprehension_not_by_index() {
        // The API server resolves `object.spec.containers[i]` from the root at every use,
        // several times the cost of the comprehension's own variable: only the shared-GPU
        // text, for the rare second container naming the same GPUs, reads one by index (the
        // container that holds them).
        let (variables, patch) = rewrite(&GpuPolicy::default_policy(), "true").unwrap();
        for expression in (variables.iter().map(|(_, e)| e.as_str())).chain([patch.as_str()]) {
            let by_index = expression.matches("object.spec.containers[").count();
            let holder = expression
                .matches("object.spec.containers[variables.holders[i]].name")
                .count();
            assert_eq!(by_index, holder, "{expression}");
        }
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
