//! `cube template` and `cube sandbox`: templates and sandboxes that live across
//! invocations.

use std::path::Path;

use clap::Subcommand;
use cube_core::templates::{MachineConfig, WorkingSet};
use cube_core::testing::TestGuestControl;
use cube_core::{CreateOptions, Engine, Runtime, RuntimeConfig, SnapshotKind, HOST_TEMPLATE};

use cube_core::network::PortMapping;

use crate::cli_error::{chain, CliError};
use crate::files_cmd;
use crate::net_cmd::{self, NetworkArgs, PolicyArgs};
use crate::run_cmd::{self, CodeLanguage};
use crate::store_cmd::store_root;
use crate::table::{self, Table};

/// What a filesystem snapshot means for the user, said wherever one is taken or used.
const FILESYSTEM_NOTE: &str = "filesystem snapshot: files only; a rollback or clone \
    restarts the sandbox's processes (running commands and code contexts are lost)";

/// A `KEY=VALUE` argument.
fn key_value(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("expected KEY=VALUE, got {s:?}")),
    }
}

#[derive(Subcommand)]
pub enum TemplateCommand {
    /// Build a template: for the jail engine a standalone root filesystem from Debian
    /// packages (python3, pip), a directory or a container image (--from-oci); for the
    /// vm engine a booted Linux guest whose agent answered, snapshotted.
    ///
    /// Example: cube template build py --packages python3-numpy
    Build(Box<crate::template_build_cmd::BuildArgs>),
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
    /// Create a sandbox from a template (default: host, the built-in jail template);
    /// prints its id.
    ///
    /// Example: cube sandbox create --engine jail --env A=1 --memory-mib 512
    Create {
        /// Template name (also --template).
        #[arg(value_name = "TEMPLATE")]
        positional: Option<String>,
        /// Template name.
        #[arg(long, conflicts_with = "positional")]
        template: Option<String>,
        /// Create from this snapshot (any in the store: taken here, or imported)
        /// instead of a template.
        #[arg(long, value_name = "ID", conflicts_with_all = ["positional", "template"])]
        snapshot: Option<String>,
        /// Engine: auto (the template's), vm or jail.
        #[arg(long, value_enum, default_value_t = run_cmd::Engine::Auto)]
        engine: run_cmd::Engine,
        /// Sandbox-wide environment variable (repeatable).
        #[arg(long = "env", value_name = "KEY=VALUE", value_parser = key_value)]
        env: Vec<(String, String)>,
        /// A label stored with the sandbox (repeatable).
        #[arg(long = "label", value_name = "KEY=VALUE", value_parser = key_value)]
        labels: Vec<(String, String)>,
        /// Memory limit, MiB, its /tmp and /dev/shm included [default: 2048 where the
        /// host has a memory cgroup controller].
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
        memory_mib: Option<u64>,
        /// CPU limit in thousandths of a core [default: 1000 where the host has a cpu
        /// cgroup controller].
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
        cpu_millis: Option<u32>,
        /// Most processes and threads at once [default: 4096 where the host has a pids
        /// cgroup controller].
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
        pids_max: Option<u32>,
        /// What the sandbox's files may take on disk, MiB; past it writes fail with
        /// ENOSPC inside [default: 4096 on a store with project quotas, see `cube store
        /// setup`].
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
        disk_mib: Option<u64>,
        /// Destroy the sandbox after this many seconds.
        #[arg(long, value_name = "S")]
        lifetime: Option<f64>,
        #[command(flatten)]
        network: NetworkArgs,
    },
    /// Run a command in a sandbox, streaming its output; exits with its exit code.
    ///
    /// Example: cube sandbox exec sb-0123456789abcdef -- python3 -c 'print(1)'
    ///
    /// Interactive: cube sandbox exec --tty sb-0123456789abcdef -- bash
    Exec {
        /// Sandbox id.
        id: String,
        /// Kill the command after this many seconds and exit 124.
        #[arg(long, value_name = "S")]
        timeout: Option<f64>,
        /// Run the command on a terminal of its own in the sandbox, typed into from
        /// this terminal (which goes raw meanwhile) and resized with its window.
        /// Needs a terminal on standard input.
        #[arg(short = 't', long)]
        tty: bool,
        /// The command and its arguments (after `--`).
        #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
        command: Vec<String>,
    },
    /// Run a code cell in a sandbox's named context (made on first use; variables
    /// persist between calls until a rollback, clone or wake restarts the sandbox).
    ///
    /// Example: cube sandbox code sb-0123456789abcdef 'x = 41; x + 1'
    Code {
        /// Sandbox id.
        id: String,
        /// Language of the cell.
        #[arg(long, value_enum, default_value_t = CodeLanguage::Python)]
        language: CodeLanguage,
        /// Context name.
        #[arg(long, default_value = "main")]
        context: String,
        /// Interrupt the cell after this many seconds (the context survives).
        #[arg(long, value_name = "S")]
        timeout: Option<f64>,
        /// The code, or `-` to read it from standard input.
        code: String,
    },
    /// List snapshots (of one sandbox, or all) with their kind.
    ///
    /// Example: cube sandbox snapshots sb-0123456789abcdef --json
    Snapshots {
        /// Sandbox id.
        id: Option<String>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// List sandboxes; with an id, list files inside that sandbox instead
    ///
    /// Examples:
    ///   cube sandbox ls --json
    ///   cube sandbox ls sb-0123456789abcdef /tmp --depth 2
    #[command(verbatim_doc_comment)]
    Ls {
        /// Sandbox id: list the files under PATH inside it.
        id: Option<String>,
        /// Directory inside the sandbox (with an id).
        #[arg(default_value = "/", requires = "id")]
        path: String,
        /// Levels to descend below PATH (with an id).
        #[arg(long, default_value_t = 1, value_name = "N", requires = "id",
              value_parser = clap::value_parser!(u32).range(1..))]
        depth: u32,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Show a sandbox's state: engine, status, machine or jail, labels and snapshots.
    ///
    /// Example: cube sandbox inspect sb-0123456789abcdef --json
    Inspect {
        /// Sandbox id.
        id: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Copy a file into or out of a sandbox (ID:/path), streamed
    ///
    /// `-` is stdin/stdout; a directory destination keeps the file's name; a bar
    /// shows progress on a terminal.
    ///
    /// Examples:
    ///   cube sandbox cp ./data.csv sb-0123456789abcdef:/tmp/data.csv
    ///   cube sandbox cp sb-0123456789abcdef:/tmp/out.png .
    #[command(verbatim_doc_comment)]
    Cp {
        /// Source: a host path, `-`, or ID:/path.
        src: String,
        /// Destination: a host path, `-`, or ID:/path.
        dst: String,
    },
    /// Print a file from inside a sandbox.
    ///
    /// Example: cube sandbox cat sb-0123456789abcdef /etc/os-release
    Cat {
        /// Sandbox id.
        id: String,
        /// Absolute path inside the sandbox.
        path: String,
    },
    /// Snapshot a sandbox; prints the snapshot id (and its kind on stderr: full, or
    /// filesystem for a jail).
    ///
    /// Example: cube sandbox snapshot sb-0123456789abcdef
    Snapshot {
        /// Sandbox id.
        id: String,
        /// Print JSON (id, kind, sandbox).
        #[arg(long)]
        json: bool,
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
    /// Change a running jail sandbox's limits; those not given stay. They hold
    /// across rollbacks, hibernation and wake. A VM's are fixed at create.
    ///
    /// Example: cube sandbox limits sb-0123456789abcdef --memory-mib 4096 --pids-max 512
    #[command(group(clap::ArgGroup::new("limit").required(true).multiple(true)))]
    Limits {
        /// Sandbox id.
        id: String,
        /// Memory limit, MiB (its /tmp and /dev/shm take their new size at its next
        /// start).
        #[arg(long, value_name = "N", group = "limit", value_parser = clap::value_parser!(u64).range(1..))]
        memory_mib: Option<u64>,
        /// CPU limit in thousandths of a core.
        #[arg(long, value_name = "N", group = "limit", value_parser = clap::value_parser!(u32).range(1..))]
        cpu_millis: Option<u32>,
        /// Most processes and threads at once.
        #[arg(long, value_name = "N", group = "limit", value_parser = clap::value_parser!(u32).range(1..))]
        pids_max: Option<u32>,
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
    /// Show a sandbox's network: device, policy, exposed ports, traffic counters.
    ///
    /// Example: cube sandbox net sb-0123456789abcdef --json
    Net {
        /// Sandbox id.
        id: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Replace a live sandbox's egress policy (new connections see it at once).
    ///
    /// Example: cube sandbox policy sb-0123456789abcdef --deny-out 203.0.113.0/24
    Policy {
        /// Sandbox id.
        id: String,
        #[command(flatten)]
        policy: PolicyArgs,
    },
    /// Serve a sandbox port on the host's addresses, or withdraw it (--remove).
    ///
    /// Example: cube sandbox expose sb-0123456789abcdef 8080:80
    Expose {
        /// Sandbox id.
        id: String,
        /// PORT or HOST_PORT:SANDBOX_PORT.
        #[arg(value_parser = net_cmd::parse_port)]
        port: PortMapping,
        /// Withdraw the host port instead.
        #[arg(long)]
        remove: bool,
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

pub fn runtime(store: Option<&Path>, pool_size: usize) -> Result<Runtime, CliError> {
    Runtime::open(RuntimeConfig {
        store_root: store_root(store)?,
        pool_size,
        network_pool_size: 0,
        supervisor: None,
    })
    .map_err(CliError::from)
}

pub fn run_template(store: Option<&Path>, command: TemplateCommand) -> Result<(), CliError> {
    let rt = runtime(store, 0)?;
    match command {
        TemplateCommand::Build(args) => crate::template_build_cmd::run(&rt, &args, store)?,
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
                    if t.engine == Engine::Jail {
                        let what = if t.name == HOST_TEMPLATE {
                            "built in: the host's userland, read-only"
                        } else {
                            t.built_from.as_deref().unwrap_or("jail")
                        };
                        println!("{:<24} {:<6} {:>6} {what}", t.name, t.engine, "-");
                        continue;
                    }
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

/// Runs `cube sandbox`; returns the exit code (exec and code pass on the command's).
pub fn run_sandbox(store: Option<&Path>, command: SandboxCommand) -> Result<u8, CliError> {
    let rt = runtime(store, 0)?;
    match command {
        SandboxCommand::Create {
            positional,
            template,
            snapshot,
            engine,
            env,
            labels,
            memory_mib,
            cpu_millis,
            pids_max,
            disk_mib,
            lifetime,
            network,
        } => {
            let template = template
                .or(positional)
                .unwrap_or_else(|| HOST_TEMPLATE.to_string());
            let engine: cube_core::EngineChoice = engine.into();
            // Said up front, before a supervisor fails deep inside on a missing device.
            let template_engine = rt
                .templates()?
                .into_iter()
                .find(|t| t.name == template)
                .map(|t| t.engine);
            if engine == cube_core::EngineChoice::Vm || template_engine == Some(Engine::Vm) {
                crate::cli_error::require_kvm(std::path::Path::new(crate::cli_error::KVM_DEVICE))?;
            }
            let options = CreateOptions {
                ephemeral: false,
                engine,
                env,
                metadata: labels.into_iter().collect(),
                lifetime: run_cmd::parse_timeout(lifetime)?,
                memory_mib,
                cpu_millis,
                pids_max,
                disk_mib,
                network: network.options()?,
                ..CreateOptions::new(false)
            };
            let sb = match snapshot {
                Some(snapshot) => rt.create_from_snapshot(&snapshot, options)?,
                None => rt.create(&template, options)?,
            };
            println!("{}", sb.id());
        }
        SandboxCommand::Exec {
            id,
            timeout,
            tty: true,
            command,
        } => {
            let timeout = run_cmd::parse_timeout(timeout)?;
            let sandbox = rt.attach(&id)?;
            return crate::tty_exec::run(|| Ok(sandbox.agent()?), &command, timeout);
        }
        SandboxCommand::Exec {
            id,
            timeout,
            tty: false,
            command,
        } => {
            let timeout = run_cmd::parse_timeout(timeout)?;
            let stdin = run_cmd::forwarded_stdin()?;
            let client = rt.attach(&id)?.agent()?;
            let code = run_cmd::stream_exec(&client, &command, timeout, stdin)?;
            return Ok(code);
        }
        SandboxCommand::Code {
            id,
            language,
            context,
            timeout,
            code,
        } => {
            let timeout = run_cmd::parse_timeout(timeout)?;
            let code = run_cmd::read_code(&code)?;
            let client = rt.attach(&id)?.agent()?;
            return run_cmd::run_cell(&client, &context, language.into(), &code, timeout);
        }
        SandboxCommand::Snapshots { id, json } => {
            if let Some(id) = &id {
                // An unknown sandbox is an error, not an empty list.
                if !rt.list()?.iter().any(|m| &m.id == id) {
                    return Err(cube_core::SandboxError::UnknownSandbox(id.clone()).into());
                }
            }
            let snaps = rt.snapshots(id.as_deref())?;
            if json {
                crate::table::print_json(&snaps)?;
            } else {
                let mut t = Table::new(&["ID", "SANDBOX", "ENGINE", "KIND", "CREATED"]);
                for s in snaps {
                    t.row(vec![
                        s.id,
                        s.sandbox,
                        s.engine.to_string(),
                        s.kind.to_string(),
                        table::human_age(s.created_unix),
                    ]);
                }
                t.print();
            }
        }
        SandboxCommand::Ls {
            id: Some(id),
            path,
            depth,
            json,
        } => files_cmd::list(&rt, &id, &path, depth, json)?,
        SandboxCommand::Ls { id: None, json, .. } => {
            let list = rt.list()?;
            if json {
                crate::table::print_json(&list)?;
            } else {
                let mut t = Table::new(&["ID", "ENGINE", "STATE", "CREATED", "ORIGIN", "LABELS"]);
                for meta in list {
                    let state = match rt.attach(&meta.id).and_then(|mut s| s.status()) {
                        Ok(s) => format!("{:?}", s.status).to_lowercase(),
                        Err(_) => "gone".to_string(),
                    };
                    t.row(vec![
                        meta.id,
                        meta.engine.to_string(),
                        state,
                        table::human_age(meta.created_unix),
                        meta.origin,
                        table::labels(&meta.metadata),
                    ]);
                }
                t.print();
            }
        }
        SandboxCommand::Inspect { id, json } => {
            let status = rt.attach(&id)?.status()?;
            let mut value =
                serde_json::to_value(&status).map_err(|e| CliError::failed(chain(&e)))?;
            let record = rt.list()?.into_iter().find(|m| m.id == id);
            let snapshots = rt.snapshots(Some(&id))?;
            if let Some(map) = value.as_object_mut() {
                map.insert("id".into(), id.clone().into());
                if let Some(record) = &record {
                    map.insert("origin".into(), record.origin.clone().into());
                    map.insert("created_unix".into(), record.created_unix.into());
                    map.insert(
                        "metadata".into(),
                        serde_json::to_value(&record.metadata)
                            .map_err(|e| CliError::failed(chain(&e)))?,
                    );
                }
                map.insert(
                    "snapshots".into(),
                    serde_json::to_value(&snapshots).map_err(|e| CliError::failed(chain(&e)))?,
                );
            }
            if json {
                crate::table::print_json(&value)?;
            } else {
                let status_text = format!("{:?}", status.status).to_lowercase();
                let mut t = Table::new(&["FIELD", "VALUE"]);
                t.row(vec!["id".into(), id.clone()]);
                t.row(vec!["engine".into(), status.engine.to_string()]);
                t.row(vec!["status".into(), status_text]);
                t.row(vec!["supervisor pid".into(), status.pid.to_string()]);
                t.row(vec![
                    "memory (rss)".into(),
                    table::human_bytes(status.rss_kib << 10),
                ]);
                if let Some(machine) = &status.config {
                    t.row(vec!["vcpus".into(), machine.vcpus.to_string()]);
                    t.row(vec![
                        "guest memory".into(),
                        table::human_bytes(machine.memory_bytes),
                    ]);
                }
                if let Some(jail) = &status.jail {
                    let pid = jail.pid.map_or("- (hibernated)".into(), |p| p.to_string());
                    t.row(vec!["agent pid".into(), pid]);
                    t.row(vec![
                        "writable layer".into(),
                        jail.layer.display().to_string(),
                    ]);
                    t.row(vec![
                        "agent socket".into(),
                        jail.agent_socket.display().to_string(),
                    ]);
                }
                if let Some(record) = &record {
                    t.row(vec!["origin".into(), record.origin.clone()]);
                    t.row(vec![
                        "created".into(),
                        table::human_age(record.created_unix),
                    ]);
                    t.row(vec!["labels".into(), table::labels(&record.metadata)]);
                }
                t.row(vec![
                    "snapshots".into(),
                    if snapshots.is_empty() {
                        "-".into()
                    } else {
                        snapshots
                            .iter()
                            .map(|s| format!("{} ({})", s.id, s.kind))
                            .collect::<Vec<_>>()
                            .join(", ")
                    },
                ]);
                t.print();
            }
        }
        SandboxCommand::Cp { src, dst } => {
            files_cmd::copy(&rt, &src, &dst)?;
        }
        SandboxCommand::Cat { id, path } => files_cmd::cat(&rt, &id, &path)?,
        SandboxCommand::Snapshot { id, json } => {
            let snap = rt.attach(&id)?.snapshot()?;
            if json {
                let v = serde_json::json!({ "id": snap.id, "kind": snap.kind, "sandbox": id });
                println!("{v}");
            } else {
                println!("{}", snap.id);
            }
            match snap.kind {
                SnapshotKind::Full => eprintln!("full snapshot: memory, CPU and files"),
                SnapshotKind::Filesystem => match &snap.fallback {
                    Some(why) => eprintln!("{FILESYSTEM_NOTE}\n(not a full snapshot: {why})"),
                    None => eprintln!("{FILESYSTEM_NOTE}"),
                },
            }
        }
        SandboxCommand::Rollback { id, snapshot } => {
            rt.attach(&id)?.rollback(&snapshot)?;
            let kind = rt
                .snapshots(Some(&id))?
                .into_iter()
                .find(|s| s.id == snapshot)
                .map(|s| s.kind);
            if kind == Some(SnapshotKind::Filesystem) {
                eprintln!("rolled back the files; the sandbox's processes were restarted (running commands and code contexts are lost)");
            }
        }
        SandboxCommand::Clone { id, n } => {
            let mut sb = rt.attach(&id)?;
            for clone in rt.clone_sandbox(&mut sb, n, 2, CreateOptions::default())? {
                println!("{}", clone.id());
            }
            // The snapshot the clones came from is the sandbox's newest.
            let kind = rt
                .snapshots(Some(&id))?
                .into_iter()
                .max_by_key(|s| s.created_unix)
                .map(|s| s.kind);
            if sb.engine() == Engine::Jail && kind == Some(SnapshotKind::Filesystem) {
                eprintln!("clones made from a {FILESYSTEM_NOTE}");
            }
        }
        SandboxCommand::Limits {
            id,
            memory_mib,
            cpu_millis,
            pids_max,
        } => rt.attach(&id)?.set_limits(cube_core::LimitChange {
            memory_mib,
            cpu_millis,
            pids_max,
        })?,
        SandboxCommand::Pause { id } => rt.attach(&id)?.pause()?,
        SandboxCommand::Resume { id } => rt.attach(&id)?.resume()?,
        SandboxCommand::Hibernate { id } => rt.attach(&id)?.hibernate()?,
        SandboxCommand::Wake { id } => rt.attach(&id)?.wake()?,
        SandboxCommand::Dirty { id, mib } => rt.attach(&id)?.guest_dirty(mib, 1)?,
        SandboxCommand::Net { id, json } => {
            let report = rt.attach(&id)?.network()?;
            net_cmd::print_report(&report, json)?;
        }
        SandboxCommand::Policy { id, policy } => {
            rt.attach(&id)?.set_policy(&policy.policy()?)?;
        }
        SandboxCommand::Expose { id, port, remove } => {
            let mut sb = rt.attach(&id)?;
            if remove {
                sb.unexpose(port.host_port)?;
            } else {
                sb.expose(port)?;
            }
        }
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
    Ok(0)
}
