//! `gpuwarden-webhook mutate`: the webhook's engine, offline. Reads manifests (Pods, the pod
//! templates of Deployments, StatefulSets, DaemonSets, ReplicaSets, Jobs and CronJobs, and
//! every pod template inside any other object: MPIJob, RayCluster, JobSet, Volcano Job, ...),
//! applies the policy exactly as admission would, and prints the rewritten objects, a diff or
//! the JSON patches, each change made where the template stands. Why each pod changed (or was
//! denied) goes to stderr, naming where it sits in a custom resource. YAML is read as kubectl
//! reads it ([`manifest::yaml_value`]).
//!
//! Exit codes: 0 when everything would be admitted (rewritten or not), 1 when something would
//! be denied, 2 on bad input (the message names the file, document and reason).
//!
//! `main.rs` wires it as a subcommand:
//!
//! ```text
//! Command::Mutate(args) => std::process::exit(gpuwarden_webhook::mutate::run_stdio(&args)),
//! ```

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::PathBuf;
use std::sync::Arc;

use gpuwarden_crds::{GpuPolicy, validation};
use serde_json::{Value, json};

use gpuwarden_crds::claims::ClaimDevices;

use crate::engine::{
    self, ClaimSource, ClaimStore, Decision, Input, Operation, Requester, Verdict,
};
use crate::manifest::{self, Document, ManifestError};
use crate::pod::PodView;
use crate::report::{self, ReportKind, ReportResult, Subject, Timestamp};
use crate::{kubevirt, nim};

/// Exit code: everything would be admitted.
pub const EXIT_ADMITTED: i32 = 0;
/// Exit code: at least one object would be denied.
pub const EXIT_DENIED: i32 = 1;
/// Exit code: bad input (unreadable file, invalid YAML/JSON, bad policy or flag).
pub const EXIT_BAD_INPUT: i32 = 2;

/// Why `mutate` could not run. Each is reported on stderr and exits with [`EXIT_BAD_INPUT`].
#[derive(Debug, thiserror::Error)]
pub enum MutateError {
    /// A manifest could not be read or parsed.
    #[error(transparent)]
    Manifest(#[from] ManifestError),
    /// `--namespace-labels` is malformed.
    #[error("--namespace-labels: {0:?} is not key=value (write k=v,k=v)")]
    Labels(String),
    /// A policy file could not be read or is not a list of GpuPolicy documents.
    #[error("policy {path}: {problem}")]
    Policy {
        /// The policy file.
        path: String,
        /// What is wrong.
        problem: String,
    },
    /// The `-f` arguments name no manifest files.
    #[error(
        "no manifests found in {0} (a directory contributes its *.yaml, *.yml and *.json files)"
    )]
    NoManifests(String),
    /// A NIMService the NIM operator could not render a pod from either.
    #[error("{file}: document {index} (line {line}): NIMService {name}: {source}")]
    BadNimService {
        /// The file.
        file: String,
        /// Document index.
        index: usize,
        /// Start line.
        line: usize,
        /// Name.
        name: String,
        /// What is wrong, and where.
        source: crate::nim::NimError,
    },
    /// A KubeVirt VM whose launcher pod cannot be read from it.
    #[error("{file}: document {index} (line {line}): {kind} {name}: {message}")]
    BadVm {
        /// The file.
        file: String,
        /// Document index.
        index: usize,
        /// Start line.
        line: usize,
        /// The kind.
        kind: String,
        /// Name.
        name: String,
        /// What is wrong, and where.
        message: String,
    },
    /// A workload without the pod template its kind must have.
    #[error(
        "{file}: document {index} (line {line}): {kind} {name} has no pod template at {pointer}"
    )]
    NoTemplate {
        /// The file.
        file: String,
        /// Document index.
        index: usize,
        /// Start line.
        line: usize,
        /// Kind.
        kind: String,
        /// Name.
        name: String,
        /// Where the template should be.
        pointer: &'static str,
    },
    /// A ResourceClaim or ResourceClaimTemplate whose spec is not one.
    #[error("{file}: document {index} (line {line}): {kind} {name}: {message}")]
    BadClaim {
        /// The file.
        file: String,
        /// Document index.
        index: usize,
        /// Start line.
        line: usize,
        /// Kind.
        kind: String,
        /// Name.
        name: String,
        /// What is wrong.
        message: String,
    },
    /// The engine produced a patch that does not apply (a bug; reported, never a panic).
    #[error("{file}: document {index}: internal error: the rewrite does not apply: {message}")]
    Patch {
        /// The file.
        file: String,
        /// Document index.
        index: usize,
        /// The patch error.
        message: String,
    },
}

/// What `mutate` prints on stdout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputFormat {
    /// Every object as multi-document YAML, rewritten where the policy rewrites it.
    Yaml,
    /// Every object as JSON (a `List` when there are several).
    Json,
    /// The RFC 6902 JSON patch of each changed object.
    Patch,
    /// A unified diff of each changed object.
    Diff,
    /// One `wgpolicyk8s.io/v1alpha2` PolicyReport per namespace, listing what each pod
    /// would have changed or refused, as the operator reports it for pods that run.
    #[value(name = "policyreport")]
    PolicyReport,
}

