//! `kubectl` as the install tests run it, as a reader would: from `PATH`, against
//! `KUBECONFIG`; and a blocking poll for what it reports.

use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::node::{Out, exec};

/// `kubectl ARGS`.
pub fn run(args: &[&str]) -> Out {
    exec(Command::new("kubectl").args(args), None)
}

/// `kubectl ARGS`, fed `stdin`.
pub fn run_stdin(args: &[&str], stdin: &str) -> Out {
    exec(Command::new("kubectl").args(args), Some(stdin))
}

/// `kubectl ARGS`, which must succeed; its standard output.
pub fn must(args: &[&str]) -> String {
    let out = run(args);
    assert!(out.ok, "kubectl {} failed: {}", args.join(" "), out.stderr);
    out.stdout
}

/// `kubectl get ARGS -o json`, or None when it fails (not found).
pub fn get_json(args: &[&str]) -> Option<Value> {
    let mut all = vec!["get"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["-o", "json"]);
    let out = run(&all);
    if !out.ok {
        return None;
    }
    serde_json::from_str(&out.stdout).ok()
}

/// Calls `check` every `every` until it answers or `timeout` passes.
pub fn poll<T>(
    timeout: Duration,
    every: Duration,
    mut check: impl FnMut() -> Option<T>,
) -> Option<T> {
    let start = Instant::now();
    loop {
        if let Some(v) = check() {
            return Some(v);
        }
        if start.elapsed() >= timeout {
            return None;
        }
        std::thread::sleep(every);
    }
}
