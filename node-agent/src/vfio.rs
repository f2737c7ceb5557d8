//! The VFIO devices the kubelet advertises and their IOMMU groups, read from sysfs.
//!
//! NVIDIA's sandbox device plugin (kubevirt-gpu-device-plugin) advertises a passthrough GPU,
//! and each other function of it, under its PCI name with its PCI address as the device ID
//! (`nvidia.com/GA102GL_RTX_A6000`: `0000:81:00.0`), and a vGPU under its type with the
//! mediated device's UUID (`nvidia.com/GRID_T4-1Q`). On `Allocate` it hands the container
//! `/dev/vfio/<group>` of the device's IOMMU group, which opens every device of the group:
//! a pod allocated a GPU's audio function gets the GPU with it. So for every device the
//! kubelet lists as allocatable, the agent reads the group sysfs puts it in (the basename
//! of its `iommu_group` link, which need not resolve: only the name counts) and, for a PCI
//! function, the driver it is bound to, or for a mediated device its type's name. Nothing
//! here relies on `/sys/kernel/iommu_groups`.
//!
//! An ID that is neither a PCI address nor a UUID is another plugin's (`nvidia.com/gpu`'s
//! `GPU-…`) and is not looked up, so no device ID ever becomes a path it was not checked
//! to be. What cannot be read, or makes no sense, is said per device
//! ([`VfioInventory::unknown`]), never guessed and never a panic.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::path::{Path, PathBuf};

use gpuwarden_crds::error_chain;
use gpuwarden_crds::node::{
    IommuGroupStatus, SYSFS_NAME_LEN, VfioDevice, VfioKind, VfioResource, VfioStatus, VfioUnknown,
};

use crate::podresources::{ContainerDevices, PodResources};

/// Where sysfs is, unless `--sysfs-root` says otherwise.
pub const DEFAULT_SYSFS_ROOT: &str = "/sys";
/// The driver a PCI function is bound to for passthrough.
pub const VFIO_PCI: &str = "vfio-pci";
/// PCI functions, by address, under the sysfs root.
const PCI_DEVICES: &str = "bus/pci/devices";
/// Mediated devices, by UUID, under the sysfs root.
const MDEV_DEVICES: &str = "bus/mdev/devices";
/// Most bytes read of an mdev type's `name`.
const NAME_READ_LIMIT: u64 = 1024;

/// What a kubelet device ID names, by its form alone: a PCI address (`0000:81:00.0`: a
/// domain of 4 to 8 hex digits, VMD's being 5, then bus, device and function) is a
/// passthrough function, a bare UUID a mediated device; anything else is neither.
pub fn id_kind(id: &str) -> Option<VfioKind> {
    if is_pci_address(id) {
        Some(VfioKind::Passthrough)
    } else if is_uuid(id) {
        Some(VfioKind::Vgpu)
    } else {
        None
    }
}

fn is_hex(s: &str, lengths: std::ops::RangeInclusive<usize>) -> bool {
    lengths.contains(&s.len()) && s.bytes().all(|b| b.is_ascii_hexdigit())
}

fn is_pci_address(id: &str) -> bool {
    let Some((rest, function)) = id.rsplit_once('.') else {
        return false;
    };
    let mut parts = rest.split(':');
    let (Some(domain), Some(bus), Some(device), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return false;
    };
    is_hex(domain, 4..=8)
        && is_hex(bus, 2..=2)
        && is_hex(device, 2..=2)
        && matches!(function.as_bytes(), [b'0'..=b'7'])
}

fn is_uuid(id: &str) -> bool {
    let groups: Vec<&str> = id.split('-').collect();
    let lengths = [8, 4, 4, 4, 12];
    groups.len() == lengths.len() && (groups.iter().zip(lengths)).all(|(g, n)| is_hex(g, n..=n))
}