/// Flags of `gpuwarden-webhook mutate`.
#[derive(Clone, Debug, clap::Args)]
pub struct MutateArgs {
    /// Manifest file or directory to read (`-` for stdin). Repeat for more; a directory
    /// contributes its *.yaml, *.yml and *.json files in name order.
    #[arg(
        short = 'f',
        long = "filename",
        env = "GPUWARDEN_MUTATE_FILENAME",
        value_delimiter = ',',
        required = true
    )]
    pub filenames: Vec<String>,

    /// File of one or more GpuPolicy documents to apply instead of the built-in default
    /// policy. Repeat for more.
    #[arg(
        long = "policy",
        env = "GPUWARDEN_MUTATE_POLICY",
        value_delimiter = ','
    )]
    pub policies: Vec<PathBuf>,

    /// Output: yaml (rewritten objects), json, patch (JSON patches), diff, or policyreport
    /// (one PolicyReport per namespace).
    #[arg(
        short = 'o',
        long = "output",
        env = "GPUWARDEN_MUTATE_OUTPUT",
        value_enum,
        default_value_t = OutputFormat::Yaml
    )]
    pub output: OutputFormat,

    /// Namespace of objects whose metadata names none (default: `default`).
    #[arg(long = "namespace", short = 'n', env = "GPUWARDEN_MUTATE_NAMESPACE")]
    pub namespace: Option<String>,

    /// Labels the namespaces are assumed to carry, as k=v,k=v; they decide which policy's
    /// namespaceSelector matches. Namespace objects in the input add their own labels.
    #[arg(long = "namespace-labels", env = "GPUWARDEN_MUTATE_NAMESPACE_LABELS")]
    pub namespace_labels: Option<String>,
}

/// What happened to one object.
#[derive(Debug)]
struct Outcome {
    doc: Document,
    /// The object after the rewrite (same as the input when nothing changed).
    after: Value,
    /// The patch against the whole object.
    patch: json_patch::Patch,
    /// What the engine decided for each pod of the object, in order; empty for objects that
    /// hold no pod.
    decisions: Vec<Judged>,
    namespace: String,
    /// For a ConfigMap or Secret: its keys that spell an NVIDIA runtime variable the policy
    /// governing its namespace does not let a container set ([`runtime_variable_keys`]).
    runtime_keys: Vec<String>,
    /// For a ResourceClaim or ResourceClaimTemplate: what of it only a DRA driver's own pods
    /// may hold in its namespace ([`driver_only_claim`]).
    driver_only: Vec<String>,
}

/// The decision for one pod of an object.
#[derive(Debug)]
struct Judged {
    /// Where the pod sits, for objects whose kind is not a known workload
    /// (`spec.mpiReplicaSpecs.Worker.template`); `None` for Pods and known workloads.
    path: Option<String>,
    /// A pod spec without metadata of its own: annotations cannot be written there.
    bare: bool,
    explanation: Explanation,
    /// What else the judgement must say: for a custom resource whose pod gpuwarden renders
    /// (a NIMService), the assumptions made and the changes its fields cannot hold.
    notes: Vec<String>,
}

/// What the engine decided about an object's pod, kept to explain it on stderr.
#[derive(Debug)]
struct Explanation {
    verdict: Verdict,
    /// `name@generation` of the governing policy ("" when none governs).
    policy: String,
    exempt: Option<String>,
    /// Whether containers that hold no GPU get `NVIDIA_VISIBLE_DEVICES=void`.
    voids: bool,
    warnings: Vec<String>,
    denial: Option<String>,
    /// The pod's policy report results.
    results: Vec<ReportResult>,
}

impl Explanation {
    fn of(decision: &Decision<'_>, subject: &Subject, found: Timestamp) -> Self {
        Self {
            results: report::results(decision, subject, found),
            verdict: decision.verdict(),
            policy: decision.policy_reference().unwrap_or("").to_owned(),
            exempt: decision.exempt_reason().map(str::to_owned),
            voids: decision.changes().next().is_some(),
            warnings: decision.warnings(),
            denial: decision.denial(),
        }
    }
}

/// Runs `mutate` on the process's stdin, stdout and stderr; returns the exit code.
pub fn run_stdio(args: &MutateArgs) -> i32 {
    let stdin = std::io::stdin();
    let stdout = std::io::stdout();
    let stderr = std::io::stderr();
    run(
        args,
        &mut stdin.lock(),
        &mut stdout.lock(),
        &mut stderr.lock(),
    )
}

/// Runs `mutate`; returns the exit code ([`EXIT_ADMITTED`], [`EXIT_DENIED`] or
/// [`EXIT_BAD_INPUT`]). Output that cannot be written (a closed pipe) is not an error.
pub fn run(
    args: &MutateArgs,
    stdin: &mut dyn Read,
    stdout: &mut dyn Write,
    stderr: &mut dyn Write,
) -> i32 {
    match run_inner(args, stdin, stdout, stderr) {
        Ok(code) => code,
        Err(errors) => {
            for e in &errors {
                let _ = writeln!(stderr, "error: {e}");
            }
            EXIT_BAD_INPUT
        }
    }
}

