//! NVIDIA NIM Operator's `NIMService` (`apps.nvidia.com/v1alpha1`): the pod the operator
//! renders from it, and the way back from a judged pod to the NIMService's own fields
//! (docs/design.md, "Custom resources without a pod template").
//!
//! A NIMService carries no pod template: the operator copies its image, command, env,
//! resources, annotations, scheduling fields and storage into a Deployment (a LeaderWorkerSet
//! for `multiNode`). The pre-flight judges that pod, as NIM Operator v3.1 renders it
//! (`api/apps/v1alpha1/nimservice_types.go` `GetDeploymentParams`, `manifests/deployment.yaml`):
//!
//! - the main container `<name>-ctr`, first: the image `repository:tag`, `command`, `args`,
//!   `resources`, and the env, the NIMService's own entries first, then the operator's
//!   (`NIM_CACHE_PATH`, `NGC_API_KEY` from `authSecret`, ...) where the NIMService sets none;
//! - `initContainers` and `sidecarContainers` (name, image, command, args, env,
//!   `workingDir`), each with the main env beneath its own;
//! - the pod's labels and annotations (`spec.labels`, `spec.annotations`), `nodeSelector`,
//!   `tolerations`, `affinity`, `runtimeClassName`, `schedulerName`, `priorityClassName`,
//!   image pull secrets, `runAsUser`/`runAsGroup`/`fsGroup` (`userID`, `groupID`, default 1000
//!   and 2000), the model store (`storage`: a NIMCache's or a named PVC, a host path, an
//!   emptyDir) and `/dev/shm`, and `draResources` as the pod's resource claims.
//!
//! The operator never sets privilege or capabilities, and the NIMService has no field for
//! them. Where the NIMService names no GPU and takes its model from a NIMCache, the operator
//! may assign GPUs from the cache's profile (its tensor parallelism, 1 by default; a
//! multi-node NIMService's `parallelism.tensor`): the pod is judged with that many, and the
//! judgement says so.

use serde_json::{Map, Value, json};

/// The API group of NIM Operator's resources.
pub const GROUP: &str = "apps.nvidia.com";
/// The kind this module reads.
pub const KIND: &str = "NIMService";

/// The GPU resource the operator assigns (fixed in its source).
const GPU: &str = "nvidia.com/gpu";

/// Where the model store is mounted.
const MODEL_STORE: &str = "/model-store";

/// A NIMService the operator could not render either: what is wrong and where.
#[derive(Debug, thiserror::Error)]
#[error("{field}: {problem}")]
pub struct NimError {
    /// The field, as a path under the NIMService (`spec.image.repository`).
    pub field: String,
    /// What is wrong with it.
    pub problem: String,
}

fn bad(field: &str, problem: impl Into<String>) -> NimError {
    NimError {
        field: field.to_owned(),
        problem: problem.into(),
    }
}

/// Whether an object is a NIMService.
pub fn is_nim_service(object: &Value) -> bool {
    let api_version = object["apiVersion"].as_str().unwrap_or("");
    object["kind"] == KIND && api_version.split_once('/').is_some_and(|(g, _)| g == GROUP)
}

/// The pod the operator renders for `nim`, and what the judgement must say of it.
#[derive(Debug, Clone, PartialEq)]
pub struct Rendered {
    /// The pod (`metadata` and `spec`).
    pub pod: Value,
    /// The GPUs assumed from a NIMCache profile, where the NIMService names none.
    pub assumed_gpus: Option<u64>,
    /// Notes for the judgement (the assumption, a multi-node NIMService).
    pub notes: Vec<String>,
}

/// The pod NIM Operator v3.1 renders for `nim` (module docs).
pub fn render(nim: &Value) -> Result<Rendered, NimError> {
    let (name, spec) = name_and_spec(nim)?;
    let image = image_of(spec.get("image"), "spec.image")?;
    let user_env = env_list(spec.get("env"), "spec.env")?;
    let main_env = merged(&user_env, &standard_env(spec));
    let mut resources = match spec.get("resources") {
        None | Some(Value::Null) => json!({}),
        Some(r @ Value::Object(_)) => r.clone(),
        Some(_) => return Err(bad("spec.resources", "not an object")),
    };
    let assumed_gpus = assume_gpus(spec, &mut resources);
    let notes = notes(spec, assumed_gpus);

    let claims = dra_claims(spec.get("draResources"))?;
    let claim_uses: Vec<Value> = claims.iter().map(|c| json!({"name": c["name"]})).collect();
    if !claim_uses.is_empty() {
        resources["claims"] = Value::Array(claim_uses.clone());
    }
    let main = main_container(name, image, spec, &main_env, resources);
    let mut containers = vec![main];
    containers.extend(sidecars(spec, &main_env, &claim_uses)?);
    let init = init_containers(spec, &main_env)?;
    let pod_spec = pod_spec(name, spec, containers, init, claims)?;
    let metadata = pod_metadata(name, spec)?;
    Ok(Rendered {
        pod: json!({"metadata": metadata, "spec": pod_spec}),
        assumed_gpus,
        notes,
    })
}

