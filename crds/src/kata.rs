//! Kata Containers' pod annotations and the agent's CDI variable (docs/design.md, "Kata
//! Containers"). Kata's runtime checks only its `hypervisor` annotations against the
//! configuration's `enable_annotations`, and every NVIDIA GPU configuration enables
//! `kernel_params` there; runtime, agent and `config_path` annotations are applied with no
//! check at all (kata-containers 3.32.0, `src/runtime/pkg/oci/utils.go`). A pod's author can
//! so change which devices the runtime plugs into the pod's VM and what the agent inside hands
//! each container. Judged here, from Kata's source:
//!
//! - [`DEVICE_ANNOTATIONS`]: VFIO hot- and cold-plug and their PCIe ports, the VFIO mode,
//!   guest hooks, guest kernel modules, and the choice of configuration file;
//! - [`KERNEL_PARAMS`] tokens that set the agent ([`AGENT_PREFIX`]), unless they are among
//!   [`AGENT_PARAMS_KEPT`], which hand containers nothing: `agent.visible_cdi_devices=true`
//!   lets any container take the VM's GPUs through [`ENV_VISIBLE_CDI_DEVICES`], and
//!   `agent.config_file` replaces the agent's whole configuration;
//! - [`ENV_VISIBLE_CDI_DEVICES`] in a container that holds no GPU of its own.

/// What every Kata annotation starts with.
pub const PREFIX: &str = "io.katacontainers.";

/// The guest kernel's command line, added to the configuration's.
pub const KERNEL_PARAMS: &str = "io.katacontainers.config.hypervisor.kernel_params";

/// What the agent's settings on the kernel command line start with.
pub const AGENT_PREFIX: &str = "agent.";

/// Kata annotations that change which devices reach the pod's VM or its containers, or which
/// configuration the runtime loads.
pub const DEVICE_ANNOTATIONS: [&str; 9] = [
    // Replaces the whole configuration, `enable_annotations` included.
    "io.katacontainers.config_path",
    "io.katacontainers.config.hypervisor.hot_plug_vfio",
    "io.katacontainers.config.hypervisor.cold_plug_vfio",
    "io.katacontainers.config.hypervisor.hotplug_vfio_on_root_bus",
    "io.katacontainers.config.hypervisor.pcie_root_port",
    "io.katacontainers.config.hypervisor.pcie_switch_port",
    // OCI hooks from the guest image, run for every container.
    "io.katacontainers.config.hypervisor.guest_hook_path",
    "io.katacontainers.config.runtime.vfio_mode",
    // modprobe in the guest.
    "io.katacontainers.config.agent.kernel_modules",
];

/// Agent settings on the kernel command line that hand containers nothing: logging, time
/// limits, proxies, and the confidential-computing guest components Kata's own NVIDIA GPU
/// manifests start this way.
pub const AGENT_PARAMS_KEPT: [&str; 10] = [
    "agent.log",
    "agent.hotplug_timeout",
    "agent.cdh_api_timeout",
    "agent.image_pull_timeout",
    "agent.launch_process_timeout",
    "agent.guest_components_procs",
    "agent.guest_components_rest_api",
    "agent.aa_kbc_params",
    "agent.https_proxy",
    "agent.no_proxy",
];

/// The variable through which Kata's agent, with `agent.visible_cdi_devices` on, hands a
/// container the CDI devices it names (`nvidia.com/gpu=all`: every GPU of the VM).
pub const ENV_VISIBLE_CDI_DEVICES: &str = "VISIBLE_CDI_DEVICES";