fn run_inner(
    args: &MutateArgs,
    stdin: &mut dyn Read,
    stdout: &mut dyn Write,
    stderr: &mut dyn Write,
) -> Result<i32, Vec<MutateError>> {
    let extra_labels = match &args.namespace_labels {
        Some(s) => parse_labels(s).map_err(|e| vec![e])?,
        None => BTreeMap::new(),
    };
    let policies = load_policies(&args.policies, stdin).map_err(|e| vec![e])?;
    let mut errors = Vec::new();
    let texts = read_manifests(&args.filenames, stdin, stderr, &mut errors).map_err(|e| vec![e])?;
    let default_namespace = args.namespace.as_deref().unwrap_or("default");
    let known = Known::read(&texts, default_namespace, &mut errors);
    if !errors.is_empty() {
        return Err(errors);
    }

    // Second pass: each document is judged, explained and written, then dropped.
    let mut explainer = Explainer::default();
    let mut failure = None;
    let now = Timestamp::of(jiff::Timestamp::now());
    let outcomes = texts
        .iter()
        .flat_map(|(path, text)| manifest::documents(path, text))
        .map_while(|doc| {
            let doc = doc.ok()?;
            let namespace = doc.namespace().unwrap_or(default_namespace).to_owned();
            let labels = known.namespace_labels(&namespace, &extra_labels);
            match judge(doc, namespace, &labels, &policies, &known.claims, now) {
                Ok(outcome) => {
                    explainer.explain(&outcome, stderr);
                    Some(outcome)
                }
                Err(e) => {
                    failure = Some(e);
                    None
                }
            }
        });
    let _ = write_output(args.output, outcomes, stdout);
    if let Some(e) = failure {
        return Err(vec![e]);
    }
    explainer.summarise(stderr);
    if args.output == OutputFormat::Yaml && args.policies.is_empty() {
        let _ = writeln!(
            stderr,
            "(built-in default policy; the objects are on stdout. -o diff shows only the changes, --policy FILE applies your own GpuPolicy)"
        );
    }
    Ok(if explainer.denied {
        EXIT_DENIED
    } else {
        EXIT_ADMITTED
    })
}

/// The text of each manifest file the `-f` arguments name, with its path; a file that
/// cannot be read goes to `errors`. A file found in a directory that is no Kubernetes
/// manifest is skipped, saying so on `stderr`.
fn read_manifests(
    filenames: &[String],
    stdin: &mut dyn Read,
    stderr: &mut dyn Write,
    errors: &mut Vec<MutateError>,
) -> Result<Vec<(String, String)>, MutateError> {
    let inputs = manifest::expand_inputs(filenames)?;
    if inputs.is_empty() {
        return Err(MutateError::NoManifests(filenames.join(", ")));
    }
    let mut texts = Vec::new();
    for input in inputs {
        match manifest::read_source(&input.path, stdin) {
            Ok(text) if input.from_directory && !manifest::looks_like_kubernetes(&text) => {
                let _ = writeln!(
                    stderr,
                    "{}: skipped: not a Kubernetes manifest (no kind)",
                    input.path
                );
            }
            Ok(text) => texts.push((input.path, text)),
            Err(e) => errors.push(e.into()),
        }
    }
    Ok(texts)
}

/// What the first pass keeps of the input for the second: the labels of its Namespace
/// objects, and its ResourceClaims and ResourceClaimTemplates.
struct Known {
    namespace_labels: BTreeMap<String, BTreeMap<String, String>>,
    claims: ClaimStore,
}

impl Known {
    /// The first pass: every document is read and checked, one at a time, so that bad
    /// input is reported in full (into `errors`) before any output.
    fn read(
        texts: &[(String, String)],
        default_namespace: &str,
        errors: &mut Vec<MutateError>,
    ) -> Self {
        let mut known = Self {
            namespace_labels: BTreeMap::new(),
            claims: ClaimStore::offline(),
        };
        for (path, text) in texts {
            for doc in manifest::documents(path, text) {
                let checked = doc.map_err(MutateError::from).and_then(|doc| {
                    pods(&doc)?;
                    Ok(doc)
                });
                match checked {
                    Ok(doc) if doc.kind() == "Namespace" => {
                        (known.namespace_labels).insert(doc.name(), labels_of(&doc.object));
                    }
                    Ok(doc) => {
                        if let Err(e) = read_claim(&doc, default_namespace, &mut known.claims) {
                            errors.push(e);
                        }
                    }
                    Err(e) => errors.push(e),
                }
            }
        }
        known
    }

    /// The labels of `namespace`: those `assumed` (`--namespace-labels`), then those of its
    /// Namespace object in the input, then the name label every namespace carries.
    fn namespace_labels(
        &self,
        namespace: &str,
        assumed: &BTreeMap<String, String>,
    ) -> BTreeMap<String, String> {
        let mut labels = assumed.clone();
        labels.extend(
            self.namespace_labels
                .get(namespace)
                .cloned()
                .unwrap_or_default(),
        );
        engine::namespace_labels_or_default(namespace, Some(labels))
    }
}

/// Which claim a `resource.k8s.io/v1` ResourceClaim or ResourceClaimTemplate is, and where
/// its claim spec sits; `None` for any other document.
fn claim_spec(doc: &Document) -> Option<(ClaimSource, &'static str)> {
    let api_version = doc.object.get("apiVersion").and_then(Value::as_str);
    match (api_version, doc.kind()) {
        (Some("resource.k8s.io/v1"), "ResourceClaim") => Some((ClaimSource::Claim, "/spec")),
        (Some("resource.k8s.io/v1"), "ResourceClaimTemplate") => {
            Some((ClaimSource::Template, "/spec/spec"))
        }
        _ => None,
    }
}

