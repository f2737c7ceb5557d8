//! Device-injection annotations (docs/design.md, "Device-injection annotations"): pod
//! annotations that node plugins read to hand a container devices, CDI devices or host mounts
//! around the kubelet. None of these plugins checks privilege, namespace or who wrote the
//! annotation, so each is judged here against what the pod holds:
//!
//! - containerd's NRI device injector (`containerd/nri` `plugins/device-injector`):
//!   `devices.`, `cdi-devices.` and `mounts.` under `noderesource.dev` (or the older
//!   `nri.io`), each as `<domain>/container.<name>`, `<domain>/pod` or the bare `<domain>`;
//!   a device is the host's device of its `major:minor`, whatever its `path`;
//! - GKE's NRI device injector: `devices.gke.io/container.<name>`; a device is the host's
//!   node at its `path`.
//!
//! NVIDIA's own NRI plugin reads `nvidia.cdi.k8s.io` in the same three forms: those are CDI
//! annotations ([`crate::is_cdi_annotation`]), which the rewrite removes.
//!
//! An injection that names NVIDIA devices the pod does not hold is refused at admission
//! ([`judge`]); the node agent checks, on the node, that the GPUs an admitted annotation
//! names are those the kubelet allocated to the pod ([`Injection::gpus`]). What the rules do
//! not judge (another vendor's device, a host mount) is named in a warning.

use std::collections::BTreeSet;
use std::fmt;

use serde::Deserialize;

use crate::RuntimeFeature;

/// A node plugin that reads pod annotations to inject devices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Injector {
    /// containerd's NRI device injector, device nodes by `major:minor`.
    NriDevices,
    /// containerd's NRI device injector, CDI devices by name.
    NriCdiDevices,
    /// containerd's NRI device injector, host bind mounts.
    NriMounts,
    /// GKE's NRI device injector, device nodes by host path.
    GkeDevices,
}

impl Injector {
    /// Who reads the annotation, for messages.
    pub fn plugin(self) -> &'static str {
        match self {
            Self::NriDevices | Self::NriCdiDevices | Self::NriMounts => {
                "containerd's NRI device injector"
            }
            Self::GkeDevices => "GKE's NRI device injector",
        }
    }
}

/// The annotation domains containerd's NRI device injector reads, new and old, each with
/// what it injects. Each is read as `<domain>/container.<name>`, `<domain>/pod` and the bare
/// `<domain>`.
pub const NRI_DOMAINS: [(&str, Injector); 6] = [
    ("devices.noderesource.dev", Injector::NriDevices),
    ("devices.nri.io", Injector::NriDevices),
    ("cdi-devices.noderesource.dev", Injector::NriCdiDevices),
    ("cdi-devices.nri.io", Injector::NriCdiDevices),
    ("mounts.noderesource.dev", Injector::NriMounts),
    ("mounts.nri.io", Injector::NriMounts),
];

/// The annotation prefix of GKE's NRI device injector: `<prefix><container name>` is its only
/// form.
pub const GKE_PREFIX: &str = "devices.gke.io/container.";

/// Which containers of the pod an injection reaches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Target<'a> {
    /// Every container (`/pod` or the bare key).
    Pod,
    /// The container of this name (`/container.<name>`).
    Container(&'a str),
}

impl Target<'_> {
    /// Whether it reaches container `name`.
    pub fn reaches(&self, name: &str) -> bool {
        match self {
            Self::Pod => true,
            Self::Container(c) => *c == name,
        }
    }
}

/// Reads an annotation key: the plugin that reads it and the containers it reaches, or
/// `None` for a key no injector reads.
pub fn injection_key(key: &str) -> Option<(Injector, Target<'_>)> {
    if let Some(name) = key.strip_prefix(GKE_PREFIX) {
        return Some((Injector::GkeDevices, Target::Container(name)));
    }
    NRI_DOMAINS.iter().find_map(|&(domain, injector)| {
        let rest = key.strip_prefix(domain)?;
        let target = match rest {
            "" | "/pod" => Target::Pod,
            _ => Target::Container(rest.strip_prefix("/container.")?),
        };
        Some((injector, target))
    })
}

