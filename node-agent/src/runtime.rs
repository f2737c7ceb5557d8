//! What the node's NVIDIA container runtime does with unprivileged containers, read (never
//! written) from its `config.toml` and the CDI spec directories under the host root.
//!
//! In the DaemonSet the agent does not read them itself: it runs as root (the kubelet's
//! pod-resources socket is root's), and the only host directories that hold these paths on
//! every node are `/etc`, `/usr` and `/var/run`, which also hold root's secrets and the
//! container runtime's socket. A second container, unprivileged and not root, reads them
//! ([`report_loop`]) and writes a report into a directory the two share; the agent reads
//! the report ([`read_report`]). Any of the paths may be missing: nothing on the host is
//! created for them, and what is missing is said in the status.

use std::path::Path;
use std::time::Duration;

use gpuwarden_crds::RuntimeStatus;
use tracing::{info, warn};

use crate::host::under;

// Defined where the posture and the CDI census read them (so that neither imports this
// module); named here too, where the runtime report's readers have always found them.
pub use crate::cdi::CDI_DIRS;
pub use crate::posture::CONFIG_PATHS;

/// CDI spec files larger than this are not read (they are a few hundred KiB at most).
const MAX_CDI_FILE: u64 = 4 * 1024 * 1024;

/// Where the runtime report is written and read: an emptyDir the two containers share.
pub const DEFAULT_REPORT: &str = "/run/gpuwarden/runtime.json";

/// Errors of the runtime report.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// The report could not be written.
    #[error("failed to write the runtime report {path}")]
    Write {
        /// The report.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The report could not be read.
    #[error("failed to read the runtime report {path}")]
    Read {
        /// The report.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The report is not a runtime status.
    #[error("the runtime report {path} is not valid")]
    Invalid {
        /// The report.
        path: String,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
    /// The report has not been written for too long: its writer is stuck or gone.
    #[error("the runtime report {path} was last written {age:?} ago, more than {limit:?}")]
    Stale {
        /// The report.
        path: String,
        /// Since its last write.
        age: Duration,
        /// The most allowed.
        limit: Duration,
    },
}

/// Errors parsing the runtime config.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeConfigError {
    /// Not TOML.
    #[error("invalid TOML: {0}")]
    Toml(String),
    /// A key has the wrong type.
    #[error("key {key} is not a {expected}")]
    Type {
        /// The key.
        key: &'static str,
        /// What it should be.
        expected: &'static str,
    },
}

/// The runtime settings that bear on isolation.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RuntimeConfig {
    /// `accept-nvidia-visible-devices-envvar-when-unprivileged`.
    pub accept_env_var_when_unprivileged: Option<bool>,
    /// `nvidia-container-runtime.mode`.
    pub mode: Option<String>,
    /// `accept-nvidia-visible-devices-as-volume-mounts`.
    pub accept_volume_mounts: Option<bool>,
    /// `features.ignore-imex-channel-requests`.
    pub ignore_imex_channel_requests: Option<bool>,
    /// `features.disable-imex-channel-creation`.
    pub disable_imex_channel_creation: Option<bool>,
}

/// Parses the text of `config.toml`.
pub fn parse_config(text: &str) -> Result<RuntimeConfig, RuntimeConfigError> {
    let table: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| RuntimeConfigError::Toml(e.message().to_owned()))?;
    let boolean = |key: &'static str| -> Result<Option<bool>, RuntimeConfigError> {
        match table.get(key) {
            None => Ok(None),
            Some(v) => v.as_bool().map(Some).ok_or(RuntimeConfigError::Type {
                key,
                expected: "boolean",
            }),
        }
    };
    let mode = match table
        .get("nvidia-container-runtime")
        .and_then(|t| t.get("mode"))
    {
        None => None,
        Some(v) => Some(
            v.as_str()
                .ok_or(RuntimeConfigError::Type {
                    key: "nvidia-container-runtime.mode",
                    expected: "string",
                })?
                .to_owned(),
        ),
    };
    let feature = |key: &'static str, name: &str| -> Result<Option<bool>, RuntimeConfigError> {
        match table.get("features").and_then(|f| f.get(name)) {
            None => Ok(None),
            Some(v) => v.as_bool().map(Some).ok_or(RuntimeConfigError::Type {
                key,
                expected: "boolean",
            }),
        }
    };
    Ok(RuntimeConfig {
        accept_env_var_when_unprivileged: boolean(
            "accept-nvidia-visible-devices-envvar-when-unprivileged",
        )?,
        mode,
        accept_volume_mounts: boolean("accept-nvidia-visible-devices-as-volume-mounts")?,
        ignore_imex_channel_requests: feature(
            "features.ignore-imex-channel-requests",
            "ignore-imex-channel-requests",
        )?,
        disable_imex_channel_creation: feature(
            "features.disable-imex-channel-creation",
            "disable-imex-channel-creation",
        )?,
    })
}