/// Keeps a `resource.k8s.io/v1` ResourceClaim or ResourceClaimTemplate for the pods that use
/// it; other documents are not claims.
fn read_claim(
    doc: &Document,
    default_namespace: &str,
    claims: &mut ClaimStore,
) -> Result<(), MutateError> {
    let Some((source, pointer)) = claim_spec(doc) else {
        return Ok(());
    };
    let spec = doc.object.pointer(pointer).cloned().unwrap_or(Value::Null);
    let spec = serde_json::from_value(spec).map_err(|e| MutateError::BadClaim {
        file: doc.source.clone(),
        index: doc.index,
        line: doc.line,
        kind: doc.kind().to_owned(),
        name: doc.name(),
        message: format!(
            "{} is not a claim spec: {e}",
            &pointer[1..].replace('/', ".")
        ),
    })?;
    let namespace = doc.namespace().unwrap_or(default_namespace);
    claims.insert(source, namespace, &doc.name(), &spec);
    Ok(())
}

/// The string labels in an object's `metadata.labels`.
fn labels_of(object: &Value) -> BTreeMap<String, String> {
    object
        .pointer("/metadata/labels")
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| v.as_str().map(|v| (k.clone(), v.to_owned())))
                .collect()
        })
        .unwrap_or_default()
}

/// A pod inside an object: where it is, and how it is reported.
struct Place {
    pointer: String,
    /// Shown for pods found inside custom resources.
    path: Option<String>,
    bare: bool,
}

/// The pods of an object: the one template of a known workload (an error when it lacks the
/// template its kind must have), the Pod itself, or every pod template found inside any
/// other object ([`manifest::find_pods`]: MPIJob, RayCluster, JobSet, ...).
fn pods(doc: &Document) -> Result<Vec<Place>, MutateError> {
    if nim::is_nim_service(&doc.object) {
        nim_pod(doc, &doc.object)?;
        return Ok(Vec::new());
    }
    let api_version = doc.object.get("apiVersion").and_then(Value::as_str);
    let Some(pointer) = manifest::pod_template_pointer(api_version.unwrap_or(""), doc.kind())
    else {
        let found = manifest::find_pods(&doc.object);
        return Ok((found.into_iter())
            .map(|f| Place {
                pointer: f.pointer,
                path: Some(f.path),
                bare: f.bare,
            })
            .collect());
    };
    match doc.object.pointer(pointer) {
        Some(template) if template.is_object() => Ok(vec![Place {
            pointer: pointer.to_owned(),
            path: None,
            bare: false,
        }]),
        _ => Err(MutateError::NoTemplate {
            file: doc.source.clone(),
            index: doc.index,
            line: doc.line,
            kind: doc.kind().to_owned(),
            name: doc.name(),
            pointer,
        }),
    }
}

/// The pod the NIM operator renders for `nim`, the NIMService `doc` holds or one written
/// back from it.
fn nim_pod(doc: &Document, nim: &Value) -> Result<nim::Rendered, MutateError> {
    nim::render(nim).map_err(|source| MutateError::BadNimService {
        file: doc.source.clone(),
        index: doc.index,
        line: doc.line,
        name: doc.name(),
        source,
    })
}

/// Parses `k=v,k=v`.
fn parse_labels(s: &str) -> Result<BTreeMap<String, String>, MutateError> {
    let mut out = BTreeMap::new();
    for pair in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some((k, v)) if !k.trim().is_empty() => {
                out.insert(k.trim().to_owned(), v.trim().to_owned());
            }
            _ => return Err(MutateError::Labels(pair.to_owned())),
        }
    }
    Ok(out)
}

/// Reads GpuPolicy documents, or returns the built-in default policy when there are none.
fn load_policies(
    paths: &[PathBuf],
    stdin: &mut dyn Read,
) -> Result<Vec<Arc<GpuPolicy>>, MutateError> {
    if paths.is_empty() {
        return Ok(vec![Arc::new(GpuPolicy::default_policy())]);
    }
    let mut policies = Vec::new();
    // The file each policy came from, for the message that refuses it.
    let mut sources = Vec::new();
    for path in paths {
        let name = path.display().to_string();
        let problem = |problem: String| MutateError::Policy {
            path: name.clone(),
            problem,
        };
        let text = manifest::read_source(&name, stdin).map_err(|e| problem(e.to_string()))?;
        let docs = manifest::parse_documents(&name, &text).map_err(|e| problem(e.to_string()))?;
        if docs.is_empty() {
            return Err(problem("no GpuPolicy documents".into()));
        }
        for doc in docs {
            if doc.kind() != "GpuPolicy" {
                return Err(problem(format!(
                    "document {} (line {}): expected a GpuPolicy, found {}",
                    doc.index,
                    doc.line,
                    doc.kind()
                )));
            }
            let (index, line) = (doc.index, doc.line);
            let policy: GpuPolicy = serde_json::from_value(doc.object).map_err(|e| {
                problem(format!(
                    "document {index} (line {line}): not a valid GpuPolicy: {e}"
                ))
            })?;
            policies.push(Arc::new(policy));
            sources.push(format!("{name} document {index} (line {line})"));
        }
    }
    // Fail closed: a policy the operator would mark not Ready is refused, not skipped.
    let all: Vec<&GpuPolicy> = policies.iter().map(AsRef::as_ref).collect();
    if let Some((at, p)) = validation::first_problem(&all) {
        return Err(MutateError::Policy {
            path: sources.get(at).cloned().unwrap_or_default(),
            problem: format!(
                "GpuPolicy {}: {}: {}",
                all[at].metadata.name.as_deref().unwrap_or("<unnamed>"),
                p.reason,
                p.message
            ),
        });
    }
    Ok(policies)
}