/// A GPU an injection names.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum GpuName {
    /// The GPU of this device minor number (`/dev/nvidia<N>`, or `195:<N>`).
    Minor(u32),
    /// The GPU a CDI device name names by what follows `=`: an index, a UUID, a MIG device.
    Cdi(String),
    /// A device node path in the value's text whose number is not written as the kernel
    /// writes a minor (`/dev/nvidia00`): a GPU, though which one is not said.
    Text(String),
}

impl fmt::Display for GpuName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Minor(n) => write!(f, "/dev/nvidia{n}"),
            Self::Cdi(id) => write!(f, "GPU {id}"),
            Self::Text(text) => f.write_str(text),
        }
    }
}

/// Something an injection hands a container.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Named {
    /// One GPU.
    Gpu(GpuName),
    /// Every GPU of the node: `nvidia.com/gpu=all`, `management.nvidia.com/...`, a
    /// device-list mount under `/var/run/nvidia-container-devices`.
    AllGpus(String),
    /// An NVIDIA control device a container with a GPU gets anyway: `nvidiactl`,
    /// `nvidia-uvm`, `nvidia-uvm-tools`, `nvidia-modeset`.
    Control(String),
    /// An NVIDIA device no pod's annotation may name: MIG capabilities, IMEX channels,
    /// NVSwitch devices.
    Restricted(String),
    /// A device of a runtime feature (`/dev/gdrdrv`, `/dev/nvidia-fs*`, `/dev/infiniband`).
    Feature(RuntimeFeature, String),
    /// A device these rules do not judge (another vendor's, or a `major:minor` that is not
    /// NVIDIA's fixed major).
    Other(String),
    /// A host mount.
    Mount(String),
}

/// One device-injection annotation, read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Injection<'a> {
    /// The annotation key.
    pub key: &'a str,
    /// Who reads it.
    pub injector: Injector,
    /// Which containers it reaches.
    pub target: Target<'a>,
    /// What it names, in order, each once.
    pub named: Vec<Named>,
    /// Why its value could not be read, if it could not: what the plugin would make of it is
    /// unknown.
    pub unreadable: Option<String>,
}

/// NVIDIA's fixed character-device major (`/dev/nvidia<N>`, `nvidiactl`, `nvidia-modeset`).
pub const NVIDIA_MAJOR: i64 = 195;

/// Reads one annotation: `None` where no injector reads its key.
pub fn read<'a>(key: &'a str, value: &str) -> Option<Injection<'a>> {
    let (injector, target) = injection_key(key)?;
    let mut injection = Injection {
        key,
        injector,
        target,
        named: Vec::new(),
        unreadable: None,
    };
    match parse(injector, value) {
        Ok(named) => injection.named = named,
        Err(why) => injection.unreadable = Some(why),
    }
    // Whatever the structure, the text: a value the plugin reads otherwise than this module
    // still names no fewer NVIDIA devices. The API server's backstop reads the same text.
    for n in text_floor(value) {
        if !injection.named.contains(&n) {
            injection.named.push(n);
        }
    }
    Some(injection)
}

/// Every injection among the pod's annotations (key, string value), in key order.
pub fn read_all<'a>(
    annotations: impl IntoIterator<Item = (&'a str, Option<&'a str>)>,
) -> Vec<Injection<'a>> {
    let mut all: Vec<Injection<'a>> = (annotations.into_iter())
        .filter_map(|(k, v)| read(k, v.unwrap_or("")))
        .collect();
    all.sort_by(|a, b| a.key.cmp(b.key));
    all
}

