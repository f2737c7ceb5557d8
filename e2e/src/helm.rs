//! The Helm binary the chart tests run, and the chart's Helm-only objects.
//!
//! `helm` is found as `$GPUWARDEN_HELM`, else `target/tools/helm` (where `.ci/run` installs
//! the pinned version), else on `PATH`; `kubectl` likewise (`$GPUWARDEN_KUBECTL`,
//! `target/tools/kubectl`, `PATH`). Where `GPUWARDEN_REQUIRE_HELM=1` (as `.ci/run` sets it)
//! a missing `helm` fails the tests that need it instead of skipping them.

use std::path::PathBuf;
use std::process::Command;

use crate::manifests::repo_root;

/// The chart, relative to the repository root.
pub const CHART: &str = "deploy/helm/gpuwarden";

/// Set to `1` to make a missing `helm` an error.
pub const REQUIRE_HELM: &str = "GPUWARDEN_REQUIRE_HELM";

/// The objects the chart adds to the base, all of them its pre-delete hook
/// (`templates/uninstall.yaml`): `kind/name`.
pub const HELM_ONLY: [&str; 4] = [
    "ServiceAccount/gpuwarden-uninstall",
    "ClusterRole/gpuwarden-uninstall",
    "ClusterRoleBinding/gpuwarden-uninstall",
    "Job/gpuwarden-uninstall",
];

/// A tool: `$env`, else `target/tools/<name>` under the repository, else `<name>` on
/// `PATH`, where it answers `version`.
fn tool(name: &str, env: &str, version_args: &[&str]) -> Option<PathBuf> {
    let candidates = [
        std::env::var_os(env).map(PathBuf::from),
        Some(repo_root().join("target/tools").join(name)),
        Some(PathBuf::from(name)),
    ];
    candidates.into_iter().flatten().find(|path| {
        Command::new(path)
            .args(version_args)
            .output()
            .is_ok_and(|o| o.status.success())
    })
}

/// The `helm` to run, if any.
pub fn helm() -> Option<PathBuf> {
    tool("helm", "GPUWARDEN_HELM", &["version", "--short"])
}

/// The `kubectl` to run, if any.
pub fn kubectl() -> Option<PathBuf> {
    tool("kubectl", "GPUWARDEN_KUBECTL", &["version", "--client"])
}

/// Whether a missing `helm` must fail the test.
pub fn helm_required() -> bool {
    std::env::var(REQUIRE_HELM).is_ok_and(|v| v == "1")
}
