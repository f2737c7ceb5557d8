//! Which doors the node itself closes (docs/design.md, "Node posture"): the NVIDIA Container
//! Toolkit's version, how the CRI runtime runs it, which CDI kinds its spec directories
//! define and which device-injecting NRI plugins run. Read from files without privilege,
//! as the runtime report is ([`crate::runtime`]); what cannot be read is said, never guessed.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use gpuwarden_crds::{CdiKindStatus, ContainerRuntimeStatus, RuntimeStatus, ToolkitStatus};

use crate::host::under;

/// Where the NVIDIA container runtime's config lives: the package default, then where the GPU
/// Operator's toolkit installs it.
pub const CONFIG_PATHS: &[&str] = &[
    "/etc/nvidia-container-runtime/config.toml",
    "/usr/local/nvidia/toolkit/.config/nvidia-container-runtime/config.toml",
];

/// Where the posture's sources live on a node; the defaults are where packages and the GPU
/// Operator put them. A node laid out otherwise names its own (`--containerd-config`,
/// `--toolkit-config`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Paths {
    /// The NVIDIA runtime's `config.toml`, first found wins.
    pub toolkit_configs: Vec<String>,
    /// containerd's configuration, first found wins (its `imports` are read too).
    pub containerd_configs: Vec<String>,
    /// CRI-O's configuration and its drop-in directory.
    pub crio_configs: Vec<String>,
    /// Where the toolkit's runtime binary may be; the CRI's own `BinaryName` for NVIDIA's
    /// runtime is tried first.
    pub toolkit_binaries: Vec<String>,
    /// The host's sysfs, where the IOMMU groups of the VFIO devices the kubelet advertises
    /// are read ([`crate::vfio`]). Not under the host root: a container's own `/sys` is the
    /// host's device tree.
    pub sysfs_root: PathBuf,
}

impl Paths {
    /// The defaults, after the given toolkit and containerd configs.
    pub fn with_first(toolkit_configs: &[String], containerd_configs: &[String]) -> Self {
        let mut paths = Self::default();
        let first = |given: &[String], defaults: &mut Vec<String>| {
            let mut list = given.to_vec();
            list.extend(defaults.drain(..).filter(|d| !given.contains(d)));
            *defaults = list;
        };
        first(toolkit_configs, &mut paths.toolkit_configs);
        first(containerd_configs, &mut paths.containerd_configs);
        paths
    }
}

impl Default for Paths {
    fn default() -> Self {
        let owned = |list: &[&str]| list.iter().map(|s| s.to_string()).collect();
        Self {
            toolkit_configs: owned(CONFIG_PATHS),
            containerd_configs: owned(&[
                "/etc/containerd/config.toml",
                "/var/lib/rancher/rke2/agent/etc/containerd/config.toml",
                "/var/lib/rancher/k3s/agent/etc/containerd/config.toml",
            ]),
            crio_configs: owned(&["/etc/crio/crio.conf", "/etc/crio/crio.conf.d"]),
            toolkit_binaries: owned(&[
                "/usr/bin/nvidia-container-runtime",
                "/usr/local/nvidia/toolkit/nvidia-container-runtime.real",
                "/usr/local/nvidia/toolkit/nvidia-container-runtime",
            ]),
            sysfs_root: PathBuf::from(crate::vfio::DEFAULT_SYSFS_ROOT),
        }
    }
}

/// The files a containerd `imports` entry names, each with its text or why it could not be
/// read.
type Imported = Vec<(String, Result<String, String>)>;
/// A CRI's posture, or why it is unknown, and the binary its NVIDIA runtime runs.
type CriFound = (Result<ContainerRuntimeStatus, String>, Option<String>);

/// The dpkg status database.
pub const DPKG_STATUS: &str = "/var/lib/dpkg/status";
/// The RPM database directory.
const RPM_DB: &str = "/var/lib/rpm";
/// The packages that carry the runtime, newest name first.
const TOOLKIT_PACKAGES: [&str; 3] = [
    "nvidia-container-toolkit-base",
    "nvidia-container-toolkit",
    "nvidia-container-runtime",
];
/// What NVIDIA's build links into the toolkit's binaries, before their version.
const VERSION_MARKER: &[u8] = b"nvidia-container-toolkit/internal/info.version=";
/// Binaries are scanned up to this many bytes.
const MAX_BINARY: u64 = 256 * 1024 * 1024;
/// A dpkg database larger than this is not read (a busy host's is a few MiB; the reader's
/// memory limit is 64 MiB).
const MAX_DPKG_STATUS: u64 = 16 * 1024 * 1024;
/// containerd's files larger than this are not read.
const MAX_CONFIG: u64 = 1024 * 1024;