/// The substrings that, anywhere in an injection's value, name every GPU: a CDI `=all`, a
/// management device, the toolkit's device-list directory. CEL tests the same text.
pub const TEXT_ALL: [&str; 3] = ["=all", "management.nvidia.com", "nvidia-container-devices"];
/// The substrings that, anywhere in an injection's value, name a restricted NVIDIA device.
pub const TEXT_RESTRICTED: [&str; 2] = ["nvidia-caps", "nvidia-nvswitch"];
/// The text of a GPU device node: `/dev/nvidia` followed by its minor number.
pub const TEXT_GPU: &str = "/dev/nvidia";
/// The text of an NVIDIA GPU's CDI name: `nvidia.com/gpu=` followed by its id, up to a
/// blank, a comma, a quote or a `]`.
pub const TEXT_CDI_GPU: &str = "nvidia.com/gpu=";

/// What the value's text names whatever its structure (see [`TEXT_ALL`], [`TEXT_RESTRICTED`],
/// [`TEXT_GPU`], [`TEXT_CDI_GPU`]): each distinct spelling is a GPU, so the text never names
/// fewer than the backstop's CEL counts (`/dev/nvidia0` and `/dev/nvidia00` are two).
fn text_floor(value: &str) -> Vec<Named> {
    let mut named = Vec::new();
    if let Some(t) = TEXT_ALL.iter().find(|t| value.contains(*t)) {
        named.push(Named::AllGpus(format!("text {t}")));
    }
    if let Some(t) = TEXT_RESTRICTED.iter().find(|t| value.contains(*t)) {
        named.push(Named::Restricted(format!("text {t}")));
    }
    let after = |mark: &str, end: &dyn Fn(char) -> bool| -> BTreeSet<String> {
        (value.match_indices(mark))
            .map(|(at, _)| {
                let rest = &value[at + mark.len()..];
                rest[..rest.find(end).unwrap_or(rest.len())].to_owned()
            })
            .filter(|token| !token.is_empty())
            .collect()
    };
    for digits in after(TEXT_GPU, &|c: char| !c.is_ascii_digit()) {
        // A minor number as the kernel writes it is that GPU; another spelling is a GPU too.
        let canonical = (digits.parse::<u32>().ok()).filter(|n| n.to_string() == digits);
        named.push(Named::Gpu(match canonical {
            Some(n) => GpuName::Minor(n),
            None => GpuName::Text(format!("{TEXT_GPU}{digits}")),
        }));
    }
    let cdi_end = |c: char| c.is_ascii_whitespace() || matches!(c, ',' | '\'' | '"' | ']');
    for id in after(TEXT_CDI_GPU, &cdi_end) {
        named.push(Named::Gpu(GpuName::Cdi(id)));
    }
    named
}

/// A device entry of either injector's devices annotation.
#[derive(Deserialize)]
struct DeviceEntry {
    #[serde(default)]
    path: Option<String>,
    #[serde(default)]
    major: Option<serde_json::Value>,
    #[serde(default)]
    minor: Option<serde_json::Value>,
}

/// A mount entry of the NRI injector's mounts annotation.
#[derive(Deserialize)]
struct MountEntry {
    #[serde(default)]
    source: Option<String>,
    #[serde(default)]
    destination: Option<String>,
}