/// The NIMService's name, which the operator names the pod's container after, and its spec.
fn name_and_spec(nim: &Value) -> Result<(&str, &Map<String, Value>), NimError> {
    let name = nim["metadata"]["name"]
        .as_str()
        .filter(|n| !n.is_empty())
        .ok_or_else(|| {
            bad(
                "metadata.name",
                "missing: the operator names the pod's container after it",
            )
        })?;
    match &nim["spec"] {
        Value::Object(spec) => Ok((name, spec)),
        Value::Null => Err(bad("spec", "missing")),
        _ => Err(bad("spec", "not an object")),
    }
}

/// A multi-node NIMService's `multiNode`; `None` for a single-node one.
fn multi_node(spec: &Map<String, Value>) -> Option<&Value> {
    spec.get("multiNode").filter(|m| !m.is_null())
}

/// Where the NIMService names no GPU (neither a resource nor a claim) and the operator
/// assigns them (from a NIMCache's profile, or a multi-node NIMService's tensor
/// parallelism), writes that many into `resources` and returns how many.
fn assume_gpus(spec: &Map<String, Value>, resources: &mut Value) -> Option<u64> {
    let names_gpu = ["limits", "requests"]
        .iter()
        .any(|f| resources[f].get(GPU).is_some());
    let has_claims = spec
        .get("draResources")
        .and_then(Value::as_array)
        .is_some_and(|a| !a.is_empty());
    let from_cache = spec.get("storage").unwrap_or(&Value::Null)["nimCache"]["name"]
        .as_str()
        .is_some_and(|n| !n.is_empty());
    let multi_node = multi_node(spec);
    if names_gpu || has_claims || !(from_cache || multi_node.is_some()) {
        return None;
    }
    let tensor = multi_node
        .and_then(|m| m["parallelism"]["tensor"].as_u64())
        .unwrap_or(1);
    for field in ["limits", "requests"] {
        if !resources[field].is_object() {
            resources[field] = json!({});
        }
        resources[field][GPU] = json!(tensor.to_string());
    }
    Some(tensor)
}

/// What the judgement must say of the rendering: the GPUs assumed, a multi-node NIMService.
fn notes(spec: &Map<String, Value>, assumed_gpus: Option<u64>) -> Vec<String> {
    let multi_node = multi_node(spec).is_some();
    let mut notes = Vec::new();
    if let Some(tensor) = assumed_gpus {
        notes.push(format!(
            "judged with {GPU}: {tensor}, which the NIM operator assigns from the {} where the NIMService names no GPU",
            if multi_node {
                "multi-node parallelism.tensor"
            } else {
                "NIMCache profile's tensor parallelism (1 by default)"
            }
        ));
    }
    if multi_node {
        notes.push(
            "multi-node: the LeaderWorkerSet's leader and worker pods carry the same image, env, resources and annotations; judged as one pod".to_owned(),
        );
    }
    notes
}

/// The main container `<name>-ctr`, with the model store and `/dev/shm` mounted.
fn main_container(
    name: &str,
    image: String,
    spec: &Map<String, Value>,
    env: &[Value],
    resources: Value,
) -> Value {
    let mut main = Map::new();
    main.insert("name".into(), json!(format!("{name}-ctr")));
    main.insert("image".into(), json!(image));
    copy(spec, &mut main, &["command", "args"]);
    if let Some(policy) = spec.get("image").and_then(|i| i.get("pullPolicy")) {
        main.insert("imagePullPolicy".into(), policy.clone());
    }
    main.insert("env".into(), Value::Array(env.to_vec()));
    main.insert("resources".into(), resources);
    let mut mounts = vec![json!({"name": "model-store", "mountPath": MODEL_STORE})];
    mounts.push(json!({"name": "dshm", "mountPath": "/dev/shm"}));
    main.insert("volumeMounts".into(), Value::Array(mounts));
    Value::Object(main)
}

