//! The CEL in deploy/admission evaluated without a cluster: the webhook's matchConditions,
//! the backstop ValidatingAdmissionPolicy and the policy that pins node agents to their own
//! node, run against real-looking pods and requests with a CEL interpreter. The API
//! server's own type checking is exercised by the end-to-end suite; this checks what the
//! expressions decide.

use std::collections::BTreeMap;
use std::sync::Arc;

use cel_interpreter::extractors::{Arguments, This};
use cel_interpreter::{Context, ExecutionError, FunctionContext, IdedExpr, Value as Cel};
use gpuwarden_e2e::manifests::{Document, load_file};
use serde_json::{Value, json};

/// Kubernetes' CEL has the strings extension; these are the parts the policies use.
/// `substring(start)` runs to the end, `substring(start, end)` to `end`.
fn substring(
    ftx: &FunctionContext,
    This(s): This<Arc<String>>,
    Arguments(args): Arguments,
) -> Result<Cel, ExecutionError> {
    let chars: Vec<char> = s.chars().collect();
    let int = |v: &Cel| match v {
        Cel::Int(i) => Ok(*i),
        other => Err(ftx.error(format!("substring index {other:?}"))),
    };
    let (start, end) = match args.as_slice() {
        [start] => (int(start)?, i64::try_from(chars.len()).unwrap_or(i64::MAX)),
        [start, end] => (int(start)?, int(end)?),
        _ => return Err(ftx.error("substring takes one or two indexes")),
    };
    let (Ok(start), Ok(end)) = (usize::try_from(start), usize::try_from(end)) else {
        return Err(ftx.error("negative substring index"));
    };
    if start > end || end > chars.len() {
        return Err(ftx.error("substring out of range"));
    }
    Ok(Cel::String(Arc::new(chars[start..end].iter().collect())))
}

fn join(
    ftx: &FunctionContext,
    This(list): This<Cel>,
    separator: Arc<String>,
) -> Result<Cel, ExecutionError> {
    let Cel::List(items) = list else {
        return Err(ftx.error("join needs a list"));
    };
    let mut parts = Vec::new();
    for item in items.iter() {
        match item {
            Cel::String(s) => parts.push(s.to_string()),
            other => return Err(ftx.error(format!("join of a non-string {other:?}"))),
        }
    }
    Ok(Cel::String(Arc::new(parts.join(separator.as_str()))))
}

/// Kubernetes' regex library: every match of `pattern` in the string, in order.
fn find_all(
    ftx: &FunctionContext,
    This(s): This<Arc<String>>,
    pattern: Arc<String>,
) -> Result<Cel, ExecutionError> {
    let re = regex::Regex::new(&pattern).map_err(|e| ftx.error(e.to_string()))?;
    let found: Vec<Cel> = (re.find_iter(&s))
        .map(|m| Cel::String(Arc::new(m.as_str().to_owned())))
        .collect();
    Ok(Cel::List(Arc::new(found)))
}

fn split(
    _: &FunctionContext,
    This(s): This<Arc<String>>,
    separator: Arc<String>,
) -> Result<Cel, ExecutionError> {
    let parts: Vec<Cel> = (s.split(separator.as_str()))
        .map(|part| Cel::String(Arc::new(part.to_owned())))
        .collect();
    Ok(Cel::List(Arc::new(parts)))
}

/// Kubernetes' CEL has the lists extension (1.34 and later); `lists.range(n)` is `[0, n)`.
fn range(_: &FunctionContext, This(_lists): This<Cel>, n: i64) -> Result<Cel, ExecutionError> {
    Ok(Cel::List(Arc::new((0..n.max(0)).map(Cel::Int).collect())))
}

/// The lists extension's `sort()`, `distinct()` and `flatten()`, and the Kubernetes `sum()`.
fn sort(ftx: &FunctionContext, This(list): This<Arc<Vec<Cel>>>) -> Result<Cel, ExecutionError> {
    let mut items = list.to_vec();
    let mut strings = Vec::with_capacity(items.len());
    for item in &items {
        match item {
            Cel::String(s) => strings.push(s.clone()),
            other => return Err(ftx.error(format!("sort of a non-string {other:?}"))),
        }
    }
    strings.sort();
    items = strings.into_iter().map(Cel::String).collect();
    Ok(Cel::List(Arc::new(items)))
}

fn distinct(_: &FunctionContext, This(list): This<Arc<Vec<Cel>>>) -> Result<Cel, ExecutionError> {
    let mut out: Vec<Cel> = Vec::new();
    for item in list.iter() {
        if !out.contains(item) {
            out.push(item.clone());
        }
    }
    Ok(Cel::List(Arc::new(out)))
}

/// `list.transformList(i, x, [f,] e)`: `e` for each index `i` and element `x` (for which `f`
/// holds).
fn transform_list(
    ftx: &FunctionContext,
    This(list): This<Arc<Vec<Cel>>>,
) -> Result<Cel, ExecutionError> {
    let (index, item, filter, expr) = match ftx.args.as_slice() {
        [index, item, expr] => (index, item, None, expr),
        [index, item, filter, expr] => (index, item, Some(filter), expr),
        _ => return Err(ftx.error("transformList takes an index, an element and expressions")),
    };
    let name = |e: &IdedExpr| match &e.expr {
        cel_parser::ast::Expr::Ident(name) => Ok(name.clone()),
        _ => Err(ftx.error("transformList binds identifiers")),
    };
    let (index, item) = (name(index)?, name(item)?);
    let mut out = Vec::with_capacity(list.len());
    for (at, value) in list.iter().enumerate() {
        let mut ctx = ftx.ptx.new_inner_scope();
        ctx.add_variable_from_value(index.as_str(), Cel::Int(at as i64));
        ctx.add_variable_from_value(item.as_str(), value.clone());
        if let Some(filter) = filter {
            match ctx.resolve(filter)? {
                Cel::Bool(true) => {}
                Cel::Bool(false) => continue,
                other => return Err(ftx.error(format!("transformList filter gave {other:?}"))),
            }
        }
        out.push(ctx.resolve(expr)?);
    }
    Ok(Cel::List(Arc::new(out)))
}

fn reverse(_: &FunctionContext, This(list): This<Arc<Vec<Cel>>>) -> Result<Cel, ExecutionError> {
    Ok(Cel::List(Arc::new(list.iter().rev().cloned().collect())))
}

fn flatten(ftx: &FunctionContext, This(list): This<Arc<Vec<Cel>>>) -> Result<Cel, ExecutionError> {
    let mut out = Vec::new();
    for item in list.iter() {
        match item {
            Cel::List(inner) => out.extend(inner.iter().cloned()),
            other => return Err(ftx.error(format!("flatten of a non-list {other:?}"))),
        }
    }
    Ok(Cel::List(Arc::new(out)))
}

fn sum(ftx: &FunctionContext, This(list): This<Arc<Vec<Cel>>>) -> Result<Cel, ExecutionError> {
    let mut total = 0i64;
    for item in list.iter() {
        match item {
            Cel::Int(n) => total += n,
            other => return Err(ftx.error(format!("sum of a non-int {other:?}"))),
        }
    }
    Ok(Cel::Int(total))
}

/// Kubernetes' `indexOf()`: of a list (the lists library), the first index of an equal
/// element; of a string (the strings extension), the first code point index of a substring;
/// -1 where there is none.
fn index_of(
    ftx: &FunctionContext,
    This(target): This<Cel>,
    item: Cel,
) -> Result<i64, ExecutionError> {
    let found = match (&target, &item) {
        (Cel::List(list), _) => list.iter().position(|x| *x == item),
        (Cel::String(s), Cel::String(sub)) => {
            (s.find(sub.as_str())).map(|byte| s[..byte].chars().count())
        }
        _ => return Err(ftx.error(format!("indexOf of {item:?} in {target:?}"))),
    };
    Ok(found.map_or(-1, |i| i64::try_from(i).unwrap_or(-1)))
}

/// The strings extension's `trim()` (Unicode white space), `lowerAscii()` and `replace()`.
fn trim(This(s): This<Arc<String>>) -> Arc<String> {
    Arc::new(s.trim().to_owned())
}

fn lower_ascii(This(s): This<Arc<String>>) -> Arc<String> {
    Arc::new(s.to_ascii_lowercase())
}

fn replace(This(s): This<Arc<String>>, from: Arc<String>, to: Arc<String>) -> Arc<String> {
    Arc::new(s.replace(from.as_str(), to.as_str()))
}

/// `dyn(x)` only changes the type the checker sees.
fn dynamic(_: &FunctionContext, This(value): This<Cel>) -> Result<Cel, ExecutionError> {
    Ok(value)
}

/// The interpreter cannot build messages, so a message literal such as the
/// MutatingAdmissionPolicy's `JSONPatch{op: ..., path: ..., value: ...}` is read as the map
/// of its fields, which is what the API server turns it into.
fn messages_as_maps(expr: &mut IdedExpr) {
    use cel_interpreter::IdedExpr as E;
    use cel_parser::ast::{EntryExpr, Expr, IdedEntryExpr, MapEntryExpr, MapExpr};
    use cel_parser::reference::Val;
    fn walk(e: &mut E) {
        match &mut e.expr {
            Expr::Struct(message) => {
                let entries = std::mem::take(&mut message.entries)
                    .into_iter()
                    .map(|entry| {
                        let EntryExpr::StructField(mut field) = entry.expr else {
                            return entry;
                        };
                        walk(&mut field.value);
                        IdedEntryExpr {
                            id: entry.id,
                            expr: EntryExpr::MapEntry(MapEntryExpr {
                                key: E {
                                    id: entry.id,
                                    expr: Expr::Literal(Val::String(field.field)),
                                },
                                value: field.value,
                                optional: field.optional,
                            }),
                        }
                    })
                    .collect();
                e.expr = Expr::Map(MapExpr { entries });
            }
            Expr::Call(call) => {
                call.target.iter_mut().for_each(|t| walk(t));
                call.args.iter_mut().for_each(walk);
            }
            Expr::Comprehension(c) => {
                for part in [
                    &mut c.iter_range,
                    &mut c.accu_init,
                    &mut c.loop_cond,
                    &mut c.loop_step,
                    &mut c.result,
                ] {
                    walk(part);
                }
            }
            Expr::List(list) => list.elements.iter_mut().for_each(walk),
            Expr::Map(map) => {
                for entry in &mut map.entries {
                    match &mut entry.expr {
                        EntryExpr::MapEntry(m) => {
                            walk(&mut m.key);
                            walk(&mut m.value);
                        }
                        EntryExpr::StructField(f) => walk(&mut f.value),
                    }
                }
            }
            Expr::Select(select) => walk(&mut select.operand),
            Expr::Ident(_) | Expr::Literal(_) | Expr::Unspecified => {}
        }
    }
    walk(expr)
}

fn eval(expression: &str, vars: &BTreeMap<&str, Value>) -> Cel {
    try_eval(expression, vars).unwrap_or_else(|e| panic!("{expression}: {e:?}"))
}

fn try_eval(expression: &str, vars: &BTreeMap<&str, Value>) -> Result<Cel, ExecutionError> {
    thread_local! {
        /// Parsed expressions: the generated-pod tests evaluate each thousands of times.
        static PROGRAMS: std::cell::RefCell<BTreeMap<String, std::rc::Rc<IdedExpr>>> =
            Default::default();
    }
    let program = PROGRAMS.with_borrow_mut(|programs| {
        programs
            .entry(expression.to_owned())
            .or_insert_with(|| {
                let mut parsed = cel_parser::Parser::default()
                    .parse(expression)
                    .unwrap_or_else(|e| panic!("does not parse: {expression}: {e}"));
                messages_as_maps(&mut parsed);
                std::rc::Rc::new(parsed)
            })
            .clone()
    });
    let mut ctx = Context::default();
    ctx.add_function("substring", substring);
    ctx.add_function("join", join);
    ctx.add_function("split", split);
    ctx.add_function("findAll", find_all);
    ctx.add_function("range", range);
    ctx.add_function("sort", sort);
    ctx.add_function("distinct", distinct);
    ctx.add_function("flatten", flatten);
    ctx.add_function("reverse", reverse);
    ctx.add_function("transformList", transform_list);
    ctx.add_function("sum", sum);
    ctx.add_function("indexOf", index_of);
    ctx.add_function("trim", trim);
    ctx.add_function("lowerAscii", lower_ascii);
    ctx.add_function("replace", replace);
    ctx.add_function("dyn", dynamic);
    ctx.add_variable_from_value("lists", Cel::String(Arc::new("lists".to_owned())));
    for (name, value) in vars {
        ctx.add_variable(
            *name,
            signed(cel_interpreter::to_value(value).expect("JSON to CEL")),
        )
        .expect("variable");
    }
    Cel::resolve(&program, &ctx)
}

/// JSON numbers as CEL reads them from an object: `int`, not the `uint` the conversion makes
/// of a positive one (a list index must be an `int`).
fn signed(value: Cel) -> Cel {
    match value {
        Cel::UInt(n) => i64::try_from(n).map_or(Cel::UInt(n), Cel::Int),
        Cel::List(items) => Cel::List(Arc::new(items.iter().cloned().map(signed).collect())),
        Cel::Map(map) => {
            let entries: std::collections::HashMap<cel_interpreter::objects::Key, Cel> =
                (map.map.iter())
                    .map(|(k, v)| (k.clone(), signed(v.clone())))
                    .collect();
            Cel::Map(cel_interpreter::objects::Map {
                map: Arc::new(entries),
            })
        }
        other => other,
    }
}

fn eval_bool(expression: &str, vars: &BTreeMap<&str, Value>) -> bool {
    match eval(expression, vars) {
        Cel::Bool(b) => b,
        other => panic!("{expression} is not a bool: {other:?}"),
    }
}

fn to_json(value: &Cel) -> Value {
    match value {
        Cel::Null => Value::Null,
        Cel::Bool(b) => json!(b),
        Cel::Int(i) => json!(i),
        Cel::UInt(u) => json!(u),
        Cel::Float(f) => json!(f),
        Cel::String(s) => json!(s.as_str()),
        Cel::List(l) => Value::Array(l.iter().map(to_json).collect()),
        Cel::Map(m) => {
            let mut out = serde_json::Map::new();
            for (k, v) in m.map.iter() {
                out.insert(format!("{k}").trim_matches('"').to_string(), to_json(v));
            }
            Value::Object(out)
        }
        other => panic!("unexpected CEL value {other:?}"),
    }
}

/// The values of an admission policy's `variables` (the policy as JSON) for one request,
/// each seeing the ones before it, as `vars` plus `variables`. The API server evaluates a
/// variable when an expression first reads it; here each is evaluated up front, and one that
/// fails is left out, so that an expression that does read it fails.
fn with_variables<'v>(policy: &Value, vars: &BTreeMap<&'v str, Value>) -> BTreeMap<&'v str, Value> {
    let mut vars = vars.clone();
    let mut variables = serde_json::Map::new();
    for variable in policy["spec"]["variables"].as_array().into_iter().flatten() {
        vars.insert("variables", Value::Object(variables.clone()));
        let name = variable["name"].as_str().expect("name");
        if let Ok(value) = try_eval(variable["expression"].as_str().expect("expression"), &vars) {
            variables.insert(name.to_string(), to_json(&value));
        }
    }
    vars.insert("variables", Value::Object(variables));
    vars
}

/// What a ValidatingAdmissionPolicy decides for one request: `None` when its
/// matchConditions do not match, else the messages of the failed validations.
fn decide(policy: &Document, vars: &BTreeMap<&str, Value>) -> Option<Vec<String>> {
    let spec = &policy.value["spec"];
    for condition in spec["matchConditions"].as_array().into_iter().flatten() {
        let expr = condition["expression"].as_str().expect("expression");
        if !eval_bool(expr, vars) {
            return None;
        }
    }
    let vars = with_variables(&policy.value, vars);
    let mut failures = Vec::new();
    for validation in spec["validations"].as_array().into_iter().flatten() {
        if !eval_bool(
            validation["expression"].as_str().expect("expression"),
            &vars,
        ) {
            let message = validation["messageExpression"]
                .as_str()
                .map(|m| match eval(m, &vars) {
                    Cel::String(s) => s.to_string(),
                    other => panic!("messageExpression is not a string: {other:?}"),
                })
                .or_else(|| validation["message"].as_str().map(str::to_string))
                .unwrap_or_default();
            failures.push(message);
        }
    }
    Some(failures)
}