/// Reads a value as the plugin does (YAML, read as sigs.k8s.io/yaml reads it: `0303` is
/// octal), into what it names.
fn parse(injector: Injector, value: &str) -> Result<Vec<Named>, String> {
    let options = serde_saphyr::options! { legacy_octal_numbers: true };
    // The reader's first line says what and where; the rest draws the value again.
    let yaml = |e: serde_saphyr::Error| {
        let e = e.to_string();
        let first = e
            .lines()
            .next()
            .unwrap_or_default()
            .trim_start_matches("error: ");
        format!("not a YAML list the plugin reads: {first}")
    };
    let mut named = Vec::new();
    match injector {
        Injector::NriDevices | Injector::GkeDevices => {
            let entries: Vec<DeviceEntry> =
                serde_saphyr::from_str_with_options(value, options).map_err(yaml)?;
            for entry in entries {
                named.push(device(injector, &entry)?);
            }
        }
        Injector::NriCdiDevices => {
            let names: Vec<String> =
                serde_saphyr::from_str_with_options(value, options).map_err(yaml)?;
            named.extend(names.iter().map(|n| cdi_device(n)));
        }
        Injector::NriMounts => {
            let entries: Vec<MountEntry> =
                serde_saphyr::from_str_with_options(value, options).map_err(yaml)?;
            for m in entries {
                let source = m.source.unwrap_or_default();
                let destination = m.destination.unwrap_or_default();
                named.push(if destination.contains(crate::gpu::DEVICE_LIST_MARK) {
                    Named::AllGpus(format!("a device-list mount at {destination}"))
                } else {
                    Named::Mount(format!("{source} at {destination}"))
                });
            }
        }
    }
    let mut seen = Vec::with_capacity(named.len());
    for n in named {
        if !seen.contains(&n) {
            seen.push(n);
        }
    }
    Ok(seen)
}

/// One device entry: by `major:minor` for the NRI injector (its `path` is only where the
/// node appears in the container), by host `path` for GKE's.
fn device(injector: Injector, entry: &DeviceEntry) -> Result<Named, String> {
    let path = entry.path.as_deref().unwrap_or("");
    if injector == Injector::GkeDevices {
        return Ok(device_path(path));
    }
    let number = |v: &Option<serde_json::Value>, what: &str| match v {
        Some(serde_json::Value::Number(n)) => n
            .as_i64()
            .ok_or_else(|| format!("device {path}: {what} {n} is not a whole number")),
        Some(serde_json::Value::String(s)) => (s.trim().parse::<i64>())
            .map_err(|_| format!("device {path}: {what} {s:?} is not a whole number")),
        None => Err(format!("device {path}: no {what}")),
        Some(other) => Err(format!(
            "device {path}: {what} {other} is not a whole number"
        )),
    };
    let (major, minor) = (
        number(&entry.major, "major")?,
        number(&entry.minor, "minor")?,
    );
    let shown = format!("{path} ({major}:{minor})");
    Ok(match (major, minor) {
        (NVIDIA_MAJOR, 255) | (NVIDIA_MAJOR, 254) => Named::Control(shown),
        (NVIDIA_MAJOR, n) => match u32::try_from(n) {
            Ok(n) => Named::Gpu(GpuName::Minor(n)),
            Err(_) => Named::Restricted(shown),
        },
        _ => Named::Other(shown),
    })
}

/// A host device node by path (cleaned lexically, as the plugin's `lstat` resolves it).
fn device_path(path: &str) -> Named {
    let clean = crate::gpu::cleaned(path);
    let shown = path.to_owned();
    let Some(rest) = clean.strip_prefix("/dev/") else {
        return Named::Other(shown);
    };
    if let Some(n) = rest.strip_prefix("nvidia")
        && !n.is_empty()
        && n.bytes().all(|b| b.is_ascii_digit())
    {
        return match n.parse() {
            Ok(n) => Named::Gpu(GpuName::Minor(n)),
            Err(_) => Named::Restricted(shown),
        };
    }
    match rest {
        "nvidiactl" | "nvidia-uvm" | "nvidia-uvm-tools" | "nvidia-modeset" => Named::Control(shown),
        "gdrdrv" => Named::Feature(RuntimeFeature::Gdrcopy, shown),
        _ if rest.starts_with("nvidia-fs") => Named::Feature(RuntimeFeature::Gds, shown),
        _ if rest == "infiniband" || rest.starts_with("infiniband/") => {
            Named::Feature(RuntimeFeature::Mofed, shown)
        }
        // MIG capabilities, IMEX channels, NVSwitch devices, and any other NVIDIA node.
        _ if rest.starts_with("nvidia") => Named::Restricted(shown),
        _ => Named::Other(shown),
    }
}