/// `sidecarContainers`, each using the pod's claims.
fn sidecars(
    spec: &Map<String, Value>,
    main_env: &[Value],
    claim_uses: &[Value],
) -> Result<Vec<Value>, NimError> {
    let mut out = Vec::new();
    for (i, extra) in array(spec.get("sidecarContainers"), "spec.sidecarContainers")?
        .iter()
        .enumerate()
    {
        let field = format!("spec.sidecarContainers[{i}]");
        let mut c = nim_container(extra, &field, main_env)?;
        if !claim_uses.is_empty() {
            c["resources"] = json!({"claims": claim_uses});
        }
        out.push(c);
    }
    Ok(out)
}

/// `initContainers`, each with the model store mounted.
fn init_containers(spec: &Map<String, Value>, main_env: &[Value]) -> Result<Vec<Value>, NimError> {
    let mut init = Vec::new();
    for (i, extra) in array(spec.get("initContainers"), "spec.initContainers")?
        .iter()
        .enumerate()
    {
        let field = format!("spec.initContainers[{i}]");
        let mut c = nim_container(extra, &field, main_env)?;
        c["volumeMounts"] = json!([{"name": "model-store", "mountPath": MODEL_STORE}]);
        init.push(c);
    }
    Ok(init)
}

/// The pod's spec around its containers: the scheduling fields, image pull secrets, the
/// user and group, the volumes and the resource claims.
fn pod_spec(
    name: &str,
    spec: &Map<String, Value>,
    containers: Vec<Value>,
    init: Vec<Value>,
    claims: Vec<Value>,
) -> Result<Map<String, Value>, NimError> {
    let mut pod_spec = Map::new();
    pod_spec.insert("serviceAccountName".into(), json!(name));
    if !init.is_empty() {
        pod_spec.insert("initContainers".into(), Value::Array(init));
    }
    pod_spec.insert("containers".into(), Value::Array(containers));
    copy(
        spec,
        &mut pod_spec,
        &[
            "runtimeClassName",
            "nodeSelector",
            "tolerations",
            "affinity",
            "schedulerName",
            "priorityClassName",
        ],
    );
    let pull_secrets = spec.get("image").and_then(|i| i.get("pullSecrets"));
    let secrets: Vec<Value> = array(pull_secrets, "spec.image.pullSecrets")?
        .iter()
        .map(|s| json!({"name": s}))
        .collect();
    if !secrets.is_empty() {
        pod_spec.insert("imagePullSecrets".into(), Value::Array(secrets));
    }
    let user = spec.get("userID").and_then(Value::as_i64).unwrap_or(1000);
    let group = spec.get("groupID").and_then(Value::as_i64).unwrap_or(2000);
    pod_spec.insert(
        "securityContext".into(),
        json!({"runAsUser": user, "runAsGroup": group, "fsGroup": group}),
    );
    let storage = spec.get("storage").unwrap_or(&Value::Null);
    pod_spec.insert(
        "volumes".into(),
        json!([model_store(storage, name)?, {"name": "dshm", "emptyDir": {"medium": "Memory"}}]),
    );
    if !claims.is_empty() {
        pod_spec.insert("resourceClaims".into(), Value::Array(claims));
    }
    Ok(pod_spec)
}

/// The pod's labels (`app: <name>` and `spec.labels`) and annotations.
fn pod_metadata(name: &str, spec: &Map<String, Value>) -> Result<Value, NimError> {
    let mut labels = Map::new();
    labels.insert("app".into(), json!(name));
    for (k, v) in string_map(spec.get("labels"), "spec.labels")? {
        labels.insert(k, v);
    }
    let annotations = string_map(spec.get("annotations"), "spec.annotations")?;
    Ok(json!({"labels": labels, "annotations": annotations}))
}