fn judge(
    doc: Document,
    namespace: String,
    labels: &BTreeMap<String, String>,
    policies: &[Arc<GpuPolicy>],
    claims: &ClaimStore,
    now: Timestamp,
) -> Result<Outcome, MutateError> {
    let display = format!("{namespace}/{}", doc.name());
    // A pod read back from a cluster is found when it was created, as the operator says.
    let found_at = (doc.object.pointer("/metadata/creationTimestamp"))
        .and_then(Value::as_str)
        .and_then(Timestamp::parse)
        .unwrap_or(now);
    let subject = Subject {
        api_version: (doc.object.get("apiVersion").and_then(Value::as_str))
            .unwrap_or("v1")
            .to_owned(),
        kind: doc.kind().to_owned(),
        namespace: namespace.clone(),
        name: doc.name(),
        uid: (doc.object.pointer("/metadata/uid").and_then(Value::as_str)).map(str::to_owned),
    };
    let scope = Scope {
        namespace: &namespace,
        labels,
        display: &display,
        policies,
        claims,
        subject: &subject,
        found_at,
    };
    if nim::is_nim_service(&doc.object) {
        return judge_nim_service(doc, &scope);
    }
    if kubevirt::is_vm(&doc.object) {
        return judge_vm(doc, &scope);
    }
    let places = pods(&doc)?;
    let (after, patch, decisions) = scope.judge_places(&doc, places)?;
    let runtime_keys = runtime_variable_keys(&doc, &namespace, labels, policies);
    let driver_only = driver_only_claim(&doc, &namespace, labels, policies);
    Ok(Outcome {
        doc,
        after,
        patch,
        decisions,
        namespace,
        runtime_keys,
        driver_only,
    })
}

/// What every pod of a document is judged in: its namespace, the namespace's labels, the
/// policies and the claims of the input.
struct Scope<'s> {
    namespace: &'s str,
    labels: &'s BTreeMap<String, String>,
    /// `namespace/name` of the object, for messages.
    display: &'s str,
    policies: &'s [Arc<GpuPolicy>],
    claims: &'s ClaimStore,
    /// The object, as PolicyReport results name it.
    subject: &'s Subject,
    /// When its pods were found, for the results' timestamps.
    found_at: Timestamp,
}

impl Scope<'_> {
    /// Each pod of `doc` at `places`, judged: the object with the changes made, the patch
    /// against it, and the decisions in order.
    fn judge_places(
        &self,
        doc: &Document,
        places: Vec<Place>,
    ) -> Result<(Value, json_patch::Patch, Vec<Judged>), MutateError> {
        let mut after = doc.object.clone();
        let mut patch = json_patch::Patch(Vec::new());
        let mut decisions = Vec::with_capacity(places.len());
        let patch_error = |message: String| MutateError::Patch {
            file: doc.source.clone(),
            index: doc.index,
            message,
        };
        for place in places {
            let Some(found) = doc.object.pointer(&place.pointer) else {
                continue;
            };
            // A bare pod spec is judged as the spec of a pod without metadata.
            let wrapped;
            let template = if place.bare {
                wrapped = json!({ "spec": found });
                &wrapped
            } else {
                found
            };
            let (explanation, changes) = self.judge_pod(template, doc.kind());
            if let Some(relative) = changes {
                let relative = if place.bare {
                    unwrap_spec(relative)
                } else {
                    relative
                };
                if let Some(target) = after.pointer_mut(&place.pointer) {
                    json_patch::patch(target, &relative.0)
                        .map_err(|e| patch_error(e.to_string()))?;
                }
                patch.0.extend(prefixed(relative, &place.pointer).0);
            }
            decisions.push(Judged {
                path: place.path,
                bare: place.bare,
                explanation,
                notes: Vec::new(),
            });
        }
        Ok((after, patch, decisions))
    }

    /// The engine's decision on `template` (a pod's metadata and spec), made by an owner of
    /// `owner_kind`, explained; and the patch against `template` where the engine changes
    /// the pod and does not deny it.
    fn judge_pod(
        &self,
        template: &Value,
        owner_kind: &str,
    ) -> (Explanation, Option<json_patch::Patch>) {
        let view = PodView::from_value(template);
        let input = Input {
            pod: &view,
            namespace: self.namespace,
            namespace_labels: self.labels,
            operation: Operation::Create,
            display_name: self.display,
            claims: self.claims,
            owner_kind: Some(owner_kind),
            requester: Requester::Unknown,
        };
        let decision = engine::decide(&input, self.policies);
        let changes = (decision.verdict() != Verdict::Denied
            && decision.changes().next().is_some())
        .then(|| crate::patch::patch_for_view(&view, decision.changes()));
        (
            Explanation::of(&decision, self.subject, self.found_at),
            changes,
        )
    }
}

/// One judgement of a NIMService's pod: its explanation, the notes on how the pod was
/// rendered, and (where the engine changes it) the NIMService written back with what it
/// cannot hold.
type NimPass = (Explanation, Vec<String>, Option<(Value, Vec<String>)>);