/// The agent settings a `kernel_params` value sets that are not [`AGENT_PARAMS_KEPT`], in
/// order: each token's name (before `=`) that starts with [`AGENT_PREFIX`]. A token is a run
/// of printable ASCII other than space: Kata splits on every Unicode space, and anything else
/// outside printable ASCII ends a token here too, so that no spelling hides a setting from
/// this reading or from the API server's (`deploy/admission/backstop-policy.yaml`).
pub fn agent_settings(kernel_params: &str) -> Vec<&str> {
    (kernel_params.split(|c: char| !c.is_ascii_graphic()))
        .map(|token| token.split('=').next().unwrap_or(token))
        .filter(|name| name.starts_with(AGENT_PREFIX) && !AGENT_PARAMS_KEPT.contains(name))
        .collect()
}

/// Why the pod annotation `key` with `value` is refused, or `None` when Kata hands nothing
/// through it.
pub fn judge(key: &str, value: &str) -> Option<String> {
    if !key.starts_with(PREFIX) {
        return None;
    }
    if DEVICE_ANNOTATIONS.contains(&key) {
        return Some(format!(
            "annotation {key} changes which devices Kata Containers plugs into the pod's VM or hands its containers, and Kata applies it with no allow-list; set it in the runtime's configuration"
        ));
    }
    if key != KERNEL_PARAMS {
        return None;
    }
    let settings = agent_settings(value);
    (!settings.is_empty()).then(|| {
        format!(
            "annotation {key} sets {} for Kata's agent, which would hand containers devices beyond their own (agent.visible_cdi_devices lets any container take the VM's GPUs through {ENV_VISIBLE_CDI_DEVICES}) or load other settings; set agent options in the runtime's configuration",
            settings.join(", ")
        )
    })
}

/// Why a container that sets [`ENV_VISIBLE_CDI_DEVICES`] and holds no GPU of its own is
/// refused (`name` is how it is named: `container sidecar`).
pub fn visible_cdi_reason(name: &str) -> String {
    format!(
        "{name} sets {ENV_VISIBLE_CDI_DEVICES} and holds no GPU: Kata's agent would hand it the GPUs it names from the pod's VM, which the kubelet allocated to other containers; request the GPU it needs, or remove the variable"
    )
}

/// Whether a container holds a GPU of its own for [`ENV_VISIBLE_CDI_DEVICES`]: a limit or
/// request on an `nvidia.com/` resource or on the policy's `resource`, or a DRA claim.
pub fn holds_gpu_of_its_own<'r>(
    mut resources: impl Iterator<Item = &'r str>,
    claims: bool,
    resource: &str,
) -> bool {
    claims || resources.any(|r| r.starts_with("nvidia.com/") || r == resource)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agent_settings_are_read_token_by_token() {
        assert_eq!(
            agent_settings("agent.visible_cdi_devices=true\tagent.log=debug  agent.devmode"),
            ["agent.visible_cdi_devices", "agent.devmode"]
        );
        // Kata's own confidential NIM manifests.
        assert!(
            agent_settings("agent.guest_components_procs=confidential-data-hub agent.aa_kbc_params=cc_kbc::http://kbs")
                .is_empty()
        );
        assert!(agent_settings("pci=realloc notagent.x=1 x=agent.y").is_empty());
        assert_eq!(
            agent_settings("quiet\u{a0}agent.visible_cdi_devices=true"),
            ["agent.visible_cdi_devices"]
        );
    }

    #[test]
    fn device_annotations_and_agent_settings_are_refused_and_others_are_not() {
        assert!(judge(KERNEL_PARAMS, "agent.visible_cdi_devices=true").is_some());
        assert!(judge(KERNEL_PARAMS, "agent.config_file=/x").is_some());
        assert!(judge(KERNEL_PARAMS, "pci=realloc agent.log=debug").is_none());
        assert!(
            judge(
                "io.katacontainers.config.hypervisor.cold_plug_vfio",
                "root-port"
            )
            .is_some()
        );
        assert!(
            judge(
                "io.katacontainers.config.hypervisor.default_memory",
                "16384"
            )
            .is_none()
        );
        assert!(judge("example.com/kernel_params", "agent.devmode").is_none());
    }
}
