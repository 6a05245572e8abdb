//! A container on the VM engine (`io.cubesandbox.engine: vm`): its root filesystem,
//! as containerd's snapshotter mounts it, becomes the root disk of a VM template
//! built for it (Cube's agent as the guest's init), and the container is a sandbox of
//! that template: its processes run in the guest through the agent, as a jail's do.
//! The template goes when the container does.
//!
//! A VM pod's guest is built the same way from the pause container's root (the pod's
//! containers are then copied in: [`crate::guest_root`]).
//!
//! The spec's binds are copied into the disk with the root, at their destinations: a
//! copy made at create, not a share. Its network is that of the namespace its spec
//! names, if one was set up for it (a VM pod's: CNI's), which the VM is spliced to
//! (cube-supervisor's `pod_network`); loopback only otherwise. What a VM container
//! does not have yet: checkpoints, which are refused saying so. Its Stats are the VM's use on the host ([`crate::stats::vm_metrics`]).
//! Building the template boots the guest once: 15 to 17 s for a busybox image on a PVM host, whose guest kernel runs
//! emulated (`cube-shim --test ctr`); the boot timeout allows 900 s there, 120 s where
//! the guest kernel runs natively.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use cube_core::host::KernelMode;
use cube_core::templates::{image_agent, MachineConfig, TreeSource, VmTemplateSpec};
use cube_core::{LimitChange, Runtime, SandboxError};

/// Guest memory where the spec sets no memory limit, MiB.
const DEFAULT_MEMORY_MIB: u64 = 512;
/// How long the guest may take to answer, where its kernel runs natively.
const NATIVE_BOOT_TIMEOUT: Duration = Duration::from_secs(120);
/// Where it is emulated (PVM hosts): minutes.
const EMULATED_BOOT_TIMEOUT: Duration = Duration::from_secs(900);

/// Why a container could not run on the VM engine.
#[derive(Debug, thiserror::Error)]
pub enum VmContainerError {
    /// What the container asks for that VM containers lack.
    #[error("{0} is not supported for VM containers yet (io.cubesandbox.engine: vm)")]
    Unsupported(&'static str),
    /// No statically linked agent to put into the guest's root.
    #[error("finding the agent for the VM's root filesystem")]
    Agent(#[source] image_agent::ImageAgentError),
    /// The template could not be built (the reason says whether the host can at all).
    #[error("building the container's VM template {0}")]
    Build(String, #[source] Box<SandboxError>),
}

/// The VM template built for one container; removed on drop (best effort: once its
/// sandbox is gone, see [`VmTemplate::remove`]).
pub struct VmTemplate {
    runtime: Arc<Runtime>,
    name: String,
    /// The guest's memory, bytes.
    memory_bytes: u64,
    removed: bool,
}

impl VmTemplate {
    /// Builds the template of container `id` of `namespace` from `rootfs`, the
    /// container's root filesystem mounted on the host, shaped by the spec's `limits`.
    pub fn build(
        runtime: &Arc<Runtime>,
        namespace: &str,
        id: &str,
        rootfs: &Path,
        limits: &LimitChange,
    ) -> Result<VmTemplate, VmContainerError> {
        let name = template_name(namespace, id);
        let agent = image_agent::locate().map_err(VmContainerError::Agent)?;
        let memory_bytes = limits.memory_mib.unwrap_or(DEFAULT_MEMORY_MIB) << 20;
        let spec = VmTemplateSpec {
            tree: TreeSource::Directory(rootfs.to_path_buf()),
            kernel: None,
            initrd: None,
            machine: MachineConfig {
                vcpus: limits
                    .cpu_millis
                    .map_or(1, |m| m.div_ceil(1000).clamp(1, u8::MAX.into()) as u8),
                memory_bytes,
                irqchip: true,
            },
            boot_timeout: match KernelMode::of_this_host() {
                Some(KernelMode::Emulated) => EMULATED_BOOT_TIMEOUT,
                _ => NATIVE_BOOT_TIMEOUT,
            },
            agent,
        };
        runtime
            .build_vm_template(&name, &spec, &mut |line| log::info!("{name}: {line}"))
            .map_err(|e| VmContainerError::Build(name.clone(), Box::new(e)))?;
        Ok(VmTemplate {
            runtime: Arc::clone(runtime),
            name,
            memory_bytes,
            removed: false,
        })
    }

    /// Its name in the store.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The guest's memory, bytes.
    pub fn memory_bytes(&self) -> u64 {
        self.memory_bytes
    }

    /// Removes it (once the container's sandbox is gone; idempotent).
    pub fn remove(&mut self) -> Result<(), SandboxError> {
        if self.removed {
            return Ok(());
        }
        self.runtime.remove_template(&self.name)?;
        self.removed = true;
        Ok(())
    }
}

impl Drop for VmTemplate {
    fn drop(&mut self) {
        if let Err(e) = self.remove() {
            log::warn!("removing VM template {}: {e}", self.name);
        }
    }
}

/// A template name for container `id` of `namespace`: unique per container, within
/// the store's naming rules whatever the id holds, and short (the template's build
/// socket path must fit a socket address).
fn template_name(namespace: &str, id: &str) -> String {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    (namespace, id).hash(&mut hasher);
    let readable: String = id
        .chars()
        .filter(|c| c.is_ascii_alphanumeric())
        .take(8)
        .collect();
    format!("ctr-{readable}-{:016x}", hasher.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn template_names_are_per_container_and_tame() {
        let a = template_name("default", "web-1");
        assert!(a.starts_with("ctr-web1-"), "{a}");
        assert!(template_name("n", "abcdefghijkl").starts_with("ctr-abcdefgh-"));
        assert_ne!(a, template_name("other", "web-1"));
        assert_ne!(a, template_name("default", "web-2"));
        let odd = template_name("ns", &"x/../é ".repeat(40));
        assert!(odd.len() <= 4 + 8 + 1 + 16, "{odd}");
        assert!(odd.chars().all(|c| c.is_ascii_alphanumeric() || c == '-'));
    }
}