/// Why a device's sysfs entries could not be read, or made no sense.
#[derive(Debug, thiserror::Error)]
pub enum SysfsError {
    /// A file or link could not be read.
    #[error("failed to read {path}")]
    Read {
        /// What.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// What should be a symlink is something else.
    #[error("{path} is not a symlink")]
    NotSymlink {
        /// What.
        path: PathBuf,
    },
    /// A link whose target has no last component (`..`, `/`).
    #[error("{path} links to {target}, which names nothing")]
    Nameless {
        /// The link.
        path: PathBuf,
        /// Its target.
        target: PathBuf,
    },
    /// An `iommu_group` link whose name is not a group number.
    #[error("{path} links to {target}: {name:?} is not an IOMMU group number")]
    GroupName {
        /// The link.
        path: PathBuf,
        /// Its target.
        target: PathBuf,
        /// Its last component.
        name: String,
    },
    /// The kubelet advertises a PCI address that sysfs does not have.
    #[error("no PCI device {path}: is --sysfs-root the host's sysfs?")]
    NoPciDevice {
        /// Where it was looked for.
        path: PathBuf,
    },
    /// A mediated device in no IOMMU group, which no VFIO driver could hand out.
    #[error("mediated device {path} has no iommu_group")]
    MdevWithoutGroup {
        /// The device's directory.
        path: PathBuf,
    },
    /// An mdev type name that is not text.
    #[error("{path} is not UTF-8 text")]
    NotText {
        /// The file.
        path: PathBuf,
    },
}

/// What sysfs says of one advertised device that is in an IOMMU group.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SysfsDevice {
    /// A PCI function or a mediated device.
    pub kind: VfioKind,
    /// Its IOMMU group.
    pub group: u32,
    /// The driver a PCI function is bound to (`vfio-pci`); `None` when unbound.
    pub driver: Option<String>,
    /// A mediated device's type name (`GRID T4-1Q`).
    pub mdev_type: Option<String>,
    /// What could not be read of its driver or type; its group is known all the same.
    pub problems: Vec<String>,
}

/// Reads the device a kubelet device ID names under the sysfs `root`: `Ok(None)` when it is
/// in no IOMMU group (a PCI function with no `iommu_group`, the IOMMU being off), when the
/// ID is no PCI address or UUID, or when a UUID names no mediated device (another plugin's
/// device). A PCI address sysfs does not have, or an entry that cannot be read or makes no
/// sense, is an error.
pub fn read_device(root: &Path, id: &str) -> Result<Option<SysfsDevice>, SysfsError> {
    let Some(kind) = id_kind(id) else {
        return Ok(None);
    };
    let dir = root
        .join(match kind {
            VfioKind::Passthrough => PCI_DEVICES,
            VfioKind::Vgpu => MDEV_DEVICES,
        })
        .join(id);
    match std::fs::metadata(&dir) {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return match kind {
                VfioKind::Passthrough => Err(SysfsError::NoPciDevice { path: dir }),
                VfioKind::Vgpu => Ok(None),
            };
        }
        Err(source) => return Err(SysfsError::Read { path: dir, source }),
    }
    let link = dir.join("iommu_group");
    let Some((target, name)) = link_name(&link)? else {
        return match kind {
            VfioKind::Passthrough => Ok(None),
            VfioKind::Vgpu => Err(SysfsError::MdevWithoutGroup { path: dir }),
        };
    };
    let group = name.parse::<u32>().map_err(|_| SysfsError::GroupName {
        path: link,
        target,
        name: name.clone(),
    })?;
    let mut device = SysfsDevice {
        kind,
        group,
        ..SysfsDevice::default()
    };
    match kind {
        VfioKind::Passthrough => match link_name(&dir.join("driver")) {
            Ok(driver) => device.driver = driver.map(|(_, name)| clip(name)),
            Err(e) => device.problems.push(error_chain(&e)),
        },
        VfioKind::Vgpu => match read_name(&dir.join("mdev_type").join("name")) {
            Ok(name) => device.mdev_type = name,
            Err(e) => device.problems.push(error_chain(&e)),
        },
    }
    Ok(Some(device))
}

