//! The built binary's `mutate` subcommand, as a user runs it.

use std::path::Path;
use std::process::Command;

fn gpuwarden_webhook() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_gpuwarden-webhook"));
    cmd.current_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join(".."));
    cmd
}

#[test]
fn mutate_the_examples_like_the_readme_says() {
    let out = gpuwarden_webhook()
        .args(["mutate", "-f", "deploy/examples/"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains("8 objects: 1 exempt, 1 passed through, 5 rewritten, 1 unchanged"),
        "{stderr}"
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        stdout.matches("\n---\n").count() + usize::from(stdout.starts_with("---\n")),
        8
    );

    let out = gpuwarden_webhook()
        .args([
            "mutate",
            "-f",
            "deploy/examples/02-deployment-two-gpus.yaml",
            "-o",
            "diff",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let diff = String::from_utf8_lossy(&out.stdout);
    assert!(
        diff.lines()
            .any(|l| l.starts_with('+') && l.trim_end().ends_with("nvidia.com/gpu: \"2\"")),
        "{diff}"
    );
}

#[test]
fn mutate_exit_codes() {
    let out = gpuwarden_webhook()
        .args(["mutate", "-f", "deploy/examples/does-not-exist.yaml"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("does-not-exist.yaml: failed to read"));

    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("deny.yaml");
    std::fs::write(
        &policy,
        "apiVersion: gpuwarden.io/v1alpha1\nkind: GpuPolicy\nmetadata:\n  name: deny\nspec:\n  mode: Deny\n",
    )
    .unwrap();
    let out = gpuwarden_webhook()
        .args(["mutate", "-f", "deploy/examples/", "--policy"])
        .arg(&policy)
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
