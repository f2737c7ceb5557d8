//! The pieces of CEL every writer in this folder shares: literals, lists, label-selector and
//! image-glob tests, a container's fields, GPU resource names and exemption scopes. It imports
//! nothing from the writers that use it.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

use crate::policy::{ContainerExemption, Exemptions, GpuPolicy};
use crate::{RESOURCE_GPU, RESOURCE_GPU_SHARED, RESOURCE_MIG_PREFIX};

/// Where an admission request holds the pod it judges: a Pod itself, or the pod template of
/// a workload. Every piece that reads the pod's own fields takes one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Pod {
    /// CEL of the pod's spec.
    pub(crate) spec: &'static str,
    /// CEL of the pod's metadata.
    pub(crate) meta: &'static str,
}

/// A Pod request: `object` is the pod.
pub(crate) const POD: Pod = Pod {
    spec: "object.spec",
    meta: "object.metadata",
};

/// A DaemonSet request: the pod is its template.
pub(crate) const DAEMON_SET_POD: Pod = Pod {
    spec: "object.spec.template.spec",
    meta: "object.spec.template.metadata",
};

impl Pod {
    /// CEL: the pod's service account as `namespace/name`, as the API server fills it in.
    pub(crate) fn service_account(self) -> String {
        let s = self.spec;
        format!(
            "(request.namespace + '/' + (has({s}.serviceAccountName) && {s}.serviceAccountName != '' ? {s}.serviceAccountName : 'default'))"
        )
    }
}

/// CEL terms: the pod's namespace is among `namespaces`, its service account among
/// `service_accounts`; one term for each list that names something.
pub(crate) fn scope_terms(
    pod: Pod,
    namespaces: &[String],
    service_accounts: &[String],
) -> Vec<String> {
    let mut terms = Vec::new();
    if !namespaces.is_empty() {
        terms.push(format!("request.namespace in {}", list(namespaces)));
    }
    if !service_accounts.is_empty() {
        terms.push(format!(
            "{} in {}",
            pod.service_account(),
            list(service_accounts)
        ));
    }
    terms
}

/// CEL terms, any of which exempts the whole pod: its namespace or its service account is
/// listed ([`Exemptions::pod_exemption`]).
pub(crate) fn pod_exempt(pod: Pod, exemptions: &Exemptions) -> Vec<String> {
    scope_terms(pod, &exemptions.namespaces, &exemptions.service_accounts)
}

/// CEL terms, all of which a container exemption's scope needs: the pod's namespace and
/// service account among those listed, and, where digests are listed, `image` (a CEL
/// expression) pinned to one of them ([`ContainerExemption::covers`]).
pub(crate) fn exemption_scope(pod: Pod, entry: &ContainerExemption, image: &str) -> Vec<String> {
    let mut all = scope_terms(pod, &entry.namespaces, &entry.service_accounts);
    all.extend(digests(entry, image));
    all
}

/// CEL: `image` is pinned to one of the digests `entry` lists; `None` where it lists none.
pub(crate) fn digests(entry: &ContainerExemption, image: &str) -> Option<String> {
    (!entry.digests.is_empty()).then(|| {
        format!(
            "{}.exists(d, {image}.endsWith('@' + d))",
            list(&entry.digests)
        )
    })
}

// Container fragments: `c` is a CEL expression of one container of the pod.

/// CEL: container `c` is privileged.
pub(crate) fn privileged(c: &str) -> String {
    format!(
        "(has({c}.securityContext) && has({c}.securityContext.privileged) && {c}.securityContext.privileged == true)"
    )
}

/// CEL: container `c`'s env entries, or none.
pub(crate) fn env(c: &str) -> String {
    format!("(has({c}.env) ? {c}.env : [])")
}

/// CEL: container `c` has an env entry of one of `names`.
pub(crate) fn has_env(c: &str, names: &[&str]) -> String {
    let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
    format!(
        "{}.exists(e, has(e.name) && e.name in {})",
        env(c),
        list(&names)
    )
}

/// CEL: container `c` has an `envFrom` prefix that could spell a runtime variable with a key
/// of what it reads ([`crate::gpu::spelled_by_prefix`]).
pub(crate) fn env_from_spells(c: &str) -> String {
    let variables: Vec<String> = (crate::gpu::RUNTIME_VARIABLES.iter())
        .map(|v| (*v).to_owned())
        .collect();
    format!(
        "(has({c}.envFrom) && {c}.envFrom.exists(f, has(f.prefix) && f.prefix != '' && {}.exists(v, v.startsWith(f.prefix) && v != f.prefix)))",
        list(&variables)
    )
}

/// CEL: container `c` mounts something at a path that names the toolkit's device-list
/// directory (the raw text: CEL cannot clean a path).
pub(crate) fn device_list_mount(c: &str) -> String {
    format!(
        "(has({c}.volumeMounts) && {c}.volumeMounts.exists(m, has(m.mountPath) && m.mountPath.contains({})))",
        literal(crate::gpu::DEVICE_LIST_MARK)
    )
}

/// CEL: `r` (a resource name) is a GPU resource under `policy` ([`crate::gpu::Rules`]).
pub(crate) fn gpu_resource(policy: &GpuPolicy, r: &str) -> String {
    let mut names = vec![RESOURCE_GPU.to_owned(), RESOURCE_GPU_SHARED.to_owned()];
    let own = &policy.spec.gpu.resource_name;
    if !names.contains(own) {
        names.push(own.clone());
    }
    names.push(crate::gpu::RESOURCE_PASSTHROUGH_ALIAS.to_owned());
    let mut any = vec![
        format!("{r} in {}", list(&names)),
        format!("{r}.startsWith({})", literal(RESOURCE_MIG_PREFIX)),
        format!("{r}.matches('^nvidia[.]com/[A-Z]')"),
    ];
    for pattern in &policy.spec.match_.gpu_resources {
        any.push(format!("{r}.matches({})", literal(&glob_regex(pattern))));
    }
    format!("({})", any.join(" || "))
}

