//! What this host can do, found by trying it (for `cube doctor` and for choosing an
//! engine): its KVM, cgroups, CRIU and eBPF, how it can track dirty pages, and whether
//! a jail starts at all; and what each sandbox's supervisor gives up once its sandbox
//! is set up.

use cube_jail::{Jail, JailConfig};

pub use cube_mem::dirty::{probe as probe_dirty_tracking, TrackerSupport};
pub use cube_supervisor::confinement::{
    Profile as SupervisorProfile, Summary as ConfinementSummary,
};
pub use cube_supervisor::host::{
    criu_check, CgroupMode, HostCapabilities, KernelMode, KvmKind, PvmFlavour,
};

/// Starts a jail running `/bin/true` and destroys it: the jail engine works here only
/// if that does. The error says why not (no namespaces, not root, no cgroups...).
pub fn probe_jail() -> Result<(), String> {
    let chain = |e: &dyn std::error::Error| crate::error_report::chain(e);
    let name = format!("doctor-{}", std::process::id());
    let dir = std::env::temp_dir().join(&name);
    let config = JailConfig::new(&name, &dir);
    let result = Jail::spawn(&config, &["/bin/true"])
        .map_err(|e| chain(&e))
        .and_then(|mut jail| {
            let exit = jail.wait().map_err(|e| chain(&e));
            let destroyed = jail.destroy().map_err(|e| chain(&e));
            match (exit, destroyed) {
                (Ok(exit), Ok(())) if exit.success() => Ok(()),
                (Ok(exit), Ok(())) => Err(format!("a jailed /bin/true ended with {exit:?}")),
                (Err(e), _) | (_, Err(e)) => Err(e),
            }
        });
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// The confinement each kind of supervisor applies to itself once its sandbox is set up
/// (capabilities kept, no_new_privs, system calls that kill it), for `cube doctor`.
pub fn supervisor_confinement() -> Vec<ConfinementSummary> {
    [
        SupervisorProfile::Vm,
        SupervisorProfile::NetworkKeeper,
        SupervisorProfile::Jail,
    ]
    .into_iter()
    .map(SupervisorProfile::summary)
    .collect()
}