/// A NIMService, judged as the pod its operator renders ([`nim`]): what the engine would
/// change is written back onto the NIMService's own fields, and what they cannot hold is said.
fn judge_nim_service(doc: Document, scope: &Scope<'_>) -> Result<Outcome, MutateError> {
    // What the engine does to the pod of `nim`: its explanation, and the NIMService that
    // renders the pod the engine leaves, with what that NIMService cannot hold.
    let pass = |nim: &Value| -> Result<NimPass, MutateError> {
        let rendered = nim_pod(&doc, nim)?;
        let (explanation, changes) = scope.judge_pod(&rendered.pod, "Deployment");
        let Some(patch) = changes else {
            return Ok((explanation, rendered.notes, None));
        };
        let mut judged = rendered.pod.clone();
        json_patch::patch(&mut judged, &patch.0).map_err(|e| MutateError::Patch {
            file: doc.source.clone(),
            index: doc.index,
            message: e.to_string(),
        })?;
        let back = nim::back(nim, &rendered, &judged);
        Ok((explanation, rendered.notes, Some(back)))
    };
    let (explanation, mut notes, mut next) = pass(&doc.object)?;
    let mut after = doc.object.clone();
    // A change to the NIMService changes every pod it renders (a sidecar inherits the main
    // env): judged again until the engine has nothing more to change, or the NIMService
    // cannot hold what it would.
    let mut cannot = Vec::new();
    for _ in 0..4 {
        let Some((written, left)) = next.take() else {
            break;
        };
        cannot = left;
        if written == after {
            break;
        }
        after = written;
        next = pass(&after)?.2;
        if next.is_none() {
            cannot.clear();
        }
    }
    notes.extend(
        cannot
            .into_iter()
            .map(|c| format!("cannot be written in the NIMService: {c}")),
    );
    let fields: Vec<String> = (after["spec"].as_object().into_iter().flatten())
        .filter(|(k, v)| doc.object["spec"].get(k.as_str()) != Some(*v))
        .map(|(k, _)| format!("spec.{k}"))
        .collect();
    if !fields.is_empty() {
        notes.push(format!(
            "on the NIMService, so that the pods it renders need no change: {} (-o diff shows them)",
            fields.join(", ")
        ));
    }
    let patch = json_patch::diff(&doc.object, &after);
    let decisions = vec![Judged {
        path: Some("(the pod its NIM operator renders)".to_owned()),
        bare: false,
        explanation,
        notes,
    }];
    Ok(Outcome {
        doc,
        after,
        patch,
        decisions,
        namespace: scope.namespace.to_owned(),
        runtime_keys: Vec::new(),
        driver_only: Vec::new(),
    })
}

/// A KubeVirt VM, judged as the launcher pod the virt-controller renders for it
/// ([`kubevirt`]): the VM itself is never changed; what the engine would change or deny in
/// its pod is said of it. Its pod names the VM's instance as controller, so it is judged as
/// KubeVirt's (docs/design.md, "VMs judged like pods").
fn judge_vm(doc: Document, scope: &Scope<'_>) -> Result<Outcome, MutateError> {
    let rendered = kubevirt::launcher_pod(&doc.object).map_err(|message| MutateError::BadVm {
        file: doc.source.clone(),
        index: doc.index,
        line: doc.line,
        kind: doc.kind().to_owned(),
        name: doc.name(),
        message,
    })?;
    let (explanation, _) = scope.judge_pod(&rendered.pod, gpuwarden_crds::vm::KIND_VMI);
    let decisions = vec![Judged {
        path: Some("(the launcher pod KubeVirt renders)".to_owned()),
        bare: false,
        explanation,
        notes: rendered.notes,
    }];
    Ok(Outcome {
        after: doc.object.clone(),
        doc,
        patch: json_patch::Patch(Vec::new()),
        decisions,
        namespace: scope.namespace.to_owned(),
        runtime_keys: Vec::new(),
        driver_only: Vec::new(),
    })
}

/// The keys of a ConfigMap or Secret (`data`, `binaryData`, `stringData`) that spell a
/// runtime variable a container of its namespace may not set under the policy that governs
/// it (docs/design.md, "Runtime variables"): `NVIDIA_VISIBLE_DEVICES` and the policy's
/// device variables. A pod that reads the object through `envFrom` gets them after the
/// device plugin's values. None in a namespace the policy exempts, or that none governs.
fn runtime_variable_keys(
    doc: &Document,
    namespace: &str,
    labels: &BTreeMap<String, String>,
    policies: &[Arc<GpuPolicy>],
) -> Vec<String> {
    if !matches!(doc.kind(), "ConfigMap" | "Secret") {
        return Vec::new();
    }
    let Some(policy) = governing(namespace, labels, policies) else {
        return Vec::new();
    };
    let rules = gpuwarden_crds::gpu::Rules::of(policy);
    let mut keys: Vec<String> = ["data", "binaryData", "stringData"]
        .iter()
        .filter_map(|field| doc.object.get(*field)?.as_object())
        .flat_map(|map| map.keys())
        .filter(|k| rules.is_judged_variable(k))
        .cloned()
        .collect();
    keys.sort();
    keys.dedup();
    keys
}

/// The policy that governs objects of `namespace` other than pods (ConfigMaps, claims): the
/// one its labels select, unless it exempts the namespace. The API server's guards read the
/// default policy; offline, the policy a pod of the namespace would get.
fn governing<'p>(
    namespace: &str,
    labels: &BTreeMap<String, String>,
    policies: &'p [Arc<GpuPolicy>],
) -> Option<&'p GpuPolicy> {
    let policy = engine::select_policy(policies, labels, &BTreeMap::new()).policy?;
    let exempt = (policy.spec.exemptions.namespaces.iter()).any(|n| n == namespace);
    (!exempt).then_some(policy)
}

