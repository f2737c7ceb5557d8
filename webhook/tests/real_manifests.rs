//! A corpus of manifests modelled on real public GPU manifests (`tests/real/*.yaml`): NVIDIA's
//! node components where their installs put them, exporters, vendor installers, training and
//! serving custom resources, passthrough and shared GPUs. Each file says which manifest it was
//! modelled on and what `mutate` (built-in default policy) must say of each object:
//!
//! ```text
//! # Modelled on <project>: <owner/repo> <path> (<commit or version>).
//! # <what the case exercises>
//! # expect: <Kind> <namespace>/<name>[ <template path>]: <verdict>
//! # expect-message: <text mutate's stderr must hold>
//! # expect-known-gap: <Kind> <namespace>/<name>[ <path>]: <verdict today> (should be <what the rules say>)
//! # expect-known-gap-message: <text the rules call for that stderr does not hold yet>
//! ```
//!
//! A known gap asserts that today's behaviour is still the gap, so fixing it fails here and
//! the expectation is then written as it should be.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

mod mutate_support;

use gpuwarden_webhook::manifest;
use gpuwarden_webhook::mutate::{EXIT_ADMITTED, EXIT_BAD_INPUT, EXIT_DENIED};
use mutate_support::run as mutate;
use serde_json::Value;

/// The words a verdict line of `mutate` starts with (Audit: says so in parentheses).
const VERDICTS: [&str; 7] = [
    "REWRITTEN",
    "VOIDED",
    "DENIED",
    "exempt",
    "unchanged",
    "no pod template",
    "Audit",
];

/// An object (or a pod inside one) and the verdict `mutate` must give it.
struct Expect {
    /// `<Kind> <namespace>/<name>[ <path>]`, as stderr names it.
    object: String,
    verdict: String,
    /// A known gap: `verdict` is what happens today, not what should.
    gap: Option<String>,
}

struct Fixture {
    path: PathBuf,
    name: String,
    text: String,
    project: Option<String>,
    expects: Vec<Expect>,
    messages: Vec<String>,
    gap_messages: Vec<String>,
}

fn real_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/real")
}

/// Every `tests/real/*.yaml`, in name order, with its header read.
fn fixtures() -> Vec<Fixture> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(real_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    paths.sort();
    paths.into_iter().map(read_fixture).collect()
}

fn read_fixture(path: PathBuf) -> Fixture {
    let name = path.file_name().unwrap().to_string_lossy().into_owned();
    let text = std::fs::read_to_string(&path).unwrap();
    let mut fixture = Fixture {
        path,
        name,
        text: text.clone(),
        project: None,
        expects: Vec::new(),
        messages: Vec::new(),
        gap_messages: Vec::new(),
    };
    // The header is the comment block the file starts with.
    for line in text.lines().map_while(|l| l.strip_prefix('#')) {
        let line = line.trim();
        let directive = |key: &str| line.strip_prefix(key).map(str::trim);
        if let Some(rest) = directive("Modelled on ") {
            let (project, _) = (rest.split_once(':'))
                .unwrap_or_else(|| panic!("{}: `# Modelled on <project>: ...`", fixture.name));
            fixture.project = Some(project.trim().to_owned());
        } else if let Some(rest) = directive("expect:") {
            fixture.expects.push(expectation(&fixture.name, rest, None));
        } else if let Some(rest) = directive("expect-known-gap:") {
            let (current, should) = rest
                .split_once(" (should be ")
                .unwrap_or_else(|| panic!("{}: a known gap says `(should be ...)`", fixture.name));
            let should = should.trim_end_matches(')').to_owned();
            fixture
                .expects
                .push(expectation(&fixture.name, current, Some(should)));
        } else if let Some(rest) = directive("expect-message:") {
            fixture.messages.push(rest.to_owned());
        } else if let Some(rest) = directive("expect-known-gap-message:") {
            fixture.gap_messages.push(rest.to_owned());
        }
    }
    fixture
}

fn expectation(file: &str, text: &str, gap: Option<String>) -> Expect {
    let (object, verdict) = text
        .rsplit_once(": ")
        .unwrap_or_else(|| panic!("{file}: `{text}` is not `<object>: <verdict>`"));
    assert!(
        VERDICTS.contains(&verdict),
        "{file}: verdict {verdict:?} of {object} is none of {VERDICTS:?}"
    );
    Expect {
        object: object.to_owned(),
        verdict: verdict.to_owned(),
        gap,
    }
}