/// The NIMService that renders `judged` (the pod [`render`] gave, as the engine left it),
/// and each change its fields cannot hold, said as what and why.
pub fn back(nim: &Value, rendered: &Rendered, judged: &Value) -> (Value, Vec<String>) {
    let mut out = nim.clone();
    let mut cannot = Vec::new();
    let before = &rendered.pod;
    let spec = &nim["spec"];

    // The main container: its env and resources are the NIMService's.
    let (main_before, main_after) = (
        &before["spec"]["containers"][0],
        &judged["spec"]["containers"][0],
    );
    if main_before["env"] != main_after["env"] {
        let (env, standard_changed) = main_env_back(spec, main_before, main_after);
        if standard_changed {
            cannot.push(format!(
                "the operator's own env of container {} changes: it is not the NIMService's to set",
                main_before["name"].as_str().unwrap_or("")
            ));
        }
        set(&mut out, "env", Value::Array(env));
    }
    if main_before["resources"] != main_after["resources"] {
        let resources = resources_back(&main_after["resources"], rendered.assumed_gpus);
        set(&mut out, "resources", resources);
    }
    cannot.extend(extras_env_back(spec, before, judged, &mut out));
    // Pod annotations are the NIMService's, but for gpuwarden's own reports, which the webhook
    // writes on each pod it admits.
    let annotations_after = without_reports(&judged["metadata"]["annotations"]);
    if without_reports(&before["metadata"]["annotations"]) != annotations_after {
        set(&mut out, "annotations", annotations_after);
    }
    // Anything else that changed has no NIMService field.
    cannot.extend(pod_changes_without_field(before, judged));
    cannot.extend(container_changes_without_field(before, judged));
    (out, cannot)
}

/// The entries of a container's `env`.
fn env_of(container: &Value) -> impl Iterator<Item = &Value> {
    container["env"].as_array().into_iter().flatten()
}

/// Whether `list` has an entry named `name`.
fn has_entry(list: &[Value], name: &str) -> bool {
    list.iter().any(|e| e["name"] == name)
}

/// The main container's env `after` the engine, as the NIMService's `spec.env`: the
/// operator's own variables are left out where the NIMService does not set them. And whether
/// any of those changes, which the NIMService cannot say.
fn main_env_back(spec: &Value, before: &Value, after: &Value) -> (Vec<Value>, bool) {
    let user_env = env_list(spec.get("env"), "spec.env").unwrap_or_default();
    let standard: Vec<String> = standard_env(spec.as_object().unwrap_or(&Map::new()))
        .iter()
        .filter_map(|e| e["name"].as_str().map(str::to_owned))
        .collect();
    let env: Vec<Value> = env_of(after)
        .filter(|e| {
            let name = e["name"].as_str().unwrap_or("");
            has_entry(&user_env, name) || !standard.iter().any(|s| s == name)
        })
        .cloned()
        .collect();
    let standard_changed = env_of(after)
        .chain(env_of(before))
        .filter(|e| {
            let name = e["name"].as_str().unwrap_or("");
            !has_entry(&user_env, name) && standard.iter().any(|s| s == name)
        })
        .any(|e| {
            let name = &e["name"];
            let find = |c: &Value| env_of(c).find(|x| x["name"] == *name).cloned();
            find(before) != find(after)
        });
    (env, standard_changed)
}

/// The main container's `resources` as the NIMService's: without the pod's claims
/// (`draResources`), nor the GPUs the operator assigns where the NIMService names none.
fn resources_back(after: &Value, assumed_gpus: Option<u64>) -> Value {
    let mut resources = after.clone();
    if let Some(map) = resources.as_object_mut() {
        map.remove("claims");
    }
    if let Some(n) = assumed_gpus {
        for field in ["limits", "requests"] {
            if resources[field][GPU] == json!(n.to_string())
                && let Some(map) = resources[field].as_object_mut()
            {
                map.remove(GPU);
            }
        }
    }
    resources
}

/// Writes back the env of init and sidecar containers that changed: what they hold beyond
/// the main env is their own. Returns the inherited variables each loses, which it cannot.
fn extras_env_back(spec: &Value, before: &Value, judged: &Value, out: &mut Value) -> Vec<String> {
    let mut cannot = Vec::new();
    // What each inherits once the main container's env is written back.
    let inherited = &judged["spec"]["containers"][0]["env"];
    for (field, kind, offset) in [
        ("sidecarContainers", "containers", 1usize),
        ("initContainers", "initContainers", 0),
    ] {
        let Some(extras) = spec.get(field).and_then(Value::as_array) else {
            continue;
        };
        for (i, extra) in extras.iter().enumerate() {
            let (b, a) = (
                &before["spec"][kind][i + offset],
                &judged["spec"][kind][i + offset],
            );
            if b["env"] == a["env"] {
                continue;
            }
            let (env, lost) = extra_env_back(extra, b, a, inherited);
            if !lost.is_empty() {
                cannot.push(format!(
                    "spec.{field}[{i}] inherits {} from the main container's env, and loses it: the NIMService cannot remove an inherited variable from one container",
                    lost.join(", ")
                ));
            }
            if let Some(slot) = out["spec"][field].get_mut(i) {
                slot["env"] = Value::Array(env);
            }
        }
    }
    cannot
}