/// CEL: container `c` is covered by `entry` ([`ContainerExemption::covers`]), or `None` when
/// the entry exempts nothing (it names neither namespaces nor service accounts).
pub(crate) fn covers(pod: Pod, entry: &ContainerExemption, c: &str) -> Option<String> {
    // The scope before the patterns: outside it none is tried.
    let scope = exemption_applies(pod, entry)?;
    Some(format!("({scope} && {})", image_matches(entry, c)))
}

/// CEL: the pod is where `entry` applies (its namespaces and service accounts), or `None`
/// when the entry exempts nothing (it names neither, or no image).
pub(crate) fn exemption_applies(pod: Pod, entry: &ContainerExemption) -> Option<String> {
    if entry.namespaces.is_empty() && entry.service_accounts.is_empty() || entry.images.is_empty() {
        return None;
    }
    Some(scope_terms(pod, &entry.namespaces, &entry.service_accounts).join(" && "))
}

/// CEL: container `c`'s image is one `entry` names (its patterns, and its digests where it
/// lists any), whatever the pod's namespace and service account.
pub(crate) fn image_matches(entry: &ContainerExemption, c: &str) -> String {
    let image = format!("{c}.image");
    // An image with neither tag nor digest is also tried as `<image>:latest`. Each pattern is
    // a literal, which the API server compiles once with the policy.
    let untagged = format!("!{image}.contains('@') && !{image}.matches(':[^/]*$')");
    let (exact, latest): (Vec<String>, Vec<String>) = (entry.images.iter())
        .map(|p| {
            let p = literal(&glob_regex(p));
            (
                format!("{image}.matches({p})"),
                format!("({image} + ':latest').matches({p})"),
            )
        })
        .unzip();
    let mut all = vec![format!("has({image}) && {image} != ''")];
    all.extend(digests(entry, &image));
    all.push(format!(
        "({} || ({untagged} && ({})))",
        exact.join(" || "),
        latest.join(" || ")
    ));
    format!("({})", all.join(" && "))
}

/// A CEL string literal.
pub(crate) fn literal(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('\'');
    for c in text.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\'' => out.push_str("\\'"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            c => out.push(c),
        }
    }
    out.push('\'');
    out
}

/// A CEL list of string literals.
pub(crate) fn list(items: &[String]) -> String {
    let items: Vec<String> = items.iter().map(|i| literal(i)).collect();
    format!("[{}]", items.join(", "))
}

/// An anchored RE2 pattern matching exactly what [`crate::exemptions::glob_match`] matches:
/// `*` any run of characters, `?` one, everything else literal.
pub(crate) fn glob_regex(glob: &str) -> String {
    let mut out = String::from("^(?s)");
    for c in glob.chars() {
        match c {
            '*' => out.push_str(".*"),
            '?' => out.push('.'),
            c if c.is_ascii_alphanumeric() || c == '/' || c == '-' || c == '_' || c == ':' => {
                out.push(c)
            }
            c if c.is_ascii() => {
                out.push('\\');
                out.push(c);
            }
            c => out.push(c),
        }
    }
    out.push('$');
    out
}

/// CEL that is true when `selector` selects an object whose labels are `labels` (a CEL
/// expression of a map that may be absent, such as `object.metadata.labels`), or `None` when
/// the selector is malformed ([`crate::selector::validate`]).
pub(crate) fn selects(selector: &LabelSelector, labels: &str) -> Option<String> {
    crate::selector::validate(selector).ok()?;
    let has = |key: &str| format!("(has({labels}) && {} in {labels})", literal(key));
    let value = |key: &str| format!("{labels}[{}]", literal(key));
    let mut all = Vec::new();
    for (key, wanted) in selector.match_labels.iter().flatten() {
        all.push(format!(
            "({} && {} == {})",
            has(key),
            value(key),
            literal(wanted)
        ));
    }
    for expr in selector.match_expressions.iter().flatten() {
        let key = expr.key.as_str();
        let values = list(expr.values.as_deref().unwrap_or_default());
        all.push(match expr.operator.as_str() {
            "In" => format!("({} && {} in {values})", has(key), value(key)),
            "NotIn" => format!("(!{} || !({} in {values}))", has(key), value(key)),
            "Exists" => has(key),
            _ => format!("!{}", has(key)),
        });
    }
    Some(if all.is_empty() {
        "true".to_owned()
    } else {
        all.join(" && ")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn literals_escape_quotes_and_backslashes() {
        assert_eq!(literal("it's\\"), "'it\\'s\\\\'");
        assert_eq!(list(&["a".into(), "b".into()]), "['a', 'b']");
    }

    #[test]
    fn globs_become_anchored_patterns_with_every_other_character_literal() {
        assert_eq!(glob_regex("nvcr.io/nvidia/*"), "^(?s)nvcr\\.io/nvidia/.*$");
        assert_eq!(glob_regex("a?b+[c]"), "^(?s)a.b\\+\\[c\\]$");
    }

    #[test]
    fn an_exemption_that_names_no_scope_exempts_nothing() {
        let entry = ContainerExemption {
            images: vec!["busybox".into()],
            namespaces: Vec::new(),
            service_accounts: Vec::new(),
            digests: Vec::new(),
        };
        assert_eq!(covers(POD, &entry, "c"), None);
    }
}