/// The verdict lines of stderr: `  <object>: <verdict text>`, as (object, verdict text).
fn verdict_lines(stderr: &str) -> Vec<(&str, &str)> {
    stderr
        .lines()
        .filter_map(|l| l.strip_prefix("  "))
        .filter(|l| !l.starts_with(' '))
        .filter_map(|l| l.split_once(": "))
        .collect()
}

fn says(verdict_text: &str, verdict: &str) -> bool {
    if verdict == "Audit" {
        verdict_text.contains("(Audit)")
    } else {
        verdict_text.starts_with(verdict)
    }
}

/// How stderr names a document: `<Kind> <namespace>/<name>`.
fn object_name(doc: &manifest::Document) -> String {
    format!(
        "{} {}/{}",
        doc.kind(),
        doc.namespace().unwrap_or("default"),
        doc.name()
    )
}

/// Each object of `-o json` output: the object itself, or the items of the List for several.
fn output_objects(stdout: &str, documents: usize) -> Vec<Value> {
    let out: Value = serde_json::from_str(stdout).unwrap();
    if documents == 1 {
        vec![out]
    } else {
        out["items"].as_array().cloned().unwrap_or_default()
    }
}

/// Every container anywhere in an object (entries of `containers` and `initContainers`
/// lists), by JSON pointer.
fn containers<'v>(value: &'v Value, pointer: String, out: &mut Vec<(String, &'v Value)>) {
    match value {
        Value::Object(map) => {
            for (key, child) in map {
                let at = format!("{pointer}/{}", key.replace('~', "~0").replace('/', "~1"));
                match (key.as_str(), child) {
                    ("containers" | "initContainers", Value::Array(list)) => {
                        for (i, c) in list.iter().enumerate() {
                            out.push((format!("{at}/{i}"), c));
                        }
                    }
                    _ => containers(child, at, out),
                }
            }
        }
        Value::Array(items) => {
            for (i, child) in items.iter().enumerate() {
                containers(child, format!("{pointer}/{i}"), out);
            }
        }
        _ => {}
    }
}

/// The extended resources a container names in its limits and requests.
fn resources(container: &Value) -> BTreeSet<String> {
    ["limits", "requests"]
        .iter()
        .filter_map(|k| container["resources"][k].as_object())
        .flat_map(|m| m.keys().cloned())
        .collect()
}

/// A GPU the container already holds through another NVIDIA device-plugin resource: a
/// time-sliced replica, a MIG slice, or a passthrough GPU (`nvidia.com/pgpu`, or the sandbox
/// device plugin's upper-case model names).
fn held_elsewhere(resource: &str) -> bool {
    resource == "nvidia.com/gpu.shared"
        || resource.starts_with("nvidia.com/mig-")
        || resource == "nvidia.com/pgpu"
        || (resource.strip_prefix("nvidia.com/"))
            .is_some_and(|r| r.starts_with(|c: char| c.is_ascii_uppercase()))
}