/// A CDI device name (`vendor/class=name`): NVIDIA's kinds by what they hand out, another
/// vendor's as [`Named::Other`].
pub fn cdi_device(name: &str) -> Named {
    let shown = name.to_owned();
    let Some((kind, device)) = name.split_once('=') else {
        return Named::Other(shown);
    };
    let (vendor, class) = kind.split_once('/').unwrap_or((kind, ""));
    if vendor != "nvidia.com" && !vendor.ends_with(".nvidia.com") {
        return Named::Other(shown);
    }
    if vendor == "management.nvidia.com" || device == "all" {
        return Named::AllGpus(shown);
    }
    match class {
        "gdrcopy" => Named::Feature(RuntimeFeature::Gdrcopy, shown),
        "gds" => Named::Feature(RuntimeFeature::Gds, shown),
        "mofed" => Named::Feature(RuntimeFeature::Mofed, shown),
        _ if class.contains("imex") || class.contains("nvswitch") || class.contains("caps") => {
            Named::Restricted(shown)
        }
        _ => Named::Gpu(GpuName::Cdi(device.to_owned())),
    }
}

impl Injection<'_> {
    /// The GPUs it names, each once.
    pub fn gpus(&self) -> impl Iterator<Item = &GpuName> {
        self.named.iter().filter_map(|n| match n {
            Named::Gpu(g) => Some(g),
            _ => None,
        })
    }
}

/// An injection the pod does not cover.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Uncovered {
    /// The container it reaches, or `None` for every container.
    pub container: Option<String>,
    /// What it names beyond the pod's GPUs, and what to do.
    pub message: String,
}

impl Uncovered {
    /// Whether it reaches container `name`.
    pub fn reaches(&self, name: &str) -> bool {
        self.container.as_deref().is_none_or(|c| c == name)
    }
}

/// What the rules make of a pod's injections.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Judgement {
    /// Why the pod cannot be admitted as it is: an injection names NVIDIA devices beyond
    /// what the pod holds, or cannot be read. Empty when every injection is covered.
    pub uncovered: Vec<Uncovered>,
    /// What the rules do not judge (another vendor's device, a host mount), one note per
    /// annotation.
    pub notes: Vec<String>,
}