/// What of a ResourceClaim or ResourceClaimTemplate only a DRA driver's own pods may hold
/// (docs/design.md, "Claims only a driver's own pods may hold"), in a namespace its policy
/// governs outside the drivers' own; the API server refuses to create it
/// (`deploy/admission/driver-claims.yaml`).
fn driver_only_claim(
    doc: &Document,
    namespace: &str,
    labels: &BTreeMap<String, String>,
    policies: &[Arc<GpuPolicy>],
) -> Vec<String> {
    let Some((_, pointer)) = claim_spec(doc) else {
        return Vec::new();
    };
    let Some(policy) = governing(namespace, labels, policies) else {
        return Vec::new();
    };
    let rules = &policy.spec.driver_claims;
    // Audit mode refuses nothing; the pod that uses the claim is told.
    if policy.spec.mode == gpuwarden_crds::PolicyMode::Audit
        || rules.namespaces.iter().any(|n| n == namespace)
    {
        return Vec::new();
    }
    let spec = doc.object.pointer(pointer).cloned().unwrap_or(Value::Null);
    // A spec that does not read was refused where the claims were gathered.
    serde_json::from_value(spec)
        .map(|spec| ClaimDevices::of(&spec).driver_only(rules))
        .unwrap_or_default()
}

/// The patch of a pod wrapped around a bare pod spec, against the spec itself: paths under
/// `/spec` lose that prefix, and changes to the pod's metadata (its annotations), which a
/// bare spec has nowhere to hold, are left out.
fn unwrap_spec(patch: json_patch::Patch) -> json_patch::Patch {
    use json_patch::PatchOperation as Op;
    let unwrap = |path: &json_patch::jsonptr::PointerBuf| {
        path.strip_prefix(json_patch::jsonptr::Pointer::from_static("/spec"))
            .map(ToOwned::to_owned)
    };
    let ops = patch.0.into_iter().filter_map(|op| match op {
        Op::Add(mut o) => {
            o.path = unwrap(&o.path)?;
            Some(Op::Add(o))
        }
        Op::Remove(mut o) => {
            o.path = unwrap(&o.path)?;
            Some(Op::Remove(o))
        }
        // The engine writes only `add` and `remove`.
        other => Some(other),
    });
    json_patch::Patch(ops.collect())
}

/// The same patch, with every path under `prefix` (a pod template pointer).
fn prefixed(patch: json_patch::Patch, prefix: &str) -> json_patch::Patch {
    use json_patch::PatchOperation as Op;
    let Ok(base) = json_patch::jsonptr::PointerBuf::parse(prefix) else {
        return patch;
    };
    let ops = patch.0.into_iter().map(|op| match op {
        Op::Add(mut o) => {
            o.path = base.concat(&o.path);
            Op::Add(o)
        }
        Op::Remove(mut o) => {
            o.path = base.concat(&o.path);
            Op::Remove(o)
        }
        // The engine writes only `add` and `remove`.
        other => other,
    });
    json_patch::Patch(ops.collect())
}

/// Tells the user, on stderr, what happened to each object and why, one object at a time,
/// and counts the outcomes for the closing line.
#[derive(Default)]
struct Explainer {
    counts: BTreeMap<&'static str, usize>,
    objects: usize,
    last_source: String,
    denied: bool,
}

impl Explainer {
    fn explain(&mut self, o: &Outcome, stderr: &mut dyn Write) {
        self.objects += 1;
        if o.doc.source != self.last_source {
            let _ = writeln!(stderr, "{}:", o.doc.source);
            self.last_source.clone_from(&o.doc.source);
        }
        let object = format!("{} {}/{}", o.doc.kind(), o.namespace, o.doc.name());
        if !o.runtime_keys.is_empty() {
            *self.counts.entry("runtime variable keys").or_default() += 1;
            let _ = writeln!(
                stderr,
                "  {object}: RUNTIME VARIABLE KEYS {}: a container that reads it through envFrom is handed devices beyond the GPUs the kubelet allocated; gpuwarden refuses a new such key, and this one stays until you rename it",
                o.runtime_keys.join(", ")
            );
            return;
        }
        if !o.driver_only.is_empty() {
            *self.counts.entry("denied").or_default() += 1;
            self.denied = true;
            let _ = writeln!(
                stderr,
                "  {object}: DENIED: {}; the API server refuses it in this namespace, and gpuwarden denies a pod that uses it",
                gpuwarden_crds::claims::driver_only_reason(&o.driver_only)
            );
            return;
        }
        if o.decisions.is_empty() {
            *self.counts.entry("passed through").or_default() += 1;
            let _ = writeln!(
                stderr,
                "  {object}: no pod template, passed through unchanged"
            );
            return;
        }
        for judged in &o.decisions {
            let at = match &judged.path {
                Some(path) if path.is_empty() => format!("{object} (the object itself)"),
                Some(path) => format!("{object} {path}"),
                None => object.clone(),
            };
            self.explain_pod(&at, judged, &o.namespace, stderr);
        }
    }