/// Reads the runtime diagnostics under `host_root` (`/` on the host, `/host` in the pod), the
/// toolkit's config and the CRI's from `paths`, and the node's posture
/// ([`crate::posture::fill`]). Problems, missing paths among them (named as on the host), go
/// into `error` (the config and the CDI directories) or `unknown` (the posture); the rest is
/// still filled in.
pub fn read_runtime(host_root: &Path, paths: &crate::posture::Paths) -> RuntimeStatus {
    let mut status = RuntimeStatus::default();
    let mut errors = Vec::new();
    let mut configured_mode = None;
    for path in &paths.toolkit_configs {
        let full = under(host_root, path);
        match std::fs::read_to_string(&full) {
            Ok(text) => {
                status.config_path = Some(path.clone());
                match parse_config(&text) {
                    Ok(cfg) => {
                        // NVIDIA's default when the key is absent is `true`.
                        status.accept_env_var_when_unprivileged =
                            Some(cfg.accept_env_var_when_unprivileged.unwrap_or(true));
                        status.mode = Some(cfg.mode.clone().unwrap_or_else(|| "auto".to_owned()));
                        configured_mode = status.mode.clone();
                        if cfg.accept_volume_mounts == Some(true) {
                            status.device_list_strategy = Some("volume-mounts".to_owned());
                        }
                        // NVIDIA's defaults when the keys are absent are all `false`.
                        status.accept_volume_mounts =
                            Some(cfg.accept_volume_mounts.unwrap_or(false));
                        status.ignore_imex_channel_requests =
                            Some(cfg.ignore_imex_channel_requests.unwrap_or(false));
                        status.disable_imex_channel_creation =
                            Some(cfg.disable_imex_channel_creation.unwrap_or(false));
                    }
                    Err(e) => errors.push(format!("{path}: {e}")),
                }
                break;
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => {
                errors.push(format!("{path}: {e}"));
                break;
            }
        }
    }
    if status.config_path.is_none() && errors.is_empty() {
        errors.push(format!(
            "no NVIDIA container runtime config found on the node ({} do not exist)",
            paths.toolkit_configs.join(" and ")
        ));
    }
    let mut missing_cdi = Vec::new();
    for dir in CDI_DIRS {
        match nvidia_cdi_specs(&under(host_root, dir)) {
            Ok(found) => {
                status.cdi_enabled |= found.any;
                errors.extend(
                    found
                        .unreadable
                        .into_iter()
                        .map(|(name, e)| format!("{dir}/{name}: {e}")),
                );
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => missing_cdi.push(*dir),
            Err(e) => errors.push(format!("{dir}: {e}")),
        }
    }
    match missing_cdi.as_slice() {
        [] => {}
        [one] => errors.push(format!("{one} does not exist")),
        many => errors.push(format!("{} do not exist", many.join(" and "))),
    }
    if !errors.is_empty() {
        status.error = Some(errors.join("; "));
    }
    crate::posture::fill(&mut status, host_root, paths, configured_mode.as_deref());
    status
}

/// What one CDI spec directory holds.
#[derive(Debug, Default)]
struct CdiSpecs {
    /// A spec for an NVIDIA device kind is there.
    any: bool,
    /// Spec files that could not be read, by name.
    unreadable: Vec<(String, std::io::Error)>,
}

/// The NVIDIA CDI specs in `dir`. A spec file the reader may not open (the CDI library writes
/// some with mode 0600) counts as NVIDIA's when its name says so, as CDI's naming convention
/// has it (`nvidia.yaml`, `k8s.device-plugin.nvidia.com-gpu.json`).
fn nvidia_cdi_specs(dir: &Path) -> std::io::Result<CdiSpecs> {
    let mut out = CdiSpecs::default();
    for entry in std::fs::read_dir(dir)?.flatten() {
        let path = entry.path();
        let is_spec = path
            .extension()
            .is_some_and(|e| e == "yaml" || e == "yml" || e == "json");
        if !is_spec
            || !entry
                .metadata()
                .is_ok_and(|m| m.is_file() && m.len() <= MAX_CDI_FILE)
        {
            continue;
        }
        let name = entry.file_name().to_string_lossy().into_owned();
        match std::fs::read_to_string(&path) {
            Ok(t) => {
                out.any |= t.lines().any(|l| {
                    let l = l.trim_start().trim_start_matches('"');
                    l.starts_with("kind") && l.contains("nvidia.com/")
                }) || t.contains("\"kind\":\"nvidia.com/");
            }
            Err(e) => {
                out.any |= name.to_ascii_lowercase().contains("nvidia");
                out.unreadable.push((name, e));
            }
        }
    }
    Ok(out)
}

/// Writes `status` to `path` so that a reader never sees half of it: a temporary file beside
/// it, renamed over it.
pub fn write_report(path: &Path, status: &RuntimeStatus) -> Result<(), ReportError> {
    let err = |source| ReportError::Write {
        path: path.display().to_string(),
        source,
    };
    let body = serde_json::to_vec(status).map_err(|e| err(std::io::Error::other(e)))?;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    std::fs::write(&tmp, body).map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)
}

/// Reads the report [`report_loop`] writes.
pub fn read_report(path: &Path) -> Result<RuntimeStatus, ReportError> {
    let text = std::fs::read(path).map_err(|source| ReportError::Read {
        path: path.display().to_string(),
        source,
    })?;
    serde_json::from_slice(&text).map_err(|source| ReportError::Invalid {
        path: path.display().to_string(),
        source,
    })
}

/// The runtime status the agent reports from `path`: the report, or, when it cannot be
/// read, a status whose `error` says why (the condition is then Unknown and names it).
pub fn status_from_report(path: &Path) -> Result<RuntimeStatus, Box<RuntimeStatus>> {
    read_report(path).map_err(|e| {
        Box::new(RuntimeStatus {
            error: Some(match &e {
                ReportError::Read { source, .. }
                    if source.kind() == std::io::ErrorKind::NotFound =>
                {
                    format!(
                        "the runtime report {} has not been written yet (the runtime-report \
                     container of the node agent's pod writes it)",
                        path.display()
                    )
                }
                other => gpuwarden_crds::error_chain(other),
            }),
            ..RuntimeStatus::default()
        })
    })
}

/// For probes: the report exists and was written less than `max_age` ago.
pub fn check_report(path: &Path, max_age: Duration) -> Result<(), ReportError> {
    let modified = std::fs::metadata(path)
        .and_then(|m| m.modified())
        .map_err(|source| ReportError::Read {
            path: path.display().to_string(),
            source,
        })?;
    let age = modified.elapsed().unwrap_or_default();
    if age > max_age {
        return Err(ReportError::Stale {
            path: path.display().to_string(),
            age: Duration::from_secs(age.as_secs()),
            limit: max_age,
        });
    }
    Ok(())
}

/// Reads the runtime configuration under `host_root` every `interval` and writes it to
/// `report`, until `shutdown`. A failed write is logged and tried again at the next tick
/// (the probes see the report go stale); what is read is logged when it changes.
pub async fn report_loop(
    host_root: &Path,
    paths: &crate::posture::Paths,
    report: &Path,
    interval: Duration,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(shutdown);
    let mut last: Option<RuntimeStatus> = None;
    loop {
        tokio::select! {
            () = &mut shutdown => return,
            _ = tick.tick() => {}
        }
        let status = read_runtime(host_root, paths);
        if last.as_ref() != Some(&status) {
            info!(
                config = status.config_path.as_deref().unwrap_or("none"),
                accept_env_var_when_unprivileged = ?status.accept_env_var_when_unprivileged,
                cdi = status.cdi_enabled,
                problems = status.error.as_deref().unwrap_or("none"),
                "NVIDIA runtime configuration read"
            );
        }
        match write_report(report, &status) {
            Ok(()) => last = Some(status),
            Err(e) => warn!(error = %gpuwarden_crds::error_chain(&e), "runtime report not written"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_keys_that_matter() {
        let cfg = parse_config(
            r#"
accept-nvidia-visible-devices-envvar-when-unprivileged = false
accept-nvidia-visible-devices-as-volume-mounts = true
disable-require = false

[nvidia-container-cli]
root = "/run/nvidia/driver"

[nvidia-container-runtime]
mode = "cdi"
log-level = "info"
"#,
        )
        .unwrap();
        assert_eq!(cfg.accept_env_var_when_unprivileged, Some(false));
        assert_eq!(cfg.mode.as_deref(), Some("cdi"));
        assert_eq!(cfg.accept_volume_mounts, Some(true));

        assert_eq!(parse_config("").unwrap(), RuntimeConfig::default());
        let err = parse_config("accept-nvidia-visible-devices-envvar-when-unprivileged = \"no\"")
            .unwrap_err()
            .to_string();
        assert!(err.contains("not a boolean"), "{err}");
        assert!(parse_config("this is [not toml").is_err());
    }

    #[test]
    fn reads_host_root_with_defaults_and_cdi() {
        let root = tempfile::tempdir().unwrap();
        let status = read_runtime(root.path(), &crate::posture::Paths::default());
        assert!(status.config_path.is_none());
        assert!(!status.cdi_enabled);
        // Nothing there at all: each missing path named as on the host, and nothing created.
        assert_eq!(
            status.error.as_deref(),
            Some(
                "no NVIDIA container runtime config found on the node \
                 (/etc/nvidia-container-runtime/config.toml and \
                 /usr/local/nvidia/toolkit/.config/nvidia-container-runtime/config.toml do not \
                 exist); /etc/cdi and /var/run/cdi do not exist"
            )
        );
        assert_eq!(std::fs::read_dir(root.path()).unwrap().count(), 0);

        let etc = root.path().join("etc/nvidia-container-runtime");
        std::fs::create_dir_all(&etc).unwrap();
        std::fs::write(etc.join("config.toml"), "[nvidia-container-runtime]\n").unwrap();
        let cdi = root.path().join("var/run/cdi");
        std::fs::create_dir_all(&cdi).unwrap();
        std::fs::write(
            cdi.join("nvidia.yaml"),
            "cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices: []\n",
        )
        .unwrap();
        let status = read_runtime(root.path(), &crate::posture::Paths::default());
        assert_eq!(
            status.config_path.as_deref(),
            Some("/etc/nvidia-container-runtime/config.toml")
        );
        // Absent key: NVIDIA's default, which leaks GPUs by environment variable.
        assert_eq!(status.accept_env_var_when_unprivileged, Some(true));
        assert!(status.env_var_leak());
        assert_eq!(status.mode.as_deref(), Some("auto"));
        assert!(status.cdi_enabled);
        // /etc/cdi is missing, and said to be.
        assert_eq!(status.error.as_deref(), Some("/etc/cdi does not exist"));

        std::fs::create_dir_all(root.path().join("etc/cdi")).unwrap();
        assert_eq!(
            read_runtime(root.path(), &crate::posture::Paths::default()).error,
            None
        );
    }

    /// The GPU Operator's toolkit puts its config under /usr/local/nvidia; a node with only
    /// that and no CDI directories reports the config, and the directories as missing.
    #[test]
    fn reads_the_gpu_operator_toolkit_config_with_cdi_directories_missing() {
        let root = tempfile::tempdir().unwrap();
        let dir = root
            .path()
            .join("usr/local/nvidia/toolkit/.config/nvidia-container-runtime");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("config.toml"),
            "accept-nvidia-visible-devices-envvar-when-unprivileged = false\n",
        )
        .unwrap();
        let status = read_runtime(root.path(), &crate::posture::Paths::default());
        assert_eq!(status.config_path.as_deref(), Some(CONFIG_PATHS[1]));
        assert_eq!(status.accept_env_var_when_unprivileged, Some(false));
        assert!(!status.cdi_enabled);
        assert_eq!(
            status.error.as_deref(),
            Some("/etc/cdi and /var/run/cdi do not exist")
        );
    }

    /// A spec file the reader cannot read (in the pod: one the CDI library wrote with mode
    /// 0600; here, as any user: one that is not text) still counts when its name is NVIDIA's,
    /// and is named; one that is not NVIDIA's by name does not count.
    #[test]
    fn an_unreadable_nvidia_spec_counts_by_its_name() {
        let root = tempfile::tempdir().unwrap();
        let cdi = root.path().join("var/run/cdi");
        std::fs::create_dir_all(&cdi).unwrap();
        std::fs::write(cdi.join("vendor.example.com-nic.json"), [0xff, 0xfe]).unwrap();
        let status = read_runtime(root.path(), &crate::posture::Paths::default());
        assert!(!status.cdi_enabled);
        std::fs::write(
            cdi.join("k8s.device-plugin.nvidia.com-gpu.json"),
            [0xff, 0xfe],
        )
        .unwrap();
        let status = read_runtime(root.path(), &crate::posture::Paths::default());
        assert!(status.cdi_enabled);
        let error = status.error.unwrap();
        assert!(
            error.contains("/var/run/cdi/k8s.device-plugin.nvidia.com-gpu.json: ")
                && error.contains("/var/run/cdi/vendor.example.com-nic.json: "),
            "{error}"
        );
    }

    #[test]
    fn the_report_carries_the_status_and_says_when_it_is_missing_or_stale() {
        let dir = tempfile::tempdir().unwrap();
        let report = dir.path().join("runtime.json");
        let missing = status_from_report(&report).unwrap_err();
        assert!(
            missing
                .error
                .as_deref()
                .is_some_and(|e| e.contains("has not been written yet")),
            "{missing:?}"
        );
        assert!(check_report(&report, Duration::from_secs(60)).is_err());

        let status = RuntimeStatus {
            config_path: Some(CONFIG_PATHS[0].to_owned()),
            accept_env_var_when_unprivileged: Some(false),
            mode: Some("cdi".to_owned()),
            device_list_strategy: None,
            cdi_enabled: true,
            error: Some("/etc/cdi does not exist".to_owned()),
            ..Default::default()
        };
        write_report(&report, &status).unwrap();
        assert_eq!(status_from_report(&report), Ok(status));
        check_report(&report, Duration::from_secs(60)).unwrap();
        // No temporary file left beside it.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
        std::thread::sleep(Duration::from_millis(1100));
        let stale = check_report(&report, Duration::from_secs(1)).unwrap_err();
        assert!(matches!(stale, ReportError::Stale { .. }), "{stale}");

        std::fs::write(&report, "not json").unwrap();
        let invalid = status_from_report(&report).unwrap_err();
        assert!(
            invalid
                .error
                .as_deref()
                .is_some_and(|e| e.contains("is not valid")),
            "{invalid:?}"
        );
    }

    #[tokio::test]
    async fn the_report_loop_writes_what_it_reads_until_shutdown() {
        let root = tempfile::tempdir().unwrap();
        let etc = root.path().join("etc/nvidia-container-runtime");
        std::fs::create_dir_all(&etc).unwrap();
        std::fs::write(etc.join("config.toml"), "").unwrap();
        let out = tempfile::tempdir().unwrap();
        let report = out.path().join("runtime.json");
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = {
            let (root, report) = (root.path().to_owned(), report.clone());
            tokio::spawn(async move {
                report_loop(
                    &root,
                    &crate::posture::Paths::default(),
                    &report,
                    Duration::from_millis(50),
                    async {
                        let _ = rx.await;
                    },
                )
                .await;
            })
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while read_report(&report).is_err() {
            assert!(std::time::Instant::now() < deadline, "no report written");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let status = read_report(&report).unwrap();
        assert_eq!(status.config_path.as_deref(), Some(CONFIG_PATHS[0]));
        assert_eq!(status.accept_env_var_when_unprivileged, Some(true));
        // The admin turns the leak off: the next report says so.
        std::fs::write(
            etc.join("config.toml"),
            "accept-nvidia-visible-devices-envvar-when-unprivileged = false\n",
        )
        .unwrap();
        while read_report(&report)
            .unwrap()
            .accept_env_var_when_unprivileged
            != Some(false)
        {
            assert!(std::time::Instant::now() < deadline, "change not reported");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tx.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("the loop stops on shutdown")
            .unwrap();
    }
}