/// An init or sidecar container's env `after` the engine, as the `env` of `extra`, its
/// NIMService entry: its own entries, and those that differ from what it `inherited`. And
/// the inherited variables it loses.
fn extra_env_back<'b>(
    extra: &Value,
    before: &'b Value,
    after: &Value,
    inherited: &Value,
) -> (Vec<Value>, Vec<&'b str>) {
    let own_env = env_list(extra.get("env"), "").unwrap_or_default();
    let inherited_entry =
        |name: &Value| (inherited.as_array().into_iter().flatten()).find(|x| x["name"] == *name);
    let env: Vec<Value> = env_of(after)
        .filter(|e| {
            has_entry(&own_env, e["name"].as_str().unwrap_or(""))
                || inherited_entry(&e["name"]) != Some(*e)
        })
        .cloned()
        .collect();
    let lost: Vec<&str> = env_of(before)
        .filter(|e| !has_entry(&own_env, e["name"].as_str().unwrap_or("")))
        .filter(|e| !env_of(after).any(|x| x["name"] == e["name"]))
        .filter(|e| inherited_entry(&e["name"]).is_some())
        .filter_map(|e| e["name"].as_str())
        .collect();
    (env, lost)
}

/// Pod annotations but gpuwarden's own.
fn without_reports(annotations: &Value) -> Value {
    let mut m = annotations.as_object().cloned().unwrap_or_default();
    m.retain(|k, _| !k.starts_with(gpuwarden_crds::ANNOTATION_PREFIX));
    Value::Object(m)
}

/// The pod's fields that changed, which the operator renders and no NIMService field holds.
fn pod_changes_without_field(before: &Value, judged: &Value) -> Vec<String> {
    [
        ("the pod's volumes (the NIMService's storage)", "volumes"),
        ("the pod's resource claims (draResources)", "resourceClaims"),
        ("the pod's security context", "securityContext"),
        ("the pod's runtimeClassName", "runtimeClassName"),
    ]
    .into_iter()
    .filter(|(_, field)| before["spec"][field] != judged["spec"][field])
    .map(|(what, _)| format!("{what} change: the operator renders them, and the NIMService has no field for the change"))
    .collect()
}

/// The containers' fields that changed and no NIMService field holds (the main container's
/// resources are the NIMService's).
fn container_changes_without_field(before: &Value, judged: &Value) -> Vec<String> {
    let mut cannot = Vec::new();
    for kind in ["containers", "initContainers"] {
        let empty = Vec::new();
        let (bs, as_) = (
            before["spec"][kind].as_array().unwrap_or(&empty),
            judged["spec"][kind].as_array().unwrap_or(&empty),
        );
        for (at, (b, a)) in bs.iter().zip(as_).enumerate() {
            let main = kind == "containers" && at == 0;
            for field in [
                "securityContext",
                "volumeMounts",
                "image",
                "command",
                "args",
                "resources",
            ] {
                if main && field == "resources" {
                    continue;
                }
                if b[field] != a[field] {
                    cannot.push(format!(
                        "{field} of container {} changes: the NIMService has no field for it",
                        b["name"].as_str().unwrap_or("")
                    ));
                }
            }
        }
    }
    cannot
}

fn set(nim: &mut Value, field: &str, value: Value) {
    if !nim["spec"].is_object() {
        nim["spec"] = json!({});
    }
    nim["spec"][field] = value;
}

/// `repository:tag` of an `Image` (`{repository, tag, pullPolicy, pullSecrets}`).
fn image_of(image: Option<&Value>, field: &str) -> Result<String, NimError> {
    let image = image
        .filter(|i| i.is_object())
        .ok_or_else(|| bad(field, "missing: {repository, tag}"))?;
    let repository = image["repository"]
        .as_str()
        .filter(|r| !r.is_empty())
        .ok_or_else(|| bad(&format!("{field}.repository"), "missing"))?;
    Ok(match image["tag"].as_str() {
        Some(tag) if !tag.is_empty() => format!("{repository}:{tag}"),
        _ => repository.to_owned(),
    })
}

/// One of `initContainers` or `sidecarContainers`: its own env first, then the main env.
fn nim_container(extra: &Value, field: &str, main_env: &[Value]) -> Result<Value, NimError> {
    let name = extra["name"]
        .as_str()
        .filter(|n| !n.is_empty())
        .ok_or_else(|| bad(&format!("{field}.name"), "missing"))?;
    let image = image_of(extra.get("image"), &format!("{field}.image"))?;
    let own = env_list(extra.get("env"), &format!("{field}.env"))?;
    let mut c = Map::new();
    c.insert("name".into(), json!(name));
    c.insert("image".into(), json!(image));
    if let Some(o) = extra.as_object() {
        copy(o, &mut c, &["command", "args", "workingDir"]);
    }
    c.insert("env".into(), Value::Array(merged(&own, main_env)));
    Ok(Value::Object(c))
}