    /// One line for one pod of an object, then its warnings and denial.
    fn explain_pod(&mut self, at: &str, judged: &Judged, namespace: &str, stderr: &mut dyn Write) {
        let d = &judged.explanation;
        let policy = d.policy.as_str();
        let (key, line) = match d.verdict {
            Verdict::NotGoverned => (
                "unchanged",
                format!("unchanged: no GpuPolicy selects namespace {namespace}"),
            ),
            Verdict::Unchanged => (
                "unchanged",
                format!("unchanged: no privileged or leaking GPU container (GpuPolicy {policy})"),
            ),
            Verdict::Exempt => (
                "exempt",
                format!(
                    "exempt{}: {} (GpuPolicy {policy})",
                    if d.voids {
                        " (containers that hold no GPU voided)"
                    } else {
                        ", unchanged"
                    },
                    d.exempt.as_deref().unwrap_or("exempt")
                ),
            ),
            Verdict::Voided => (
                "voided",
                format!(
                    "VOIDED by GpuPolicy {policy} (Enforce): containers without a GPU resource get NVIDIA_VISIBLE_DEVICES=void, and those with one lose a void of their own"
                ),
            ),
            Verdict::Rewritten => (
                "rewritten",
                format!("REWRITTEN by GpuPolicy {policy} (Enforce)"),
            ),
            Verdict::Audited => (
                "audited",
                format!(
                    "admitted unchanged by GpuPolicy {policy} (Audit); in Enforce it would change"
                ),
            ),
            Verdict::Denied => ("denied", format!("DENIED by GpuPolicy {policy}")),
        };
        self.denied |= d.verdict == Verdict::Denied;
        *self.counts.entry(key).or_default() += 1;
        let _ = writeln!(stderr, "  {at}: {line}");
        for w in &d.warnings {
            let w = w
                .strip_prefix("gpuwarden audit: ")
                .or_else(|| w.strip_prefix("gpuwarden: "))
                .unwrap_or(w);
            let _ = writeln!(stderr, "    - {w}");
        }
        for note in &judged.notes {
            let _ = writeln!(stderr, "    - {note}");
        }
        if judged.bare && d.verdict == Verdict::Rewritten {
            let _ = writeln!(
                stderr,
                "    - a pod spec without metadata of its own: the pod's annotations (gpuwarden's report, CDI annotations) are not written here"
            );
        }
        if let Some(message) = &d.denial {
            let message = message.strip_prefix("gpuwarden: ").unwrap_or(message);
            let _ = writeln!(stderr, "    {message}");
        }
    }

    fn summarise(&self, stderr: &mut dyn Write) {
        let summary: Vec<String> = (self.counts.iter())
            .map(|(k, n)| format!("{n} {k}"))
            .collect();
        let _ = writeln!(
            stderr,
            "{} object{}: {}",
            self.objects,
            if self.objects == 1 { "" } else { "s" },
            summary.join(", ")
        );
    }
}

fn to_yaml(value: &Value) -> String {
    serde_saphyr::to_string(value).unwrap_or_else(|e| format!("# cannot render as YAML: {e}\n"))
}

/// Serialises the items of an iterator as a JSON list as they come, so that the whole list
/// is never held.
struct Streamed<I>(std::cell::RefCell<Option<I>>);

impl<I: Iterator<Item = Value>> serde::Serialize for Streamed<I> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.0.borrow_mut().take().into_iter().flatten())
    }
}

fn write_output(
    format: OutputFormat,
    mut outcomes: impl Iterator<Item = Outcome>,
    out: &mut dyn Write,
) -> std::io::Result<()> {
    match format {
        OutputFormat::Yaml => {
            for o in outcomes {
                writeln!(out, "---")?;
                let yaml = to_yaml(&o.after);
                out.write_all(yaml.strip_prefix("---\n").unwrap_or(&yaml).as_bytes())?;
            }
        }
        OutputFormat::Json => {
            let first = outcomes.next();
            let second = outcomes.next();
            match (first, second) {
                (Some(one), None) => serde_json::to_writer_pretty(&mut *out, &one.after)?,
                (first, second) => {
                    let items = first.into_iter().chain(second).chain(outcomes);
                    #[derive(serde::Serialize)]
                    #[serde(rename_all = "camelCase", bound = "I: Iterator<Item = Value>")]
                    struct List<I> {
                        api_version: &'static str,
                        kind: &'static str,
                        items: Streamed<I>,
                    }
                    let list = List {
                        api_version: "v1",
                        kind: "List",
                        items: Streamed(Some(items.map(|o| o.after)).into()),
                    };
                    serde_json::to_writer_pretty(&mut *out, &list)?;
                }
            }
            writeln!(out)?;
        }
        OutputFormat::Patch => {
            let patches = outcomes.filter(|o| !o.patch.0.is_empty()).map(|o| {
                json!({
                    "source": o.doc.source,
                    "document": o.doc.index,
                    "kind": o.doc.kind(),
                    "namespace": o.namespace,
                    "name": o.doc.name(),
                    "patch": o.patch,
                })
            });
            serde_json::to_writer_pretty(&mut *out, &Streamed(Some(patches).into()))?;
            writeln!(out)?;
        }
        OutputFormat::PolicyReport => {
            let results = outcomes.flat_map(|o| {
                (o.decisions.into_iter()).flat_map(|judged| judged.explanation.results)
            });
            let reports =
                report::reports_by_namespace(results, gpuwarden_crds::reports::MAX_RESULTS);
            for r in reports {
                writeln!(out, "---")?;
                let yaml = to_yaml(&r.to_object(ReportKind::PolicyReport));
                out.write_all(yaml.strip_prefix("---\n").unwrap_or(&yaml).as_bytes())?;
            }
        }
        OutputFormat::Diff => {
            for o in outcomes.filter(|o| o.after != o.doc.object) {
                let before = to_yaml(&o.doc.object);
                let after = to_yaml(&o.after);
                let name = format!("{}/{}/{}", o.doc.kind(), o.namespace, o.doc.name());
                let diff = similar::TextDiff::from_lines(&before, &after);
                write!(
                    out,
                    "{}",
                    diff.unified_diff().context_radius(3).header(
                        &format!(
                            "{name} (original, {} document {})",
                            o.doc.source, o.doc.index
                        ),
                        &format!("{name} (rewritten)"),
                    )
                )?;
            }
        }
    }
    out.flush()
}
