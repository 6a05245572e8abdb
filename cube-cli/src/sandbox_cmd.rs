//! `cube template` and `cube sandbox`: templates and sandboxes that live across
//! invocations.

use std::path::Path;

use clap::Subcommand;
use cube_core::snapshot::MachineConfig;
use cube_core::test_guest::WorkingSet;
use cube_core::{CreateOptions, Runtime, RuntimeConfig};

use crate::{chain, store_root, CliError};

#[derive(Subcommand)]
pub enum TemplateCommand {
    /// Build a template from Cube's synthetic test guest (boot, settle, snapshot).
    ///
    /// Example: cube template build-test base --memory-mib 2048 --vcpus 2
    BuildTest {
        /// Template name.
        name: String,
        /// Guest memory in MiB.
        #[arg(long, default_value_t = 2048)]
        memory_mib: u64,
        /// vCPUs.
        #[arg(long, default_value_t = 2)]
        vcpus: u8,
        /// Writable disk per sandbox, MiB (sparse, copy-on-write).
        #[arg(long, default_value_t = 1024)]
        disk_mib: u64,
    },
    /// List templates.
    ///
    /// Example: cube template ls --json
    Ls {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Remove a template.
    ///
    /// Example: cube template rm base
    Rm {
        /// Template name.
        name: String,
    },
}

#[derive(Subcommand)]
pub enum SandboxCommand {
    /// Create a sandbox from a template; prints its id.
    ///
    /// Example: cube sandbox create base
    Create {
        /// Template name.
        template: String,
    },
    /// List sandboxes.
    ///
    /// Example: cube sandbox ls --json
    Ls {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Show a sandbox's state.
    ///
    /// Example: cube sandbox inspect sb-0123456789abcdef
    Inspect {
        /// Sandbox id.
        id: String,
    },
    /// Snapshot a sandbox; prints the snapshot id.
    ///
    /// Example: cube sandbox snapshot sb-0123456789abcdef
    Snapshot {
        /// Sandbox id.
        id: String,
    },
    /// Roll a sandbox back to one of its snapshots.
    ///
    /// Example: cube sandbox rollback sb-0123456789abcdef snap-0123456789abcdef
    Rollback {
        /// Sandbox id.
        id: String,
        /// Snapshot id.
        snapshot: String,
    },
    /// Clone a sandbox n times; prints the new ids.
    ///
    /// Example: cube sandbox clone sb-0123456789abcdef -n 3
    Clone {
        /// Sandbox id.
        id: String,
        /// Number of clones.
        #[arg(short, default_value_t = 1)]
        n: usize,
    },
    /// Stop a sandbox's vCPUs (memory stays).
    ///
    /// Example: cube sandbox pause sb-0123456789abcdef
    Pause {
        /// Sandbox id.
        id: String,
    },
    /// Continue a paused sandbox.
    ///
    /// Example: cube sandbox resume sb-0123456789abcdef
    Resume {
        /// Sandbox id.
        id: String,
    },
    /// Write a sandbox's state to disk and release its memory.
    ///
    /// Example: cube sandbox hibernate sb-0123456789abcdef
    Hibernate {
        /// Sandbox id.
        id: String,
    },
    /// Restore a hibernated sandbox.
    ///
    /// Example: cube sandbox wake sb-0123456789abcdef
    Wake {
        /// Sandbox id.
        id: String,
    },
    /// Have the test guest dirty N MiB of memory.
    ///
    /// Example: cube sandbox dirty sb-0123456789abcdef 64
    Dirty {
        /// Sandbox id.
        id: String,
        /// MiB to write.
        mib: u64,
    },
    /// Destroy sandboxes.
    ///
    /// Example: cube sandbox rm sb-0123456789abcdef
    Rm {
        /// Sandbox ids.
        #[arg(required = true)]
        ids: Vec<String>,
    },
}

fn runtime(store: Option<&Path>, pool_size: usize) -> Result<Runtime, CliError> {
    Runtime::open(RuntimeConfig {
        store_root: store_root(store)?,
        pool_size,
        supervisor: None,
    })
    .map_err(CliError::from)
}

pub fn run_template(store: Option<&Path>, command: TemplateCommand) -> Result<(), CliError> {
    let rt = runtime(store, 0)?;
    match command {
        TemplateCommand::BuildTest {
            name,
            memory_mib,
            vcpus,
            disk_mib,
        } => {
            let meta = rt.build_test_template(
                &name,
                MachineConfig {
                    vcpus,
                    memory_bytes: memory_mib << 20,
                    irqchip: true,
                },
                WorkingSet::default(),
                disk_mib << 20,
            )?;
            println!("{}", meta.name);
        }
        TemplateCommand::Ls { json } => {
            let templates = rt.templates()?;
            if json {
                let text = serde_json::to_string_pretty(&templates)
                    .map_err(|e| CliError::failed(chain(&e)))?;
                println!("{text}");
            } else {
                println!(
                    "{:<24} {:<6} {:>6} {:>10} {:>10}",
                    "NAME", "ENGINE", "VCPUS", "MEMORY", "DISK"
                );
                for t in templates {
                    println!(
                        "{:<24} {:<6} {:>6} {:>7} MiB {:>6} MiB",
                        t.name,
                        t.engine,
                        t.machine.vcpus,
                        t.machine.memory_bytes >> 20,
                        t.rootfs_bytes >> 20
                    );
                }
            }
        }
        TemplateCommand::Rm { name } => rt.remove_template(&name)?,
    }
    Ok(())
}

pub fn run_sandbox(store: Option<&Path>, command: SandboxCommand) -> Result<(), CliError> {
    let rt = runtime(store, 0)?;
    match command {
        SandboxCommand::Create { template } => {
            let sb = rt.create(&template, CreateOptions::default())?;
            println!("{}", sb.id());
        }
        SandboxCommand::Ls { json } => {
            let list = rt.list()?;
            if json {
                let text =
                    serde_json::to_string_pretty(&list).map_err(|e| CliError::failed(chain(&e)))?;
                println!("{text}");
            } else {
                println!("{:<22} {:<6} {:<10} ORIGIN", "ID", "ENGINE", "STATE");
                for meta in list {
                    let state = match rt.attach(&meta.id).and_then(|mut s| s.status()) {
                        Ok(s) => format!("{:?}", s.status).to_lowercase(),
                        Err(_) => "gone".to_string(),
                    };
                    println!(
                        "{:<22} {:<6} {:<10} {}",
                        meta.id, meta.engine, state, meta.origin
                    );
                }
            }
        }
        SandboxCommand::Inspect { id } => {
            let status = rt.attach(&id)?.status()?;
            let text =
                serde_json::to_string_pretty(&status).map_err(|e| CliError::failed(chain(&e)))?;
            println!("{text}");
        }
        SandboxCommand::Snapshot { id } => {
            let snap = rt.attach(&id)?.snapshot()?;
            println!("{}", snap.id);
        }
        SandboxCommand::Rollback { id, snapshot } => rt.attach(&id)?.rollback(&snapshot)?,
        SandboxCommand::Clone { id, n } => {
            let mut sb = rt.attach(&id)?;
            for clone in rt.clone_sandbox(&mut sb, n, 2, CreateOptions::default())? {
                println!("{}", clone.id());
            }
        }
        SandboxCommand::Pause { id } => rt.attach(&id)?.pause()?,
        SandboxCommand::Resume { id } => rt.attach(&id)?.resume()?,
        SandboxCommand::Hibernate { id } => rt.attach(&id)?.hibernate()?,
        SandboxCommand::Wake { id } => rt.attach(&id)?.wake()?,
        SandboxCommand::Dirty { id, mib } => rt.attach(&id)?.guest_dirty(mib, 1)?,
        SandboxCommand::Rm { ids } => {
            for id in ids {
                match rt.attach(&id) {
                    Ok(sb) => sb.destroy()?,
                    // The supervisor is gone (crash, reboot): remove what it left.
                    Err(cube_core::SandboxError::Supervisor { .. }) => rt.remove_stale(&id)?,
                    Err(e) => return Err(e.into()),
                }
            }
        }
    }
    Ok(())
}