/// The version of the toolkit installed on the node: from the dpkg database, else from the
/// build flags in its runtime binary (`binaries`, in order). `Err` says why none was found.
pub fn toolkit_version(host_root: &Path, binaries: &[String]) -> Result<ToolkitStatus, String> {
    let mut why = Vec::new();
    match read_limited(&under(host_root, DPKG_STATUS), MAX_DPKG_STATUS) {
        Ok(text) => match dpkg_version(&String::from_utf8_lossy(&text)) {
            Some((package, version)) => {
                return Ok(ToolkitStatus {
                    version,
                    source: format!("package {package} in {DPKG_STATUS}"),
                });
            }
            None => why.push(format!(
                "{DPKG_STATUS} lists no installed NVIDIA toolkit package"
            )),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => why.push(format!("{DPKG_STATUS}: {e}")),
    }
    if under(host_root, RPM_DB).is_dir() {
        why.push(format!(
            "the RPM database in {RPM_DB} is not read (its format is not one the agent parses)"
        ));
    }
    for binary in binaries {
        let path = under(host_root, binary);
        match binary_version(&path) {
            Ok(Some(version)) => {
                return Ok(ToolkitStatus {
                    version,
                    source: format!("build flags of {binary}"),
                });
            }
            Ok(None) => why.push(format!("{binary} carries no toolkit version")),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => why.push(format!("{binary}: {e}")),
        }
    }
    if why.is_empty() {
        why.push(format!(
            "no toolkit package in {DPKG_STATUS} and no runtime binary at {}",
            binaries.join(", ")
        ));
    }
    Err(why.join("; "))
}

/// The installed toolkit package and its version in a dpkg status database.
pub fn dpkg_version(status: &str) -> Option<(String, String)> {
    let mut found: BTreeMap<usize, (String, String)> = BTreeMap::new();
    for paragraph in status.split("\n\n") {
        let field = |name: &str| {
            (paragraph.lines())
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
                .map(str::trim)
        };
        let Some(package) = field("Package") else {
            continue;
        };
        let Some(rank) = TOOLKIT_PACKAGES.iter().position(|p| *p == package) else {
            continue;
        };
        let installed = field("Status").is_some_and(|s| s.ends_with(" installed"));
        if let (true, Some(version)) = (installed, field("Version")) {
            found.insert(rank, (package.to_owned(), version.to_owned()));
        }
    }
    found.into_values().next()
}

/// The version NVIDIA's build linked into a toolkit binary (`-X .../info.version=1.18.2`),
/// read without running it, a chunk at a time (the reader's memory is small; the binary is
/// not).
pub fn binary_version(path: &Path) -> std::io::Result<Option<String>> {
    const CHUNK: usize = 1024 * 1024;
    // What a chunk keeps of the one before: a marker and a version cut at the seam.
    const CARRY: usize = VERSION_MARKER.len() + 64;
    let file = std::fs::File::open(path)?;
    let mut file = file.take(MAX_BINARY);
    let mut window: Vec<u8> = Vec::with_capacity(CHUNK + CARRY);
    let mut chunk = vec![0u8; CHUNK];
    loop {
        let n = file.read(&mut chunk)?;
        window.extend_from_slice(&chunk[..n]);
        if let Some(version) = version_after_marker(&window) {
            // A version at the very end may go on in the next chunk.
            if n == 0 || !window.ends_with(version.as_bytes()) {
                return Ok(Some(version));
            }
        }
        if n == 0 {
            return Ok(None);
        }
        let keep = window.len().saturating_sub(CARRY);
        window.drain(..keep);
    }
}

fn version_after_marker(bytes: &[u8]) -> Option<String> {
    let at = (bytes.windows(VERSION_MARKER.len())).position(|w| w == VERSION_MARKER)?;
    let rest = &bytes[at + VERSION_MARKER.len()..];
    let end = (rest.iter())
        .position(|b| !(b.is_ascii_alphanumeric() || b"._+~-".contains(b)))
        .unwrap_or(rest.len())
        .min(64);
    let version = std::str::from_utf8(&rest[..end]).ok()?;
    (!version.is_empty()).then(|| version.to_owned())
}

fn read_limited(path: &Path, limit: u64) -> std::io::Result<Vec<u8>> {
    let file = std::fs::File::open(path)?;
    let len = file.metadata()?.len();
    if len > limit {
        return Err(std::io::Error::other(format!(
            "larger than {limit} bytes ({len})"
        )));
    }
    let mut out = Vec::with_capacity(usize::try_from(len).unwrap_or(0));
    file.take(limit).read_to_end(&mut out)?;
    Ok(out)
}

/// The CRI runtime's posture, and the binary its NVIDIA runtime runs (for the toolkit's
/// version), from containerd's configuration or, failing that, CRI-O's.
pub fn container_runtime(host_root: &Path, paths: &Paths) -> CriFound {
    let mut why = Vec::new();
    for config in &paths.containerd_configs {
        match read_limited(&under(host_root, config), MAX_CONFIG) {
            Ok(text) => {
                let text = String::from_utf8_lossy(&text);
                let imports = |pattern: &str| read_imports(host_root, pattern);
                return match containerd(&text, config, &imports) {
                    Ok((status, binary)) => (Ok(status), binary),
                    Err(e) => (Err(format!("{config}: {e}")), None),
                };
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => why.push(format!("{config}: {e}")),
        }
    }
    match crio(host_root, &paths.crio_configs) {
        Ok(Some(found)) => return found,
        Ok(None) => {}
        Err(e) => why.push(e),
    }
    if why.is_empty() {
        why.push(format!(
            "no CRI configuration found ({} do not exist)",
            (paths.containerd_configs.iter())
                .chain(&paths.crio_configs)
                .cloned()
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    (Err(why.join("; ")), None)
}

/// The files a containerd `imports` entry names (a path or a `*` glob in one directory),
/// with their text.
fn read_imports(host_root: &Path, pattern: &str) -> Imported {
    let read = |path: &str| {
        read_limited(&under(host_root, path), MAX_CONFIG)
            .map(|t| String::from_utf8_lossy(&t).into_owned())
            .map_err(|e| e.to_string())
    };
    let Some((dir, file)) = pattern.rsplit_once('/') else {
        return vec![(pattern.to_owned(), read(pattern))];
    };
    let Some((prefix, suffix)) = file.split_once('*') else {
        return vec![(pattern.to_owned(), read(pattern))];
    };
    let Ok(entries) = std::fs::read_dir(under(host_root, dir)) else {
        return Vec::new();
    };
    let mut names: Vec<String> = (entries.flatten())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(prefix) && n.ends_with(suffix))
        .collect();
    names.sort();
    (names.into_iter())
        .map(|n| {
            let path = format!("{dir}/{n}");
            let text = read(&path);
            (path, text)
        })
        .collect()
}

/// Merges `from` into `into`, tables key by key, later values winning, as containerd merges
/// its imports.
fn merge(into: &mut toml::Table, from: toml::Table) {
    for (key, value) in from {
        match (into.get_mut(&key), value) {
            (Some(toml::Value::Table(a)), toml::Value::Table(b)) => merge(a, b),
            (_, value) => {
                into.insert(key, value);
            }
        }
    }
}

/// containerd's posture from its configuration (`text`, read from `path`) and its imports.
/// Version 2 (containerd 1.x) keeps the CRI under `io.containerd.grpc.v1.cri`, CDI off and
/// NRI off unless enabled; version 3 (2.x) under `io.containerd.cri.v1.runtime`, CDI and
/// NRI on unless disabled.
pub fn containerd(
    text: &str,
    path: &str,
    imports: &dyn Fn(&str) -> Imported,
) -> Result<(ContainerRuntimeStatus, Option<String>), String> {
    let mut table: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| format!("invalid TOML: {}", e.message()))?;
    let patterns: Vec<String> = (table.get("imports").and_then(toml::Value::as_array))
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_str().map(str::to_owned))
        .collect();
    for pattern in patterns {
        for (file, text) in imports(&pattern) {
            let text = text.map_err(|e| format!("import {file}: {e}"))?;
            let imported: toml::Table = text.parse().map_err(|e: toml::de::Error| {
                format!("import {file}: invalid TOML: {}", e.message())
            })?;
            merge(&mut table, imported);
        }
    }
    let version = table
        .get("version")
        .and_then(toml::Value::as_integer)
        .unwrap_or(1);
    let plugins = table.get("plugins").and_then(toml::Value::as_table);
    let plugin = |name: &str| {
        plugins
            .and_then(|p| p.get(name))
            .and_then(toml::Value::as_table)
    };
    let (cri, cdi_default, nri_default) = match version {
        3 => (plugin("io.containerd.cri.v1.runtime"), true, true),
        _ => (plugin("io.containerd.grpc.v1.cri"), false, false),
    };
    let runtimes = cri
        .and_then(|c| c.get("containerd"))
        .and_then(toml::Value::as_table);
    let default_runtime = (runtimes.and_then(|r| r.get("default_runtime_name")))
        .and_then(toml::Value::as_str)
        .unwrap_or("runc")
        .to_owned();
    let (nvidia_handlers, nvidia_binary) = nvidia_runtimes(
        runtimes.and_then(|r| r.get("runtimes")),
        &default_runtime,
        |entry| entry.get("options")?.get("BinaryName")?.as_str(),
    );
    let nvidia_default = nvidia_handlers.contains(&default_runtime);
    let cdi_enabled = (cri.and_then(|c| c.get("enable_cdi")))
        .and_then(toml::Value::as_bool)
        .unwrap_or(cdi_default);
    let nri_enabled = match plugin("io.containerd.nri.v1.nri") {
        Some(nri) => !nri
            .get("disable")
            .and_then(toml::Value::as_bool)
            .unwrap_or(!nri_default),
        None => nri_default,
    };
    Ok((
        ContainerRuntimeStatus {
            name: "containerd".into(),
            config_path: path.to_owned(),
            default_runtime: Some(default_runtime),
            nvidia_default: Some(nvidia_default),
            nvidia_handlers,
            cdi_enabled: Some(cdi_enabled),
            nri_enabled: Some(nri_enabled),
        },
        nvidia_binary,
    ))
}

/// CRI-O's posture from `crio.conf` and its drop-in directory (later files win). CRI-O
/// injects CDI devices always; NRI is on from 1.30.
fn crio(host_root: &Path, configs: &[String]) -> Result<Option<CriFound>, String> {
    let mut files = Vec::new();
    for config in configs {
        let full = under(host_root, config);
        if full.is_dir() {
            let mut names: Vec<PathBuf> = (std::fs::read_dir(&full)
                .map_err(|e| format!("{config}: {e}"))?)
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "conf"))
            .collect();
            names.sort();
            files.extend(names.into_iter().map(|p| {
                let name = p
                    .file_name()
                    .unwrap_or_default()
                    .to_string_lossy()
                    .into_owned();
                (format!("{config}/{name}"), p)
            }));
        } else if full.is_file() {
            files.push((config.clone(), full));
        }
    }
    if files.is_empty() {
        return Ok(None);
    }
    let mut table = toml::Table::new();
    for (shown, path) in &files {
        let text = read_limited(path, MAX_CONFIG).map_err(|e| format!("{shown}: {e}"))?;
        let parsed: toml::Table = (String::from_utf8_lossy(&text).parse())
            .map_err(|e: toml::de::Error| format!("{shown}: invalid TOML: {}", e.message()))?;
        merge(&mut table, parsed);
    }
    let crio = table.get("crio").and_then(toml::Value::as_table);
    let runtime = crio
        .and_then(|c| c.get("runtime"))
        .and_then(toml::Value::as_table);
    let default_runtime = (runtime.and_then(|r| r.get("default_runtime")))
        .and_then(toml::Value::as_str)
        .unwrap_or("crun")
        .to_owned();
    let (nvidia_handlers, nvidia_binary) = nvidia_runtimes(
        runtime.and_then(|r| r.get("runtimes")),
        &default_runtime,
        |entry| entry.get("runtime_path")?.as_str(),
    );
    let nri_enabled = (crio.and_then(|c| c.get("nri")))
        .and_then(|n| n.get("enable_nri"))
        .and_then(toml::Value::as_bool);
    Ok(Some((
        Ok(ContainerRuntimeStatus {
            name: "cri-o".into(),
            config_path: files[0].0.clone(),
            nvidia_default: Some(nvidia_handlers.contains(&default_runtime)),
            nvidia_handlers,
            default_runtime: Some(default_runtime),
            cdi_enabled: Some(true),
            nri_enabled,
        }),
        nvidia_binary,
    )))
}