/// The target of the symlink at `path` and the target's last component, which is all that
/// counts: sysfs links point into trees a container (or a test rig) may not have. `None`
/// when there is no such link.
fn link_name(path: &Path) -> Result<Option<(PathBuf, String)>, SysfsError> {
    let read = |source| SysfsError::Read {
        path: path.to_path_buf(),
        source,
    };
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(read(e)),
        Ok(meta) if !meta.file_type().is_symlink() => {
            return Err(SysfsError::NotSymlink {
                path: path.to_path_buf(),
            });
        }
        Ok(_) => {}
    }
    let target = std::fs::read_link(path).map_err(read)?;
    let name = match target.file_name() {
        Some(name) => name.to_string_lossy().into_owned(),
        None => {
            return Err(SysfsError::Nameless {
                path: path.to_path_buf(),
                target,
            });
        }
    };
    Ok(Some((target, name)))
}

/// The first line of a small sysfs text file, clipped; `None` when it is missing or empty.
fn read_name(path: &Path) -> Result<Option<String>, SysfsError> {
    let read = |source| SysfsError::Read {
        path: path.to_path_buf(),
        source,
    };
    let mut bytes = Vec::new();
    match std::fs::File::open(path) {
        Ok(file) => file
            .take(NAME_READ_LIMIT)
            .read_to_end(&mut bytes)
            .map_err(read)?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(read(e)),
    };
    let text = String::from_utf8(bytes).map_err(|_| SysfsError::NotText {
        path: path.to_path_buf(),
    })?;
    let line = text.lines().next().unwrap_or_default().trim();
    Ok((!line.is_empty()).then(|| clip(line.to_owned())))
}

fn clip(mut s: String) -> String {
    if let Some((i, _)) = s.char_indices().nth(SYSFS_NAME_LEN) {
        s.truncate(i);
    }
    s
}

/// One advertised device that sysfs puts in an IOMMU group.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GroupedDevice {
    /// The resource it is advertised under.
    pub resource: String,
    /// Its kubelet device ID.
    pub id: String,
    /// What sysfs says of it.
    pub sysfs: SysfsDevice,
}

impl GroupedDevice {
    /// The device as the status names it, with its driver when `with_driver`.
    pub fn named(&self, with_driver: bool) -> VfioDevice {
        VfioDevice {
            resource_name: self.resource.clone(),
            device_id: self.id.clone(),
            driver: self.sysfs.driver.clone().filter(|_| with_driver),
        }
    }
}

/// The kubelet's allocatable devices that are in an IOMMU group, and those whose group
/// could not be read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VfioInventory {
    /// Sorted by resource and ID.
    pub devices: Vec<GroupedDevice>,
    /// What could not be read, sorted by resource and ID.
    pub unknown: Vec<VfioUnknown>,
}

impl VfioInventory {
    /// Reads, under the sysfs `root`, every device in `allocatable` (the kubelet's
    /// `GetAllocatableResources`).
    pub fn read(root: &Path, allocatable: &[ContainerDevices]) -> Self {
        Self::from_reads(allocatable, |id| read_device(root, id))
    }

    /// The inventory of `allocatable`, each device ID read once by `read`.
    pub fn from_reads(
        allocatable: &[ContainerDevices],
        mut read: impl FnMut(&str) -> Result<Option<SysfsDevice>, SysfsError>,
    ) -> Self {
        let listed: BTreeSet<(&str, &str)> = (allocatable.iter())
            .flat_map(|d| (d.device_ids.iter()).map(|id| (d.resource_name.as_str(), id.as_str())))
            .collect();
        let mut read_ids: BTreeMap<&str, Result<Option<SysfsDevice>, String>> = BTreeMap::new();
        let mut inventory = Self::default();
        for (resource, id) in listed {
            let result = read_ids
                .entry(id)
                .or_insert_with(|| read(id).map_err(|e| error_chain(&e)));
            let unknown = |reason: &str| VfioUnknown {
                resource_name: resource.to_owned(),
                device_id: id.to_owned(),
                reason: reason.to_owned(),
            };
            match result {
                Ok(None) => {}
                Ok(Some(sysfs)) => {
                    (inventory.unknown).extend(sysfs.problems.iter().map(|p| unknown(p)));
                    inventory.devices.push(GroupedDevice {
                        resource: resource.to_owned(),
                        id: id.to_owned(),
                        sysfs: sysfs.clone(),
                    });
                }
                Err(reason) => inventory.unknown.push(unknown(reason)),
            }
        }
        inventory
    }

