//! What the node's NVIDIA container runtime does with unprivileged containers, read (never
//! written) from its `config.toml` and the CDI spec directories under the host root.

use std::path::{Path, PathBuf};

use gpuwarden_crds::RuntimeStatus;

/// Where the NVIDIA container runtime's config lives: the package default, then where the GPU
/// Operator's toolkit installs it.
pub const CONFIG_PATHS: &[&str] = &[
    "/etc/nvidia-container-runtime/config.toml",
    "/usr/local/nvidia/toolkit/.config/nvidia-container-runtime/config.toml",
];
/// Where CDI specs live.
pub const CDI_DIRS: &[&str] = &["/etc/cdi", "/var/run/cdi"];

/// CDI spec files larger than this are not read (they are a few hundred KiB at most).
const MAX_CDI_FILE: u64 = 4 * 1024 * 1024;

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
    Ok(RuntimeConfig {
        accept_env_var_when_unprivileged: boolean(
            "accept-nvidia-visible-devices-envvar-when-unprivileged",
        )?,
        mode,
        accept_volume_mounts: boolean("accept-nvidia-visible-devices-as-volume-mounts")?,
    })
}

fn under(host_root: &Path, path: &str) -> PathBuf {
    host_root.join(path.trim_start_matches('/'))
}

/// Reads the runtime diagnostics under `host_root` (`/` on the host, `/host` in the pod).
/// Problems go into `error`; the rest is still filled in.
pub fn read_runtime(host_root: &Path) -> RuntimeStatus {
    let mut status = RuntimeStatus::default();
    let mut errors = Vec::new();
    for path in CONFIG_PATHS {
        let full = under(host_root, path);
        match std::fs::read_to_string(&full) {
            Ok(text) => {
                status.config_path = Some((*path).to_owned());
                match parse_config(&text) {
                    Ok(cfg) => {
                        // NVIDIA's default when the key is absent is `true`.
                        status.accept_env_var_when_unprivileged =
                            Some(cfg.accept_env_var_when_unprivileged.unwrap_or(true));
                        status.mode = Some(cfg.mode.unwrap_or_else(|| "auto".to_owned()));
                        if cfg.accept_volume_mounts == Some(true) {
                            status.device_list_strategy = Some("volume-mounts".to_owned());
                        }
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
            "no NVIDIA container runtime config found under {} ({})",
            host_root.display(),
            CONFIG_PATHS.join(", ")
        ));
    }
    status.cdi_enabled = CDI_DIRS
        .iter()
        .any(|dir| has_nvidia_cdi_spec(&under(host_root, dir)));
    if !errors.is_empty() {
        status.error = Some(errors.join("; "));
    }
    status
}

/// Whether `dir` holds a CDI spec for an NVIDIA device kind.
fn has_nvidia_cdi_spec(dir: &Path) -> bool {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return false;
    };
    entries.flatten().any(|entry| {
        let path = entry.path();
        let is_spec = path
            .extension()
            .is_some_and(|e| e == "yaml" || e == "yml" || e == "json");
        is_spec
            && entry
                .metadata()
                .is_ok_and(|m| m.is_file() && m.len() <= MAX_CDI_FILE)
            && std::fs::read_to_string(&path).is_ok_and(|t| {
                t.lines().any(|l| {
                    let l = l.trim_start().trim_start_matches('"');
                    l.starts_with("kind") && l.contains("nvidia.com/")
                }) || t.contains("\"kind\":\"nvidia.com/")
            })
    })
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
        let status = read_runtime(root.path());
        assert!(status.config_path.is_none());
        assert!(!status.cdi_enabled);
        assert!(
            status
                .error
                .unwrap()
                .contains("no NVIDIA container runtime config")
        );

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
        let status = read_runtime(root.path());
        assert_eq!(
            status.config_path.as_deref(),
            Some("/etc/nvidia-container-runtime/config.toml")
        );
        // Absent key: NVIDIA's default, which leaks GPUs by environment variable.
        assert_eq!(status.accept_env_var_when_unprivileged, Some(true));
        assert!(status.env_var_leak());
        assert_eq!(status.mode.as_deref(), Some("auto"));
        assert!(status.cdi_enabled);
        assert_eq!(status.error, None);
    }
}
