//! The Troubleshooting page (docs/troubleshooting.md) quotes what a person sees: the
//! messages `kubectl` prints on pod creation, the node agent's log, and the GpuNode
//! conditions. Each quote is held to the code that prints it, so a message changed in the
//! code fails here until the page follows it.
//!
//! A quoted message stands for what the code prints with example values filled in (`ns/p`,
//! `train`, `16`), and `...` leaves a part out. It is held to the sources as a whole: each
//! space in it, with the text on both sides of it as far as they go, must be part of a
//! constant text of gpuwarden's sources (a string literal of Rust, or of the CEL of the
//! admission policies, less its `{}` holes) or of the Kubernetes API server and Go, whose
//! few texts are listed below. So every word sits in the prose of some message, or is a
//! value standing next to one of its holes; a word changed, added or dropped in prose
//! leaves a space no constant text covers. The conditions table is held to the operator's
//! own condition function.

use std::collections::BTreeSet;
use std::path::Path;

use gpuwarden_crds::RuntimeStatus;
use gpuwarden_crds::install;
use gpuwarden_e2e::manifests::{load_file, repo_root};
use gpuwarden_e2e::readme::{TROUBLESHOOTING, doc_section};
use gpuwarden_operator::gpunode::{AgentLiveness, CONDITION_TYPES, desired_conditions};

/// The Troubleshooting page, below its heading.
fn troubleshooting() -> String {
    doc_section(TROUBLESHOOTING, "Troubleshooting")
}

/// The rows of the tables whose first column is `header`, as cells.
fn table_rows(section: &str, header: &str) -> Vec<Vec<String>> {
    let mut rows = Vec::new();
    let mut in_table = false;
    for line in section.lines() {
        let line = line.trim();
        if !line.starts_with('|') {
            in_table = false;
            continue;
        }
        let cells: Vec<String> = line
            .trim_matches('|')
            .split(" | ")
            .map(|c| c.trim().to_owned())
            .collect();
        if cells[0] == header {
            in_table = true;
        } else if in_table && !cells[0].starts_with("---") {
            rows.push(cells);
        }
    }
    rows
}

/// The `backticked` parts of a cell.
fn quoted(cell: &str) -> Vec<String> {
    cell.split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect()
}

/// Texts of Kubernetes and Go that the table quotes beside gpuwarden's: how the API server
/// reports a webhook it cannot call (`k8s.io/apiserver/pkg/util/webhook/error.go`) and a
/// ValidatingAdmissionPolicy's denial (`.../policy/validating/dispatcher.go`), with
/// gpuwarden's names filled in; kubectl's prefix of a warning; and Go's network errors.
fn kubernetes_texts() -> Vec<String> {
    let docs = load_file("deploy/admission/backstop-policy.yaml").expect("backstop policy");
    let binding = docs
        .iter()
        .find(|d| d.kind() == "ValidatingAdmissionPolicyBinding")
        .expect("the backstop's binding");
    let policy = binding.value["spec"]["policyName"]
        .as_str()
        .expect("policyName");
    vec![
        format!("failed calling webhook \"{}\": ", install::MUTATING_WEBHOOK),
        format!(
            "ValidatingAdmissionPolicy '{policy}' with binding '{}' denied request: ",
            binding.name()
        ),
        "Warning: ".into(),
        "connection refused".into(),
        "context deadline exceeded".into(),
        "x509: certificate signed by unknown authority".into(),
    ]
}