/// Judges the pod's injections against the GPUs it holds (`held`, its containers' GPU
/// limits together) and the runtime features the policy allows: an injection is covered when
/// the distinct GPUs all of them name are no more than the pod holds, it names no NVIDIA
/// device a pod may not name (every GPU, MIG capabilities, IMEX channels, NVSwitch), its
/// control and feature devices come with a GPU the pod holds (and a feature the policy
/// allows), and it can be read. The node agent checks the GPUs themselves on the node.
pub fn judge(injections: &[Injection<'_>], held: u32, features: &[RuntimeFeature]) -> Judgement {
    let mut judgement = Judgement::default();
    let gpus: BTreeSet<&GpuName> = injections.iter().flat_map(Injection::gpus).collect();
    let named = u32::try_from(gpus.len()).unwrap_or(u32::MAX);
    for i in injections {
        let plugin = i.injector.plugin();
        let container = match i.target {
            Target::Pod => None,
            Target::Container(c) => Some(c.to_owned()),
        };
        if let Some(why) = &i.unreadable {
            judgement.uncovered.push(Uncovered {
                container: container.clone(),
                message: format!("annotation {} ({plugin}) cannot be read: {why}", i.key),
            });
        }
        let mut beyond = Vec::new();
        let mut other = Vec::new();
        for n in &i.named {
            match n {
                Named::AllGpus(what) => beyond.push(format!("every GPU ({what})")),
                Named::Restricted(what) => beyond.push(what.clone()),
                Named::Control(what) if held == 0 => beyond.push(what.clone()),
                Named::Feature(f, what) if held == 0 || !features.contains(f) => {
                    beyond.push(format!("{what} (runtime feature {})", f.name()))
                }
                Named::Other(what) | Named::Mount(what) => other.push(what.as_str()),
                _ => {}
            }
        }
        let own: Vec<String> = i.gpus().map(ToString::to_string).collect();
        if named > held && !own.is_empty() {
            beyond.push(format!(
                "{} ({named} GPUs named by the pod's annotations, {held} held by its containers' limits)",
                own.join(", ")
            ));
        }
        if !beyond.is_empty() {
            judgement.uncovered.push(Uncovered { container, message: format!(
                "annotation {} has {plugin} hand {} devices around the kubelet: {}; request GPUs with a resource limit and name no more of them than the pod holds",
                i.key,
                match i.target {
                    Target::Pod => "every container".to_owned(),
                    Target::Container(c) => format!("container {c}"),
                },
                beyond.join(", ")
            )});
        }
        if !other.is_empty() {
            judgement.notes.push(format!(
                "annotation {} has {plugin} hand {} to {}, which gpuwarden does not judge",
                i.key,
                other.join(", "),
                match i.target {
                    Target::Pod => "every container".to_owned(),
                    Target::Container(c) => format!("container {c}"),
                }
            ));
        }
    }
    judgement
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_form_of_each_injector_is_read() {
        for (domain, injector) in NRI_DOMAINS {
            assert_eq!(injection_key(domain), Some((injector, Target::Pod)));
            assert_eq!(
                injection_key(&format!("{domain}/pod")),
                Some((injector, Target::Pod))
            );
            assert_eq!(
                injection_key(&format!("{domain}/container.main")),
                Some((injector, Target::Container("main")))
            );
            assert_eq!(injection_key(&format!("{domain}/other")), None);
            assert_eq!(injection_key(&format!("{domain}.example/pod")), None);
        }
        assert_eq!(
            injection_key("devices.gke.io/container.tcpxo-daemon"),
            Some((Injector::GkeDevices, Target::Container("tcpxo-daemon")))
        );
        assert_eq!(injection_key("devices.gke.io/pod"), None);
        assert_eq!(injection_key("cdi.k8s.io/x"), None);
    }

    #[test]
    fn nri_devices_are_the_hosts_by_major_and_minor() {
        let value = "- path: /dev/not-a-gpu\n  type: c\n  major: 195\n  minor: 3\n- path: /dev/ctl\n  type: c\n  major: 0303\n  minor: 255\n- path: /dev/fuse\n  type: c\n  major: 10\n  minor: 229\n";
        let i = read("devices.noderesource.dev/container.c0", value).unwrap();
        assert_eq!(i.unreadable, None);
        assert_eq!(
            i.named,
            [
                Named::Gpu(GpuName::Minor(3)),
                Named::Control("/dev/ctl (195:255)".into()),
                Named::Other("/dev/fuse (10:229)".into()),
            ]
        );
    }

    #[test]
    fn gke_devices_are_the_hosts_by_path_and_the_text_counts_too() {
        let value = "- path: /dev/nvidia0\n- path: /dev//nvidia1\n- path: /dev/nvidiactl\n- path: /dev/dmabuf_import_helper\n";
        let i = read("devices.gke.io/container.tcpxo-daemon", value).unwrap();
        let gpus: Vec<&GpuName> = i.gpus().collect();
        assert_eq!(gpus, [&GpuName::Minor(0), &GpuName::Minor(1)]);
        assert!(
            i.named
                .contains(&Named::Other("/dev/dmabuf_import_helper".into()))
        );
        // A value the YAML reader refuses still names what its text names.
        let broken = read("devices.gke.io/container.x", "path: [/dev/nvidia7").unwrap();
        assert!(broken.unreadable.is_some());
        assert_eq!(broken.gpus().collect::<Vec<_>>(), [&GpuName::Minor(7)]);
    }

    #[test]
    fn cdi_names_by_kind() {
        assert!(matches!(
            cdi_device("nvidia.com/gpu=all"),
            Named::AllGpus(_)
        ));
        assert!(matches!(
            cdi_device("management.nvidia.com/gpu=0"),
            Named::AllGpus(_)
        ));
        assert_eq!(
            cdi_device("nvidia.com/gpu=GPU-1"),
            Named::Gpu(GpuName::Cdi("GPU-1".into()))
        );
        assert_eq!(
            cdi_device("k8s.gpu.nvidia.com/device=gpu-0"),
            Named::Gpu(GpuName::Cdi("gpu-0".into()))
        );
        assert!(matches!(
            cdi_device("nvidia.com/imex-channel=0"),
            Named::Restricted(_)
        ));
        assert!(matches!(cdi_device("vendor.com/nic=1"), Named::Other(_)));
    }

    #[test]
    fn a_pod_may_name_no_more_gpus_than_it_holds() {
        let tcpxo: String = (0..8)
            .map(|n| format!("- path: /dev/nvidia{n}\n"))
            .chain(["- path: /dev/nvidiactl\n- path: /dev/nvidia-uvm\n- path: /dev/dmabuf_import_helper\n".to_owned()])
            .collect();
        let all = read_all([(
            "devices.gke.io/container.tcpxo-daemon",
            Some(tcpxo.as_str()),
        )]);
        let covered = judge(&all, 8, &[]);
        assert!(covered.uncovered.is_empty(), "{covered:?}");
        assert_eq!(covered.notes.len(), 1);
        assert!(
            covered.notes[0].contains("/dev/dmabuf_import_helper"),
            "{covered:?}"
        );
        let short = judge(&all, 2, &[]);
        assert_eq!(short.uncovered.len(), 1);
        assert!(
            (short.uncovered[0].message).contains("8 GPUs named by the pod's annotations, 2 held"),
            "{short:?}"
        );
        let none = judge(&all, 0, &[]);
        assert!(
            none.uncovered[0].message.contains("/dev/nvidiactl"),
            "{none:?}"
        );
    }

    #[test]
    fn restricted_devices_every_gpu_and_unallowed_features_are_never_covered() {
        for (key, value) in [
            ("cdi-devices.noderesource.dev/pod", "- nvidia.com/gpu=all\n"),
            (
                "devices.gke.io/container.c",
                "- path: /dev/nvidia-caps-imex-channels/channel0\n",
            ),
            (
                "devices.gke.io/container.c",
                "- path: /dev/nvidia-nvswitchctl\n",
            ),
            (
                "mounts.noderesource.dev",
                "- source: /dev/null\n  destination: /var/run/nvidia-container-devices/all\n",
            ),
            (
                "devices.gke.io/container.c",
                "- path: /dev/infiniband/uverbs0\n",
            ),
            ("devices.noderesource.dev", "not: [a list"),
        ] {
            let all = read_all([(key, Some(value))]);
            let j = judge(&all, 8, &[RuntimeFeature::Gdrcopy]);
            assert_eq!(j.uncovered.len(), 1, "{key}: {value}: {j:?}");
            // A denial message is one line, whatever the YAML reader says.
            assert!(!j.uncovered[0].message.contains('\n'), "{j:?}");
        }
        let gdrcopy = read_all([("devices.gke.io/container.c", Some("- path: /dev/gdrdrv\n"))]);
        assert!(
            judge(&gdrcopy, 1, &[RuntimeFeature::Gdrcopy])
                .uncovered
                .is_empty()
        );
        assert_eq!(judge(&gdrcopy, 1, &[]).uncovered.len(), 1);
    }

    #[test]
    fn mounts_and_other_devices_are_named_not_refused() {
        let all = read_all([(
            "mounts.noderesource.dev/container.c",
            Some("- source: /var/lib/x\n  destination: /x\n  type: bind\n"),
        )]);
        let j = judge(&all, 0, &[]);
        assert!(j.uncovered.is_empty());
        assert_eq!(
            j.notes,
            [
                "annotation mounts.noderesource.dev/container.c has containerd's NRI device injector hand /var/lib/x at /x to container c, which gpuwarden does not judge"
            ]
        );
    }
}