/// `first`, then the entries of `then` whose names `first` does not set.
fn merged(first: &[Value], then: &[Value]) -> Vec<Value> {
    let mut out = first.to_vec();
    out.extend(
        then.iter()
            .filter(|e| !first.iter().any(|f| f["name"] == e["name"]))
            .cloned(),
    );
    out
}

/// The env the operator gives the main container itself.
fn standard_env(spec: &Map<String, Value>) -> Vec<Value> {
    let port = spec
        .get("expose")
        .and_then(|e| e["service"]["port"].as_u64())
        .unwrap_or(8000)
        .to_string();
    let secret = spec.get("authSecret").and_then(Value::as_str).unwrap_or("");
    vec![
        json!({"name": "NIM_CACHE_PATH", "value": MODEL_STORE}),
        json!({"name": "NGC_API_KEY", "valueFrom": {"secretKeyRef": {"name": secret, "key": "NGC_API_KEY"}}}),
        json!({"name": "OUTLINES_CACHE_DIR", "value": "/tmp/outlines"}),
        json!({"name": "NIM_SERVER_PORT", "value": port}),
        json!({"name": "NIM_HTTP_API_PORT", "value": port}),
        json!({"name": "NIM_JSONL_LOGGING", "value": "1"}),
        json!({"name": "NIM_LOG_LEVEL", "value": "INFO"}),
    ]
}

/// The model store volume (`storage`), in the operator's order of precedence.
fn model_store(storage: &Value, name: &str) -> Result<Value, NimError> {
    let read_only = storage["readOnly"].as_bool().unwrap_or(false);
    let pvc = |claim: &str| json!({"name": "model-store", "persistentVolumeClaim": {"claimName": claim, "readOnly": read_only}});
    if let Some(cache) = storage["nimCache"]["name"]
        .as_str()
        .filter(|n| !n.is_empty())
    {
        // The NIMCache's PVC: its name is in the cache's status, not here.
        return Ok(pvc(&format!("<pvc of NIMCache {cache}>")));
    }
    if storage["pvc"]["create"].as_bool() == Some(true) {
        return Ok(pvc(&format!("{name}-pvc")));
    }
    if let Some(claim) = storage["pvc"]["name"].as_str().filter(|n| !n.is_empty()) {
        return Ok(pvc(claim));
    }
    if let Some(dir) = storage.get("emptyDir").filter(|d| d.is_object()) {
        let mut empty = json!({});
        if let Some(limit) = dir.get("sizeLimit") {
            empty["sizeLimit"] = limit.clone();
        }
        return Ok(json!({"name": "model-store", "emptyDir": empty}));
    }
    match storage.get("hostPath") {
        Some(Value::String(path)) => Ok(
            json!({"name": "model-store", "hostPath": {"path": path, "type": "DirectoryOrCreate"}}),
        ),
        Some(Value::Null) | None => Ok(json!({"name": "model-store", "emptyDir": {}})),
        Some(_) => Err(bad("spec.storage.hostPath", "not a string")),
    }
}

/// The pod's resource claims for `draResources`.
fn dra_claims(resources: Option<&Value>) -> Result<Vec<Value>, NimError> {
    let mut out = Vec::new();
    for (i, r) in array(resources, "spec.draResources")?.iter().enumerate() {
        let mut claim = json!({"name": format!("claim-{i}")});
        if let Some(n) = r["resourceClaimName"].as_str() {
            claim["resourceClaimName"] = json!(n);
        } else if let Some(n) = r["resourceClaimTemplateName"].as_str() {
            claim["resourceClaimTemplateName"] = json!(n);
        } else if r.get("claimCreationSpec").is_some() {
            claim["resourceClaimTemplateName"] = json!(format!("<created for draResources[{i}]>"));
        } else {
            return Err(bad(
                &format!("spec.draResources[{i}]"),
                "names neither resourceClaimName, resourceClaimTemplateName nor claimCreationSpec",
            ));
        }
        out.push(claim);
    }
    Ok(out)
}

fn array<'v>(value: Option<&'v Value>, field: &str) -> Result<&'v [Value], NimError> {
    match value {
        None | Some(Value::Null) => Ok(&[]),
        Some(Value::Array(items)) => Ok(items),
        Some(_) => Err(bad(field, "not a list")),
    }
}

