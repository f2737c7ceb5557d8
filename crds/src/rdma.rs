//! RDMA: where a container's verbs devices (`/dev/infiniband`) come from, and the signs that a
//! privileged container uses the ones privilege gave it (docs/design.md, "RDMA").
//!
//! A privileged container sees every device of the host, the HCAs' verbs devices among them.
//! De-privileged, its device cgroup admits only what the kubelet allocated: an RDMA device
//! plugin's resource, or a DRA claim. A container that used the host's HCAs through privilege
//! and asks for neither would lose RDMA without a word (NCCL fails, or falls back to
//! sockets), so what its own spec says of RDMA is read here:
//!
//! - NCCL's InfiniBand/RoCE settings (`NCCL_IB_*`, unless `NCCL_IB_DISABLE` turns IB off),
//!   `NCCL_NET=IB` or `gIB`, UCX's verbs devices and transports, libfabric's EFA provider,
//!   NVSHMEM's InfiniBand transports;
//! - an RDMA NCCL plugin: Google's gIB plugin mounted at `/usr/local/gib` (or from a host
//!   directory `.../gib`), the AWS OFI NCCL plugin or EFA libraries on `LD_LIBRARY_PATH`.
//!
//! None of these is read from a file, a ConfigMap (`envFrom`, `valueFrom`) or the launcher of
//! an MPIJob: settings `mpirun -x` passes on, or an `/etc/nccl.conf`, are not seen.
//! `NCCL_SOCKET_IFNAME`, `NCCL_NET_GDR_LEVEL` and the tuner plugins are not signs of verbs:
//! GPUDirect-TCPX(O) pods set them too.
//!
//! A pod network that hands RDMA devices to an unprivileged pod (GKE's RDMA networks, a Multus
//! network of an SR-IOV RDMA pool) is read from the pod's annotations by name: such a pod is
//! rewritten, with a warning that its devices must now come from that network.

/// The default `rdmaResources`: extended resources whose device plugins hand a container
/// verbs devices. NVIDIA's RDMA shared device plugin serves `rdma/*`; NVIDIA's Network
/// Operator names SR-IOV and host-device pools under `nvidia.com` (its examples and docs:
/// `rdma-vf` in Oracle's OKE recipes, `sriov_rdma_vf`, `sriov_rdma`, `rdma_host_dev`,
/// `mlnxnics` for InfiniBand VFs, `sriovlegacy`, `sriovswitchdev`, `sriov_resource` and its
/// per-rail `sriov_resource_rail_<n>`, `hostdev`); AWS's EFA device plugin serves
/// `vpc.amazonaws.com/efa`.
pub const DEFAULT_RESOURCES: [&str; 10] = [
    "rdma/*",
    "nvidia.com/*rdma*",
    "nvidia.com/mlnxnics",
    "nvidia.com/mlnxics",
    "nvidia.com/sriovlegacy",
    "nvidia.com/sriovswitchdev",
    "nvidia.com/sriov_resource*",
    "nvidia.com/hostdev",
    "nvidia.com/ib_sriov",
    "vpc.amazonaws.com/efa",
];

/// Environment variables whose names start with this are NCCL's InfiniBand/RoCE settings.
pub const NCCL_IB_PREFIX: &str = "NCCL_IB_";

/// Environment variables (beside [`NCCL_IB_PREFIX`] and [`LIBRARY_PATH`]) whose value may
/// show verbs use. Where a privileged container sets one, the API server's rewrite leaves the
/// pod to the webhook, which reads the value.
pub const VARIABLES: [&str; 7] = [
    "NCCL_NET",
    "NCCL_NET_PLUGIN",
    "UCX_NET_DEVICES",
    "UCX_TLS",
    "FI_PROVIDER",
    "FI_EFA_USE_DEVICE_RDMA",
    "NVSHMEM_REMOTE_TRANSPORT",
];