/// Which handlers of a CRI's `runtimes` table run NVIDIA's runtime (`binary` reads the
/// binary an entry runs), the default first, at most 8; and the binary of the first.
fn nvidia_runtimes(
    runtimes: Option<&toml::Value>,
    default: &str,
    binary: impl Fn(&toml::Value) -> Option<&str>,
) -> (Vec<String>, Option<String>) {
    let mut found: Vec<(&String, &str)> = (runtimes.and_then(toml::Value::as_table))
        .into_iter()
        .flatten()
        .filter_map(|(handler, entry)| Some((handler, binary(entry)?)))
        .filter(|(_, binary)| binary.contains("nvidia-container-runtime"))
        .collect();
    found.sort_by_key(|(h, _)| (h.as_str() != default, h.as_str()));
    found.truncate(8);
    let first = found.first().map(|(_, b)| (*b).to_owned());
    (found.into_iter().map(|(h, _)| h.clone()).collect(), first)
}

/// The binaries to read the toolkit's version from: the CRI's NVIDIA runtime binary (and,
/// where that is a wrapper, the runtime beside it), then the usual places.
pub fn binaries(nvidia_binary: Option<&str>, paths: &Paths) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(binary) = nvidia_binary {
        out.push(binary.to_owned());
        out.push(format!("{binary}.real"));
        if let Some((dir, _)) = binary.rsplit_once('/') {
            out.push(format!("{dir}/nvidia-container-runtime"));
        }
    }
    for b in &paths.toolkit_binaries {
        if !out.contains(b) {
            out.push(b.clone());
        }
    }
    out.dedup();
    out
}