fn env_list(value: Option<&Value>, field: &str) -> Result<Vec<Value>, NimError> {
    let items = array(value, field)?;
    for (i, e) in items.iter().enumerate() {
        if !e["name"].is_string() {
            return Err(bad(&format!("{field}[{i}].name"), "missing"));
        }
    }
    Ok(items.to_vec())
}

fn string_map(value: Option<&Value>, field: &str) -> Result<Map<String, Value>, NimError> {
    match value {
        None | Some(Value::Null) => Ok(Map::new()),
        Some(Value::Object(m)) => {
            if let Some((k, _)) = m.iter().find(|(_, v)| !v.is_string()) {
                return Err(bad(&format!("{field}.{k}"), "not a string"));
            }
            Ok(m.clone())
        }
        Some(_) => Err(bad(field, "not a map")),
    }
}

fn copy(from: &Map<String, Value>, to: &mut Map<String, Value>, fields: &[&str]) {
    for field in fields {
        if let Some(v) = from.get(*field).filter(|v| !v.is_null()) {
            to.insert((*field).to_owned(), v.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nim(spec: Value) -> Value {
        json!({"apiVersion": "apps.nvidia.com/v1alpha1", "kind": "NIMService",
            "metadata": {"name": "llm", "namespace": "ai"}, "spec": spec})
    }

    fn base() -> Value {
        json!({"image": {"repository": "nvcr.io/nim/llm", "tag": "1.8", "pullSecrets": ["ngc"]},
            "authSecret": "ngc-api", "resources": {"limits": {"nvidia.com/gpu": 2}},
            "storage": {"pvc": {"name": "store"}}})
    }

    #[test]
    fn the_pod_is_rendered_as_the_operator_renders_it() {
        let mut spec = base();
        spec["env"] =
            json!([{"name": "NIM_LOG_LEVEL", "value": "DEBUG"}, {"name": "A", "value": "1"}]);
        spec["annotations"] = json!({"team": "ml"});
        spec["userID"] = json!(42);
        spec["sidecarContainers"] = json!([{"name": "shipper", "image": {"repository": "fb"},
            "env": [{"name": "A", "value": "2"}]}]);
        let r = render(&nim(spec)).unwrap();
        let pod = &r.pod;
        let main = &pod["spec"]["containers"][0];
        assert_eq!(main["name"], "llm-ctr");
        assert_eq!(main["image"], "nvcr.io/nim/llm:1.8");
        assert_eq!(main["resources"]["limits"]["nvidia.com/gpu"], 2);
        let names: Vec<&str> = (main["env"].as_array().unwrap().iter())
            .map(|e| e["name"].as_str().unwrap())
            .collect();
        // The NIMService's own first, then the operator's it does not set.
        assert_eq!(&names[..3], ["NIM_LOG_LEVEL", "A", "NIM_CACHE_PATH"]);
        assert!(!names[2..].contains(&"NIM_LOG_LEVEL"));
        assert_eq!(main["env"][0]["value"], "DEBUG");
        let sidecar = &pod["spec"]["containers"][1];
        assert_eq!(sidecar["image"], "fb");
        assert_eq!(sidecar["env"][0], json!({"name": "A", "value": "2"}));
        assert!(
            sidecar["env"]
                .as_array()
                .unwrap()
                .iter()
                .any(|e| e["name"] == "NGC_API_KEY")
        );
        assert_eq!(pod["spec"]["imagePullSecrets"], json!([{"name": "ngc"}]));
        assert_eq!(pod["spec"]["securityContext"]["runAsUser"], 42);
        assert_eq!(pod["spec"]["securityContext"]["fsGroup"], 2000);
        assert_eq!(
            pod["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"],
            "store"
        );
        assert_eq!(pod["metadata"]["annotations"], json!({"team": "ml"}));
        assert_eq!(r.assumed_gpus, None);
    }

    #[test]
    fn gpus_from_a_cache_profile_are_assumed_and_said() {
        let mut spec = base();
        spec["resources"] = json!({});
        spec["storage"] = json!({"nimCache": {"name": "cache"}});
        let r = render(&nim(spec.clone())).unwrap();
        assert_eq!(r.assumed_gpus, Some(1));
        assert_eq!(
            r.pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"],
            "1"
        );
        assert!(r.notes[0].contains("NIMCache profile"));
        spec["multiNode"] = json!({"parallelism": {"tensor": 8, "pipeline": 2}});
        let r = render(&nim(spec)).unwrap();
        assert_eq!(r.assumed_gpus, Some(8));
        assert!(r.notes.iter().any(|n| n.starts_with("multi-node")));
    }

    #[test]
    fn storage_becomes_the_model_store_volume() {
        for (storage, key, value) in [
            (
                json!({"pvc": {"create": true}}),
                "/persistentVolumeClaim/claimName",
                json!("llm-pvc"),
            ),
            (
                json!({"hostPath": "/data/models"}),
                "/hostPath/path",
                json!("/data/models"),
            ),
            (
                json!({"emptyDir": {"sizeLimit": "10Gi"}}),
                "/emptyDir/sizeLimit",
                json!("10Gi"),
            ),
        ] {
            let mut spec = base();
            spec["storage"] = storage;
            let r = render(&nim(spec)).unwrap();
            assert_eq!(r.pod["spec"]["volumes"][0].pointer(key), Some(&value));
        }
    }

    #[test]
    fn bad_fields_are_named() {
        for (edit, field) in [
            (json!({"image": {"tag": "1"}}), "spec.image.repository"),
            (json!({"env": {"A": "1"}}), "spec.env"),
            (json!({"env": [{"value": "1"}]}), "spec.env[0].name"),
            (json!({"annotations": {"a": 1}}), "spec.annotations.a"),
            (json!({"draResources": [{}]}), "spec.draResources[0]"),
            (
                json!({"sidecarContainers": [{"image": {"repository": "x"}}]}),
                "spec.sidecarContainers[0].name",
            ),
            (json!({"storage": {"hostPath": 3}}), "spec.storage.hostPath"),
        ] {
            let mut spec = base();
            for (k, v) in edit.as_object().unwrap() {
                spec[k] = v.clone();
            }
            let e = render(&nim(spec)).unwrap_err();
            assert_eq!(e.field, field, "{e}");
        }
        assert_eq!(
            render(&json!({"metadata": {"name": "x"}}))
                .unwrap_err()
                .field,
            "spec"
        );
    }

    #[test]
    fn any_shape_of_any_field_is_an_answer_not_a_panic() {
        let fields = [
            "image",
            "env",
            "resources",
            "storage",
            "labels",
            "annotations",
            "nodeSelector",
            "tolerations",
            "draResources",
            "sidecarContainers",
            "initContainers",
            "multiNode",
            "userID",
            "groupID",
            "expose",
            "authSecret",
            "command",
            "runtimeClassName",
        ];
        let shapes = [
            json!(1),
            json!("x"),
            json!([]),
            json!([1, "x", {}]),
            json!({}),
            json!(null),
            json!({"name": 1, "tensor": "x", "nimCache": 3, "pvc": [], "limits": "x"}),
        ];
        for field in fields {
            for shape in &shapes {
                let mut spec = base();
                spec[field] = shape.clone();
                let cr = nim(spec);
                if let Ok(r) = render(&cr) {
                    let _ = back(&cr, &r, &json!({"spec": {"containers": 7}}));
                    let _ = back(&cr, &r, &r.pod);
                }
            }
        }
        for spec in [json!(1), json!("x"), json!([]), json!(null)] {
            assert!(render(&json!({"metadata": {"name": "x"}, "spec": spec})).is_err());
        }
    }

    #[test]
    fn changes_go_back_to_the_fields_that_render_them() {
        let mut spec = base();
        spec["env"] = json!([{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}, {"name": "B", "value": "1"}]);
        spec["annotations"] = json!({"cdi.k8s.io/x": "nvidia.com/gpu=all", "team": "ml"});
        let cr = nim(spec);
        let r = render(&cr).unwrap();
        let mut judged = r.pod.clone();
        let env = judged["spec"]["containers"][0]["env"]
            .as_array_mut()
            .unwrap();
        env.retain(|e| e["name"] != "NVIDIA_VISIBLE_DEVICES");
        judged["metadata"]["annotations"] =
            json!({"team": "ml", "gpuwarden.io/policy": "default@0"});
        let (out, cannot) = back(&cr, &r, &judged);
        assert_eq!(out["spec"]["env"], json!([{"name": "B", "value": "1"}]));
        assert_eq!(out["spec"]["annotations"], json!({"team": "ml"}));
        assert!(cannot.is_empty(), "{cannot:?}");
        // A volume has no NIMService field to go back to.
        judged["spec"]["volumes"] = json!([]);
        let (_, cannot) = back(&cr, &r, &judged);
        assert_eq!(cannot.len(), 1);
        assert!(cannot[0].contains("volumes"));
    }
}