    /// The device advertised under `resource` as `id`, when it is in an IOMMU group.
    pub fn get(&self, resource: &str, id: &str) -> Option<&GroupedDevice> {
        (self.devices.iter()).find(|d| d.resource == resource && d.id == id)
    }

    /// The IOMMU groups that back more than one advertised device (by device ID), with
    /// their devices.
    pub fn shared_groups(&self) -> BTreeMap<u32, Vec<&GroupedDevice>> {
        let mut groups: BTreeMap<u32, Vec<&GroupedDevice>> = BTreeMap::new();
        for d in &self.devices {
            groups.entry(d.sysfs.group).or_default().push(d);
        }
        groups.retain(|_, devices| {
            let ids: BTreeSet<&str> = devices.iter().map(|d| d.id.as_str()).collect();
            ids.len() > 1
        });
        groups
    }

    /// The status of these devices; `None` when there are none and nothing was unknown.
    pub fn status(&self) -> Option<VfioStatus> {
        let mut resources: BTreeMap<&str, VfioResource> = BTreeMap::new();
        for d in &self.devices {
            let r = resources
                .entry(d.resource.as_str())
                .or_insert_with(|| VfioResource {
                    name: d.resource.clone(),
                    kind: d.sysfs.kind,
                    ..VfioResource::default()
                });
            r.devices += 1;
            match d.sysfs.kind {
                VfioKind::Passthrough => {
                    let on_vfio = d.sysfs.driver.as_deref() == Some(VFIO_PCI);
                    *r.vfio_pci.get_or_insert(0) += u32::from(on_vfio);
                }
                VfioKind::Vgpu => {
                    if r.mdev_type.is_none() {
                        r.mdev_type.clone_from(&d.sysfs.mdev_type);
                    }
                }
            }
        }
        let status = VfioStatus {
            resources: resources.into_values().collect(),
            shared_groups: (self.shared_groups().into_iter())
                .map(|(group, devices)| IommuGroupStatus {
                    group,
                    devices: devices.iter().map(|d| d.named(true)).collect(),
                })
                .collect(),
            unknown: self.unknown.clone(),
        };
        (status != VfioStatus::default()).then_some(status)
    }
}

/// A device of the inventory the kubelet allocated to a container.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VfioHold {
    /// Pod namespace.
    pub namespace: String,
    /// Pod name.
    pub pod: String,
    /// Container name.
    pub container: String,
    /// The resource it was allocated under.
    pub resource: String,
    /// Its device ID.
    pub id: String,
}

