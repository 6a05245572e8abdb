//! `cube doctor`: what this host can do, found by trying it.

use std::path::Path;

use serde::Serialize;

use crate::cli_error::{chain, CliError};
use crate::store_cmd::store_root;
use cube_core::host::{
    probe_dirty_tracking, probe_jail, supervisor_confinement, ConfinementSummary, HostCapabilities,
    KvmKind, PvmFlavour,
};
use cube_core::store::{filesystem_name, supports_reflink};
use cube_core::templates::{cube_guest_kernel, PVM_STOCK_KERNEL};

/// The doctor's report.
#[derive(Serialize)]
struct Report {
    #[serde(flatten)]
    host: HostCapabilities,
    /// The store root examined.
    store: String,
    /// Filesystem of the store.
    store_filesystem: Option<String>,
    /// Whether the store's filesystem can reflink.
    reflink: bool,
    /// Whether soft-dirty page tracking works.
    soft_dirty: bool,
    /// Whether userfaultfd write-protect tracking works.
    uffd_wp: bool,
    /// Whether KVM's dirty log works.
    kvm_dirty_log: bool,
    /// Usable engines, strongest first.
    engines: Vec<&'static str>,
    /// What each kind of supervisor gives up once its sandbox is set up.
    supervisor_confinement: Vec<ConfinementSummary>,
    /// Plain-language notes on what does not work and why.
    notes: Vec<String>,
}

/// What a PVM host means for Linux guests, by flavour.
fn pvm_note(flavour: Option<PvmFlavour>) -> String {
    let which = match flavour {
        Some(PvmFlavour::VirtPvm) => {
            "the public virt-pvm (a kernel built with its CONFIG_PVM_GUEST would run natively)"
        }
        Some(PvmFlavour::Private) => {
            "a private variant (MSR 0x4b564d11 reads \"PVM\"): no public PVM guest kernel runs \
             natively on it"
        }
        Some(PvmFlavour::Unknown) | None => "a flavour Cube does not recognise",
    };
    format!(
        "KVM is PVM, {which}. Guest CPL3 code runs natively, guest kernel code is emulated \
         (about a microsecond an instruction): Linux guests run in Cube's emulated-kernel \
         mode, correct but slow (Cube's guest kernel boots in tens of seconds, exec and \
         Python pay for every system call); the test guest runs at native speed"
    )
}

/// A note where the kernel lets a process hard-link files it neither owns nor may
/// write (`fs.protected_hardlinks` off): a confined VM supervisor owns its sandbox's
/// directory, and could then link another sandbox's socket or files into it, where
/// the library takes what it finds as that sandbox's own.
fn protected_hardlinks_note() -> Option<String> {
    hardlinks_note(&std::fs::read_to_string("/proc/sys/fs/protected_hardlinks").ok()?)
}

/// [`protected_hardlinks_note`] for the sysctl's `value`.
fn hardlinks_note(value: &str) -> Option<String> {
    (value.trim() == "0").then(|| {
        "fs.protected_hardlinks is 0: a VM supervisor could hard-link other sandboxes' \
         sockets and files into its own directory; set it to 1 (sysctl \
         fs.protected_hardlinks=1, the default of most distributions)"
            .to_string()
    })
}

