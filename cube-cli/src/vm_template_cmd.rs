//! `cube template build --engine vm`: a Linux guest booted on an ext4 image of the
//! tree, snapshotted once its agent answers.

use std::time::Duration;

use cube_core::snapshot::MachineConfig;
use cube_core::vm_template::VmTemplateSpec;
use cube_core::{Runtime, SandboxError};

use cube_core::vstate::emulation::KernelMode;

use crate::build_progress::BuildProgress;
use crate::template_build_cmd::BuildArgs;
use crate::{chain, CliError};

/// Default `--boot-timeout` where the guest kernel runs natively.
const NATIVE_BOOT_TIMEOUT_S: u64 = 120;
/// Default `--boot-timeout` where the guest kernel runs emulated (PVM hosts).
const EMULATED_BOOT_TIMEOUT_S: u64 = 900;

/// Builds a VM template; on a host where it cannot finish, says why at once.
pub fn build_vm(rt: &Runtime, args: &BuildArgs) -> Result<(), CliError> {
    let agent = cube_core::supervisor::jail_sandbox::locate_agent().map_err(CliError::failed)?;
    let spec = VmTemplateSpec {
        tree: args.tree_source(),
        kernel: args.kernel.clone(),
        initrd: args.initrd.clone(),
        machine: MachineConfig {
            vcpus: 1,
            memory_bytes: args.memory_mib << 20,
            irqchip: true,
        },
        boot_timeout: Duration::from_secs(args.boot_timeout.unwrap_or(
            // An emulated kernel takes a minute or two to boot here; a native one,
            // about a second.
            match cube_core::host_caps::linux_kernel_mode() {
                Some(KernelMode::Emulated) => EMULATED_BOOT_TIMEOUT_S,
                _ => NATIVE_BOOT_TIMEOUT_S,
            },
        )),
        agent,
    };
    let progress = BuildProgress::start(&format!("building VM template {}", args.name));
    let result = rt.build_vm_template(&args.name, &spec, &mut |line| progress.line(line));
    progress.finish();
    match result {
        Ok(meta) => {
            println!("{}", meta.name);
            Ok(())
        }
        Err(SandboxError::VmTemplate(
            _,
            e @ (cube_core::vm_template::VmTemplateError::StockKernelOnPvm
            | cube_core::vm_template::VmTemplateError::NoKvm),
        )) => Err(CliError::unsupported(e.to_string())
            .hint(format!("cube template build {} --engine jail", args.name))),
        Err(e) => Err(CliError::failed(chain(&e))),
    }
}
