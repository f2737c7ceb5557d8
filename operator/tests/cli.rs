//! The binary's help text documents every flag, with its environment variable.

use std::process::Command;

#[test]
fn run_help_documents_every_flag_and_its_env_var() {
    let out = Command::new(env!("CARGO_BIN_EXE_gpuwarden-operator"))
        .args(["run", "--help"])
        .output()
        .expect("run the operator binary");
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for (flag, env) in [
        ("--namespace", "POD_NAMESPACE"),
        ("--health-listen", "GPUWARDEN_HEALTH_LISTEN"),
        (
            "--manage-webhook-certificates",
            "GPUWARDEN_MANAGE_WEBHOOK_CERTIFICATES",
        ),
        ("--taint-unhealthy-nodes", "GPUWARDEN_TAINT_UNHEALTHY_NODES"),
        ("--leader-election", "GPUWARDEN_LEADER_ELECTION"),
        ("--concurrency", "GPUWARDEN_CONCURRENCY"),
        ("--cert-validity", "GPUWARDEN_CERT_VALIDITY"),
        ("--identity", "POD_NAME"),
        ("--log-format", "GPUWARDEN_LOG_FORMAT"),
    ] {
        assert!(help.contains(flag), "{flag} missing from:\n{help}");
        assert!(
            help.contains(&format!("env: {env}")),
            "{env} missing from:\n{help}"
        );
    }
    assert!(help.contains("default: gpuwarden-system"), "{help}");
    assert!(help.contains("0.0.0.0:8080"));
}

#[test]
fn bad_flags_are_refused_with_a_message() {
    for args in [
        &["run", "--cert-validity", "5m"][..],
        &["run", "--concurrency", "0"],
        &["run", "--leader-election", "maybe"],
        &["run", "--health-listen", "nowhere"],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_gpuwarden-operator"))
            .args(args)
            .env_remove("KUBECONFIG")
            .output()
            .expect("run the operator binary");
        assert!(!out.status.success(), "{args:?} accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("error"), "{args:?}: {err}");
    }
}