/// The CDI kinds in the spec directories, with what could not be read.
pub fn cdi_kinds(host_root: &Path) -> (Vec<CdiKindStatus>, Vec<String>) {
    let mut kinds: BTreeMap<String, (u32, u32)> = BTreeMap::new();
    let mut problems = Vec::new();
    for dir in crate::cdi::CDI_DIRS {
        match crate::cdi::census(&under(host_root, dir)) {
            Ok(census) => {
                for (kind, (devices, files)) in census.kinds {
                    let entry = kinds.entry(kind).or_default();
                    entry.0 = entry.0.saturating_add(devices);
                    entry.1 = entry.1.saturating_add(files);
                }
                if !census.unreadable.is_empty() {
                    problems.push(format!(
                        "{} spec files in {dir} could not be read ({}: {}); DRA drivers write \
                         theirs mode 0600, and the node agent reads those for the claims",
                        census.unreadable.len(),
                        census.unreadable[0].0,
                        census.unreadable[0].1
                    ));
                }
                problems
                    .extend((census.invalid.iter()).map(|(name, e)| format!("{dir}/{name}: {e}")));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => problems.push(format!("{dir}: {e}")),
        }
    }
    let list = (kinds.into_iter())
        .map(|(kind, (devices, files))| CdiKindStatus {
            kind,
            devices,
            files,
        })
        .collect();
    (list, problems)
}

/// NRI plugins known to inject devices that pod annotations name: containerd/nri's
/// `device-injector` (the `devices.noderesource.dev` and `devices.nri.io` keys) and GKE's.
/// `text` is an image reference or a process's command line.
pub fn is_device_injector(text: &str) -> bool {
    let lower = text.to_ascii_lowercase();
    lower.contains("device-injector") || lower.contains("device_injector")
}

/// The device-injecting NRI plugins running as host processes, where the host's `/proc` is
/// visible under `host_root`; `Err` where it is not.
pub fn injector_processes(host_root: &Path) -> Result<Vec<String>, String> {
    let proc = under(host_root, "/proc");
    if !proc.join("1").is_dir() {
        return Err(
            "host processes are not visible to the agent (the host-pid component shows them); pods are judged from the API"
                .into(),
        );
    }
    let mut found = Vec::new();
    for entry in std::fs::read_dir(&proc)
        .map_err(|e| format!("/proc: {e}"))?
        .flatten()
    {
        let name = entry.file_name();
        if !name.to_string_lossy().bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let argv0 = cmdline.split(|b| *b == 0).next().unwrap_or_default();
        let argv0 = String::from_utf8_lossy(argv0);
        if is_device_injector(&argv0) {
            let shown = format!("process {argv0}");
            if !found.contains(&shown) {
                found.push(shown);
            }
        }
    }
    found.sort();
    Ok(found)
}

/// Fills the posture fields of `status`, read under `host_root` from `paths`. `configured_mode`
/// is the toolkit config's `nvidia-container-runtime.mode`, if one was read.
pub fn fill(
    status: &mut RuntimeStatus,
    host_root: &Path,
    paths: &Paths,
    configured_mode: Option<&str>,
) {
    let mut unknown = Vec::new();
    let (cri, nvidia_binary) = container_runtime(host_root, paths);
    match cri {
        Ok(cri) => status.container_runtime = Some(cri),
        Err(why) => unknown.push(("containerRuntime", why)),
    }
    let toolkit = toolkit_version(host_root, &binaries(nvidia_binary.as_deref(), paths));
    match toolkit {
        Ok(toolkit) => status.toolkit = Some(toolkit),
        Err(why) => unknown.push(("toolkit", why)),
    }
    let version =
        (status.toolkit.as_ref()).and_then(|t| gpuwarden_crds::toolkit::Version::parse(&t.version));
    status.resolved_mode =
        gpuwarden_crds::toolkit::resolved_mode(configured_mode, version.as_ref());
    if status.resolved_mode.is_none() && status.config_path.is_some() {
        unknown.push((
            "resolvedMode",
            "mode auto resolves by the toolkit's version, which is unknown".into(),
        ));
    }
    let (kinds, problems) = cdi_kinds(host_root);
    status.cdi_kinds = kinds;
    if !problems.is_empty() {
        unknown.push(("cdiKinds", problems.join("; ")));
    }
    match injector_processes(host_root) {
        Ok(found) => status.device_injectors = found,
        Err(why) => unknown.push(("deviceInjectors", why)),
    }
    status.unknown = (unknown.into_iter())
        .map(|(field, reason)| gpuwarden_crds::UnknownField {
            field: field.into(),
            reason,
        })
        .collect();
}

/// The GPU Operator's toolkit image (`nvcr.io/nvidia/k8s/container-toolkit:v1.17.8-ubuntu20.04`).
const TOOLKIT_IMAGE: &str = "/container-toolkit:";

/// What the pods on the node add to what the host's files say: the version of the GPU
/// Operator's toolkit, read from the image tag of its pod where the host told none, and
/// device-injecting NRI plugins that run as pods. Only a pod whose privilege the policy
/// exempts counts for the version, as a tenant may name an image anything; an injector is
/// listed whoever runs it, which can only make the node look more open.
pub fn from_pods(status: &mut RuntimeStatus, pods: &[crate::pods::PodInfo]) {
    if status.toolkit.is_none() {
        let found = (pods.iter().filter(|p| p.exempt.is_some()))
            .flat_map(|p| p.containers.iter().map(move |c| (p, c)))
            .find_map(|(p, c)| {
                let (_, tag) = c.image.split_once(TOOLKIT_IMAGE)?;
                let tag = tag.split('@').next().unwrap_or(tag);
                gpuwarden_crds::toolkit::Version::parse(tag)?;
                Some(ToolkitStatus {
                    version: tag.to_owned(),
                    source: format!(
                        "image of the GPU Operator's toolkit pod {}/{}",
                        p.namespace, p.name
                    ),
                })
            });
        if let Some(toolkit) = found {
            let version = gpuwarden_crds::toolkit::Version::parse(&toolkit.version);
            status.toolkit = Some(toolkit);
            if status.config_path.is_some() {
                status.resolved_mode = gpuwarden_crds::toolkit::resolved_mode(
                    status.mode.as_deref(),
                    version.as_ref(),
                );
            }
            status
                .unknown
                .retain(|u| u.field != "toolkit" && u.field != "resolvedMode");
        }
    }
    let pods_injecting = (pods.iter())
        .filter(|p| p.containers.iter().any(|c| is_device_injector(&c.image)))
        .map(|p| format!("pod {}/{}", p.namespace, p.name));
    let mut injectors: Vec<String> = status
        .device_injectors
        .drain(..)
        .chain(pods_injecting)
        .collect();
    injectors.sort();
    injectors.dedup();
    injectors.truncate(16);
    status.device_injectors = injectors;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_installed_toolkit_package_is_read_from_dpkg() {
        let status = "Package: nvidia-container-toolkit\nStatus: install ok installed\nVersion: 1.17.8-1\n\n\
                      Package: nvidia-container-toolkit-base\nStatus: deinstall ok config-files\nVersion: 1.16.1-1\n\n\
                      Package: libc6\nStatus: install ok installed\nVersion: 2.36-9\n";
        assert_eq!(
            dpkg_version(status),
            Some(("nvidia-container-toolkit".into(), "1.17.8-1".into()))
        );
        // The base package, where both are installed, is the runtime's.
        let both = format!(
            "{status}\nPackage: nvidia-container-toolkit-base\nStatus: install ok installed\nVersion: 1.17.8-1\n"
        );
        assert_eq!(
            dpkg_version(&both).unwrap().0,
            "nvidia-container-toolkit-base"
        );
        assert_eq!(
            dpkg_version("Package: libc6\nStatus: install ok installed\n"),
            None
        );
        assert_eq!(dpkg_version(""), None);
    }

    #[test]
    fn a_binarys_version_is_found_across_chunks() {
        let dir = tempfile::tempdir().unwrap();
        for at in [
            0usize,
            1024 * 1024 - 10,
            1024 * 1024 - 50,
            3 * 1024 * 1024 + 7,
        ] {
            let mut bytes = vec![0u8; at];
            bytes.extend_from_slice(VERSION_MARKER);
            bytes.extend_from_slice(b"1.17.8 ");
            bytes.extend(std::iter::repeat_n(0u8, 100));
            let path = dir.path().join(format!("bin-{at}"));
            std::fs::write(&path, &bytes).unwrap();
            assert_eq!(
                binary_version(&path).unwrap().as_deref(),
                Some("1.17.8"),
                "{at}"
            );
        }
        // The version is the file's last bytes.
        let path = dir.path().join("tail");
        let mut bytes = vec![1u8; 1024 * 1024 - VERSION_MARKER.len() - 2];
        bytes.extend_from_slice(VERSION_MARKER);
        bytes.extend_from_slice(b"1.18.2");
        std::fs::write(&path, &bytes).unwrap();
        assert_eq!(binary_version(&path).unwrap().as_deref(), Some("1.18.2"));
        let none = dir.path().join("none");
        std::fs::write(&none, vec![7u8; 2 * 1024 * 1024]).unwrap();
        assert_eq!(binary_version(&none).unwrap(), None);
    }

    #[test]
    fn a_binary_tells_its_version_by_its_build_flags() {
        let mut bytes = vec![0u8; 100];
        bytes.extend_from_slice(b"build\t-ldflags=\"-s -w -X github.com/NVIDIA/nvidia-container-toolkit/internal/info.version=1.18.2 -X x.y=z\"");
        assert_eq!(version_after_marker(&bytes).as_deref(), Some("1.18.2"));
        assert_eq!(version_after_marker(b"no marker here"), None);
        assert_eq!(version_after_marker(VERSION_MARKER), None);
    }

    #[test]
    fn containerd_one_and_two_are_read_with_their_defaults_and_imports() {
        let none = |_: &str| Vec::new();
        // containerd 1.7 as NVIDIA's installer leaves it: nvidia the default, CDI off, NRI
        // off.
        let v2 = r#"
version = 2
[plugins."io.containerd.grpc.v1.cri".containerd]
  default_runtime_name = "nvidia"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia.options]
    BinaryName = "/usr/local/nvidia/toolkit/nvidia-container-runtime"
"#;
        let (status, binary) = containerd(v2, "/etc/containerd/config.toml", &none).unwrap();
        assert_eq!(status.default_runtime.as_deref(), Some("nvidia"));
        assert_eq!(status.nvidia_default, Some(true));
        assert_eq!(
            (status.cdi_enabled, status.nri_enabled),
            (Some(false), Some(false))
        );
        assert_eq!(
            binary.as_deref(),
            Some("/usr/local/nvidia/toolkit/nvidia-container-runtime")
        );
        // containerd 2: CDI and NRI on unless turned off; the GPU Operator's drop-in.
        let v3 = "version = 3\nimports = [\"/etc/containerd/conf.d/*.toml\"]\n";
        let dropin = r#"
version = 3
[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.nvidia.options]
  BinaryName = "/usr/bin/nvidia-container-runtime"
[plugins."io.containerd.nri.v1.nri"]
  disable = true
"#;
        let imports = |pattern: &str| {
            assert_eq!(pattern, "/etc/containerd/conf.d/*.toml");
            vec![(
                "/etc/containerd/conf.d/99-nvidia.toml".to_owned(),
                Ok(dropin.to_owned()),
            )]
        };
        let (status, binary) = containerd(v3, "/etc/containerd/config.toml", &imports).unwrap();
        assert_eq!(status.default_runtime.as_deref(), Some("runc"));
        assert_eq!(status.nvidia_default, Some(false));
        assert_eq!(
            (status.cdi_enabled, status.nri_enabled),
            (Some(true), Some(false))
        );
        assert_eq!(binary.as_deref(), Some("/usr/bin/nvidia-container-runtime"));
        // Bad input is named.
        let err = containerd("version = [", "/etc/containerd/config.toml", &none).unwrap_err();
        assert!(err.starts_with("invalid TOML"), "{err}");
        let broken = |_: &str| {
            vec![(
                "/etc/containerd/conf.d/x.toml".to_owned(),
                Ok("= 1".to_owned()),
            )]
        };
        let err = containerd(v3, "/etc/containerd/config.toml", &broken).unwrap_err();
        assert!(
            err.starts_with("import /etc/containerd/conf.d/x.toml: invalid TOML"),
            "{err}"
        );
    }

    /// A host root with the given files.
    fn host(files: &[(&str, &[u8])]) -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        for (path, body) in files {
            let full = under(root.path(), path);
            std::fs::create_dir_all(full.parent().unwrap()).unwrap();
            std::fs::write(full, body).unwrap();
        }
        root
    }

    #[test]
    fn a_gpu_operator_node_is_read_whole() {
        let mut runtime = b"\x7fELF....".to_vec();
        runtime.extend_from_slice(
            b"-X github.com/NVIDIA/nvidia-container-toolkit/internal/info.version=1.16.1 ",
        );
        let root = host(&[
            (
                "/usr/local/nvidia/toolkit/.config/nvidia-container-runtime/config.toml",
                b"[nvidia-container-runtime]\nmode = \"auto\"\n[features]\nignore-imex-channel-requests = true\n",
            ),
            (
                "/etc/containerd/config.toml",
                b"version = 2\n[plugins.\"io.containerd.grpc.v1.cri\"]\nenable_cdi = true\n[plugins.\"io.containerd.grpc.v1.cri\".containerd]\ndefault_runtime_name = \"nvidia\"\n[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.nvidia.options]\nBinaryName = \"/usr/local/nvidia/toolkit/nvidia-container-runtime\"\n",
            ),
            ("/usr/local/nvidia/toolkit/nvidia-container-runtime", b"#!/bin/sh\nexec nvidia-container-runtime.real \"$@\"\n"),
            ("/usr/local/nvidia/toolkit/nvidia-container-runtime.real", &runtime),
            (
                "/var/run/cdi/nvidia.yaml",
                b"cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices: [{name: '0'}, {name: '1'}, {name: all}]\n",
            ),
            ("/etc/cdi/broken.yaml", b"kind: ["),
        ]);
        let status = crate::runtime::read_runtime(root.path(), &Paths::default());
        let toolkit = status.toolkit.clone().unwrap();
        assert_eq!(toolkit.version, "1.16.1");
        assert_eq!(
            toolkit.source,
            "build flags of /usr/local/nvidia/toolkit/nvidia-container-runtime.real"
        );
        assert_eq!(status.resolved_mode.as_deref(), Some("legacy"));
        assert_eq!(status.ignore_imex_channel_requests, Some(true));
        assert_eq!(status.disable_imex_channel_creation, Some(false));
        assert_eq!(status.accept_volume_mounts, Some(false));
        let cri = status.container_runtime.clone().unwrap();
        assert_eq!(
            (cri.name.as_str(), cri.nvidia_default, cri.cdi_enabled),
            ("containerd", Some(true), Some(true))
        );
        assert_eq!(
            status.cdi_kinds,
            [CdiKindStatus {
                kind: "nvidia.com/gpu".into(),
                devices: 3,
                files: 1
            }]
        );
        let unknown: Vec<(&str, &str)> = (status.unknown.iter())
            .map(|u| (u.field.as_str(), u.reason.as_str()))
            .collect();
        assert!(
            unknown
                .iter()
                .any(|(f, r)| *f == "cdiKinds"
                    && r.starts_with("/etc/cdi/broken.yaml: not a CDI spec")),
            "{unknown:?}"
        );
        assert!(
            unknown.iter().any(|(f, _)| *f == "deviceInjectors"),
            "{unknown:?}"
        );
    }

    #[test]
    fn what_cannot_be_read_is_said_and_never_guessed() {
        let root = host(&[("/var/lib/rpm/rpmdb.sqlite", b"SQLite format 3\0")]);
        let status = crate::runtime::read_runtime(root.path(), &Paths::default());
        assert_eq!(status.toolkit, None);
        assert_eq!(status.resolved_mode, None);
        let why = |field: &str| {
            (status.unknown.iter())
                .find(|u| u.field == field)
                .map(|u| u.reason.clone())
                .unwrap_or_default()
        };
        assert!(
            why("toolkit").contains("the RPM database in /var/lib/rpm is not read"),
            "{}",
            why("toolkit")
        );
        assert!(
            why("containerRuntime").starts_with("no CRI configuration found"),
            "{}",
            why("containerRuntime")
        );

        // A dpkg database that lists no toolkit, and a CRI-O node.
        let root = host(&[
            ("/var/lib/dpkg/status", b"Package: libc6\nStatus: install ok installed\nVersion: 2.36\n"),
            ("/etc/crio/crio.conf", b"[crio.runtime]\ndefault_runtime = \"nvidia\"\n[crio.runtime.runtimes.nvidia]\nruntime_path = \"/usr/bin/nvidia-container-runtime\"\n"),
            ("/etc/crio/crio.conf.d/10-nri.conf", b"[crio.nri]\nenable_nri = true\n"),
        ]);
        let status = crate::runtime::read_runtime(root.path(), &Paths::default());
        let cri = status.container_runtime.clone().unwrap();
        assert_eq!(
            (
                cri.name.as_str(),
                cri.nvidia_default,
                cri.nri_enabled,
                cri.cdi_enabled
            ),
            ("cri-o", Some(true), Some(true), Some(true))
        );
        assert!(
            (status.unknown.iter()).any(|u| u.field == "toolkit"
                && u.reason
                    .contains("/var/lib/dpkg/status lists no installed NVIDIA toolkit package")),
            "{:?}",
            status.unknown
        );
    }

    #[test]
    fn the_gpu_operators_toolkit_pod_tells_the_version_only_when_exempt() {
        use crate::pods::{ContainerInfo, PodInfo};
        let pod = |namespace: &str, name: &str, image: &str, exempt: bool| PodInfo {
            uid: name.into(),
            namespace: namespace.into(),
            name: name.into(),
            exempt: exempt.then(|| "GpuPolicy default: namespace gpu-operator".into()),
            containers: vec![ContainerInfo {
                name: "c".into(),
                image: image.into(),
                ..Default::default()
            }],
            ..Default::default()
        };
        let unknown = || RuntimeStatus {
            config_path: Some(
                "/usr/local/nvidia/toolkit/.config/nvidia-container-runtime/config.toml".into(),
            ),
            mode: Some("auto".into()),
            unknown: vec![gpuwarden_crds::UnknownField {
                field: "toolkit".into(),
                reason: "no package".into(),
            }],
            ..Default::default()
        };
        // A tenant's pod naming a patched toolkit image proves nothing.
        let mut status = unknown();
        let forged = pod(
            "team-a",
            "fake",
            "nvcr.io/nvidia/k8s/container-toolkit:v1.99.0",
            false,
        );
        from_pods(&mut status, std::slice::from_ref(&forged));
        assert_eq!(status.toolkit, None);
        let real = pod(
            "gpu-operator",
            "nvidia-container-toolkit-daemonset-x7k2p",
            "nvcr.io/nvidia/k8s/container-toolkit:v1.17.3-ubuntu20.04",
            true,
        );
        let injector = pod(
            "kube-system",
            "nri-device-injector-abcde",
            "ghcr.io/containerd/nri/plugins/device-injector:v0.8.0",
            false,
        );
        from_pods(&mut status, &[forged, real, injector]);
        let toolkit = status.toolkit.clone().unwrap();
        assert_eq!(toolkit.version, "v1.17.3-ubuntu20.04");
        assert!(
            toolkit
                .source
                .contains("gpu-operator/nvidia-container-toolkit-daemonset-x7k2p")
        );
        assert_eq!(status.resolved_mode.as_deref(), Some("legacy"));
        assert!(status.unknown.is_empty());
        assert_eq!(
            status.device_injectors,
            ["pod kube-system/nri-device-injector-abcde"]
        );
    }
}