/// The string literals of a Rust source, as their values: escapes resolved, a `\` at the
/// end of a line joining it to the next without the indentation. Comments are skipped.
fn rust_literals(text: &str) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        match chars[i] {
            '/' if chars.get(i + 1) == Some(&'/') => {
                while i < chars.len() && chars[i] != '\n' {
                    i += 1;
                }
            }
            '/' if chars.get(i + 1) == Some(&'*') => {
                i += 2;
                while i + 1 < chars.len() && !(chars[i] == '*' && chars[i + 1] == '/') {
                    i += 1;
                }
                i += 2;
            }
            // A char literal ('"', '\'', 'x') or a lifetime ('a).
            '\'' => {
                if chars.get(i + 1) == Some(&'\\') {
                    i += 2;
                    while i < chars.len() && chars[i] != '\'' {
                        i += 1;
                    }
                    i += 1;
                } else if chars.get(i + 2) == Some(&'\'') {
                    i += 3;
                } else {
                    i += 1;
                }
            }
            'r' if (chars.get(i + 1) == Some(&'"') || chars.get(i + 1) == Some(&'#'))
                && (i == 0 || !(chars[i - 1].is_alphanumeric() || chars[i - 1] == '_')) =>
            {
                let mut hashes = 0;
                let mut j = i + 1;
                while chars.get(j) == Some(&'#') {
                    hashes += 1;
                    j += 1;
                }
                if chars.get(j) != Some(&'"') {
                    i += 1;
                    continue;
                }
                let close: String = std::iter::once('"')
                    .chain(std::iter::repeat_n('#', hashes))
                    .collect();
                let rest: String = chars[j + 1..].iter().collect();
                let end = rest.find(&close).unwrap_or(rest.len());
                out.push(rest[..end].to_owned());
                i = j + 1 + rest[..end].chars().count() + close.chars().count();
            }
            '"' => {
                let mut value = String::new();
                i += 1;
                while i < chars.len() && chars[i] != '"' {
                    if chars[i] == '\\' {
                        i += 1;
                        match chars.get(i) {
                            Some('n') => value.push('\n'),
                            Some('t') => value.push('\t'),
                            Some('0') => value.push('\0'),
                            Some('\n') => {
                                while chars.get(i + 1).is_some_and(|c| c.is_whitespace()) {
                                    i += 1;
                                }
                            }
                            Some('u') => {
                                let close = (i..chars.len()).find(|&k| chars[k] == '}');
                                let hex: String = close
                                    .map(|c| chars[i + 2..c].iter().collect())
                                    .unwrap_or_default();
                                if let Some(c) =
                                    u32::from_str_radix(&hex, 16).ok().and_then(char::from_u32)
                                {
                                    value.push(c);
                                }
                                i = close.unwrap_or(i);
                            }
                            Some(c) => value.push(*c),
                            None => {}
                        }
                    } else {
                        value.push(chars[i]);
                    }
                    i += 1;
                }
                out.push(value);
                i += 1;
            }
            _ => i += 1,
        }
    }
    out
}

/// The string literals of a CEL expression; literals joined by `+` are one.
fn cel_literals(expression: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut joined = false;
    let mut rest = expression;
    while let Some(start) = rest.find(['\'', '"']) {
        let between = &rest[..start];
        let quote = rest[start..].chars().next().unwrap_or('\'');
        let body = &rest[start + 1..];
        let end = body.find(quote).unwrap_or(body.len());
        let literal = body[..end].to_owned();
        if joined && between.trim() == "+" {
            if let Some(last) = out.last_mut() {
                last.push_str(&literal);
            }
        } else {
            out.push(literal);
        }
        joined = true;
        rest = body.get(end + 1..).unwrap_or_default();
    }
    out
}

/// The constant parts of a template, empty ones too: a format string's text between its
/// `{...}` holes (`{{` and `}}` are braces).
fn parts(template: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut current = String::new();
    let mut chars = template.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '{' if chars.peek() == Some(&'{') => {
                chars.next();
                current.push('{');
            }
            '}' if chars.peek() == Some(&'}') => {
                chars.next();
                current.push('}');
            }
            '{' => {
                for c in chars.by_ref() {
                    if c == '}' {
                        break;
                    }
                }
                out.push(std::mem::take(&mut current));
            }
            _ => current.push(c),
        }
    }
    out.push(current);
    out
}

/// The constant parts of a template that can vouch for a space on their own.
fn chunks(template: &str) -> Vec<String> {
    parts(template).into_iter().filter(|c| usable(c)).collect()
}

/// A template whose holes are joined by a bare space, with other constant text around them
/// (`({} {})` prints `(container train)`): its spaces count only where the whole template
/// matches, each hole a value without spaces.
#[derive(Debug)]
struct Joined(Vec<String>);

impl Joined {
    fn from(template: &str) -> Option<Self> {
        let parts = parts(template);
        if parts.len() < 3 {
            return None;
        }
        let bare = parts[1..parts.len() - 1]
            .iter()
            .any(|p| !p.is_empty() && p.trim().is_empty());
        let framed = parts.concat().chars().any(|c| !c.is_whitespace());
        (bare && framed).then_some(Self(parts))
    }