fn container(name: &str, privileged: Option<bool>) -> Value {
    let mut c = json!({"name": name, "image": "nvcr.io/nvidia/pytorch:24.05-py3"});
    if let Some(p) = privileged {
        c["securityContext"] = json!({"privileged": p});
    }
    c
}

fn pod(spec: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": spec})
}

fn default_params() -> Value {
    gpuwarden_crds::manifests::default_policy_manifest()
}

fn request(namespace: &str) -> Value {
    json!({"namespace": namespace, "name": "p", "operation": "CREATE",
           "userInfo": {"username": "alice"},
           "resource": {"group": "", "version": "v1", "resource": "pods"}})
}

/// The shipped webhook's `may-reach-gpus` matchCondition.
fn may_reach_gpus() -> String {
    let docs = load_file("deploy/admission/mutating-webhook.yaml").expect("manifest");
    let condition = &docs[0].value["webhooks"][0]["matchConditions"][0];
    assert_eq!(condition["name"], "may-reach-gpus");
    condition["expression"]
        .as_str()
        .expect("expression")
        .to_owned()
}

/// The webhook's matchConditions send a pod exactly when some container (regular, init or
/// ephemeral) is privileged or names GPUs through the runtime's own channels, or the pod
/// carries a CDI annotation; ordinary pods, GPU requests among them, are never sent.
#[test]
fn match_conditions_select_pods_that_may_reach_gpus() {
    let condition = may_reach_gpus();
    let cases = [
        (pod(json!({"containers": [container("a", None)]})), false),
        (
            pod(json!({"containers": [container("a", Some(false))]})),
            false,
        ),
        (
            pod(json!({"containers": [{"name": "a", "securityContext": {"runAsUser": 1}}]})),
            false,
        ),
        (
            pod(json!({"containers": [container("a", Some(true))]})),
            true,
        ),
        (
            pod(json!({"containers": [container("a", None), container("b", Some(true))]})),
            true,
        ),
        (
            pod(
                json!({"containers": [container("a", None)], "initContainers": [container("i", Some(true))]}),
            ),
            true,
        ),
        (
            pod(
                json!({"containers": [container("a", None)], "initContainers": [container("i", Some(false))]}),
            ),
            false,
        ),
        (
            pod(
                json!({"containers": [container("a", None)], "ephemeralContainers": [container("e", Some(true))]}),
            ),
            true,
        ),
        (
            pod(
                json!({"containers": [{"name": "a", "env": [{"name": "HOME", "value": "/"}],
                "resources": {"limits": {"nvidia.com/gpu": "1"}},
                "volumeMounts": [{"name": "d", "mountPath": "/data"}]}]}),
            ),
            false,
        ),
        (
            pod(json!({"containers": [{"name": "a",
                "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}]})),
            true,
        ),
        // The void rule's entry hands out nothing: it sends no pod.
        (
            pod(json!({"containers": [{"name": "a",
                "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]}]})),
            false,
        ),
        (
            pod(
                json!({"containers": [{"name": "a", "resources": {"limits": {"cpu": "1"}},
                "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]}]}),
            ),
            false,
        ),
        // Unless another webhook (HAMi's) gave its container a GPU after the void: the entry
        // would hide it, and the webhook removes it.
        (
            pod(json!({"containers": [{"name": "a",
                "resources": {"limits": {"nvidia.com/gpumem": "3000", "nvidia.com/gpu": "1"}},
                "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]}]})),
            true,
        ),
        (
            pod(
                json!({"containers": [container("a", None)], "initContainers": [{"name": "i",
                "resources": {"limits": {"nvidia.com/gpu": "1"}},
                "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]}]}),
            ),
            true,
        ),
        (
            pod(
                json!({"containers": [{"name": "a", "env": [{"name": "NVIDIA_VISIBLE_DEVICES",
                "value": "void", "valueFrom": {"configMapKeyRef": {"name": "g", "key": "k"}}}]}]}),
            ),
            true,
        ),
        (
            pod(
                json!({"containers": [container("a", None)], "initContainers": [{"name": "i",
                "env": [{"name": "NVIDIA_MIG_MONITOR_DEVICES", "value": "all"}]}]}),
            ),
            true,
        ),
        (
            pod(
                json!({"containers": [{"name": "a", "volumeMounts": [{"name": "d",
                "mountPath": "/var/run/nvidia-container-devices/all"}]}]}),
            ),
            true,
        ),
        (
            pod(
                json!({"containers": [container("a", None)], "ephemeralContainers": [{"name": "e",
                "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "0"}]}]}),
            ),
            true,
        ),
        (
            {
                let mut p = pod(json!({"containers": [container("a", None)]}));
                p["metadata"]["annotations"] = json!({"cdi.k8s.io/gpu": "nvidia.com/gpu=all"});
                p
            },
            true,
        ),
        (
            {
                let mut p = pod(json!({"containers": [container("a", None)]}));
                p["metadata"]["annotations"] = json!({"team": "a"});
                p
            },
            false,
        ),
    ];
    for (object, expected) in cases {
        let vars = BTreeMap::from([("object", object.clone())]);
        assert_eq!(eval_bool(&condition, &vars), expected, "{object}");
    }
}

fn backstop() -> Document {
    load_file("deploy/admission/backstop-policy.yaml").expect("manifest")[0].clone()
}

fn backstop_decides(object: Value, namespace: &str, params: Value) -> Option<Vec<String>> {
    let vars = BTreeMap::from([
        ("object", object),
        ("request", request(namespace)),
        ("namespaceObject", json!({"metadata": {"name": namespace}})),
        ("params", params),
    ]);
    decide(&backstop(), &vars)
}

/// KAI-Scheduler's fraction pod as the API server holds it after KAI's webhook (v0.17.0):
/// the fraction container reads NVIDIA_VISIBLE_DEVICES from `<prefix>-0`.
fn kai_fraction_pod() -> Value {
    let map = "train-x7k2pqr-shared-gpu-0";
    json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "train", "annotations": {"gpu-fraction": "0.5",
            "runai/shared-gpu-configmap": "train-x7k2pqr-shared-gpu"}},
        "spec": {"schedulerName": "kai-scheduler", "runtimeClassName": "nvidia", "containers": [
            {"name": "main", "image": "nvcr.io/nvidia/pytorch:24.05-py3", "env": [
                {"name": "NVIDIA_VISIBLE_DEVICES",
                 "valueFrom": {"configMapKeyRef": {"name": map, "key": "NVIDIA_VISIBLE_DEVICES"}}},
                {"name": "GPU_PORTION",
                 "valueFrom": {"configMapKeyRef": {"name": map, "key": "GPU_PORTION"}}}],
             "envFrom": [{"configMapRef": {"name": format!("{map}-evar"), "optional": false}}]},
            {"name": "log", "image": "busybox", "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]}]}})
}

/// What a tenant can write that looks like KAI's grant but is not, with what makes it so.
fn forged_kai_pods() -> Vec<(&'static str, Value)> {
    let pod = kai_fraction_pod();
    let with = |f: &dyn Fn(&mut Value)| {
        let mut p = pod.clone();
        f(&mut p);
        p
    };
    let reference = "/spec/containers/0/env/0/valueFrom/configMapKeyRef";
    vec![
        (
            "names its node",
            with(&|p| p["spec"]["nodeName"] = json!("node-1")),
        ),
        (
            "another scheduler",
            with(&|p| p["spec"]["schedulerName"] = json!("default-scheduler")),
        ),
        (
            "no fraction asked",
            with(&|p| {
                p["metadata"]["annotations"]
                    .as_object_mut()
                    .unwrap()
                    .remove("gpu-fraction");
            }),
        ),
        (
            "a map KAI would not name",
            with(&|p| {
                p.pointer_mut(reference).unwrap()["name"] = json!("tenant-gpus");
            }),
        ),
        (
            "a prefix outside the guarded names",
            with(&|p| {
                p["metadata"]["annotations"]["runai/shared-gpu-configmap"] = json!("tenant");
                p.pointer_mut(reference).unwrap()["name"] = json!("tenant-0");
            }),
        ),
        (
            "an optional reference",
            with(&|p| {
                p.pointer_mut(reference).unwrap()["optional"] = json!(true);
            }),
        ),
        (
            "another key",
            with(&|p| p.pointer_mut(reference).unwrap()["key"] = json!("GPUS")),
        ),
        (
            "a privileged fraction container",
            with(&|p| {
                p["spec"]["containers"][0]["securityContext"] = json!({"privileged": true});
            }),
        ),
        (
            "the fraction is another container's",
            with(&|p| {
                p["metadata"]["annotations"]["gpu-fraction-container-name"] = json!("log");
            }),
        ),
        (
            "its own value after KAI's",
            with(&|p| {
                p["spec"]["containers"][0]["env"]
                    .as_array_mut()
                    .unwrap()
                    .push(json!({"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}));
            }),
        ),
    ]
}

/// The default policy, naming KAI.
fn kai_params() -> Value {
    let mut params = default_params();
    params["spec"]["gpu"]["sharing"] = json!({"kai": {}});
    params
}

/// The backstop admits KAI's grant where the default policy names KAI, and nothing a tenant
/// can write like it; the webhook's engine answers the same for each.
#[test]
fn the_backstop_admits_kais_grant_only() {
    use gpuwarden_webhook::admission::{StaticSource, handle_review};

    let admitted_by_engine = |pod: &Value, params: &Value| {
        let policy: gpuwarden_crds::GpuPolicy =
            serde_json::from_value(params.clone()).expect("a policy");
        let review = json!({
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {
                "uid": "u", "namespace": "team-a", "operation": "CREATE",
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "userInfo": {"username": "alice"}, "object": pod,
            }
        });
        let (bytes, _) = handle_review(review.to_string().as_bytes(), &StaticSource::new([policy]));
        let answer: Value = serde_json::from_slice(&bytes).expect("JSON");
        answer["response"]["allowed"] == json!(true) && answer["response"]["patch"].is_null()
    };
    let pod = kai_fraction_pod();
    assert_eq!(
        backstop_decides(pod.clone(), "team-a", kai_params()),
        Some(vec![])
    );
    assert!(admitted_by_engine(&pod, &kai_params()));
    let failures = backstop_decides(pod.clone(), "team-a", default_params()).expect("matched");
    assert!(failures[0].contains(": main;"), "{failures:?}");
    assert!(!admitted_by_engine(&pod, &default_params()));
    // An init container picked by name reads `-i<index>`.
    let mut init = pod.clone();
    let main = init["spec"]["containers"][0].take();
    init["spec"]["containers"] = json!([null]);
    let void = json!([{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]);
    init["spec"]["containers"][0] = json!({"name": "log", "image": "busybox", "env": void});
    init["spec"]["initContainers"] =
        json!([{"name": "first", "image": "busybox", "env": void}, main]);
    init["metadata"]["annotations"]["gpu-fraction-container-name"] = json!("main");
    init["spec"]["initContainers"][1]["env"][0]["valueFrom"]["configMapKeyRef"]["name"] =
        json!("train-x7k2pqr-shared-gpu-i1");
    assert_eq!(
        backstop_decides(init.clone(), "team-a", kai_params()),
        Some(vec![])
    );
    assert!(admitted_by_engine(&init, &kai_params()));
    for (what, pod) in forged_kai_pods() {
        let failures = backstop_decides(pod.clone(), "team-a", kai_params()).expect("matched");
        assert!(!failures.is_empty(), "{what}: the backstop admits it");
        assert!(
            !admitted_by_engine(&pod, &kai_params()),
            "{what}: the engine admits it"
        );
    }
}

/// Where a GpuPolicy names KAI, only KAI's binder writes the data of ConfigMaps named as
/// KAI names them; anyone may still change their metadata or delete them.
#[test]
fn only_kais_binder_writes_kais_config_maps() {
    let guard = load_file("deploy/admission/kai-sharing.yaml").expect("manifest")[0].clone();
    let decide_for =
        |user: &str, operation: &str, name: &str, data: Value, old: Value, params: Value| {
            let object = json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": "team-a"}, "data": data});
            let mut old_object = object.clone();
            old_object["data"] = old;
            let vars = BTreeMap::from([
                ("object", object),
                (
                    "oldObject",
                    if operation == "UPDATE" {
                        old_object
                    } else {
                        Value::Null
                    },
                ),
                (
                    "request",
                    json!({"operation": operation, "userInfo": {"username": user}}),
                ),
                ("params", params),
            ]);
            decide(&guard, &vars)
        };
    let binder = "system:serviceaccount:kai-scheduler:binder";
    let gpu = json!({"NVIDIA_VISIBLE_DEVICES": "GPU-1"});
    let all = json!({"NVIDIA_VISIBLE_DEVICES": "all"});
    for name in [
        "train-x7k2pqr-shared-gpu-0",
        "train-x7k2pqr-shared-gpu-i2",
        "train-x7k2pqr-shared-gpu-0-evar",
        "x-shared-gpu-12-evar",
    ] {
        let create =
            |user: &str| decide_for(user, "CREATE", name, gpu.clone(), Value::Null, kai_params());
        assert_eq!(create(binder), Some(vec![]), "{name}");
        let denied = create("alice").expect("matched");
        assert!(
            denied[0].contains(
                "lets only the binder of KAI-Scheduler (system:serviceaccount:kai-scheduler:binder)"
            ),
            "{denied:?}"
        );
        let update = |user: &str, data: &Value| {
            decide_for(
                user,
                "UPDATE",
                name,
                data.clone(),
                gpu.clone(),
                kai_params(),
            )
        };
        assert_eq!(update("alice", &all).map(|f| f.len()), Some(1), "{name}");
        assert_eq!(update(binder, &all), Some(vec![]));
        assert_eq!(
            update(
                "system:serviceaccount:kube-system:generic-garbage-collector",
                &gpu
            ),
            Some(vec![])
        );
        // No policy names KAI: nothing checked.
        assert_eq!(
            decide_for(
                "alice",
                "CREATE",
                name,
                all.clone(),
                Value::Null,
                default_params()
            ),
            None
        );
    }
    // Other names, and KAI's binder in another namespace.
    for name in [
        "shared-gpu",
        "train-shared-gpu-x",
        "train-shared-gpu-0-evar-1",
        "gpu-0",
    ] {
        assert_eq!(
            decide_for(
                "alice",
                "CREATE",
                name,
                all.clone(),
                Value::Null,
                kai_params()
            ),
            None,
            "{name}"
        );
    }
    let mut elsewhere = kai_params();
    elsewhere["spec"]["gpu"]["sharing"]["kai"]["binder"] = json!("kai/binder");
    let name = "train-x7k2pqr-shared-gpu-0";
    assert_eq!(
        decide_for(
            binder,
            "CREATE",
            name,
            gpu.clone(),
            Value::Null,
            elsewhere.clone()
        )
        .map(|f| f.len()),
        Some(1)
    );
    assert_eq!(
        decide_for(
            "system:serviceaccount:kai:binder",
            "CREATE",
            name,
            gpu,
            Value::Null,
            elsewhere
        ),
        Some(vec![])
    );
}

/// No ConfigMap or Secret key a pod reads through `envFrom` spells an NVIDIA runtime variable
/// in a governed namespace: refused on create, and on update where it is added or changed;
/// a key already there, other keys, exempt namespaces, Audit mode, KAI's binder and the
/// runtime features the policy allows pass.
#[test]
fn no_config_map_or_secret_key_spells_a_runtime_variable() {
    let guard = load_file("deploy/admission/runtime-variables.yaml").expect("manifest")[0].clone();
    let decide_for = |kind: &str,
                      user: &str,
                      namespace: &str,
                      (data, old): (Value, Option<Value>),
                      params: Value| {
        let field = if kind == "Secret" {
            "stringData"
        } else {
            "data"
        };
        let object = json!({"apiVersion": "v1", "kind": kind,
            "metadata": {"name": "settings", "namespace": namespace}, field: data});
        let old_object = old.map_or(Value::Null, |old| {
            json!({"apiVersion": "v1", "kind": kind,
                "metadata": {"name": "settings", "namespace": namespace}, "data": old})
        });
        let operation = if old_object.is_null() {
            "CREATE"
        } else {
            "UPDATE"
        };
        let vars = BTreeMap::from([
            ("object", object),
            ("oldObject", old_object),
            (
                "request",
                json!({"operation": operation, "kind": {"kind": kind},
                    "namespace": namespace, "userInfo": {"username": user}}),
            ),
            ("namespaceObject", json!({"metadata": {"name": namespace}})),
            ("params", params),
        ]);
        decide(&guard, &vars)
    };
    let alice = "alice";
    let create = |data: Value| (data, None);
    for kind in ["ConfigMap", "Secret"] {
        for key in [
            "NVIDIA_VISIBLE_DEVICES",
            "NVIDIA_MIG_CONFIG_DEVICES",
            "NVIDIA_IMEX_CHANNELS",
            "NVIDIA_NVSWITCH",
            "NVIDIA_MOFED",
            "NVIDIA_GDS",
        ] {
            let refused = decide_for(
                kind,
                alice,
                "team-a",
                create(json!({key: "all"})),
                default_params(),
            )
            .expect("matched");
            assert_eq!(refused.len(), 1, "{kind} {key}");
            assert!(
                refused[0].starts_with(&format!("gpuwarden: {kind} settings sets {key}, a variable of the NVIDIA container runtime")),
                "{refused:?}"
            );
        }
        // A token, a look-alike and an allowed feature pass.
        for key in [
            "HF_TOKEN",
            "nvidia_visible_devices",
            "NVIDIA_VISIBLE_DEVICES_X",
            "NVIDIA_GDRCOPY",
            "NVIDIA_DRIVER_CAPABILITIES",
        ] {
            assert_eq!(
                decide_for(
                    kind,
                    alice,
                    "team-a",
                    create(json!({key: "x"})),
                    default_params()
                ),
                Some(vec![]),
                "{kind} {key}"
            );
        }
    }
    // Updates: adding or changing the key is refused; a key already there stays.
    let old = json!({"NVIDIA_VISIBLE_DEVICES": "0", "A": "1"});
    let update = |new: Value| (new, Some(old.clone()));
    assert_eq!(
        decide_for(
            "ConfigMap",
            alice,
            "team-a",
            update(json!({"NVIDIA_VISIBLE_DEVICES": "0", "A": "2"})),
            default_params()
        ),
        Some(vec![])
    );
    assert_eq!(
        decide_for(
            "ConfigMap",
            alice,
            "team-a",
            update(json!({"NVIDIA_VISIBLE_DEVICES": "all", "A": "1"})),
            default_params()
        )
        .map(|f| f.len()),
        Some(1)
    );
    assert_eq!(
        decide_for(
            "ConfigMap",
            alice,
            "team-a",
            update(json!({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_MOFED": "enabled"})),
            default_params()
        )
        .map(|f| f.len()),
        Some(1)
    );
    // Exempt namespaces, Audit mode, KAI's binder where the policy names KAI, allowed features.
    let gpu = || create(json!({"NVIDIA_VISIBLE_DEVICES": "GPU-1"}));
    let mut exempting = default_params();
    exempting["spec"]["exemptions"]["namespaces"] = json!(["kube-system", "ml-platform"]);
    assert_eq!(
        decide_for("ConfigMap", alice, "ml-platform", gpu(), exempting),
        Some(vec![])
    );
    let mut audit = default_params();
    audit["spec"]["mode"] = json!("Audit");
    assert_eq!(
        decide_for("ConfigMap", alice, "team-a", gpu(), audit),
        Some(vec![])
    );
    let binder = "system:serviceaccount:kai-scheduler:binder";
    assert_eq!(
        decide_for("ConfigMap", binder, "team-a", gpu(), kai_params()),
        Some(vec![])
    );
    assert_eq!(
        decide_for("ConfigMap", binder, "team-a", gpu(), default_params()).map(|f| f.len()),
        Some(1)
    );
    let mut open = default_params();
    open["spec"]["runtimeFeatures"] = json!(["GDRCOPY", "MOFED"]);
    assert_eq!(
        decide_for(
            "Secret",
            alice,
            "team-a",
            create(json!({"NVIDIA_MOFED": "enabled"})),
            open
        ),
        Some(vec![])
    );
    let mut strict = default_params();
    strict["spec"]["runtimeFeatures"] = json!([]);
    assert_eq!(
        decide_for(
            "Secret",
            alice,
            "team-a",
            create(json!({"NVIDIA_GDRCOPY": "enabled"})),
            strict
        )
        .map(|f| f.len()),
        Some(1)
    );
}

/// The backstop rejects a privileged container with any GPU signal the webhook knows (a
/// GPU limit, a MIG or shared-GPU limit, NVIDIA_VISIBLE_DEVICES, a /dev hostPath mount, an
/// NVIDIA CDI annotation), naming it, and admits privileged containers without a signal,
/// rewritten pods, and GPU pods that are not privileged.
#[test]
fn backstop_rejects_privileged_gpu_containers_only() {
    let ns = "team-a";
    let mut gpu_env = container("train", Some(true));
    gpu_env["env"] = json!([{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]);
    let mut void_env = container("side", Some(true));
    void_env["env"] = json!([{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]);
    let mut limit = container("train", Some(true));
    limit["resources"] = json!({"limits": {"nvidia.com/gpu": "1"}});
    let mut mig = container("train", Some(true));
    mig["resources"] = json!({"limits": {"nvidia.com/mig-1g.10gb": "1"}});
    let mut shared = container("train", Some(true));
    shared["resources"] = json!({"limits": {"nvidia.com/gpu.shared": "1"}});
    let mut dev = container("train", Some(true));
    dev["volumeMounts"] = json!([{"name": "nv", "mountPath": "/dev/nvidia0"}]);
    let dev_volume = json!([{"name": "nv", "hostPath": {"path": "/dev/nvidia0"}}]);
    let mut rewritten = limit.clone();
    rewritten["securityContext"] = json!({"privileged": false, "allowPrivilegeEscalation": false});
    let mut unprivileged_gpu = limit.clone();
    unprivileged_gpu["securityContext"] = json!({});
    let mut tools = container("tools", Some(true));
    tools["image"] = json!("busybox:1.36");
    let mut unprivileged_env = gpu_env.clone();
    unprivileged_env["securityContext"] = json!({});
    let mut device_list = container("train", None);
    device_list["volumeMounts"] =
        json!([{"name": "e", "mountPath": "/var/run/nvidia-container-devices/0"}]);
    let mut mig_monitor = container("train", Some(false));
    mig_monitor["env"] = json!([{"name": "NVIDIA_MIG_MONITOR_DEVICES", "value": "all"}]);

    let denied = [
        pod(json!({"containers": [gpu_env.clone()]})),
        pod(json!({"containers": [limit]})),
        pod(json!({"containers": [mig]})),
        pod(json!({"containers": [shared]})),
        pod(json!({"containers": [dev], "volumes": dev_volume})),
        pod(json!({"containers": [container("a", None)], "initContainers": [gpu_env.clone()]})),
        {
            let mut p = pod(json!({"containers": [container("train", Some(true))]}));
            p["metadata"]["annotations"] = json!({"cdi.k8s.io/gpu": "nvidia.com/gpu=all"});
            p
        },
        // Hints: a GPU image, the NVIDIA runtime class, a GPU node label, a GPU taint.
        pod(json!({"containers": [container("train", Some(true))]})),
        {
            let mut train = tools.clone();
            train["name"] = json!("train");
            pod(json!({"containers": [train], "runtimeClassName": "nvidia"}))
        },
        {
            let mut train = tools.clone();
            train["name"] = json!("train");
            pod(json!({"containers": [train], "nodeSelector": {"nvidia.com/gpu.present": "true"}}))
        },
        {
            let mut train = tools.clone();
            train["name"] = json!("train");
            pod(json!({"containers": [train], "affinity": {"nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In",
                        "values": ["NVIDIA-H100-80GB-HBM3"]}]}]}}}}))
        },
        {
            let mut train = tools.clone();
            train["name"] = json!("train");
            pod(
                json!({"containers": [train], "tolerations": [{"key": "nvidia.com/gpu",
                "operator": "Exists", "effect": "NoSchedule"}]}),
            )
        },
        // Leaks, whatever the privilege.
        pod(json!({"containers": [unprivileged_env]})),
        pod(json!({"containers": [device_list]})),
        pod(json!({"containers": [mig_monitor]})),
        {
            let mut p = pod(json!({"containers": [container("train", None)]}));
            p["metadata"]["annotations"] = json!({"cdi.k8s.io/gpu": "nvidia.com/gpu=all"});
            p
        },
    ];
    for object in denied {
        let failures = backstop_decides(object.clone(), ns, default_params())
            .unwrap_or_else(|| panic!("the backstop did not match {object}"));
        assert_eq!(failures.len(), 1, "{object}: {failures:?}");
        assert!(
            failures[0].contains("name GPUs around the kubelet are not admitted")
                && failures[0].contains("train"),
            "{failures:?}"
        );
    }
    let admitted = [
        pod(json!({"containers": [tools.clone()]})),
        // Hints about the pod's placement count for privileged containers only.
        pod(json!({"containers": [container("a", None)], "runtimeClassName": "nvidia"})),
        // A node selector that says "not a GPU node" is no hint.
        pod(
            json!({"containers": [tools.clone()], "nodeSelector": {"nvidia.com/gpu.present": "false"}}),
        ),
        pod(json!({"containers": [void_env]})),
        pod(json!({"containers": [rewritten]})),
        pod(json!({"containers": [unprivileged_gpu]})),
        pod(json!({"containers": [container("a", None)]})),
    ];
    for object in admitted {
        let failures = backstop_decides(object.clone(), ns, default_params());
        assert_eq!(failures, Some(vec![]), "{object}");
    }
}

/// The backstop follows the default policy: its exempt namespaces, service accounts and
/// image patterns (prefix globs), Audit mode, and `match.privilegedContainers: All`.
#[test]
fn backstop_follows_the_default_policy() {
    let mut gpu = container("train", Some(true));
    gpu["env"] = json!([{"name": "NVIDIA_VISIBLE_DEVICES", "value": "0"}]);
    let gpu_pod = pod(json!({"containers": [gpu.clone()]}));

    // Exempt namespace.
    assert_eq!(
        backstop_decides(gpu_pod.clone(), "kube-system", default_params()),
        Some(vec![])
    );
    // Exempt image (the default policy's dcgm-exporter pattern), in the GPU Operator's
    // namespace only: a tenant running it elsewhere is rejected.
    let mut dcgm = gpu.clone();
    dcgm["image"] = json!("nvcr.io/nvidia/k8s/dcgm-exporter:3.3.5-3.4.0-ubuntu22.04");
    let dcgm_pod = pod(json!({"containers": [dcgm]}));
    assert_eq!(
        backstop_decides(dcgm_pod.clone(), "gpu-operator", default_params()),
        Some(vec![])
    );
    assert_eq!(
        backstop_decides(dcgm_pod.clone(), "monitoring", default_params()).map(|f| f.len()),
        Some(1)
    );
    // Scoped to a service account and pinned to a digest: both must hold.
    let digest = format!("sha256:{}", "c".repeat(64));
    let mut pinned = default_params();
    pinned["spec"]["exemptions"]["containers"] = json!([{
        "images": ["registry.example.com/tools/*"],
        "serviceAccounts": ["team-a/debugger"],
        "digests": [digest],
    }]);
    let tool = |image: String, sa: &str| {
        let mut c = gpu.clone();
        c["image"] = json!(image);
        let mut p = pod(json!({"containers": [c]}));
        p["spec"]["serviceAccountName"] = json!(sa);
        p
    };
    let at_digest = format!(
        "registry.example.com/tools/nsenter@sha256:{}",
        "c".repeat(64)
    );
    assert_eq!(
        backstop_decides(
            tool(at_digest.clone(), "debugger"),
            "team-a",
            pinned.clone()
        ),
        Some(vec![])
    );
    for (image, sa) in [
        (at_digest, "default"),
        (
            "registry.example.com/tools/nsenter:1".to_owned(),
            "debugger",
        ),
    ] {
        assert_eq!(
            backstop_decides(tool(image, sa), "team-a", pinned.clone()).map(|f| f.len()),
            Some(1)
        );
    }
    // Exempt service account.
    let mut params = default_params();
    params["spec"]["exemptions"]["serviceAccounts"] = json!(["team-a/gpu-admin"]);
    let mut sa_pod = gpu_pod.clone();
    sa_pod["spec"]["serviceAccountName"] = json!("gpu-admin");
    assert_eq!(
        backstop_decides(sa_pod, "team-a", params.clone()),
        Some(vec![])
    );
    assert_eq!(
        backstop_decides(gpu_pod.clone(), "team-a", params).map(|f| f.len()),
        Some(1)
    );
    // Audit: the webhook only warns, so the backstop stays out of the way.
    let mut audit = default_params();
    audit["spec"]["mode"] = json!("Audit");
    assert_eq!(backstop_decides(gpu_pod.clone(), "team-a", audit), None);
    // Deny behaves as Enforce here: reject.
    let mut deny = default_params();
    deny["spec"]["mode"] = json!("Deny");
    assert_eq!(
        backstop_decides(gpu_pod, "team-a", deny).map(|f| f.len()),
        Some(1)
    );
    // All: every privileged container counts.
    let mut all = default_params();
    all["spec"]["match"]["privilegedContainers"] = json!("All");
    let plain = pod(json!({"containers": [container("tools", Some(true))]}));
    assert_eq!(
        backstop_decides(plain, "team-a", all).map(|f| f.len()),
        Some(1)
    );
}

/// A privileged ephemeral container is refused by the backstop (it cannot request GPUs);
/// an unprivileged one passes.
#[test]
fn backstop_refuses_privileged_ephemeral_containers() {
    let object = pod(json!({
        "containers": [container("app", None)],
        "ephemeralContainers": [container("debugger", Some(true))],
    }));
    let failures = backstop_decides(object, "team-a", default_params()).expect("matched");
    assert_eq!(failures.len(), 1);
    assert!(failures[0].contains("debugger"), "{failures:?}");
    let mut exempt = container("dcgm", Some(true));
    exempt["image"] = json!("nvcr.io/nvidia/cloud-native/dcgm:3.3.5-1-ubuntu22.04");
    let mut app = container("app", None);
    app["image"] = json!("busybox");
    let object = pod(json!({
        "containers": [app],
        "ephemeralContainers": [container("looker", Some(false)), exempt],
    }));
    assert_eq!(
        backstop_decides(object, "gpu-operator", default_params()),
        Some(vec![])
    );
}

fn agent_request(resource: &str, name: &str, node: Option<&str>) -> Value {
    let mut user = json!({
        "username": format!(
            "system:serviceaccount:{}:{}",
            gpuwarden_crds::SYSTEM_NAMESPACE,
            gpuwarden_crds::install::NODE_AGENT_NAME
        ),
    });
    if let Some(node) = node {
        user["extra"] = json!({"authentication.kubernetes.io/node-name": [node]});
    }
    json!({"name": name, "operation": "UPDATE", "userInfo": user,
           "resource": {"group": "gpuwarden.io", "version": "v1alpha1", "resource": resource}})
}

/// A node agent may write its own node's GpuNode status and Lease and nothing else; a
/// token without a node name (Kubernetes before 1.30) is refused with a message that says
/// so; other users are not this policy's business.
#[test]
fn agent_policy_pins_each_agent_to_its_node() {
    let policy = load_file("deploy/admission/agent-own-node.yaml").expect("manifest")[0].clone();
    let lease = gpuwarden_crds::agent_lease_name("gpu-1");
    let cases: [(&str, &str, Option<&str>, bool); 6] = [
        ("gpunodes", "gpu-1", Some("gpu-1"), true),
        ("gpunodes", "gpu-2", Some("gpu-1"), false),
        ("leases", &lease, Some("gpu-1"), true),
        ("leases", "gpuwarden-agent-gpu-2", Some("gpu-1"), false),
        ("leases", "gpu-1", Some("gpu-1"), false),
        ("gpunodes", "gpu-1", None, false),
    ];
    for (resource, name, node, allowed) in cases {
        let vars = BTreeMap::from([("request", agent_request(resource, name, node))]);
        let failures = decide(&policy, &vars).expect("the agent's requests match");
        assert_eq!(
            failures.is_empty(),
            allowed,
            "{resource} {name} as {node:?}: {failures:?}"
        );
        if node.is_none() {
            assert!(failures[0].contains("1.30"), "{failures:?}");
        } else if !allowed {
            assert!(failures[0].contains(name), "{failures:?}");
        }
    }
    let mut other = agent_request("gpunodes", "gpu-2", None);
    other["userInfo"]["username"] =
        json!("system:serviceaccount:gpuwarden-system:gpuwarden-operator");
    assert_eq!(decide(&policy, &BTreeMap::from([("request", other)])), None);
}

/// No expression selects a field named by a CEL reserved word (`request.namespace`,
/// `x.package`, ...): Kubernetes only reaches such fields escaped as `__word__`, and a
/// plain selection fails on the server. (The interpreter above is not that strict.)
#[test]
fn expressions_avoid_cel_reserved_words_as_fields() {
    const RESERVED: &[&str] = &[
        "as",
        "break",
        "const",
        "continue",
        "else",
        "for",
        "function",
        "if",
        "import",
        "let",
        "loop",
        "package",
        "namespace",
        "return",
        "var",
        "void",
        "while",
    ];
    let mut expressions = Vec::new();
    for file in [
        "deploy/admission/mutating-webhook.yaml",
        "deploy/admission/backstop-policy.yaml",
        "deploy/admission/agent-own-node.yaml",
        "deploy/admission/kai-sharing.yaml",
    ] {
        fn collect(v: &Value, out: &mut Vec<String>) {
            match v {
                Value::Object(m) => {
                    for (k, v) in m {
                        match (k.as_str(), v) {
                            ("expression" | "messageExpression", Value::String(s)) => {
                                out.push(s.clone())
                            }
                            _ => collect(v, out),
                        }
                    }
                }
                Value::Array(a) => a.iter().for_each(|v| collect(v, out)),
                _ => {}
            }
        }
        for doc in load_file(file).expect("manifest") {
            collect(&doc.value, &mut expressions);
        }
    }
    assert!(expressions.len() > 10);
    for expr in &expressions {
        // Drop string literals, then look at every `.word`.
        let code: String = expr
            .split('\'')
            .step_by(2)
            .flat_map(|s| s.split('"').step_by(2))
            .collect::<Vec<_>>()
            .join(" ");
        for part in code.split('.').skip(1) {
            let word: String = part
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            assert!(
                !RESERVED.contains(&word.as_str()),
                "`.{word}` selects a CEL reserved word in: {expr}"
            );
        }
    }
}

/// Pods generated for the differential test: every GPU signal and its look-alikes.
mod generated {
    use rand::rngs::StdRng;
    use rand::seq::IndexedRandom;
    use rand::{Rng, SeedableRng};
    use serde_json::{Value, json};

    pub const VISIBLE: &[&str] = &[
        "all",
        "ALL",
        " all ",
        "none",
        "NONE",
        " None ",
        "void",
        "VOID",
        "Void ",
        "",
        " ",
        " , ",
        ",",
        "0",
        "0,1",
        " 0 , 1 ",
        "none,0",
        "all,none",
        "GPU-8f2c3b1a",
        "\tvoid\n",
        "MIG-2a3b4c5d/1/0",
    ];
    pub const HOST_PATHS: &[&str] = &[
        "/dev",
        "/dev/",
        "/dev/nvidia0",
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/dri",
        "/dev/dri/",
        "/dev/dri/card0",
        "/dev/drifoo",
        "/dev/fuse",
        "/dev/kvm",
        "/dev/shm",
        "/devices",
        "/var/lib/nvidia",
        "/dev/./nvidia0",
        "//dev/nvidia0",
        "/dev/nvidia0/",
        "/dev/nvidia0/../fuse",
        "/dev/dri/..",
        "/dev/fuse/../nvidia0",
    ];
    pub const RESOURCES: &[&str] = &[
        "nvidia.com/gpu",
        "nvidia.com/gpu.shared",
        "nvidia.com/mig-1g.10gb",
        "nvidia.com/mig-3g.40gb",
        "example.com/accel",
        "cpu",
        "memory",
        "nvidia.com/gpux",
        // Passthrough GPUs of NVIDIA's sandbox device plugin, and NVIDIA names that are not.
        "nvidia.com/GH100_H100_PCIE",
        "nvidia.com/pgpu",
        "nvidia.com/rdma-vf",
        "example.com/vgpu-a",
        "example.com/vgpu-b",
    ];
    /// `match.gpuResources` a policy may add; the last is beyond CEL (a `?`).
    pub const GPU_RESOURCE_PATTERNS: &[&str] = &[
        "example.com/vgpu-*",
        "example.com/vgpu-a",
        "example.com/vgpu-?",
    ];
    pub const IMAGES: &[&str] = &[
        "nvcr.io/nvidia/pytorch:24.05-py3",
        "nvcr.io/nvidia/k8s/dcgm-exporter:3.3.5-3.4.0-ubuntu22.04",
        "nvcr.io/nvidia/k8s-device-plugin:v0.15.0",
        "registry.example.com/team/tools:1.0",
        "registry.example.com/team/tools",
        "busybox",
        "nvidia/cuda:12.4.1-base-ubuntu22.04",
        "nvidia/cuda",
        "docker.io/tensorflow/tensorflow:2.16.1-gpu",
        "tensorflow/tensorflow:2.16.1",
        "vllm/vllm-openai:v0.5.0",
        "registry.example.com/team/tools@sha256:dddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddd",
    ];
    /// GPU image patterns a policy may use instead of the defaults; the first two are
    /// beyond CEL (a `?`, an inner `*`).
    pub const GPU_PATTERNS: &[&str] =
        &["busybox:1.?", "registry.*/tools:*", "*/cuda:*", "busybox*"];
    /// Mount paths at, under and beside the toolkit's device-list root.
    pub const DEVICE_LIST_PATHS: &[&str] = &[
        "/var/run/nvidia-container-devices/all",
        "/var/run/nvidia-container-devices/0",
        "/var/run/nvidia-container-devices",
        "/var/run/nvidia-container-devices/",
        "/var/run/nvidia-container-devices-x/0",
        "/var/run/nvidia-container-devices/../x",
        "/var/run//nvidia-container-devices/0",
        "/run/nvidia-container-devices/0",
    ];
    /// `envFrom` prefixes: starts of NVIDIA runtime variables, and prefixes that are not.
    pub const ENV_FROM_PREFIXES: &[&str] = &[
        "NVIDIA_",
        "NVIDIA_VISIBLE_",
        "N",
        "NVIDIA_GDR",
        "NVIDIA_VISIBLE_DEVICES",
        "HF_",
        "",
        "nvidia_",
    ];
    /// Device-injection annotations (key, value): every GPU, GPUs by path and by number,
    /// restricted devices, mounts, other vendors' devices, look-alike keys.
    pub const INJECTIONS: &[(&str, &str)] = &[
        (
            "devices.gke.io/container.c0",
            "- path: /dev/nvidia0\n- path: /dev/nvidia1\n",
        ),
        (
            "devices.gke.io/container.c1",
            "- path: /dev/nvidia0\n- path: /dev/nvidiactl\n",
        ),
        (
            "devices.gke.io/container.c0",
            "- path: /dev/nvidia-caps-imex-channels/channel0\n",
        ),
        (
            "devices.noderesource.dev/pod",
            "- path: /dev/x\n  type: c\n  major: 195\n  minor: 2\n",
        ),
        (
            "devices.nri.io",
            "- path: /dev/fuse\n  type: c\n  major: 10\n  minor: 229\n",
        ),
        (
            "devices.noderesource.dev/container.c1",
            "- path: /dev/nvidia00\n  type: c\n  major: 195\n  minor: 0\n",
        ),
        (
            "cdi-devices.noderesource.dev/container.c0",
            "- nvidia.com/gpu=all\n",
        ),
        ("cdi-devices.nri.io/pod", "- nvidia.com/gpu=0\n"),
        (
            "mounts.noderesource.dev/pod",
            "- source: /srv\n  destination: /srv\n",
        ),
        (
            "mounts.nri.io/container.c0",
            "- source: /dev/null\n  destination: /var/run/nvidia-container-devices/0\n",
        ),
        ("devices.noderesource.dev/other", "- path: /dev/nvidia0\n"),
        ("devices.gke.io/pod", "- path: /dev/nvidia0\n"),
        ("devices.noderesource.dev", "{not a list"),
        ("nvidia.cdi.k8s.io", "nvidia.com/gpu=all"),
    ];
    /// Exempt image patterns a policy may add; the first has a wildcard in the middle,
    /// which CEL cannot match as a glob.
    pub const PATTERNS: &[&str] = &[
        "registry.example.com/*/tools:1.?",
        "busybox",
        "registry.example.com/team/*",
    ];

    pub struct Case {
        pub pod: Value,
        pub policy: Value,
        /// Whether the case holds something CEL cannot express: a hostPath the backstop
        /// cannot resolve, or an image pattern with a wildcard before its end.
        pub beyond_cel: bool,
    }

    /// Commands and args: start-up steps as real images run them, and words that only look
    /// like one.
    pub const COMMANDS: &[&[&str]] = &[
        &["/usr/sbin/sshd", "-De"],
        &[
            "sh",
            "-c",
            "chown -R app /data && exec gosu app python train.py",
        ],
        &["python", "train.py"],
        &["sudo", "-E", "python", "train.py"],
        &["supervisord", "-n"],
        &["/opt/sshd/run", "--su"],
        &["sh", "-c", "su app -s /bin/sh -c 'dropbear -F'|cat"],
        &["/entrypoint.sh"],
    ];

    /// A `command` (and sometimes `args`) from [`COMMANDS`], or none.
    pub fn command(rng: &mut StdRng, c: &mut Value) {
        if rng.random_bool(0.4) {
            let words = *COMMANDS.choose(rng).unwrap();
            if rng.random_bool(0.3) {
                c["command"] = json!([words[0]]);
                c["args"] = json!(words[1..]);
            } else {
                c["command"] = json!(words);
            }
        }
    }

    fn container(rng: &mut StdRng, name: String, volumes: &[String]) -> Value {
        let mut c = json!({"name": name, "image": *IMAGES.choose(rng).unwrap()});
        if rng.random_bool(0.75) {
            c["securityContext"] = json!({"privileged": rng.random_bool(0.8)});
            // What an ordinary container drops or forbids itself.
            match rng.random_range(0..8) {
                0 => {
                    c["securityContext"]["capabilities"] =
                        json!({"drop": ["ALL"], "add": ["CHOWN"]})
                }
                1 => {
                    c["securityContext"]["capabilities"] = json!({"drop": ["SETUID", "SYS_CHROOT"]})
                }
                2 if c["securityContext"]["privileged"] == false => {
                    c["securityContext"]["allowPrivilegeEscalation"] = json!(false)
                }
                _ => {}
            }
        }
        command(rng, &mut c);
        let mut env = Vec::new();
        for _ in 0..rng.random_range(0..4) {
            env.push(match rng.random_range(0..8) {
                0 => json!({"name": "HOME", "value": "/root"}),
                // Signs of RDMA use, and settings that are none.
                7 => {
                    let (name, value) = *[
                        ("NCCL_IB_HCA", "=mlx5_0,mlx5_1"),
                        ("NCCL_IB_DISABLE", "1"),
                        ("NCCL_NET", "IB"),
                        ("NCCL_NET", "Socket"),
                        ("UCX_TLS", "rc,sm,self"),
                        ("LD_LIBRARY_PATH", "/usr/local/gib/lib64"),
                        ("LD_LIBRARY_PATH", "/usr/local/nvidia/lib64"),
                        ("NCCL_SOCKET_IFNAME", "eth0"),
                    ]
                    .choose(rng)
                    .unwrap();
                    json!({"name": name, "value": value})
                }
                6 => json!({"name": *["NVIDIA_MIG_CONFIG_DEVICES", "NVIDIA_MIG_MONITOR_DEVICES",
                    "NVIDIA_DRIVER_CAPABILITIES", "NVIDIA_IMEX_CHANNELS", "NVIDIA_NVSWITCH",
                    "NVIDIA_MOFED", "NVIDIA_GDS", "NVIDIA_GDRCOPY", "CUDA_VERSION"]
                    .choose(rng).unwrap(), "value": *["enabled", "all", "0"].choose(rng).unwrap()}),
                1 => json!({"name": "NVIDIA_VISIBLE_DEVICES",
                    "valueFrom": {"configMapKeyRef": {"name": "gpus", "key": "devices"}}}),
                2 => json!({"name": "NVIDIA_VISIBLE_DEVICES"}),
                _ => json!({"name": "NVIDIA_VISIBLE_DEVICES",
                    "value": *VISIBLE.choose(rng).unwrap()}),
            });
        }
        if !env.is_empty() {
            c["env"] = Value::Array(env);
        }
        match rng.random_range(0..12) {
            0 => c["envFrom"] = json!([{"configMapRef": {"name": "app-env"}}]),
            1 => c["envFrom"] = json!([]),
            // Prefixes that spell an NVIDIA runtime variable with a key, and look-alikes.
            2 => {
                let prefix = *ENV_FROM_PREFIXES.choose(rng).unwrap();
                c["envFrom"] = json!([{"prefix": prefix, "secretRef": {"name": "app-env"}}]);
            }
            _ => {}
        }
        for field in ["limits", "requests"] {
            if rng.random_bool(0.3) {
                let resource = *RESOURCES.choose(rng).unwrap();
                c["resources"][field] = json!({ resource: "1" });
            }
        }
        let mut mounts: Vec<Value> = volumes
            .iter()
            .filter(|_| rng.random_bool(0.3))
            .map(|v| json!({"name": v, "mountPath": format!("/mnt/{v}")}))
            .collect();
        if rng.random_bool(0.1) {
            let path = *DEVICE_LIST_PATHS.choose(rng).unwrap();
            mounts.push(json!({"name": "scratch", "mountPath": path}));
        }
        // Where Google's gIB NCCL plugin is mounted.
        if rng.random_bool(0.04) {
            mounts.push(json!({"name": "scratch", "mountPath": "/usr/local/gib"}));
        }
        if !mounts.is_empty() {
            c["volumeMounts"] = Value::Array(mounts);
        }
        c
    }

    /// The backstop's GPU image match, as its CEL writes it: no `?`, `*` only at the ends.
    fn cel_image_match(p: &str, image: &str) -> bool {
        let inner = p.len() >= 3 && p[1..p.len() - 1].contains('*');
        if p.contains('?') || inner {
            return false;
        }
        if p == "*" || p == "**" {
            return true;
        }
        match (p.strip_prefix('*'), p.strip_suffix('*')) {
            (Some(_), Some(_)) => image.contains(&p[1..p.len() - 1]),
            (None, Some(prefix)) => image.starts_with(prefix),
            (Some(suffix), None) => image.ends_with(suffix),
            (None, None) => image == p,
        }
    }

    pub fn cases(count: usize) -> Vec<Case> {
        let mut rng = StdRng::seed_from_u64(0x6770_7577_6172_6463);
        (0..count)
            .map(|i| {
                let mut paths = Vec::new();
                let volumes: Vec<String> = (0..rng.random_range(0..3))
                    .map(|v| {
                        paths.push(*HOST_PATHS.choose(&mut rng).unwrap());
                        format!("v{v}")
                    })
                    .collect();
                let mut spec = json!({
                    "containers": (0..rng.random_range(1..4))
                        .map(|c| container(&mut rng, format!("c{c}"), &volumes))
                        .collect::<Vec<_>>(),
                    "volumes": volumes.iter().zip(&paths)
                        .map(|(v, p)| json!({"name": v, "hostPath": {"path": p}}))
                        .collect::<Vec<_>>(),
                });
                if rng.random_bool(0.3) {
                    spec["initContainers"] = json!([container(&mut rng, "init".into(), &volumes)]);
                }
                // Where the pod asks to run: hints that it runs on GPU nodes, and look-alikes.
                match rng.random_range(0..10) {
                    0 => spec["runtimeClassName"] = json!("nvidia"),
                    1 => spec["runtimeClassName"] = json!("kata"),
                    2 => spec["nodeSelector"] = json!({"nvidia.com/gpu.present": "true"}),
                    3 => spec["nodeSelector"] = json!({"nvidia.com/gpu.present": "false"}),
                    4 => {
                        let op = *["In", "Exists", "NotIn", "DoesNotExist"].choose(&mut rng).unwrap();
                        spec["affinity"] = json!({"nodeAffinity": {
                            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                                {"matchExpressions": [{"key": "kubernetes.io/os", "operator": "In", "values": ["linux"]}]},
                                {"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": op}]}]}}})
                    }
                    5 => spec["tolerations"] = json!([{"key": "nvidia.com/gpu", "operator": "Exists"}]),
                    6 => spec["tolerations"] = json!([{"operator": "Exists"}]),
                    _ => {}
                }
                let mut pod = json!({"apiVersion": "v1", "kind": "Pod",
                    "metadata": {"name": format!("p{i}")}, "spec": spec});
                match rng.random_range(0..11) {
                    8..=10 => {
                        let (key, value) = *INJECTIONS.choose(&mut rng).unwrap();
                        pod["metadata"]["annotations"] = json!({ key: value });
                    }
                    0 => {
                        pod["metadata"]["annotations"] =
                            json!({"cdi.k8s.io/gpu": "nvidia.com/gpu=all"})
                    }
                    1 => {
                        pod["metadata"]["annotations"] = json!({"cdi.k8s.io/x": "vendor.com/dev=1"})
                    }
                    3 => {
                        pod["metadata"]["annotations"] = json!({
                            "nvidia.cdi.k8s.io/container.c0": "management.nvidia.com/gpu=all"
                        })
                    }
                    2 => {
                        let value = *["nvidia.com/pgpu=0", "nvidia.com/pgpu=0,nvidia.com/gpu=1",
                            "nvidia.com/pgpu=0,nvidia.com/pgpu=1"].choose(&mut rng).unwrap();
                        pod["metadata"]["annotations"] = json!({"cdi.k8s.io/gpu": value});
                        if rng.random_bool(0.7) {
                            pod["spec"]["containers"][0]["resources"]["limits"]
                                ["nvidia.com/GH100_H100_PCIE"] = json!("1");
                            // Kata needs NVIDIA_VISIBLE_DEVICES=all inside the VM.
                            if rng.random_bool(0.5) {
                                pod["spec"]["containers"][0]["env"] =
                                    json!([{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]);
                            }
                        }
                    }
                    _ => {}
                }
                let mut policy = gpuwarden_crds::manifests::default_policy_manifest();
                if rng.random_bool(0.15) {
                    policy["spec"]["stripCdiAnnotations"] = json!(false);
                }
                match rng.random_range(0..5) {
                    0 => policy["spec"]["runtimeFeatures"] = json!([]),
                    1 => policy["spec"]["runtimeFeatures"] = json!(["GDRCOPY", "GDS", "MOFED"]),
                    _ => {}
                }
                match rng.random_range(0..6) {
                    0 => {
                        policy["spec"]["match"]["gpuImages"] =
                            json!([*GPU_PATTERNS.choose(&mut rng).unwrap()])
                    }
                    1 => {
                        for hint in ["runtimeClassNames", "gpuNodeLabels", "gpuTaints", "gpuImages"] {
                            policy["spec"]["match"][hint] = json!([]);
                        }
                    }
                    _ => {}
                }
                if rng.random_bool(0.1) {
                    policy["spec"]["match"]["privilegedContainers"] = json!("All");
                }
                if rng.random_bool(0.1) {
                    policy["spec"]["capabilities"]["dropAll"] = json!(true);
                }
                if rng.random_bool(0.3) {
                    policy["spec"]["gpu"]["resourceName"] = json!("example.com/accel");
                }
                let mut resource_glob = false;
                if rng.random_bool(0.2) {
                    let pattern = *GPU_RESOURCE_PATTERNS.choose(&mut rng).unwrap();
                    resource_glob = pattern.contains('?');
                    policy["spec"]["match"]["gpuResources"] = json!([pattern]);
                }
                let mut inner_wildcard = false;
                if rng.random_bool(0.3) {
                    // A scoped exemption: here, elsewhere, for one service account, pinned.
                    let pattern = *PATTERNS.choose(&mut rng).unwrap();
                    inner_wildcard = pattern.contains('?');
                    let mut entry = json!({"images": [pattern]});
                    match rng.random_range(0..4) {
                        0 => entry["namespaces"] = json!(["team-a"]),
                        1 => entry["namespaces"] = json!(["elsewhere"]),
                        2 => entry["serviceAccounts"] = json!(["team-a/builder"]),
                        _ => {
                            entry["namespaces"] = json!(["team-a"]);
                            entry["digests"] = json!([format!("sha256:{}", "d".repeat(64))]);
                        }
                    }
                    policy["spec"]["exemptions"]["containers"]
                        .as_array_mut()
                        .unwrap()
                        .push(entry);
                }
                if rng.random_bool(0.3) {
                    pod["spec"]["serviceAccountName"] = json!("builder");
                }
                let mount_paths = ["containers", "initContainers"].into_iter().flat_map(|f| {
                    (pod["spec"][f].as_array().into_iter().flatten()).flat_map(|c| {
                        (c["volumeMounts"].as_array().into_iter().flatten())
                            .filter_map(|m| m["mountPath"].as_str())
                    })
                });
                let unresolved = (paths.iter().copied().chain(mount_paths)).any(|p| {
                    p.contains("//")
                        || p.contains("/./")
                        || p.contains("/../")
                        || p.ends_with("/..")
                });
                let gpu_images: Vec<String> = serde_json::from_value(
                    policy["spec"]["match"]["gpuImages"].clone(),
                )
                .unwrap_or_else(|_| {
                    gpuwarden_crds::GpuPolicy::default_policy().spec.match_.gpu_images
                });
                let glob_only = ["containers", "initContainers"].into_iter().any(|f| {
                    (pod["spec"][f].as_array().into_iter().flatten()).any(|c| {
                        let image = c["image"].as_str().unwrap_or("");
                        gpu_images.iter().any(|p| {
                            gpuwarden_crds::exemptions::image_exempt(image, std::slice::from_ref(p))
                                && !cel_image_match(p, image)
                        })
                    })
                });
                Case {
                    pod,
                    policy,
                    beyond_cel: inner_wildcard || unresolved || glob_only || resource_glob,
                }
            })
            .collect()
    }
}

/// The backstop's GPU containers are the predicate's (`gpuwarden_crds::gpu`), on thousands
/// of generated pods: device paths and their look-alikes, NONE/void in any case and with
/// blanks, repeated env entries, valueFrom, every GPU resource name, the policy's own
/// resource name, `privilegedContainers: All`, exempt images. Where CEL cannot express a
/// rule (unresolved paths, glob patterns) the backstop may only be the more permissive.
#[test]
fn backstop_agrees_with_the_gpu_predicate() {
    use gpuwarden_crds::GpuPolicy;
    use gpuwarden_crds::gpu::{ContainerKind, Rules, pod_containers};
    use std::collections::BTreeSet;

    let backstop = backstop();
    let cases = generated::cases(2400);
    let (mut agreed, mut permissive, mut rejected) = (0, 0, 0);
    let mut injections_refused = 0;
    for (i, case) in cases.iter().enumerate() {
        let pod: k8s_openapi::api::core::v1::Pod =
            serde_json::from_value(case.pod.clone()).expect("a pod");
        let policy: GpuPolicy = serde_json::from_value(case.policy.clone()).expect("a policy");
        let ex = &policy.spec.exemptions;
        let sa = case.pod["spec"]["serviceAccountName"]
            .as_str()
            .unwrap_or("");
        let predicate: BTreeSet<String> = pod_containers(&pod, Rules::of(&policy))
            .into_iter()
            .filter(|c| c.kind != ContainerKind::Ephemeral)
            .filter(|c| ex.container_exemption(c.image, "team-a", sa).is_none())
            .filter(|c| (c.privileged && c.signals.maybe_gpu()) || c.signals.leaks())
            .map(|c| c.name.to_owned())
            .collect();
        let vars = BTreeMap::from([
            ("object", case.pod.clone()),
            ("request", request("team-a")),
            ("namespaceObject", json!({"metadata": {"name": "team-a"}})),
            ("params", case.policy.clone()),
        ]);
        let evaluated = with_variables(&backstop.value, &vars);
        // Device-injection annotations: what the backstop refuses, the engine denies.
        if evaluated["variables"]["injectionBeyond"] == json!(true)
            && evaluated["variables"]["exempt"] != json!(true)
        {
            let mut source = gpuwarden_webhook::admission::StaticSource::new([policy.clone()]);
            source
                .namespaces
                .insert("team-a".into(), Default::default());
            let (engine, _) = engine_answer(&case.pod, "team-a", &source);
            let denied = engine
                .as_ref()
                .err()
                .is_some_and(|m| m.contains("annotation "));
            assert!(
                denied,
                "case {i}: the backstop refuses an injection the engine admits: {engine:?}\npod: {:#}\npolicy spec: {:#}",
                case.pod, case.policy["spec"]
            );
            injections_refused += 1;
        }
        let cel: BTreeSet<String> = evaluated["variables"]["offending"]
            .as_array()
            .expect("offending is a list")
            .iter()
            .map(|n| n.as_str().expect("a name").to_owned())
            .collect();
        let explain = || {
            format!(
                "case {i}: predicate {predicate:?}, backstop {cel:?}\npod: {:#}\npolicy spec: {:#}",
                case.pod, case.policy["spec"]
            )
        };
        assert!(
            cel.is_subset(&predicate),
            "the backstop is stricter: {}",
            explain()
        );
        if cel == predicate {
            agreed += 1;
        } else {
            assert!(
                case.beyond_cel,
                "the backstop misses GPU containers: {}",
                explain()
            );
            permissive += 1;
        }
        rejected += usize::from(!cel.is_empty());
    }
    eprintln!(
        "{} pods: {agreed} agree, {permissive} more permissive where CEL cannot resolve a path \
         or a glob, {rejected} rejected by the backstop",
        cases.len()
    );
    assert!(cases.len() >= 2000 && rejected > cases.len() / 5);
    assert!(permissive < cases.len() / 10, "{permissive}");
    eprintln!("{injections_refused} pods refused for a device-injection annotation");
    assert!(injections_refused >= 50, "{injections_refused}");
}

/// The exemption condition the operator writes into the webhook configuration
/// (`gpuwarden_crds::admission::match_conditions`) lets through, without a call, only pods the engine
/// would leave unchanged under the same policies, and the backstop admits them: on
/// generated pods in NVIDIA's, exempt and ordinary namespaces, with NVIDIA component images,
/// under one or two policies (a second one with other exemptions, sometimes invalid).
#[test]
fn the_exemption_condition_skips_only_pods_the_engine_leaves_unchanged() {
    use gpuwarden_crds::GpuPolicy;
    use gpuwarden_crds::admission::match_conditions::not_exempt_expression;
    use gpuwarden_crds::validation::validate_policy;
    use gpuwarden_webhook::admission::{StaticSource, handle_review};
    use rand::seq::IndexedRandom;
    use rand::{Rng, SeedableRng};

    const NAMESPACES: &[&str] = &[
        "team-a",
        "gpu-operator",
        "nvidia-device-plugin",
        "monitoring",
        "kube-system",
    ];
    const COMPONENT_IMAGES: &[&str] = &[
        "nvcr.io/nvidia/k8s-device-plugin:v0.19.1",
        "nvcr.io/nvidia/k8s/dcgm-exporter:4.5.3-4.8.2-distroless",
        "nvcr.io/nvidia/cloud-native/k8s-mig-manager:v0.15.0",
        "nvcr.io/nvidia/gpu-operator@sha256:0123",
        "nvcr.io/nvidia/driver",
        "registry.example.com/team/tools:1.0",
    ];
    let may_reach = may_reach_gpus();
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x6e6f_7465_7865_6d70);
    let (mut skipped, mut skipped_privileged, mut sent) = (0, 0, 0);
    for (i, case) in generated::cases(2400).into_iter().enumerate() {
        let mut pod = case.pod;
        let namespace = *NAMESPACES.choose(&mut rng).unwrap();
        // NVIDIA's components, and images a team exempts, in some containers or all.
        if rng.random_bool(0.5) {
            let all = rng.random_bool(0.6);
            for field in ["containers", "initContainers"] {
                let list = pod["spec"].get_mut(field).and_then(Value::as_array_mut);
                for c in list.into_iter().flatten() {
                    if all || rng.random_bool(0.5) {
                        c["image"] = json!(*COMPONENT_IMAGES.choose(&mut rng).unwrap());
                    }
                }
            }
        }
        let mut default: GpuPolicy = serde_json::from_value(case.policy.clone()).expect("a policy");
        if rng.random_bool(0.1) {
            // Invalid: it fails closed, its image exemptions hold nowhere.
            default.spec.gpu.default_count = default.spec.gpu.max_per_container + 1;
        }
        let mut policies = vec![default];
        if rng.random_bool(0.4) {
            let mut team = GpuPolicy::default_policy();
            team.metadata.name = Some("team".into());
            team.spec.priority = 10;
            team.spec.namespace_selector = serde_json::from_value(
                json!({"matchLabels": {"kubernetes.io/metadata.name": "team-a"}}),
            )
            .expect("selector");
            match rng.random_range(0..3) {
                0 => team.spec.exemptions.containers[0]
                    .namespaces
                    .push("team-a".into()),
                1 => team.spec.exemptions.namespaces.push("monitoring".into()),
                // Invalid: its image exemptions no longer hold anywhere.
                _ => team.spec.gpu.default_count = team.spec.gpu.max_per_container + 1,
            }
            policies.push(team);
        }
        let condition = not_exempt_expression(policies.iter(), |p| validate_policy(p).is_empty());
        let vars = BTreeMap::from([("object", pod.clone()), ("request", request(namespace))]);
        let exempt_here = !eval_bool(&condition, &vars);
        if !eval_bool(&may_reach, &vars) {
            continue;
        }
        if !exempt_here {
            sent += 1;
            continue;
        }
        skipped += 1;
        skipped_privileged += usize::from(pod.to_string().contains("\"privileged\":true"));
        let review = json!({
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {
                "uid": format!("u{i}"), "namespace": namespace, "operation": "CREATE",
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "userInfo": {"username": "alice"}, "object": pod,
            }
        });
        let source = StaticSource::new(policies.clone());
        let (bytes, _) = handle_review(review.to_string().as_bytes(), &source);
        let answer: Value = serde_json::from_slice(&bytes).expect("JSON");
        assert!(
            answer["response"]["allowed"] == json!(true) && answer["response"]["patch"].is_null(),
            "case {i}: let through without a call, but the engine would answer {:#}\nnamespace {namespace}\ncondition {condition}\npod {pod:#}",
            answer["response"]
        );
        // The backstop, whose parameter is the default policy, admits it too.
        if namespace != "kube-system" {
            let failures = backstop_decides(pod.clone(), namespace, case.policy.clone());
            assert!(
                failures.as_ref().is_none_or(|f| f.is_empty()),
                "case {i}: the backstop refuses a pod let through: {failures:?}\npod {pod:#}"
            );
        }
    }
    eprintln!(
        "{skipped} pods let through without a call ({skipped_privileged} privileged), {sent} sent"
    );
    assert!(
        skipped >= 200 && skipped_privileged >= 100 && sent >= 500,
        "{skipped} {skipped_privileged} {sent}"
    );
}

/// What the API server does with the rendered MutatingAdmissionPolicies: each whose binding
/// selects the pod (namespace and object selectors) and whose matchConditions hold has its
/// JSONPatch applied, in name order. Returns the names of those that changed the pod.
fn api_server_mutates(
    rendered: &[gpuwarden_crds::admission::policies::Rendered],
    pod: &mut Value,
    namespace: &str,
    labels: &BTreeMap<String, String>,
) -> Vec<String> {
    api_server_mutates_update(rendered, pod, None, namespace, labels)
}

/// [`api_server_mutates`] for a create (`old` is `None`) or for an update of `old` into
/// `pod` (`pods/ephemeralcontainers`).
fn api_server_mutates_update(
    rendered: &[gpuwarden_crds::admission::policies::Rendered],
    pod: &mut Value,
    old: Option<&Value>,
    namespace: &str,
    labels: &BTreeMap<String, String>,
) -> Vec<String> {
    use gpuwarden_crds::admission::policies::{KIND_MUTATING, KIND_MUTATING_BINDING};
    let admission_vars = |pod: &Value, namespace: &str, labels: &BTreeMap<String, String>| {
        let mut vars = admission_vars(pod, namespace, labels);
        if let Some(old) = old {
            vars.insert("oldObject", old.clone());
            if let Some(request) = vars.get_mut("request") {
                request["operation"] = json!("UPDATE");
                request["subResource"] = json!("ephemeralcontainers");
            }
        }
        vars
    };
    let mut changed = Vec::new();
    for policy in rendered.iter().filter(|r| r.kind == KIND_MUTATING) {
        let vars = admission_vars(pod, namespace, labels);
        if !selected_and_matched(
            rendered,
            KIND_MUTATING_BINDING,
            &policy.object,
            pod,
            labels,
            &vars,
        ) {
            continue;
        }
        for mutation in policy.object["spec"]["mutations"]
            .as_array()
            .expect("mutations")
        {
            let expression = mutation["jsonPatch"]["expression"]
                .as_str()
                .expect("jsonPatch");
            // Variables are evaluated on the pod as the mutations before left it.
            let vars = with_variables(&policy.object, &admission_vars(pod, namespace, labels));
            let ops = to_json(&eval(expression, &vars));
            let patch: json_patch::Patch = serde_json::from_value(ops.clone())
                .unwrap_or_else(|e| panic!("not a JSONPatch: {e}: {ops}"));
            if patch.0.is_empty() {
                continue;
            }
            json_patch::patch(pod, &patch).unwrap_or_else(|e| {
                panic!("the policy's patch does not apply: {e}: {ops}\n{pod:#}")
            });
            changed.push(policy.name.clone());
        }
    }
    changed
}

/// `object`, `request` and `namespaceObject` as an admission policy sees them.
fn admission_vars(
    pod: &Value,
    namespace: &str,
    labels: &BTreeMap<String, String>,
) -> BTreeMap<&'static str, Value> {
    BTreeMap::from([
        ("object", pod.clone()),
        ("request", request(namespace)),
        (
            "namespaceObject",
            json!({"metadata": {"name": namespace, "labels": labels}}),
        ),
    ])
}

/// Whether `policy`'s binding selects the pod and its matchConditions hold.
fn selected_and_matched(
    rendered: &[gpuwarden_crds::admission::policies::Rendered],
    binding_kind: &str,
    policy: &Value,
    pod: &Value,
    labels: &BTreeMap<String, String>,
    vars: &BTreeMap<&str, Value>,
) -> bool {
    use gpuwarden_crds::selector::matches;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
    let name = &policy["metadata"]["name"];
    let binding = rendered
        .iter()
        .find(|r| r.kind == binding_kind && r.object["metadata"]["name"] == *name)
        .expect("every policy has its binding");
    let resources = &binding.object["spec"]["matchResources"];
    let selector = |field: &str| -> LabelSelector {
        serde_json::from_value(resources[field].clone()).unwrap_or_default()
    };
    let pod_labels: BTreeMap<String, String> =
        serde_json::from_value(pod["metadata"]["labels"].clone()).unwrap_or_default();
    if !matches(&selector("namespaceSelector"), labels).expect("valid selector")
        || !matches(&selector("objectSelector"), &pod_labels).expect("valid selector")
    {
        return false;
    }
    (policy["spec"]["matchConditions"]
        .as_array()
        .into_iter()
        .flatten())
    .all(|c| eval_bool(c["expression"].as_str().expect("expression"), vars))
}

/// The engine's answer through `handle_review`: `Err(message)` when it denies, else the pod
/// with its patch applied, and its warnings.
fn engine_answer(
    pod: &Value,
    namespace: &str,
    source: &gpuwarden_webhook::admission::StaticSource,
) -> (Result<Value, String>, Vec<String>) {
    use gpuwarden_webhook::admission::handle_review;
    let review = json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": "u", "namespace": namespace, "operation": "CREATE",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "userInfo": {"username": "alice"}, "object": pod,
        }
    });
    let (bytes, _) = handle_review(review.to_string().as_bytes(), source);
    let answer: Value = serde_json::from_slice(&bytes).expect("JSON");
    let response = &answer["response"];
    let warnings: Vec<String> =
        serde_json::from_value(response["warnings"].clone()).unwrap_or_default();
    if response["allowed"] != json!(true) {
        return (Err(response["status"]["message"].to_string()), warnings);
    }
    let mut out = pod.clone();
    if let Some(patch) = response["patch"].as_str() {
        let engine = base64_simd::STANDARD.decode_to_vec(patch).expect("base64");
        let patch: json_patch::Patch = serde_json::from_slice(&engine).expect("a patch");
        json_patch::patch(&mut out, &patch).expect("the engine's patch applies");
    }
    (Ok(out), warnings)
}

/// `kubectl debug` on a governed pod: for every ephemeral container an update adds (images
/// exempt or not, in exempt and governed namespaces, with and without their own GPU
/// variables or a device-list mount, next to ephemeral containers already there), the
/// rendered MutatingAdmissionPolicy stores the pod the engine writes, or leaves to the
/// webhook what it denies.
#[test]
fn api_server_voids_new_ephemeral_containers_as_the_engine_does() {
    use gpuwarden_crds::GpuPolicy;
    use gpuwarden_crds::admission::policies::{MutatingApi, render};
    use gpuwarden_crds::selection::namespace_labels_or_default;
    use gpuwarden_webhook::admission::{StaticSource, handle_review};

    let mut policy = GpuPolicy::default_policy();
    policy.metadata.uid = Some("u".into());
    let rendered = render(&[&policy], |_| true, MutatingApi::V1);
    let source = StaticSource::new([policy]);
    let images = [
        "nvcr.io/nvidia/cuda:12.4.1-base-ubuntu22.04",
        "busybox",
        "nvcr.io/nvidia/k8s/dcgm-exporter:3.3.5-3.4.0-ubuntu22.04",
    ];
    let envs = [
        json!(null),
        json!([{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]),
        json!([{"name": "TERM", "value": "xterm"}]),
        json!([{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]),
    ];
    let (mut voided, mut denied, mut total) = (0, 0, 0);
    for namespace in ["ml", "gpu-operator"] {
        let labels = namespace_labels_or_default(namespace, None);
        for image in images {
            for env in &envs {
                for (before, device_list) in [(0, false), (1, false), (1, true)] {
                    total += 1;
                    let debugger = |name: &str, image: &str, env: &Value, mount: bool| {
                        let mut c = json!({"name": name, "image": image,
                            "securityContext": {"privileged": false}});
                        if !env.is_null() {
                            c["env"] = env.clone();
                        }
                        if mount {
                            c["volumeMounts"] = json!([{"name": "list",
                                "mountPath": "/var/run/nvidia-container-devices/all"}]);
                        }
                        c
                    };
                    let mut old = pod(json!({
                        "containers": [container("app", None)],
                        "volumes": [{"name": "list", "emptyDir": {}}]
                    }));
                    old["metadata"]["name"] = json!("p");
                    if before > 0 {
                        old["spec"]["ephemeralContainers"] =
                            json!([debugger("debugger-old", images[0], &json!(null), false)]);
                    }
                    let mut new = old.clone();
                    let added = debugger("debugger-new", image, env, device_list);
                    match new["spec"]["ephemeralContainers"].as_array_mut() {
                        Some(list) => list.push(added),
                        None => new["spec"]["ephemeralContainers"] = json!([added]),
                    }
                    let review = json!({
                        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                        "request": {
                            "uid": "u", "namespace": namespace, "operation": "UPDATE",
                            "subResource": "ephemeralcontainers",
                            "kind": {"group": "", "version": "v1", "kind": "Pod"},
                            "resource": {"group": "", "version": "v1", "resource": "pods"},
                            "userInfo": {"username": "alice"},
                            "object": new, "oldObject": old,
                        }
                    });
                    let (bytes, _) = handle_review(review.to_string().as_bytes(), &source);
                    let answer: Value = serde_json::from_slice(&bytes).expect("JSON");
                    let ctx =
                        || format!("{namespace} {image} {env} before {before} list {device_list}");
                    let mut stored = new.clone();
                    api_server_mutates_update(
                        &rendered,
                        &mut stored,
                        Some(&old),
                        namespace,
                        &labels,
                    );
                    if answer["response"]["allowed"] != json!(true) {
                        // The webhook denies it; the policy must not have made it look voided.
                        denied += 1;
                        assert_eq!(stored, new, "{}", ctx());
                        continue;
                    }
                    let mut engine = new.clone();
                    if let Some(patch) = answer["response"]["patch"].as_str() {
                        let bytes = base64_simd::STANDARD.decode_to_vec(patch).expect("base64");
                        let patch: json_patch::Patch =
                            serde_json::from_slice(&bytes).expect("a patch");
                        json_patch::patch(&mut engine, &patch).expect("applies");
                    }
                    assert_eq!(stored, engine, "{}", ctx());
                    assert_eq!(
                        stored["spec"]["ephemeralContainers"][before],
                        engine["spec"]["ephemeralContainers"][before]
                    );
                    voided += usize::from(stored != new);
                }
            }
        }
    }
    eprintln!(
        "{total} ephemeral additions: {voided} voided on both paths, {denied} denied by the webhook"
    );
    assert!(
        voided >= 4 && denied >= 4,
        "{voided} voided, {denied} denied"
    );
}

/// One source of truth: on thousands of generated pods under generated policies, the API
/// server's path (the rendered MutatingAdmissionPolicies, then the webhook where its
/// matchConditions still send the pod, then the policies that ask to be reinvoked where the
/// webhook changed it) stores exactly the pod the engine alone writes, or both deny it. In Audit mode the
/// rendered ValidatingAdmissionPolicy names the containers the engine names.
#[test]
fn api_server_policies_follow_the_engine() {
    // The rewrite's expressions nest deeply: the parser and the interpreter recurse on them.
    std::thread::Builder::new()
        .stack_size(256 << 20)
        .spawn(policies_follow_the_engine)
        .expect("a thread")
        .join()
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
}

fn policies_follow_the_engine() {
    use gpuwarden_crds::admission::match_conditions::not_exempt_expression;
    use gpuwarden_crds::admission::policies::{
        KIND_VALIDATING, KIND_VALIDATING_BINDING, MutatingApi, render,
    };
    use gpuwarden_crds::selection::namespace_labels_or_default;
    use gpuwarden_crds::validation::validate_policy;
    use gpuwarden_crds::{GpuPolicy, PolicyMode};
    use gpuwarden_webhook::admission::StaticSource;
    use rand::seq::IndexedRandom;
    use rand::{Rng, SeedableRng};

    const NAMESPACES: &[(&str, &[(&str, &str)])] = &[
        ("team-a", &[("team", "a")]),
        ("batch", &[]),
        (
            "restricted",
            &[("pod-security.kubernetes.io/enforce", "restricted")],
        ),
        (
            "baseline",
            &[("pod-security.kubernetes.io/enforce", "baseline")],
        ),
        ("gpu-operator", &[]),
        ("kube-system", &[]),
    ];
    const PLAIN_IMAGES: &[&str] = &[
        "nvcr.io/nvidia/cuda:12.4.1-base-ubuntu22.04",
        "busybox",
        "nvcr.io/nvidia/k8s/dcgm-exporter:3.3.5-3.4.0-ubuntu22.04",
        "registry.example.com/team/tools:1.0",
    ];
    let may_reach = may_reach_gpus();
    let start_up =
        load_file(gpuwarden_crds::manifests::START_UP_WARNINGS).expect("manifest")[0].clone();
    let mut start_up_warned = (0, 0);
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x6d61_7073_6469_6666);
    let cases = generated::cases(2400);
    let total = cases.len();
    let (mut by_policy, mut by_both, mut by_webhook, mut denied, mut audited) = (0, 0, 0, 0, 0);
    let mut daemon_set_warnings = 0;
    let mut rewritten_alone = 0;
    for (i, case) in cases.into_iter().enumerate() {
        let mut pod = case.pod;
        let (namespace, labels) = *NAMESPACES.choose(&mut rng).unwrap();
        let labels = namespace_labels_or_default(
            namespace,
            Some(
                labels
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
            ),
        );
        // Containers without privilege, many with a CUDA image: what the void rule is for.
        // Some pods have nothing else: ordinary pods, which no webhook is sent.
        let ordinary = rng.random_bool(0.4);
        if ordinary {
            let spec = pod["spec"].as_object_mut().expect("spec");
            spec.remove("volumes");
            pod["metadata"]
                .as_object_mut()
                .map(|m| m.remove("annotations"));
        }
        for field in ["containers", "initContainers"] {
            for c in pod["spec"]
                .get_mut(field)
                .and_then(Value::as_array_mut)
                .into_iter()
                .flatten()
            {
                if ordinary {
                    if let Some(env) = c.get_mut("env").and_then(Value::as_array_mut) {
                        env.retain(|e| !e["name"].as_str().unwrap_or("").starts_with("NVIDIA_"));
                    }
                    c.as_object_mut().map(|c| c.remove("volumeMounts"));
                }
                if ordinary || rng.random_bool(0.4) {
                    c.as_object_mut().map(|c| c.remove("securityContext"));
                    if rng.random_bool(0.5) {
                        c["image"] = json!(*PLAIN_IMAGES.choose(&mut rng).unwrap());
                    }
                }
                if rng.random_bool(0.1) {
                    c["resources"]["claims"] = json!([{"name": "nic"}]);
                }
            }
        }
        // Privileged GPU pods as most are written, which the API server rewrites itself:
        // each container privileged with its GPUs named plainly, or not privileged at all.
        if !ordinary && rng.random_bool(0.8) {
            plain_privileged(&mut pod, &mut rng);
        }
        if rng.random_bool(0.5) {
            pod["metadata"]["labels"] = json!({"app": "serve"});
        }
        if rng.random_bool(0.15) {
            let role = *["worker", "launcher"].choose(&mut rng).unwrap();
            pod["metadata"]["labels"][gpuwarden_crds::start_up::LABEL_MPI_JOB_ROLE] = json!(role);
        }
        if rng.random_bool(0.1) {
            pod["metadata"]["ownerReferences"] = json!([{"apiVersion": "apps/v1",
                "kind": "DaemonSet", "name": "agent", "uid": "1", "controller": true}]);
        }
        let mut default: GpuPolicy = serde_json::from_value(case.policy.clone()).expect("a policy");
        default.spec.mode = *[
            PolicyMode::Enforce,
            PolicyMode::Enforce,
            PolicyMode::Audit,
            PolicyMode::Deny,
        ]
        .choose(&mut rng)
        .unwrap();
        default.spec.void_non_gpu_containers = rng.random_bool(0.9);
        if rng.random_bool(0.05) {
            default.spec.gpu.default_count = default.spec.gpu.max_per_container + 1;
        }
        let mut policies = vec![default];
        if rng.random_bool(0.4) {
            let mut team = GpuPolicy::default_policy();
            team.metadata.name = Some("team".into());
            team.spec.priority = 10;
            team.spec.mode = *[PolicyMode::Enforce, PolicyMode::Audit]
                .choose(&mut rng)
                .unwrap();
            team.spec.namespace_selector =
                serde_json::from_value(json!({"matchLabels": {"team": "a"}})).expect("selector");
            if rng.random_bool(0.5) {
                team.spec.pod_selector = Some(
                    serde_json::from_value(json!({"matchExpressions": [
                        {"key": "app", "operator": "In", "values": ["serve"]}]}))
                    .expect("selector"),
                );
            }
            if rng.random_bool(0.1) {
                team.spec.gpu.default_count = team.spec.gpu.max_per_container + 1;
            }
            policies.push(team);
        }
        let valid = |p: &GpuPolicy| validate_policy(p).is_empty();
        let refs: Vec<&GpuPolicy> = policies.iter().collect();
        let rendered = render(&refs, valid, MutatingApi::V1);
        let not_exempt = not_exempt_expression(policies.iter(), valid);
        let mut source = StaticSource::new(policies.clone());
        source
            .namespaces
            .insert(namespace.to_owned(), labels.clone());

        let ctx = || {
            format!(
                "case {i} in {namespace}\npolicies {:#}\npod {pod:#}",
                json!(policies)
            )
        };
        let (alone, warnings) = engine_answer(&pod, namespace, &source);

        // The API server's path.
        let mut stored = pod.clone();
        let first = api_server_mutates(&rendered, &mut stored, namespace, &labels);
        let vars = admission_vars(&stored, namespace, &labels);
        let sent = eval_bool(&may_reach, &vars) && eval_bool(&not_exempt, &vars);
        let chain = if sent {
            match engine_answer(&stored, namespace, &source).0 {
                // A policy that asks to be reinvoked runs again on what the webhook wrote.
                Ok(mut after) if after != stored => {
                    let again: Vec<&str> = (rendered.iter())
                        .filter(|r| r.object["spec"]["reinvocationPolicy"] == "IfNeeded")
                        .map(|r| r.name.as_str())
                        .collect();
                    let reinvoked: Vec<_> = (rendered.iter())
                        .filter(|r| again.contains(&r.name.as_str()))
                        .cloned()
                        .collect();
                    api_server_mutates(&reinvoked, &mut after, namespace, &labels);
                    Ok(after)
                }
                other => other,
            }
        } else {
            Ok(stored.clone())
        };
        match (&alone, &chain) {
            (Err(_), Err(_)) => denied += 1,
            (Ok(engine), Ok(api_server)) => assert_eq!(
                api_server,
                engine,
                "the API server's path stores another pod than the engine writes\n{}",
                ctx()
            ),
            _ => panic!(
                "one path denies, the other admits: engine {alone:?}, API server {chain:?}\n{}",
                ctx()
            ),
        }
        let rewritten = stored["metadata"]["annotations"]
            .get(gpuwarden_crds::ANNOTATION_REWRITTEN)
            .is_some();
        rewritten_alone += usize::from(rewritten && !sent);

        // What start-up steps keep and lose: the API server's warning on the stored pod says
        // what the engine says, whichever path rewrote it.
        if let Ok(stored) = &chain {
            let vars = admission_vars(stored, namespace, &labels);
            let api = decide(&start_up, &vars).unwrap_or_default();
            let engine: Vec<&String> = (warnings.iter())
                .filter(|w| w.starts_with(gpuwarden_crds::start_up::WARNING_PREFIX))
                .collect();
            let same = api.len() == engine.len()
                && api.iter().zip(&engine).all(|(api, engine)| {
                    api == *engine
                        || (engine.ends_with("...")
                            && api.starts_with(engine.trim_end_matches("...")))
                });
            assert!(
                same,
                "start-up: the API server warns {api:#?}, the engine {engine:#?}\n{}",
                ctx()
            );
            start_up_warned.0 += usize::from(!api.is_empty() && !sent);
            start_up_warned.1 += usize::from(api.iter().any(|w| w.contains(": loses ")));
        }
        match (first.is_empty(), sent) {
            (false, false) => by_policy += 1,
            (false, true) => by_both += 1,
            (true, true) => by_webhook += 1,
            (true, false) => {}
        }

        // Audit: the warning policy names the containers the engine names.
        // The engine names containers without a claim and claim holders in two warnings.
        let mut engine_names: Vec<&str> = (warnings.iter())
            .filter_map(|w| w.strip_prefix("gpuwarden audit: "))
            .filter_map(|w| w.split_once(" would get NVIDIA_VISIBLE_DEVICES=void in Enforce"))
            .flat_map(|(names, _)| names.split(", "))
            .collect();
        engine_names.sort_unstable();
        let engine_names = (!engine_names.is_empty()).then(|| engine_names.join(", "));
        let vars = admission_vars(&pod, namespace, &labels);
        let mut api_names = None;
        let for_daemon_sets = |r: &&gpuwarden_crds::admission::policies::Rendered| {
            r.object["spec"]["matchConstraints"]["resourceRules"][0]["resources"][0] == "daemonsets"
        };
        for policy in (rendered.iter())
            .filter(|r| r.kind == KIND_VALIDATING)
            .filter(|r| !for_daemon_sets(r))
        {
            if !selected_and_matched(
                &rendered,
                KIND_VALIDATING_BINDING,
                &policy.object,
                &pod,
                &labels,
                &vars,
            ) {
                continue;
            }
            let vars = with_variables(&policy.object, &vars);
            let mut names: Vec<String> =
                serde_json::from_value(vars["variables"]["voided"].clone()).expect("names");
            names.sort_unstable();
            if !names.is_empty() {
                api_names = Some(names.join(", "));
            }
        }
        audited += usize::from(api_names.is_some());
        assert_eq!(
            api_names,
            engine_names,
            "Audit: the warning policy and the engine name other containers\n{}",
            ctx()
        );

        // Audit, for the pod as a DaemonSet's template: the DaemonSet warning says what the
        // engine says of the DaemonSet's pod, word for word.
        let owner = json!([{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "agent",
            "uid": "1", "controller": true}]);
        let mut ds_pod = pod.clone();
        ds_pod["metadata"]["ownerReferences"] = owner;
        let (_, ds_warnings) = engine_answer(&ds_pod, namespace, &source);
        let engine_says = (ds_warnings.iter())
            .find(|w| w.starts_with("gpuwarden audit: DaemonSet "))
            .cloned();
        let mut template_meta = json!({});
        for key in ["labels", "annotations"] {
            if let Some(v) = pod["metadata"].get(key) {
                template_meta[key] = v.clone();
            }
        }
        let daemon_set = json!({"apiVersion": "apps/v1", "kind": "DaemonSet",
            "metadata": {"name": "agent", "namespace": namespace},
            "spec": {"selector": {"matchLabels": {"app": "agent"}},
                     "template": {"metadata": template_meta, "spec": pod["spec"].clone()}}});
        let vars = admission_vars(&daemon_set, namespace, &labels);
        let mut api_says = None;
        for policy in (rendered.iter())
            .filter(|r| r.kind == KIND_VALIDATING)
            .filter(for_daemon_sets)
        {
            if !selected_and_matched(
                &rendered,
                KIND_VALIDATING_BINDING,
                &policy.object,
                &daemon_set,
                &labels,
                &vars,
            ) {
                continue;
            }
            let vars = with_variables(&policy.object, &vars);
            let validation = &policy.object["spec"]["validations"][0];
            if eval_bool(
                validation["expression"].as_str().expect("expression"),
                &vars,
            ) {
                continue;
            }
            let message = eval(
                validation["messageExpression"].as_str().expect("message"),
                &vars,
            );
            api_says = Some(to_json(&message).as_str().expect("a string").to_owned());
        }
        // The engine clips its warnings to what Kubernetes keeps.
        let clipped = match (&api_says, &engine_says) {
            (Some(api), Some(engine)) if engine.ends_with("...") && api != engine => {
                api.starts_with(engine.trim_end_matches("..."))
            }
            _ => api_says == engine_says,
        };
        assert!(
            clipped,
            "Audit: the DaemonSet warning says {api_says:?}, the engine {engine_says:?}\n{}",
            ctx()
        );
        daemon_set_warnings += usize::from(api_says.is_some());
    }
    eprintln!(
        "{total} pods: {by_policy} changed by the API server's policies alone ({rewritten_alone} privileged GPU pods rewritten), {by_both} by them and the webhook, {by_webhook} by the webhook alone; {denied} denied on both paths; {audited} void warnings in Audit, {daemon_set_warnings} of them for DaemonSets; start-up warnings on {} pods the API server rewrote alone, {} saying what is lost",
        start_up_warned.0, start_up_warned.1
    );
    assert!(
        start_up_warned.0 >= 30 && start_up_warned.1 >= 30,
        "start-up warnings: {start_up_warned:?}"
    );
    assert!(
        by_policy >= 150
            && rewritten_alone >= 100
            && by_both >= 15
            && by_webhook >= 500
            && audited >= 50
            && daemon_set_warnings >= 50
            && denied >= 100,
        "{by_policy} {rewritten_alone} {by_both} {by_webhook} {audited} {daemon_set_warnings} {denied}"
    );
}

/// Makes `pod` a privileged GPU pod as most are written: no hostPath volumes, annotations,
/// `envFrom`, claims or device-list mounts; each container privileged and naming its GPUs
/// (a limit, a request, `NVIDIA_VISIBLE_DEVICES`), or not privileged and naming none. Some
/// still fall outside what the API server rewrites (a zero limit, `none`, a lower-case
/// capability, a shared request), which the webhook must then get.
fn plain_privileged(pod: &mut Value, rng: &mut rand::rngs::StdRng) {
    use rand::Rng;
    use rand::seq::IndexedRandom;
    const RESOURCES: &[&str] = &[
        "nvidia.com/gpu",
        "nvidia.com/gpu",
        "example.com/accel",
        "nvidia.com/mig-1g.10gb",
        "nvidia.com/gpu.shared",
    ];
    const VISIBLE: &[&str] = &[
        "0,1",
        "1, 0",
        "all",
        "ALL",
        "GPU-8f2c3b1a",
        "0,0",
        "none",
        "0,1 ,2",
        "3",
    ];
    const CAPS: &[&str] = &["IPC_LOCK", "NET_ADMIN", "SYS_ADMIN", "CHOWN", "SYS_PTRACE"];
    let spec = pod["spec"].as_object_mut().expect("spec");
    spec.remove("volumes");
    if rng.random_bool(0.1) {
        spec.insert("hostNetwork".into(), json!(true));
    }
    if let Some(meta) = pod["metadata"].as_object_mut() {
        meta.remove("annotations");
    }
    for field in ["initContainers", "containers"] {
        let init = field == "initContainers";
        for c in pod["spec"]
            .get_mut(field)
            .and_then(Value::as_array_mut)
            .into_iter()
            .flatten()
        {
            let c = c.as_object_mut().expect("container");
            for key in ["envFrom", "volumeMounts", "resources", "securityContext"] {
                c.remove(key);
            }
            let mut env: Vec<Value> = (c.remove("env").and_then(|e| e.as_array().cloned()))
                .unwrap_or_default()
                .into_iter()
                .filter(|e| !e["name"].as_str().unwrap_or("").starts_with("NVIDIA_"))
                .collect();
            if init || rng.random_bool(0.3) {
                if rng.random_bool(0.3) {
                    c.insert(
                        "resources".into(),
                        json!({"limits": {"nvidia.com/gpu": "1"}}),
                    );
                }
            } else {
                let mut context = json!({"privileged": true});
                if rng.random_bool(0.5) {
                    let mut add: Vec<&str> = CAPS.choose_multiple(rng, 2).copied().collect();
                    if rng.random_bool(0.1) {
                        add.push("cap_sys_admin");
                    }
                    context["capabilities"] = json!({"add": add});
                    if rng.random_bool(0.3) {
                        let drop = *[&["NET_RAW"][..], &["ALL"], &["SETUID", "CHOWN"]]
                            .choose(rng)
                            .expect("drops");
                        context["capabilities"]["drop"] = json!(drop);
                    }
                }
                c.insert("securityContext".into(), context);
                let resource = *RESOURCES.choose(rng).expect("resources");
                let count = *["1", "2", "1", "4", "0"].choose(rng).expect("counts");
                match rng.random_range(0..4) {
                    0 => {
                        c.insert("resources".into(), json!({"limits": {resource: count}}));
                    }
                    1 => {
                        c.insert("resources".into(), json!({"requests": {resource: count}}));
                    }
                    _ => {}
                }
                if rng.random_bool(0.7) {
                    if rng.random_bool(0.3) {
                        let value = *["compute,utility", "all"]
                            .choose(rng)
                            .expect("capabilities");
                        env.push(json!({"name": "NVIDIA_DRIVER_CAPABILITIES", "value": value}));
                    }
                    let value = *VISIBLE.choose(rng).expect("values");
                    env.push(json!({"name": "NVIDIA_VISIBLE_DEVICES", "value": value}));
                }
            }
            if !env.is_empty() {
                c.insert("env".into(), Value::Array(env));
            }
        }
    }
}

/// The claim guard (`deploy/admission/driver-claims.yaml`) refuses a ResourceClaim or
/// ResourceClaimTemplate exactly where the engine's reading of claims
/// (`ClaimDevices::driver_only`, which the engine denies a pod for and offline `mutate`
/// marks a claim for) finds something only a driver's own pods may hold, names the same
/// classes and config kinds, and says why in the engine's words: on generated claims and
/// templates with `exactly` and `firstAvailable` requests, opaque configs with and without
/// a kind, in tenant, driver and exempt namespaces, under default, custom, missing and
/// Audit `driverClaims`, created and updated.
#[test]
fn the_claim_guard_follows_the_engine() {
    use gpuwarden_crds::GpuPolicy;
    use gpuwarden_crds::claims::{
        CONFIG_KIND_CD_DAEMON, ClaimDevices, DEVICE_CLASS_CD_CHANNEL, DEVICE_CLASS_CD_DAEMON,
        driver_only_reason,
    };
    use k8s_openapi::api::resource::v1::ResourceClaimSpec;
    use rand::seq::IndexedRandom;
    use rand::{Rng, SeedableRng};

    const CLASSES: &[&str] = &[
        DEVICE_CLASS_CD_DAEMON,
        DEVICE_CLASS_CD_CHANNEL,
        "gpu.nvidia.com",
        "mig.nvidia.com",
        "nic.example.com",
        "compute-domain-daemon.nvidia.com.example.com",
    ];
    const KINDS: &[&str] = &[
        CONFIG_KIND_CD_DAEMON,
        "ComputeDomainChannelConfig",
        "GpuConfig",
        "computedomaindaemonconfig",
    ];
    const NAMESPACES: &[&str] = &["team-a", "ml", "nvidia-dra-driver-gpu"];
    let guard = load_file(gpuwarden_crds::manifests::DRIVER_CLAIMS).expect("manifest")[0].clone();
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x636c_6169_6d73);
    let (mut refused, mut passed_in_driver_namespaces, mut unchanged_updates) = (0, 0, 0);
    for i in 0..3000 {
        let mut requests = Vec::new();
        for r in 0..rng.random_range(0..4) {
            let class = *CLASSES.choose(&mut rng).unwrap();
            requests.push(if rng.random_bool(0.7) {
                json!({"name": format!("r{r}"), "exactly": {"deviceClassName": class}})
            } else {
                let alternatives: Vec<Value> = (0..rng.random_range(1..4))
                    .map(|s| {
                        json!({"name": format!("s{s}"),
                            "deviceClassName": *CLASSES.choose(&mut rng).unwrap()})
                    })
                    .collect();
                json!({"name": format!("r{r}"), "firstAvailable": alternatives})
            });
        }
        let mut configs = Vec::new();
        for _ in 0..rng.random_range(0..3) {
            let mut parameters = json!({"apiVersion": "resource.nvidia.com/v1beta1"});
            if rng.random_bool(0.8) {
                parameters["kind"] = json!(*KINDS.choose(&mut rng).unwrap());
            }
            configs.push(json!({"requests": ["r0"], "opaque": {
                "driver": "compute-domain.nvidia.com", "parameters": parameters}}));
        }
        let mut spec = json!({});
        if rng.random_bool(0.95) {
            spec["devices"] = json!({});
            if !requests.is_empty() {
                spec["devices"]["requests"] = Value::Array(requests);
            }
            if !configs.is_empty() {
                spec["devices"]["config"] = Value::Array(configs);
            }
        }
        let template = rng.random_bool(0.4);
        let (kind, resource, object) = if template {
            (
                "ResourceClaimTemplate",
                "resourceclaimtemplates",
                json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                    "metadata": {"name": format!("c{i}")}, "spec": {"spec": spec}}),
            )
        } else {
            (
                "ResourceClaim",
                "resourceclaims",
                json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                    "metadata": {"name": format!("c{i}")}, "spec": spec}),
            )
        };
        let namespace = *NAMESPACES.choose(&mut rng).unwrap();
        let mut params = default_params();
        match rng.random_range(0..10) {
            0 => {
                params["spec"]
                    .as_object_mut()
                    .map(|s| s.remove("driverClaims"));
            }
            1 | 2 => {
                let some = |rng: &mut rand::rngs::StdRng, from: &[&str]| -> Vec<String> {
                    (from.iter())
                        .filter(|_| rng.random_bool(0.5))
                        .map(|s| s.to_string())
                        .collect()
                };
                params["spec"]["driverClaims"] = json!({
                    "deviceClasses": some(&mut rng, CLASSES),
                    "configKinds": some(&mut rng, KINDS),
                    "namespaces": some(&mut rng, NAMESPACES),
                });
            }
            3 => params["spec"]["mode"] = json!("Audit"),
            4 => params["spec"]["exemptions"]["namespaces"] = json!([namespace]),
            _ => {}
        }
        let (operation, old) = match rng.random_range(0..10) {
            0 => ("UPDATE", Some(object.clone())),
            1 => {
                let mut old = object.clone();
                if template {
                    old["spec"]["spec"] = json!({});
                } else {
                    old["spec"] = json!({});
                }
                ("UPDATE", Some(old))
            }
            _ => ("CREATE", None),
        };
        let mut request = request(namespace);
        request["operation"] = json!(operation);
        request["kind"] = json!({"group": "resource.k8s.io", "version": "v1", "kind": kind});
        request["resource"] =
            json!({"group": "resource.k8s.io", "version": "v1", "resource": resource});
        let mut vars = BTreeMap::from([
            ("object", object.clone()),
            ("request", request),
            ("params", params.clone()),
        ]);
        if let Some(old) = &old {
            vars.insert("oldObject", old.clone());
        }
        let failures = decide(&guard, &vars).expect("the guard has no matchConditions");

        // The engine's reading, under the same policy.
        let policy: GpuPolicy = serde_json::from_value(params.clone()).expect("a policy");
        let rules = &policy.spec.driver_claims;
        let claim_spec: ResourceClaimSpec = serde_json::from_value(spec).expect("a claim spec");
        let unchanged = old.as_ref() == Some(&object);
        let judged = policy.spec.mode != gpuwarden_crds::PolicyMode::Audit
            && !(policy.spec.exemptions.namespaces.iter()).any(|n| n == namespace)
            && !rules.namespaces.iter().any(|n| n == namespace)
            && !unchanged;
        let engine = ClaimDevices::of(&claim_spec).driver_only(rules);
        let ctx = || format!("case {i} in {namespace}, {operation}\n{object:#}\n{params:#}");
        if !judged || engine.is_empty() {
            assert_eq!(failures, Vec::<String>::new(), "{}", ctx());
            passed_in_driver_namespaces +=
                usize::from(!engine.is_empty() && rules.namespaces.iter().any(|n| n == namespace));
            unchanged_updates += usize::from(!engine.is_empty() && unchanged);
            continue;
        }
        refused += 1;
        let evaluated = with_variables(&guard.value, &vars);
        let named: Vec<String> =
            serde_json::from_value(evaluated["variables"]["named"].clone()).expect("named");
        let configs: Vec<String> =
            serde_json::from_value(evaluated["variables"]["configs"].clone()).expect("configs");
        let mut cel: Vec<String> = (named.iter().map(|c| format!("DeviceClass {c}")))
            .chain(configs.iter().map(|k| format!("opaque config {k}")))
            .collect();
        let mut sorted_engine = engine.clone();
        sorted_engine.sort();
        cel.sort();
        assert_eq!(cel, sorted_engine, "{}", ctx());
        assert_eq!(failures.len(), 1, "{failures:?}\n{}", ctx());
        // Listed in the policy's order by the API server, the claim's by the engine.
        let ordered: Vec<String> = (named.iter().map(|c| format!("DeviceClass {c}")))
            .chain(configs.iter().map(|k| format!("opaque config {k}")))
            .collect();
        assert_eq!(
            failures[0],
            format!("gpuwarden: {kind} c{i}: {}", driver_only_reason(&ordered)),
            "{}",
            ctx()
        );
    }
    eprintln!(
        "3000 claims: {refused} refused, {passed_in_driver_namespaces} of a driver's own namespace passed, {unchanged_updates} unchanged updates passed"
    );
    assert!(
        refused >= 500 && passed_in_driver_namespaces >= 100 && unchanged_updates >= 50,
        "{refused} {passed_in_driver_namespaces} {unchanged_updates}"
    );
}

/// Kata Containers' annotations and `VISIBLE_CDI_DEVICES` (docs/design.md, "Kata
/// Containers"): the backstop's `kata` and `visibleCdi` name exactly the annotations
/// `kata::judge` refuses and the containers that set the variable holding no GPU of their
/// own; the engine denies exactly those pods, naming each; and the webhook's matchConditions
/// send every pod the engine denies. On generated pods with device and agent annotations
/// (agent settings split by tabs, no-break spaces and runs of spaces, the settings Kata's
/// own GPU manifests use, look-alike keys), containers with and without GPUs of their own,
/// in governed and exempt namespaces.
#[test]
fn kata_and_visible_cdi_follow_the_engine() {
    use gpuwarden_crds::kata::{
        DEVICE_ANNOTATIONS, ENV_VISIBLE_CDI_DEVICES, KERNEL_PARAMS, holds_gpu_of_its_own, judge,
    };
    use gpuwarden_webhook::admission::StaticSource;
    use rand::seq::IndexedRandom;
    use rand::{Rng, SeedableRng};
    use std::collections::BTreeSet;

    const KERNEL_PARAM_VALUES: &[&str] = &[
        "agent.visible_cdi_devices=true",
        "agent.log=debug",
        "console=ttyS0  agent.log=debug",
        "agent.log=debug\u{a0}agent.devmode",
        "agent.guest_components_procs=confidential-data-hub agent.aa_kbc_params=cc_kbc::http://kbs",
        "agent.hotplug_timeout=5s\tagent.debug_console",
        "quiet",
        "xagent.devmode",
        "agent.",
        "agent.log",
    ];
    const OTHER_KEYS: &[&str] = &[
        "io.katacontainers.config.hypervisor.default_memory",
        "io.katacontainers.config_path.x",
        "katacontainers.config_path",
        "io.katacontainers.config.hypervisor.kernel_params.x",
    ];
    const RESOURCES: &[Option<(&str, &str)>] = &[
        None,
        Some(("limits", "nvidia.com/gpu")),
        Some(("requests", "nvidia.com/pgpu")),
        Some(("limits", "cpu")),
        Some(("limits", "example.com/accel")),
    ];
    let backstop = backstop();
    let may_reach = may_reach_gpus();
    let policy = gpuwarden_crds::GpuPolicy::default_policy();
    let mut source = StaticSource::new([policy.clone()]);
    for ns in ["team-a", "gpu-operator"] {
        source.namespaces.insert(ns.into(), Default::default());
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x6b61_7461);
    let (mut kata_denied, mut visible_denied, mut vm_denied, mut admitted) = (0, 0, 0, 0);
    for i in 0..1500 {
        let mut containers = Vec::new();
        for c in 0..rng.random_range(1..4) {
            let mut container = json!({"name": format!("c{c}"),
                "image": "nvcr.io/nvidia/cuda:12.4.1-base-ubuntu22.04"});
            if rng.random_bool(0.3) {
                container["env"] =
                    json!([{"name": ENV_VISIBLE_CDI_DEVICES, "value": "nvidia.com/gpu=all"}]);
            }
            if let Some((field, resource)) = *RESOURCES.choose(&mut rng).unwrap() {
                container["resources"] = json!({ field: { resource: "1" } });
            }
            containers.push(container);
        }
        let mut annotations = serde_json::Map::new();
        for _ in 0..rng.random_range(0..3) {
            match rng.random_range(0..3) {
                0 => {
                    annotations.insert(
                        (*DEVICE_ANNOTATIONS.choose(&mut rng).unwrap()).to_owned(),
                        json!("true"),
                    );
                }
                1 => {
                    annotations.insert(
                        KERNEL_PARAMS.to_owned(),
                        json!(*KERNEL_PARAM_VALUES.choose(&mut rng).unwrap()),
                    );
                }
                _ => {
                    annotations.insert(
                        (*OTHER_KEYS.choose(&mut rng).unwrap()).to_owned(),
                        json!("1"),
                    );
                }
            }
        }
        let mut spec = json!({"containers": containers});
        if rng.random_bool(0.5) {
            spec["runtimeClassName"] = json!("kata-qemu-nvidia-gpu");
        }
        let mut pod = pod(spec);
        if !annotations.is_empty() {
            pod["metadata"]["annotations"] = Value::Object(annotations.clone());
        }
        let namespace = if rng.random_bool(0.15) {
            "gpu-operator"
        } else {
            "team-a"
        };
        let ctx = || format!("case {i} in {namespace}\n{pod:#}");

        let vars = BTreeMap::from([
            ("object", pod.clone()),
            ("request", request(namespace)),
            ("namespaceObject", json!({"metadata": {"name": namespace}})),
            ("params", default_params()),
        ]);
        let evaluated = with_variables(&backstop.value, &vars);
        let names = |variable: &str| -> BTreeSet<String> {
            serde_json::from_value(evaluated["variables"][variable].clone())
                .unwrap_or_else(|e| panic!("{variable}: {e}\n{}", ctx()))
        };
        let kata: BTreeSet<String> = (annotations.iter())
            .filter(|(k, v)| judge(k, v.as_str().unwrap_or_default()).is_some())
            .map(|(k, _)| k.clone())
            .collect();
        assert_eq!(names("kata"), kata, "{}", ctx());
        let exemptions = &policy.spec.exemptions;
        let image_exempt = |c: &Value| {
            let image = c["image"].as_str().unwrap_or_default();
            exemptions
                .container_exemption(image, namespace, "")
                .is_some()
        };
        let containers = pod["spec"]["containers"].as_array().expect("containers");
        let all_exempt = containers.iter().all(image_exempt);
        assert_eq!(
            evaluated["variables"]["allExempt"],
            json!(all_exempt),
            "{}",
            ctx()
        );
        let visible: BTreeSet<String> = (containers.iter())
            .filter(|c| c.get("env").is_some() && !image_exempt(c))
            .filter(|c| {
                let resources = (["limits", "requests"].iter())
                    .filter_map(|f| c["resources"][f].as_object())
                    .flat_map(|m| m.keys().map(String::as_str));
                !holds_gpu_of_its_own(resources, false, gpuwarden_crds::RESOURCE_GPU)
            })
            .map(|c| c["name"].as_str().unwrap_or_default().to_owned())
            .collect();
        assert_eq!(names("visibleCdi"), visible, "{}", ctx());

        let exempt = evaluated["variables"]["exempt"] == json!(true);
        let failures = decide(&backstop, &vars).expect("matched");
        let (engine, _) = engine_answer(&pod, namespace, &source);
        // A VM device (the default policy's virtualMachines) outside a VM runtime class:
        // alice is not KubeVirt's virt-controller.
        let vm_held: BTreeSet<String> = (containers.iter())
            .filter(|c| !image_exempt(c))
            .filter(|c| {
                (["limits", "requests"].iter())
                    .filter_map(|f| c["resources"][f].as_object())
                    .flat_map(|m| m.keys())
                    .any(|r| policy.spec.virtual_machines.is_device(r))
            })
            .map(|c| c["name"].as_str().unwrap_or_default().to_owned())
            .collect();
        assert_eq!(names("vmHeld"), vm_held, "{}", ctx());
        let in_vm = pod["spec"]["runtimeClassName"] == json!("kata-qemu-nvidia-gpu");
        assert_eq!(
            evaluated["variables"]["vmRuntime"],
            json!(in_vm),
            "{}",
            ctx()
        );
        let refused = !exempt
            && ((!all_exempt && !kata.is_empty())
                || !visible.is_empty()
                || (!in_vm && !vm_held.is_empty()));
        assert_eq!(failures.is_empty(), !refused, "{failures:?}\n{}", ctx());
        match &engine {
            Err(message) => {
                assert!(
                    refused,
                    "the engine denies what the backstop admits: {message}\n{}",
                    ctx()
                );
                for key in kata.iter().filter(|_| !all_exempt) {
                    assert!(
                        message.contains(&format!("annotation {key}")),
                        "{message}\n{}",
                        ctx()
                    );
                }
                for name in &visible {
                    assert!(
                        message.contains(&format!("container {name} sets")),
                        "{message}\n{}",
                        ctx()
                    );
                }
                for name in vm_held.iter().filter(|_| !in_vm) {
                    assert!(
                        message.contains(&format!("container {name} requests nvidia.com/pgpu")),
                        "{message}\n{}",
                        ctx()
                    );
                }
                vm_denied += usize::from(!in_vm && !vm_held.is_empty());
                let sent = eval_bool(
                    &may_reach,
                    &admission_vars(&pod, namespace, &BTreeMap::new()),
                );
                assert!(
                    sent,
                    "the webhook is not sent a pod the engine denies\n{}",
                    ctx()
                );
                kata_denied += usize::from(!kata.is_empty() && !all_exempt);
                visible_denied += usize::from(!visible.is_empty());
            }
            Ok(_) => {
                assert!(
                    !refused,
                    "the backstop refuses what the engine admits: {failures:?}\n{}",
                    ctx()
                );
                admitted += 1;
            }
        }
    }
    eprintln!(
        "1500 pods: {kata_denied} denied for Kata annotations, {visible_denied} for VISIBLE_CDI_DEVICES, {vm_denied} for VM devices outside a VM, {admitted} admitted"
    );
    assert!(
        kata_denied >= 300 && visible_denied >= 200 && vm_denied >= 50 && admitted >= 300,
        "{kata_denied} {visible_denied} {vm_denied} {admitted}"
    );
}

/// The backstop's fallbacks, where a stored GpuPolicy lacks `virtualMachines`, are the
/// policy's own defaults (`crds::vm`), and a request by the virt-controller or a pod of a
/// VM runtime class holds its VM devices, where a tenant's is refused.
#[test]
fn the_backstops_vm_defaults_are_the_policys() {
    use gpuwarden_crds::vm::{
        DEFAULT_CONTROLLERS, DEFAULT_DEVICE_RESOURCES, DEFAULT_RUNTIME_CLASSES,
    };
    let backstop = backstop();
    let variables = backstop.value["spec"]["variables"]
        .as_array()
        .expect("variables");
    let expression = |name: &str| {
        (variables.iter())
            .find(|v| v["name"] == name)
            .and_then(|v| v["expression"].as_str())
            .unwrap_or_else(|| panic!("variable {name}"))
            .to_owned()
    };
    for (variable, defaults) in [
        ("vmHeld", &DEFAULT_DEVICE_RESOURCES[..]),
        ("vmMaker", &DEFAULT_CONTROLLERS[..]),
        ("vmRuntime", &DEFAULT_RUNTIME_CLASSES[..]),
    ] {
        let text = expression(variable);
        for d in defaults {
            assert!(
                text.contains(&format!("'{d}'")),
                "{variable} lacks {d}: {text}"
            );
        }
    }
    // Params without virtualMachines: the fallbacks decide.
    let mut params = default_params();
    params["spec"]
        .as_object_mut()
        .map(|s| s.remove("virtualMachines"));
    let pod = |class: Option<&str>| {
        let mut p = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
            "spec": {"containers": [{"name": "compute", "image": "busybox",
                "resources": {"limits": {"nvidia.com/GRID_T4-1Q": "1"}}}]}});
        if let Some(class) = class {
            p["spec"]["runtimeClassName"] = json!(class);
        }
        p
    };
    let decide_as = |user: &str, object: Value| {
        let mut request = request("team-a");
        request["userInfo"]["username"] = json!(user);
        let vars = BTreeMap::from([
            ("object", object),
            ("request", request),
            ("namespaceObject", json!({"metadata": {"name": "team-a"}})),
            ("params", params.clone()),
        ]);
        decide(&backstop, &vars).expect("matched")
    };
    assert!(!decide_as("alice", pod(None)).is_empty());
    assert!(decide_as(DEFAULT_CONTROLLERS[0], pod(None)).is_empty());
    assert!(decide_as("alice", pod(Some("kata-qemu-nvidia-gpu"))).is_empty());
    assert!(!decide_as("alice", pod(Some("runc"))).is_empty());
}