/// The loader's search path: a sign where it holds one of [`PLUGIN_LIBRARIES`].
pub const LIBRARY_PATH: &str = "LD_LIBRARY_PATH";

/// Where Google's gIB NCCL plugin is mounted in a container.
pub const PLUGIN_MOUNT: &str = "/usr/local/gib";

/// The last part of the host directory the gIB plugin's installer fills.
const PLUGIN_HOST_DIR: &str = "/gib";

/// Parts of a `LD_LIBRARY_PATH` (or a `NCCL_NET_PLUGIN` path) that load an RDMA NCCL plugin.
pub const PLUGIN_LIBRARIES: [&str; 3] = ["/gib", "aws-ofi-nccl", "/opt/amazon/efa"];

/// `NCCL_NET_PLUGIN` names of RDMA NCCL plugins (NCCL loads `libnccl-net-<name>.so`).
const PLUGIN_NAMES: [&str; 3] = ["ofi", "aws-ofi", "gib"];

/// The annotations a pod names its extra networks in: Multus's and GKE's.
pub const NETWORK_ANNOTATIONS: [&str; 2] = [
    "k8s.v1.cni.cncf.io/networks",
    "networking.gke.io/interfaces",
];

/// Words in a network's name that mark it as an RDMA network (`rdma-0` on GKE,
/// `sriov-rdma-network`, `aks-infiniband`, `roce-net`).
const NETWORK_WORDS: [&str; 3] = ["rdma", "infiniband", "roce"];

/// The first sign in a container's env (name, value) that it uses verbs devices, said as
/// `NAME=value`. `NCCL_IB_DISABLE` other than `0` turns NCCL's IB off, and with it every
/// `NCCL_IB_*` as a sign.
pub fn env_signal<'v>(env: impl Iterator<Item = (&'v str, &'v str)> + Clone) -> Option<String> {
    let ib_off = env
        .clone()
        .any(|(n, v)| n == "NCCL_IB_DISABLE" && !matches!(v.trim(), "" | "0"));
    env.into_iter()
        .find(|&(name, value)| is_env_signal(name, value, ib_off))
        .map(|(name, value)| format!("{name}={value}"))
}

fn is_env_signal(name: &str, value: &str, ib_off: bool) -> bool {
    let value = value.trim();
    if let Some(setting) = name.strip_prefix(NCCL_IB_PREFIX) {
        return !ib_off && (setting != "DISABLE" || value == "0") && !value.is_empty();
    }
    let items = || value.split([',', ':', ';']).map(str::trim);
    match name {
        "NCCL_NET" => {
            !ib_off && (value.eq_ignore_ascii_case("IB") || value.eq_ignore_ascii_case("gIB"))
        }
        "NCCL_NET_PLUGIN" if PLUGIN_NAMES.iter().any(|p| value.eq_ignore_ascii_case(p)) => true,
        "NCCL_NET_PLUGIN" | LIBRARY_PATH => PLUGIN_LIBRARIES.iter().any(|p| value.contains(p)),
        "UCX_NET_DEVICES" => items().any(|d| {
            ["mlx", "ibp", "irdma", "bnxt_re", "efa", "rxe", "hfi1"]
                .iter()
                .any(|p| d.starts_with(p))
        }),
        "UCX_TLS" => items().filter(|t| !t.starts_with('^')).any(|t| {
            matches!(
                t,
                "ib" | "rc"
                    | "rc_v"
                    | "rc_x"
                    | "rc_mlx5"
                    | "dc"
                    | "dc_x"
                    | "dc_mlx5"
                    | "ud"
                    | "ud_v"
                    | "ud_x"
                    | "ud_mlx5"
            )
        }),
        "FI_PROVIDER" => items().any(|p| p.eq_ignore_ascii_case("efa")),
        "FI_EFA_USE_DEVICE_RDMA" => value == "1",
        "NVSHMEM_REMOTE_TRANSPORT" => {
            matches!(
                value.to_ascii_lowercase().as_str(),
                "ibrc" | "ibgda" | "ibdevx"
            )
        }
        _ => false,
    }
}