    /// The spans of `segment` its constant parts take where it matches at `at`.
    fn matches(&self, segment: &str, at: usize) -> Option<Vec<(usize, usize)>> {
        fn from(
            parts: &[String],
            segment: &str,
            at: usize,
            spans: &mut Vec<(usize, usize)>,
        ) -> bool {
            let Some(rest) = segment.get(at..) else {
                return false;
            };
            if !rest.starts_with(parts[0].as_str()) {
                return false;
            }
            let end = at + parts[0].len();
            spans.push((at, end));
            if parts.len() == 1 {
                return true;
            }
            // A hole: one or more characters that are not spaces.
            let value: Vec<usize> = segment[end..]
                .char_indices()
                .take_while(|(_, c)| !c.is_whitespace())
                .map(|(i, c)| end + i + c.len_utf8())
                .collect();
            for next in value.into_iter().rev() {
                let mark = spans.len();
                if from(&parts[1..], segment, next, spans) {
                    return true;
                }
                spans.truncate(mark);
            }
            spans.pop();
            false
        }
        let mut spans = Vec::new();
        from(&self.0, segment, at, &mut spans).then_some(spans)
    }
}

/// Whether a piece of constant text can vouch for a space: it has one, and something else
/// (a bare space would let any two words next to each other pass).
fn usable(piece: &str) -> bool {
    piece.contains(char::is_whitespace) && !piece.trim().is_empty()
}

/// Every constant text gpuwarden's sources can print, and the templates that join values
/// by a bare space.
fn source_chunks() -> (Vec<String>, Vec<Joined>) {
    fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                rust_files(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    let mut files = Vec::new();
    for crate_dir in ["crds", "webhook", "operator", "node-agent"] {
        rust_files(&repo_root().join(crate_dir).join("src"), &mut files);
    }
    let mut out = BTreeSet::new();
    let mut joined = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).expect("source");
        for literal in rust_literals(&text) {
            out.extend(chunks(&literal));
            joined.extend(Joined::from(&literal));
        }
    }
    for file in [
        "backstop-policy.yaml",
        "agent-own-node.yaml",
        "kai-sharing.yaml",
        "runtime-variables.yaml",
    ] {
        for doc in load_file(&format!("deploy/admission/{file}")).expect("admission policy") {
            for validation in doc.value["spec"]["validations"]
                .as_array()
                .into_iter()
                .flatten()
            {
                if let Some(expression) = validation["messageExpression"].as_str() {
                    out.extend(cel_literals(expression).into_iter().filter(|c| usable(c)));
                }
            }
        }
    }
    out.extend(kubernetes_texts());
    (out.into_iter().collect(), joined)
}

/// Why `segment` (a quote between two `...`) is not what the code prints, if it is not:
/// the spaces no constant text covers, with the words beside them.
fn unexplained(segment: &str, (chunks, joined): &(Vec<String>, Vec<Joined>)) -> Option<String> {
    let mut covered = vec![false; segment.len()];
    let mut cover = |from: usize, to: usize, piece: &str| {
        if usable(piece) {
            covered[from..to].iter_mut().for_each(|c| *c = true);
        }
    };
    for chunk in chunks {
        for (at, _) in segment.match_indices(chunk.as_str()) {
            cover(at, at + chunk.len(), chunk);
        }
        if chunk.len() > segment.len() && chunk.contains(segment) {
            cover(0, segment.len(), segment);
        }
        // The quote may begin in the middle of a constant text and end in another.
        let longest_end = (1..chunk.len().min(segment.len()))
            .rev()
            .filter(|&k| chunk.is_char_boundary(chunk.len() - k))
            .find(|&k| segment.starts_with(&chunk[chunk.len() - k..]));
        if let Some(k) = longest_end {
            cover(0, k, &segment[..k]);
        }
        let longest_start = (1..chunk.len().min(segment.len()))
            .rev()
            .filter(|&k| chunk.is_char_boundary(k))
            .find(|&k| segment.ends_with(&chunk[..k]));
        if let Some(k) = longest_start {
            cover(
                segment.len() - k,
                segment.len(),
                &segment[segment.len() - k..],
            );
        }
    }
    for template in joined {
        for (at, _) in segment.char_indices() {
            for (from, to) in template.matches(segment, at).into_iter().flatten() {
                covered[from..to].iter_mut().for_each(|c| *c = true);
            }
        }
    }
    let words: Vec<(usize, &str)> = segment
        .split_whitespace()
        .map(|w| (w.as_ptr() as usize - segment.as_ptr() as usize, w))
        .collect();
    let problems: Vec<String> = words
        .windows(2)
        .filter(|pair| {
            let (end, next) = (pair[0].0 + pair[0].1.len(), pair[1].0);
            (end..next).any(|i| !covered[i])
        })
        .map(|pair| format!("{:?}", format!("{} {}", pair[0].1, pair[1].1)))
        .collect();
    (!problems.is_empty()).then(|| problems.join(", "))
}