/// The devices in `list` (the kubelet's `List`) that `inventory` puts in an IOMMU group.
pub fn holds(list: &[PodResources], inventory: &VfioInventory) -> Vec<VfioHold> {
    if inventory.devices.is_empty() {
        return Vec::new();
    }
    let mut out = Vec::new();
    for pod in list {
        for container in &pod.containers {
            for devices in &container.devices {
                for id in &devices.device_ids {
                    if inventory.get(&devices.resource_name, id).is_some() {
                        out.push(VfioHold {
                            namespace: pod.namespace.clone(),
                            pod: pod.name.clone(),
                            container: container.name.clone(),
                            resource: devices.resource_name.clone(),
                            id: id.clone(),
                        });
                    }
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::podresources::ContainerResources;
    use std::os::unix::fs::symlink;

    use crate::testing::sandbox::{self, A6000, AUDIO, AUDIO_FN, GPU, MDEVS, T4, T4_1Q};

    fn link(target: &str, at: &Path) {
        std::fs::create_dir_all(at.parent().unwrap()).unwrap();
        symlink(target, at).unwrap();
    }

    fn rig_sysfs() -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        sandbox::write_sysfs(root.path()).unwrap();
        root
    }

    fn rig_allocatable() -> Vec<ContainerDevices> {
        sandbox::allocatable()
    }

    #[test]
    fn device_ids_are_pci_addresses_uuids_or_neither() {
        assert_eq!(id_kind(GPU), Some(VfioKind::Passthrough));
        assert_eq!(id_kind("10000:e1:00.7"), Some(VfioKind::Passthrough), "VMD");
        assert_eq!(id_kind(MDEVS[0]), Some(VfioKind::Vgpu));
        for other in [
            "GPU-5e4f0000-0000-0000-0000-000000000000",
            "MIG-5e4f0000-0000-0000-0000-000000000000",
            "0",
            "1:0",
            "mlx5_0",
            "0000:81:00.8",
            "0000:81:00.0::1",
            "0000:81:00",
            "81:00.0",
            "0000:81:00.0/../../..",
            "../0000:81:00.0",
            "0000:81:0g.0",
            "3f1a6a0e-0000-4a00-8000-00000000a01",
            "3f1a6a0e-0000-4a00-8000-00000000a010/..",
            "",
        ] {
            assert_eq!(id_kind(other), None, "{other:?}");
        }
    }

    #[test]
    fn the_rig_reads_as_its_plugin_sees_it() {
        let root = rig_sysfs();
        let gpu = read_device(root.path(), GPU).unwrap().expect("in a group");
        assert_eq!(
            gpu,
            SysfsDevice {
                kind: VfioKind::Passthrough,
                group: 13,
                driver: Some("vfio-pci".into()),
                ..SysfsDevice::default()
            }
        );
        let t4 = read_device(root.path(), T4).unwrap().expect("in a group");
        assert_eq!((t4.group, t4.driver.as_deref()), (5, Some("nvidia")));
        let mdev = read_device(root.path(), MDEVS[1])
            .unwrap()
            .expect("in a group");
        assert_eq!(
            mdev,
            SysfsDevice {
                kind: VfioKind::Vgpu,
                group: 11,
                mdev_type: Some("GRID T4-1Q".into()),
                ..SysfsDevice::default()
            }
        );
        // Another plugin's IDs, and a UUID that is no mediated device, are not looked up.
        assert!(read_device(root.path(), "GPU-5e4f").unwrap().is_none());
        let other = "11111111-2222-3333-4444-555555555555";
        assert!(read_device(root.path(), other).unwrap().is_none());

        let inventory = VfioInventory::read(root.path(), &rig_allocatable());
        assert_eq!(inventory.unknown, []);
        assert_eq!(inventory.devices.len(), 5, "{inventory:#?}");
        let shared = inventory.shared_groups();
        assert_eq!(shared.keys().collect::<Vec<_>>(), [&13]);
        let ids: Vec<&str> = shared[&13].iter().map(|d| d.id.as_str()).collect();
        assert_eq!(ids, [GPU, AUDIO_FN]);

        let status = inventory.status().expect("VFIO-backed resources");
        let passthrough = |name: &str| VfioResource {
            name: name.into(),
            kind: VfioKind::Passthrough,
            devices: 1,
            vfio_pci: Some(1),
            mdev_type: None,
        };
        assert_eq!(
            status.resources,
            [
                passthrough(A6000),
                passthrough(AUDIO),
                VfioResource {
                    name: T4_1Q.into(),
                    kind: VfioKind::Vgpu,
                    devices: 3,
                    vfio_pci: None,
                    mdev_type: Some("GRID T4-1Q".into()),
                },
            ]
        );
        assert_eq!(
            status.shared_groups,
            [IommuGroupStatus {
                group: 13,
                devices: vec![
                    VfioDevice {
                        resource_name: A6000.into(),
                        device_id: GPU.into(),
                        driver: Some("vfio-pci".into()),
                    },
                    VfioDevice {
                        resource_name: AUDIO.into(),
                        device_id: AUDIO_FN.into(),
                        driver: Some("vfio-pci".into()),
                    },
                ],
            }]
        );
        assert_eq!(status.unknown, []);
    }

    #[test]
    fn a_node_without_vfio_devices_has_no_vfio_status() {
        let root = rig_sysfs();
        let gpus = &rig_allocatable()[3..];
        let inventory = VfioInventory::read(root.path(), gpus);
        assert_eq!(inventory, VfioInventory::default());
        assert_eq!(inventory.status(), None);
        // A PCI function in no IOMMU group (the IOMMU off) is no VFIO device either.
        std::fs::remove_file(
            root.path()
                .join("devices/pci0000:40/0000:40:01.1/0000:41:00.0/iommu_group"),
        )
        .unwrap();
        assert!(read_device(root.path(), T4).unwrap().is_none());
    }

    /// Each bad entry is one `unknown` line that says what and why; the other devices are
    /// read as ever, and nothing panics.
    #[test]
    fn bad_sysfs_entries_are_unknown_with_a_reason() {
        let root = rig_sysfs();
        let r = root.path();
        let pci = |addr: &str| r.join(PCI_DEVICES).join(addr);
        let make = |addr: &str| {
            let dir = r.join("devices/pci0000:c0").join(addr);
            std::fs::create_dir_all(&dir).unwrap();
            link(&dir.display().to_string(), &pci(addr));
            dir
        };
        // iommu_group a plain file, a directory, a link to a name that is no number, a
        // link to `..`.
        std::fs::write(make("0000:c1:00.0").join("iommu_group"), "13\n").unwrap();
        std::fs::create_dir(make("0000:c2:00.0").join("iommu_group")).unwrap();
        symlink(
            "../../../../kernel/iommu_groups/thirteen",
            make("0000:c3:00.0").join("iommu_group"),
        )
        .unwrap();
        symlink("..", make("0000:c4:00.0").join("iommu_group")).unwrap();
        // A device directory that is a file (reading under it fails: not a directory),
        // and one that links to itself (too many levels of links).
        std::fs::write(pci("0000:c5:00.0"), "").unwrap();
        symlink(pci("0000:c6:00.0"), pci("0000:c6:00.0")).unwrap();
        // Grouped, but its driver link is a file: the group still counts.
        let odd_driver = make("0000:c7:00.0");
        symlink(
            "../../kernel/iommu_groups/40",
            odd_driver.join("iommu_group"),
        )
        .unwrap();
        std::fs::write(odd_driver.join("driver"), "vfio-pci").unwrap();
        // A mediated device without a group, and one whose type name is not text.
        let mdev = |uuid: &str| {
            let dir = r.join("devices/mdevs").join(uuid);
            std::fs::create_dir_all(&dir).unwrap();
            link(&dir.display().to_string(), &r.join(MDEV_DEVICES).join(uuid));
            dir
        };
        mdev("aaaaaaaa-0000-0000-0000-000000000001");
        let binary = mdev("aaaaaaaa-0000-0000-0000-000000000002");
        symlink("../../kernel/iommu_groups/41", binary.join("iommu_group")).unwrap();
        std::fs::create_dir(binary.join("mdev_type")).unwrap();
        std::fs::write(binary.join("mdev_type/name"), [0xff, 0xfe, b'\n']).unwrap();

        let ids = [
            "0000:c1:00.0",
            "0000:c2:00.0",
            "0000:c3:00.0",
            "0000:c4:00.0",
            "0000:c5:00.0",
            "0000:c6:00.0",
            "0000:c7:00.0",
            "0000:c8:00.0",
            "aaaaaaaa-0000-0000-0000-000000000001",
            "aaaaaaaa-0000-0000-0000-000000000002",
        ];
        let mut allocatable = rig_allocatable();
        allocatable.push(ContainerDevices {
            resource_name: "example.com/odd".into(),
            device_ids: ids.iter().map(|s| s.to_string()).collect(),
        });
        let inventory = VfioInventory::read(r, &allocatable);
        let reasons: BTreeMap<&str, &str> = (inventory.unknown.iter())
            .map(|u| (u.device_id.as_str(), u.reason.as_str()))
            .collect();
        let has = |id: &str, parts: &[&str]| {
            let reason = reasons
                .get(id)
                .unwrap_or_else(|| panic!("{id}: {reasons:#?}"));
            for part in parts {
                assert!(reason.contains(part), "{id}: {reason}");
            }
        };
        has(
            "0000:c1:00.0",
            &["0000:c1:00.0/iommu_group is not a symlink"],
        );
        has(
            "0000:c2:00.0",
            &["0000:c2:00.0/iommu_group is not a symlink"],
        );
        has(
            "0000:c3:00.0",
            &["\"thirteen\" is not an IOMMU group number"],
        );
        has("0000:c4:00.0", &["links to .., which names nothing"]);
        has("0000:c5:00.0", &["failed to read", "0000:c5:00.0"]);
        has("0000:c6:00.0", &["failed to read", "0000:c6:00.0"]);
        has("0000:c7:00.0", &["0000:c7:00.0/driver is not a symlink"]);
        has(
            "0000:c8:00.0",
            &["no PCI device", "is --sysfs-root the host's sysfs?"],
        );
        has(
            "aaaaaaaa-0000-0000-0000-000000000001",
            &["has no iommu_group"],
        );
        has(
            "aaaaaaaa-0000-0000-0000-000000000002",
            &["mdev_type/name is not UTF-8 text"],
        );
        assert_eq!(reasons.len(), ids.len(), "{reasons:#?}");

        // The good devices and the two whose group is known despite a bad driver or name.
        let grouped: Vec<(&str, u32)> = (inventory.devices.iter())
            .map(|d| (d.id.as_str(), d.sysfs.group))
            .collect();
        assert_eq!(
            grouped,
            [
                ("0000:c7:00.0", 40),
                ("aaaaaaaa-0000-0000-0000-000000000002", 41),
                (GPU, 13),
                (AUDIO_FN, 13),
                (MDEVS[0], 10),
                (MDEVS[1], 11),
                (MDEVS[2], 12),
            ]
        );
        let status = inventory.status().unwrap();
        assert_eq!(status.unknown.len(), ids.len());
        let odd = (status.resources.iter())
            .find(|r| r.name == "example.com/odd")
            .unwrap();
        assert_eq!((odd.devices, odd.vfio_pci), (2, Some(0)));
    }

    #[test]
    fn holds_are_the_grouped_devices_each_container_was_allocated() {
        let root = rig_sysfs();
        let inventory = VfioInventory::read(root.path(), &rig_allocatable());
        let pod = |name: &str, resource: &str, ids: &[&str]| PodResources {
            name: name.into(),
            namespace: "vms".into(),
            containers: vec![ContainerResources {
                name: "compute".into(),
                devices: vec![ContainerDevices {
                    resource_name: resource.into(),
                    device_ids: ids.iter().map(|s| s.to_string()).collect(),
                }],
                ..ContainerResources::default()
            }],
        };
        let list = [
            pod("vm-a", A6000, &[GPU]),
            pod("vm-b", T4_1Q, &[MDEVS[2]]),
            pod("trainer", "nvidia.com/gpu", &["GPU-5e4f"]),
            // A device the kubelet does not advertise under that resource.
            pod("odd", AUDIO, &[GPU]),
        ];
        let held = holds(&list, &inventory);
        let hold = |pod: &str, resource: &str, id: &str| VfioHold {
            namespace: "vms".into(),
            pod: pod.into(),
            container: "compute".into(),
            resource: resource.into(),
            id: id.into(),
        };
        assert_eq!(
            held,
            [hold("vm-a", A6000, GPU), hold("vm-b", T4_1Q, MDEVS[2])]
        );
        assert!(holds(&list, &VfioInventory::default()).is_empty());
    }
}