/// Whether a mount at `mount_path` of a host directory `host_path` (if any) is an RDMA NCCL
/// plugin: at [`PLUGIN_MOUNT`] or below it, or of a host directory `.../gib`.
pub fn is_plugin_mount(mount_path: &str, host_path: Option<&str>) -> bool {
    let mount = mount_path.trim_end_matches('/');
    mount == PLUGIN_MOUNT
        || mount.starts_with(&format!("{PLUGIN_MOUNT}/"))
        || host_path.is_some_and(|h| h.trim_end_matches('/').ends_with(PLUGIN_HOST_DIR))
}

/// The RDMA networks a pod's annotations name, each once. Multus's value is a
/// comma-separated list (`[namespace/]name[@interface]`) or a JSON list of objects with a
/// `name`; GKE's is a JSON list of objects with a `network`. A value that reads as neither is
/// read as text, word by word.
pub fn networks<'a>(annotations: impl Iterator<Item = (&'a str, &'a str)>) -> Vec<String> {
    let mut out = Vec::new();
    for (key, value) in annotations {
        if !NETWORK_ANNOTATIONS.contains(&key) {
            continue;
        }
        let names: Vec<String> = match serde_json::from_str::<serde_json::Value>(value) {
            Ok(serde_json::Value::Array(items)) => items
                .iter()
                .filter_map(|i| i["network"].as_str().or(i["name"].as_str()))
                .map(str::to_owned)
                .collect(),
            _ => value
                .split(',')
                .map(|n| {
                    let n = n.trim();
                    let n = n.split_once('@').map_or(n, |(n, _)| n);
                    n.rsplit_once('/').map_or(n, |(_, n)| n).to_owned()
                })
                .collect(),
        };
        for name in names {
            let lower = name.to_ascii_lowercase();
            if NETWORK_WORDS.iter().any(|w| lower.contains(w)) && !out.contains(&name) {
                out.push(name);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn signal(env: &[(&str, &str)]) -> Option<String> {
        env_signal(env.iter().copied())
    }

    #[test]
    fn nccl_ib_settings_are_signs_unless_ib_is_off() {
        assert_eq!(
            signal(&[
                ("NCCL_SOCKET_IFNAME", "eth0"),
                ("NCCL_IB_HCA", "=mlx5_0,mlx5_1")
            ]),
            Some("NCCL_IB_HCA==mlx5_0,mlx5_1".into())
        );
        assert_eq!(
            signal(&[("NCCL_IB_GID_INDEX", "3")]).as_deref(),
            Some("NCCL_IB_GID_INDEX=3")
        );
        assert_eq!(
            signal(&[("NCCL_IB_DISABLE", "0")]).as_deref(),
            Some("NCCL_IB_DISABLE=0")
        );
        assert_eq!(
            signal(&[("NCCL_IB_DISABLE", "1"), ("NCCL_IB_HCA", "mlx5")]),
            None
        );
        assert_eq!(
            signal(&[("NCCL_IB_HCA", "mlx5"), ("NCCL_IB_DISABLE", "1")]),
            None
        );
        assert_eq!(
            signal(&[("NCCL_IB_DISABLE", "1"), ("NCCL_NET", "IB")]),
            None
        );
        assert_eq!(signal(&[("NCCL_IB_HCA", "")]), None);
    }

    #[test]
    fn other_verbs_settings_are_signs() {
        for (name, value) in [
            ("NCCL_NET", "IB"),
            ("NCCL_NET", "gIB"),
            ("UCX_NET_DEVICES", "mlx5_0:1,mlx5_3:1"),
            ("UCX_NET_DEVICES", "ibp12s0:1"),
            ("UCX_TLS", "rc,sm,self"),
            ("UCX_TLS", "dc_x"),
            ("FI_PROVIDER", "efa"),
            ("FI_EFA_USE_DEVICE_RDMA", "1"),
            ("NVSHMEM_REMOTE_TRANSPORT", "ibgda"),
            (
                "LD_LIBRARY_PATH",
                "/usr/local/gib/lib64:/usr/local/nvidia/lib64",
            ),
            (
                "LD_LIBRARY_PATH",
                "/opt/aws-ofi-nccl/install/lib:/opt/amazon/efa/lib",
            ),
            ("NCCL_NET_PLUGIN", "ofi"),
        ] {
            assert!(signal(&[(name, value)]).is_some(), "{name}={value}");
        }
    }

    #[test]
    fn sockets_tcp_and_tuning_are_not_signs() {
        for (name, value) in [
            ("NCCL_SOCKET_IFNAME", "eth0"),
            ("NCCL_NET", "Socket"),
            ("NCCL_NET_GDR_LEVEL", "PIX"),
            ("NCCL_TUNER_PLUGIN", "libnccl-tuner.so"),
            ("NCCL_NET_PLUGIN", "none"),
            ("NCCL_GPUDIRECTTCPX_SOCKET_IFNAME", "eth1,eth2"),
            ("UCX_NET_DEVICES", "eth0"),
            ("UCX_TLS", "tcp,sm,self"),
            ("UCX_TLS", "^rc"),
            ("LD_LIBRARY_PATH", "/usr/local/nvidia/lib64"),
            ("FI_PROVIDER", "tcp"),
        ] {
            assert_eq!(signal(&[(name, value)]), None, "{name}={value}");
        }
    }

    #[test]
    fn plugin_mounts_are_read_by_path() {
        assert!(is_plugin_mount(
            "/usr/local/gib",
            Some("/home/kubernetes/bin/gib")
        ));
        assert!(is_plugin_mount("/usr/local/gib/", None));
        assert!(is_plugin_mount(
            "/plugins",
            Some("/home/kubernetes/bin/gib")
        ));
        assert!(!is_plugin_mount(
            "/usr/local/nvidia",
            Some("/home/kubernetes/bin/nvidia")
        ));
        assert!(!is_plugin_mount("/data/gibberish", Some("/mnt/gibberish")));
    }

    #[test]
    fn rdma_networks_are_read_from_both_annotations() {
        let gke = r#"[{"interfaceName":"eth0","network":"default"},{"interfaceName":"eth2","network":"rdma-0"},{"interfaceName":"eth3","network":"rdma-1"}]"#;
        assert_eq!(
            networks([("networking.gke.io/interfaces", gke)].into_iter()),
            vec!["rdma-0".to_owned(), "rdma-1".to_owned()]
        );
        assert_eq!(
            networks(
                [(
                    "k8s.v1.cni.cncf.io/networks",
                    "rdma-vf,rdma-vf,default/aks-infiniband@ib0"
                )]
                .into_iter()
            ),
            vec!["rdma-vf".to_owned(), "aks-infiniband".to_owned()]
        );
        let tcpxo = r#"[{"interfaceName":"eth1","network":"vpc1"}]"#;
        assert!(networks([("networking.gke.io/interfaces", tcpxo)].into_iter()).is_empty());
        assert!(networks([("example.com/networks", "rdma-0")].into_iter()).is_empty());
    }

    #[test]
    fn default_resources_are_valid_patterns_that_miss_gpus() {
        for p in DEFAULT_RESOURCES {
            assert!(crate::bounds::resource_pattern_problem(p).is_none(), "{p}");
            assert!(!crate::glob::glob_match(p, crate::RESOURCE_GPU), "{p}");
        }
        assert!(crate::glob::glob_match(
            "nvidia.com/*rdma*",
            "nvidia.com/rdma-vf"
        ));
        assert!(crate::glob::glob_match(
            "nvidia.com/*rdma*",
            "nvidia.com/sriov_rdma_vf"
        ));
    }
}