/// The quotes of the message tables, with their problems.
fn message_problems(section: &str, chunks: &(Vec<String>, Vec<Joined>)) -> Vec<String> {
    let mut problems = Vec::new();
    for row in table_rows(section, "message") {
        for quote in quoted(&row[0]) {
            for segment in quote.split("...").map(str::trim).filter(|s| !s.is_empty()) {
                if let Some(problem) = unexplained(segment, chunks) {
                    problems.push(format!("`{quote}`: no source prints {problem}"));
                }
            }
        }
    }
    problems
}

#[test]
fn every_quoted_message_is_what_the_code_prints() {
    let section = troubleshooting();
    let chunks = source_chunks();
    let quotes: usize = table_rows(&section, "message")
        .iter()
        .map(|r| quoted(&r[0]).len())
        .sum();
    assert!(quotes >= 25, "only {quotes} quoted messages found");
    let problems = message_problems(&section, &chunks);
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The check is not one that passes anything: a word changed in a quote, prose no source
/// has, and a message of the API server with another webhook's name all fail it.
#[test]
fn a_message_that_drifted_is_noticed() {
    let chunks = source_chunks();
    let drifted = [
        // The backstop's message before it named GPU-naming containers.
        "| message | meaning | what to do |\n|---|---|---|\n| `ValidatingAdmissionPolicy 'gpuwarden-privileged-gpu-pods' with binding 'gpuwarden-privileged-gpu-pods' denied request: gpuwarden: privileged GPU containers are not admitted in this namespace: train; ...` | x | y |",
        "| message | meaning | what to do |\n|---|---|---|\n| `NVML is not available: libnvidia-ml.so.1 could not be loaded (...); run on a GPU node with the NVIDIA driver, or pass a fake file` | x | y |",
        "| message | meaning | what to do |\n|---|---|---|\n| `failed calling webhook \"pods.example.com\": ... connection refused` | x | y |",
    ];
    for table in drifted {
        assert!(
            !message_problems(table, &chunks).is_empty(),
            "not noticed: {table}"
        );
    }
    // And the same rows as the code prints them pass.
    let current = "| message | meaning | what to do |\n|---|---|---|\n| `NVML is not available: libnvidia-ml.so.1 could not be loaded (...); run on a GPU node with the NVIDIA driver, or pass --fake FILE` | x | y |";
    assert_eq!(message_problems(current, &chunks), Vec::<String>::new());
}

/// Every condition, status and reason the conditions table names is one the operator sets,
/// and every reason the operator gives for a status other than True is in the table.
#[test]
fn the_conditions_table_is_what_the_operator_sets() {
    let section = troubleshooting();
    let types = CONDITION_TYPES;
    let mut documented = BTreeSet::new();
    for row in table_rows(&section, "condition") {
        let names: Vec<String> = quoted(&row[0])
            .into_iter()
            .filter(|q| types.contains(&q.as_str()))
            .collect();
        assert!(!names.is_empty(), "a row without a condition: {row:?}");
        let status = ["True", "False", "Unknown"]
            .into_iter()
            .find(|s| row[0].split_whitespace().any(|w| w == *s))
            .unwrap_or_else(|| panic!("a row without a status: {row:?}"));
        for name in names {
            for reason in quoted(&row[1]) {
                documented.insert((name.clone(), status.to_owned(), reason));
            }
        }
    }

    // What the operator sets, over the agent's states that lead to each reason.
    let ts = |s: i64| k8s_openapi::jiff::Timestamp::from_second(1_800_000_000 + s).expect("time");
    let gpu = |healthy: bool| {
        serde_json::from_value::<gpuwarden_crds::GpuStatus>(serde_json::json!({
            "index": 0, "uuid": "GPU-0", "model": "H100", "memoryMiB": 81559,
            "pciBusId": "00000000:18:00.0",
            "health": if healthy {
                serde_json::json!({"state": "Healthy"})
            } else {
                serde_json::json!({"state": "Unhealthy", "reasons": ["Xid79"]})
            },
        }))
        .expect("a GPU")
    };
    let status = |change: &dyn Fn(&mut serde_json::Value)| {
        let mut value = serde_json::json!({
            "gpus": [],
            "bindings": [],
            "privilegedPods": [],
        });
        change(&mut value);
        serde_json::from_value::<gpuwarden_crds::GpuNodeStatus>(value).expect("a status")
    };
    let mut statuses = vec![
        None,
        Some(status(&|_| {})),
        Some(status(&|v| {
            v["bindings"] = serde_json::json!([{"podUid": "u", "container": "c", "namespace": "ns",
                "pod": "p", "gpuUuids": ["GPU-0"], "source": "Observed"}]);
        })),
        Some(status(&|v| {
            v["privilegedPods"] = serde_json::json!([{"uid": "u", "namespace": "ns", "name": "p"}]);
        })),
        // A claim whose CDI spec hands out GPUs beyond its allocation.
        Some(status(&|v| {
            v["bindings"] = serde_json::json!([{"podUid": "u", "container": "c", "namespace": "ns",
                "pod": "p", "resourceName": "compute-domain.nvidia.com", "claims": ["ns/d"],
                "gpuUuids": ["GPU-0"], "deviceNodes": ["/dev/nvidia0"], "source": "BeyondClaim"}]);
        })),
        // A device plugin and a DRA driver handing out the same GPU.
        Some(status(&|v| {
            v["bindings"] = serde_json::json!([
                {"podUid": "u", "container": "c", "namespace": "ns", "pod": "p",
                 "resourceName": "nvidia.com/gpu", "gpuUuids": ["GPU-0"], "source": "Allocated"},
                {"podUid": "w", "container": "c", "namespace": "ns", "pod": "q",
                 "resourceName": "gpu.nvidia.com", "claims": ["ns/q-gpu"], "gpuUuids": ["GPU-0"],
                 "source": "Allocated"}]);
        })),
        // Two pods holding devices of one IOMMU group.
        Some(status(&|v| {
            let hold = |mine: &str, other: &str| {
                serde_json::json!([{"group": 13,
                "allocated": [{"resourceName": mine, "deviceId": mine}],
                "others": [{"resourceName": other, "deviceId": other}]}])
            };
            v["bindings"] = serde_json::json!([
                {"podUid": "u", "container": "compute", "namespace": "ns", "pod": "p",
                 "resourceName": "nvidia.com/GA102GL_A10", "gpuUuids": [], "source": "IommuGroup",
                 "iommuGroups": hold("0000:81:00.0", "0000:81:00.1")},
                {"podUid": "w", "container": "compute", "namespace": "ns", "pod": "q",
                 "resourceName": "nvidia.com/GA102_HIGH_DEFINITION_AUDIO_CONTROLLER",
                 "gpuUuids": [], "source": "IommuGroup", "iommuGroups": hold("0000:81:00.1", "0000:81:00.0")}]);
        })),
        Some(status(&|v| {
            v["truncated"] = serde_json::json!({"bindings": 3});
        })),
    ];
    for (healthy, runtime) in [
        (true, RuntimeStatus::default()),
        (
            false,
            RuntimeStatus {
                accept_env_var_when_unprivileged: Some(false),
                ..Default::default()
            },
        ),
        (
            true,
            RuntimeStatus {
                error: Some("no NVIDIA container runtime config found on the node".into()),
                ..Default::default()
            },
        ),
    ]
    .into_iter()
    // The toolkit: affected, patched, a version that does not read.
    .chain(["1.17.3-1", "1.18.2", "latest"].map(|version| {
        (
            true,
            RuntimeStatus {
                toolkit: Some(gpuwarden_crds::ToolkitStatus {
                    version: version.into(),
                    source: "dpkg".into(),
                }),
                ..Default::default()
            },
        )
    })) {
        let mut s = status(&|_| {});
        s.gpus = Some(vec![gpu(healthy)]);
        s.runtime = Some(runtime);
        statuses.push(Some(s));
    }
    let livenesses = [
        AgentLiveness::Live { expires: ts(100) },
        AgentLiveness::Expired { expired: ts(-100) },
        AgentLiveness::NoLease,
        AgentLiveness::Incomplete,
    ];
    let mut set = BTreeSet::new();
    for s in &statuses {
        for liveness in &livenesses {
            for c in desired_conditions(s.as_ref(), liveness) {
                set.insert((c.type_.clone(), c.status.to_owned(), c.reason.clone()));
            }
        }
    }
    let unknown: Vec<_> = documented.difference(&set).collect();
    assert!(
        unknown.is_empty(),
        "docs/troubleshooting.md names conditions the operator does not set: {unknown:?}"
    );
    let missing: Vec<_> = set
        .iter()
        .filter(|(_, status, _)| status != "True")
        .filter(|t| !documented.contains(*t))
        .collect();
    assert!(
        missing.is_empty(),
        "the operator sets conditions docs/troubleshooting.md does not explain: {missing:?}"
    );
}