/// Every `defaultMode` value in an object.
fn default_modes(value: &Value, out: &mut Vec<i64>) {
    match value {
        Value::Object(map) => {
            for (key, child) in map {
                match (key.as_str(), child.as_i64()) {
                    ("defaultMode", Some(mode)) => out.push(mode),
                    _ => default_modes(child, out),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|v| default_modes(v, out)),
        _ => {}
    }
}

/// `cdi.k8s.io/*` annotations naming only passthrough GPUs, anywhere in an object, by value.
fn passthrough_cdi(value: &Value, out: &mut Vec<(String, String)>) {
    match value {
        Value::Object(map) => {
            for (key, child) in map {
                if key == "annotations" {
                    for (k, v) in child.as_object().into_iter().flatten() {
                        let Some(v) = v.as_str() else { continue };
                        if k.starts_with("cdi.k8s.io/")
                            && v.split(',').all(|d| d.starts_with("nvidia.com/pgpu="))
                        {
                            out.push((k.clone(), v.to_owned()));
                        }
                    }
                } else {
                    passthrough_cdi(child, out);
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|v| passthrough_cdi(v, out)),
        _ => {}
    }
}

/// Checks one fixture against what `mutate -o json` says of it; returns the failures.
fn check(fixture: &Fixture, known_gaps: &mut Vec<String>) -> Vec<String> {
    let file = &fixture.name;
    let mut failures = Vec::new();
    let mut fail = |m: String| failures.push(format!("{file}: {m}"));
    if fixture.project.is_none() {
        fail("does not say what it is modelled on (`# Modelled on <project>: ...`)".into());
    }
    if fixture.expects.is_empty() {
        fail("expects nothing (`# expect: <object>: <verdict>`)".into());
    }
    let path = fixture.path.display().to_string();
    let run = mutate(&["-f", &path, "-o", "json"]);
    let stderr = &run.stderr;
    if run.code == EXIT_BAD_INPUT {
        fail(format!("mutate refused the file:\n{stderr}"));
        return failures;
    }
    let lines = verdict_lines(stderr);

    for e in &fixture.expects {
        let found: Vec<&str> = (lines.iter())
            .filter(|(object, _)| *object == e.object)
            .map(|(_, text)| *text)
            .collect();
        let holds = found.iter().any(|text| says(text, &e.verdict));
        match (&e.gap, holds) {
            (None, true) => {}
            (None, false) => fail(format!(
                "{}: expected {}, mutate said {found:?}\n{stderr}",
                e.object, e.verdict
            )),
            (Some(should), true) => known_gaps.push(format!(
                "{file}: {} is {} (should be {should})",
                e.object, e.verdict
            )),
            (Some(should), false) => fail(format!(
                "{}: the known gap ({}, should be {should}) is no longer what mutate says ({found:?}): write the expectation as it now is\n{stderr}",
                e.object, e.verdict
            )),
        }
    }
    // Every object mutate reports is one the file expects something of.
    for (object, text) in &lines {
        if !fixture.expects.iter().any(|e| e.object == *object) {
            fail(format!("{object}: reported ({text}) but not expected"));
        }
    }
    for m in &fixture.messages {
        if !stderr.contains(m.as_str()) {
            fail(format!("expected message {m:?} in:\n{stderr}"));
        }
    }
    for m in &fixture.gap_messages {
        if stderr.contains(m.as_str()) {
            fail(format!(
                "the known gap is closed: {m:?} is now in stderr; make it an expect-message\n{stderr}"
            ));
        } else {
            known_gaps.push(format!("{file}: stderr does not say {m:?} yet"));
        }
    }

    // Denials, and only denials, exit 1.
    let denied = lines.iter().any(|(_, text)| says(text, "DENIED"));
    let code = if denied { EXIT_DENIED } else { EXIT_ADMITTED };
    if run.code != code {
        fail(format!("exit code {}, expected {code}\n{stderr}", run.code));
    }

    let documents = manifest::parse_documents(&path, &fixture.text).unwrap();
    let outputs = output_objects(&run.stdout, documents.len());
    if outputs.len() != documents.len() {
        fail(format!(
            "{} documents in, {} objects out",
            documents.len(),
            outputs.len()
        ));
        return failures;
    }
    for (doc, after) in documents.iter().zip(&outputs) {
        let object = object_name(doc);
        let texts: Vec<&str> = (lines.iter())
            .filter(|(o, _)| *o == object || o.starts_with(&format!("{object} ")))
            .map(|(_, text)| *text)
            .collect();
        let rewritten = texts
            .iter()
            .any(|t| says(t, "REWRITTEN") || says(t, "VOIDED"));
        // What is not rewritten comes out exactly as kubectl reads it.
        if !rewritten && *after != doc.object {
            fail(format!(
                "{object}: reported {texts:?} but its output differs from its input\nin:  {}\nout: {after}",
                doc.object
            ));
        }
        // A KubeVirt VM is never changed: what its launcher pod gets happens when KubeVirt
        // creates the pod.
        let vm = (lines.iter()).any(|(o, _)| {
            o.starts_with(&object) && o.contains("(the launcher pod KubeVirt renders)")
        });
        if rewritten && *after == doc.object && !vm {
            fail(format!(
                "{object}: reported REWRITTEN but came out unchanged"
            ));
        }
        // A GPU held through another NVIDIA resource counts as held: no nvidia.com/gpu beside it.
        let mut out_containers = Vec::new();
        containers(after, String::new(), &mut out_containers);
        for (pointer, c) in out_containers {
            let now = resources(c);
            let before = doc
                .object
                .pointer(&pointer)
                .map(resources)
                .unwrap_or_default();
            if now.iter().any(|r| held_elsewhere(r))
                && now.contains("nvidia.com/gpu")
                && !before.contains("nvidia.com/gpu")
            {
                fail(format!(
                    "{object} {pointer}: nvidia.com/gpu added beside {now:?}"
                ));
            }
        }
        // A CDI annotation naming passthrough GPUs stays.
        let (mut cdi_before, mut cdi_after) = (Vec::new(), Vec::new());
        passthrough_cdi(&doc.object, &mut cdi_before);
        passthrough_cdi(after, &mut cdi_after);
        for kept in cdi_before.iter().filter(|a| !cdi_after.contains(a)) {
            fail(format!(
                "{object}: passthrough CDI annotation {kept:?} removed"
            ));
        }
    }

    // A mode written with a leading zero is octal to kubectl (YAML 1.1): 0755 is 493.
    let mut modes = Vec::new();
    outputs.iter().for_each(|o| default_modes(o, &mut modes));
    for word in fixture.text.split_whitespace() {
        let Some(octal) = word.strip_prefix('0').filter(|d| !d.is_empty()) else {
            continue;
        };
        let Ok(mode) = i64::from_str_radix(octal, 8) else {
            continue;
        };
        let written = fixture.text.contains(&format!("defaultMode: {word}"));
        if written && !modes.contains(&mode) {
            fail(format!(
                "defaultMode: {word} should read as {mode}, the output has {modes:?}"
            ));
        }
    }
    failures
}

#[test]
fn real_manifests_get_the_verdicts_the_rules_give_them() {
    let fixtures = fixtures();
    let mut failures = Vec::new();
    let mut known_gaps = Vec::new();
    for fixture in &fixtures {
        failures.extend(check(fixture, &mut known_gaps));
    }

    let projects: BTreeSet<&str> = (fixtures.iter())
        .filter_map(|f| f.project.as_deref())
        .collect();
    if fixtures.len() < 30 {
        failures.push(format!("only {} fixtures (at least 30)", fixtures.len()));
    }
    if projects.len() < 16 {
        failures.push(format!(
            "only {} projects (at least 16): {projects:?}",
            projects.len()
        ));
    }

    // The passthrough case the rules single out: Contrast's Kata pod keeps its CDI annotation
    // and is given no nvidia.com/gpu.
    let contrast = real_dir().join("contrast-kata-gpu-pod.yaml");
    let run = mutate(&["-f", &contrast.display().to_string(), "-o", "json"]);
    let pod: Value = serde_json::from_str(&run.stdout).unwrap();
    assert_eq!(
        pod["metadata"]["annotations"]["cdi.k8s.io/gpu"], "nvidia.com/pgpu=0",
        "contrast-kata-gpu-pod.yaml: Pod default/gpu-tester lost its CDI annotation:\n{pod:#}"
    );
    let c = &pod["spec"]["containers"][0];
    assert!(
        !resources(c).contains("nvidia.com/gpu"),
        "contrast-kata-gpu-pod.yaml: Pod default/gpu-tester was given nvidia.com/gpu:\n{c:#}"
    );
    assert_eq!(c["resources"]["limits"]["nvidia.com/GH100_H100_PCIE"], "1");

    if !known_gaps.is_empty() {
        eprintln!("known gaps ({}):", known_gaps.len());
        known_gaps.iter().for_each(|g| eprintln!("  {g}"));
    }
    assert!(
        failures.is_empty(),
        "{} failure(s):\n\n{}",
        failures.len(),
        failures.join("\n\n")
    );
}

#[test]
fn denied_manifests_exit_1_from_the_binary_alone_and_together() {
    let fixtures = fixtures();
    let binary = || {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_gpuwarden-webhook"));
        cmd.current_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join(".."));
        cmd
    };
    let denied = |f: &Fixture| f.expects.iter().filter(|e| e.verdict == "DENIED").count();
    let mut denials = 0;
    for f in &fixtures {
        let out = binary()
            .args(["mutate", "-f", &f.path.display().to_string()])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        let expected = if denied(f) > 0 { 1 } else { 0 };
        assert_eq!(out.status.code(), Some(expected), "{}:\n{stderr}", f.name);
        denials += denied(f);
    }
    assert!(denials >= 4, "the corpus has {denials} denials");

    // The whole corpus at once: one denial is enough to fail the run, and each is counted.
    let out = binary()
        .args(["mutate", "-f", "webhook/tests/real", "-o", "patch"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let documents: usize = (fixtures.iter())
        .map(|f| {
            let path = f.path.display().to_string();
            manifest::parse_documents(&path, &f.text).unwrap().len()
        })
        .sum();
    let summary = stderr.lines().last().unwrap_or_default();
    assert!(
        summary.starts_with(&format!("{documents} objects: "))
            && summary.contains(&format!("{denials} denied")),
        "expected {documents} objects and {denials} denied in the summary: {summary}\n{stderr}"
    );
}

/// The advice of docs/policy.md for node agents outside NVIDIA's namespaces, taken as written:
/// with its container exemptions added to the default policy, dcgm-exporter from its own
/// manifest and both nvidia_gpu_exporter DaemonSets in `monitoring` are left as they are
/// (neither voided nor denied), and the same exporters in another namespace are not.
#[test]
fn the_documented_exemption_gives_third_party_exporters_their_gpus() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let page = std::fs::read_to_string(root.join("docs/policy.md")).expect("docs/policy.md");
    let advice = page
        .split_once("**A node agent that reads every GPU needs an exemption.**")
        .and_then(|(_, rest)| rest.split_once("```yaml\n"))
        .and_then(|(_, rest)| rest.split_once("\n```"))
        .expect("the exemption block of docs/policy.md")
        .0;
    // Its entries under `containers:`, two spaces less indented, as the default policy's are.
    let entries: Vec<&str> = (advice.lines())
        .skip_while(|l| l.trim() != "containers:")
        .skip(1)
        .map(|l| l.strip_prefix("  ").unwrap_or(l))
        .collect();
    assert!(entries.len() >= 4, "{advice}");
    let default =
        std::fs::read_to_string(root.join("deploy/policies/default.yaml")).expect("policy");
    let policy = default.replacen(
        "    containers:\n",
        &format!("    containers:\n{}\n", entries.join("\n")),
        1,
    );
    assert_ne!(policy, default);
    let dir = tempfile::tempdir().expect("a temporary directory");
    let policy_file = dir.path().join("policy.yaml");
    std::fs::write(&policy_file, policy).expect("write the policy");
    let real = |name: &str| real_dir().join(name);
    let manifests = [
        real("dcgm-exporter-standalone.yaml"),
        real("nvidia-gpu-exporter-runtime-injected.yaml"),
        real("nvidia-gpu-exporter-legacy-privileged.yaml"),
    ];
    let mut args = vec![
        "--policy".to_owned(),
        policy_file.display().to_string(),
        "-n".to_owned(),
        "monitoring".to_owned(),
        "-o".to_owned(),
        "diff".to_owned(),
    ];
    for m in &manifests {
        args.extend(["-f".to_owned(), m.display().to_string()]);
    }
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let run = mutate(&argv);
    assert_eq!(run.code, EXIT_ADMITTED, "{}", run.stderr);
    assert!(
        !run.stderr.contains("VOIDED") && !run.stderr.contains("DENIED"),
        "{}",
        run.stderr
    );
    assert_eq!(
        run.stderr.matches("DaemonSet monitoring/").count(),
        3,
        "{}",
        run.stderr
    );
    assert!(
        run.stdout.trim().is_empty(),
        "nothing changes:\n{}",
        run.stdout
    );
    // Without the advice, the same three are voided or denied.
    let argv: Vec<&str> = (argv.iter().copied())
        .filter(|a| *a != "--policy" && *a != policy_file.to_str().unwrap_or_default())
        .collect();
    let bare = mutate(&argv);
    assert_eq!(
        bare.stderr.matches("VOIDED").count() + bare.stderr.matches("DENIED").count(),
        3,
        "{}",
        bare.stderr
    );
}