pub fn run(store: Option<&Path>, json: bool) -> Result<(), CliError> {
    let host = HostCapabilities::probe();
    let root = store_root(store)?;
    let probe_dir = if root.exists() {
        root.clone()
    } else {
        std::env::temp_dir()
    };
    let reflink = supports_reflink(&probe_dir).unwrap_or(false);
    let store_filesystem = filesystem_name(&probe_dir).ok();
    let tracking = probe_dirty_tracking();
    let mut notes = Vec::new();
    let mut engines = Vec::new();
    match host.kvm {
        KvmKind::Hardware => engines.push("vm"),
        KvmKind::Pvm => {
            engines.push("vm");
            notes.push(pvm_note(host.pvm_flavour));
            if cube_guest_kernel(&root).is_none() {
                notes.push(PVM_STOCK_KERNEL.to_string());
            }
        }
        KvmKind::None => notes.push("no usable /dev/kvm: the vm engine is unavailable".to_string()),
    }
    match probe_jail() {
        Ok(()) => {
            engines.push("jail");
            notes.push(
                "the jail engine isolates with namespaces, cgroups, dropped capabilities, an \
                 unprivileged uid and seccomp on the host's own kernel: weaker than a VM, where \
                 one kernel bug can cross sandboxes"
                    .to_string(),
            );
        }
        Err(reason) => notes.push(format!("the jail engine is unavailable: {reason}")),
    }
    if !reflink {
        notes.push(format!(
            "the store's filesystem ({}) cannot reflink: snapshots fall back to sparse copies; run `cube store setup` to put the store on a loop-mounted XFS image",
            store_filesystem.clone().unwrap_or_else(|| "unknown".into())
        ));
    }
    if let Some(note) = protected_hardlinks_note() {
        notes.push(note);
    }
    if !tracking.soft_dirty {
        notes.push(
            "soft-dirty tracking is unavailable (kernel lacks CONFIG_MEM_SOFT_DIRTY)".to_string(),
        );
    }
    let report = Report {
        host,
        store: root.display().to_string(),
        store_filesystem,
        reflink,
        soft_dirty: tracking.soft_dirty,
        uffd_wp: tracking.uffd_wp,
        kvm_dirty_log: tracking.kvm_dirty_log,
        engines,
        supervisor_confinement: supervisor_confinement(),
        notes,
    };
    if json {
        let text =
            serde_json::to_string_pretty(&report).map_err(|e| CliError::failed(chain(&e)))?;
        println!("{text}");
        return Ok(());
    }
    let value = serde_json::to_value(&report).map_err(|e| CliError::failed(chain(&e)))?;
    println!("{:<28} VALUE", "CAPABILITY");
    if let serde_json::Value::Object(map) = value {
        for (key, v) in map {
            if key == "notes" || key == "supervisor_confinement" {
                continue;
            }
            let shown = match v {
                serde_json::Value::String(s) => s,
                serde_json::Value::Null => "-".to_string(),
                other => other.to_string(),
            };
            println!("{key:<28} {shown}");
        }
    }
    println!();
    println!("SUPERVISOR CONFINEMENT (applied by each sandbox's supervisor once it is set up)");
    for c in &report.supervisor_confinement {
        let kept = if c.capabilities_kept.is_empty() {
            "none".to_string()
        } else {
            c.capabilities_kept.join(",")
        };
        let filter = if c.syscalls_killed.is_empty() {
            "no seccomp filter (CRIU, which it runs, must have none)".to_string()
        } else {
            format!(
                "{} system calls kill it: {}",
                c.syscalls_killed.len(),
                c.syscalls_killed.join(",")
            )
        };
        let mut threads_allowed = String::new();
        for (threads, list) in [
            ("vCPU threads", &c.vcpu_syscalls_allowed),
            ("device event loop", &c.device_loop_syscalls_allowed),
        ] {
            if !list.is_empty() {
                threads_allowed.push_str(&format!(
                    "; its {threads} may make only: {}",
                    list.join(",")
                ));
            }
        }
        println!(
            "{:<15} runs as {}; no_new_privs, capabilities kept: {kept}; {filter}{threads_allowed}; files: {}",
            serde_json::to_value(c.profile)
                .ok()
                .and_then(|v| v.as_str().map(str::to_string))
                .unwrap_or_default(),
            c.runs_as,
            c.filesystem,
        );
    }
    println!();
    for note in &report.notes {
        println!("note: {note}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unprotected_hardlinks_get_a_note() {
        assert!(hardlinks_note("0\n").is_some_and(|n| n.contains("protected_hardlinks=1")));
        assert!(hardlinks_note("1\n").is_none());
        assert!(hardlinks_note("").is_none());
    }
}
