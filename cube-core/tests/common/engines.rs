//! Sandboxes of either engine for the fault suites: a private store and runtime per
//! engine, the state a sandbox is expected to hold, and what of a sandbox is left on
//! the host after it is gone.

use std::path::{Path, PathBuf};

use cube_core::HOST_TEMPLATE;

use super::workload::{JailState, VmState, VM_PAGES};
use super::*;

/// What a sandbox of either engine is expected to hold.
#[derive(Clone, Debug)]
pub enum Expected {
    /// A jail holding this state.
    Jail(JailState),
    /// A test-guest VM whose dirty area holds this pattern.
    Vm(u64),
}

impl Expected {
    /// Asserts that `sb` holds this state.
    pub fn check(&self, sb: &mut Sandbox, when: &str) {
        match self {
            Expected::Jail(state) => state.check(&sb.agent().unwrap(), when),
            Expected::Vm(pattern) => VmState { pattern: *pattern }.check(sb, when),
        }
    }

    /// Whether `sb` holds this state (for a snapshot that may hold one of several).
    pub fn holds(&self, sb: &mut Sandbox) -> bool {
        match self {
            Expected::Jail(state) => {
                let agent = sb.agent().unwrap();
                let files = super::workload::sh(
                    &agent,
                    "cd $HOME/state && for f in $(ls); do echo \"$f=$(cat $f)\"; done",
                );
                let mut want: Vec<String> = state
                    .files
                    .iter()
                    .map(|(n, c)| format!("{n}={c}"))
                    .collect();
                want.sort();
                let mut found: Vec<String> = files.lines().map(str::to_string).collect();
                found.sort();
                py(&agent, "x") == state.x.to_string() && found == want
            }
            Expected::Vm(pattern) => {
                dirty_area_words(sb, VM_PAGES) == pattern_words(*pattern, VM_PAGES)
            }
        }
    }
}

/// Processes whose cgroup path names sandbox `id`.
pub fn processes_of(id: &str) -> Vec<u32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
        if cgroup.contains(id) && pid_alive(pid) {
            found.push(pid);
        }
    }
    found
}

/// One engine's world: a private store, a runtime on it, the template.
pub struct Suite {
    _dir: Option<tempfile::TempDir>,
    /// The store root.
    pub root: PathBuf,
    /// The runtime on it.
    pub rt: Runtime,
    /// The template its sandboxes start from (the test guest's, or the host's).
    pub template: String,
    /// Whether this is the VM engine's (else the jail's).
    pub vm: bool,
}

impl Suite {
    /// The jail engine's, on a private store; None (after saying why) where full-state
    /// jails cannot run.
    pub fn jail() -> Option<Suite> {
        if skip_full_jail() {
            return None;
        }
        Some(Suite::open(false, None))
    }

    /// The VM engine's, on a private store; None (after saying why) without KVM.
    pub fn vm() -> Option<Suite> {
        if !kvm_present() {
            return None;
        }
        Some(Suite::open(true, None))
    }

    /// A suite on the store at `root` (None: a private temporary one).
    pub fn open(vm: bool, root: Option<&Path>) -> Suite {
        let (dir, root) = match root {
            Some(root) => (None, root.to_path_buf()),
            None => {
                let dir = tempfile::TempDir::new().unwrap();
                let root = dir.path().canonicalize().unwrap();
                (Some(dir), root)
            }
        };
        let rt = Runtime::open(RuntimeConfig {
            store_root: root.clone(),
            pool_size: 0,
            network_pool_size: 0,
            supervisor: Some(supervisor()),
        })
        .unwrap();
        let template = if vm {
            rt.build_test_template("faults", machine(), NO_WORKING_SET, 0)
                .unwrap();
            "faults".to_string()
        } else {
            HOST_TEMPLATE.to_string()
        };
        Suite {
            _dir: dir,
            root,
            rt,
            template,
            vm,
        }
    }

    /// The engine's name, for messages.
    pub fn name(&self) -> &'static str {
        if self.vm {
            "vm"
        } else {
            "jail"
        }
    }

    /// A sandbox holding state `x`.
    pub fn create(&self, x: i64) -> (Sandbox, Expected) {
        let mut sb = self.rt.create(&self.template, PERSISTENT).unwrap();
        let state = self.set(&mut sb, None, x);
        (sb, state)
    }

    /// Moves `sb` to state `x` (from `from`, for a jail whose server runs already).
    pub fn set(&self, sb: &mut Sandbox, from: Option<&Expected>, x: i64) -> Expected {
        if self.vm {
            return Expected::Vm(VmState::set(sb, 0x5000_0000_0000 + x as u64).pattern);
        }
        let agent = sb.agent().unwrap();
        let mut state = match from {
            Some(Expected::Jail(s)) => s.clone(),
            _ => JailState::start(&agent),
        };
        state.advance(&agent, x, "f", &format!("state-{x}"));
        Expected::Jail(state)
    }

    /// Whatever of sandbox `id` is still on the host: processes, cgroups, mounts,
    /// store entries.
    pub fn leftovers(&self, id: &str, cgroup_parents: &[PathBuf]) -> Vec<String> {
        let mut left = Vec::new();
        for pid in processes_of(id) {
            left.push(format!("process {pid}"));
        }
        for parent in cgroup_parents {
            for name in entries(parent) {
                if name.starts_with(id) {
                    left.push(format!("cgroup {}", parent.join(name).display()));
                }
            }
        }
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        for line in mountinfo.lines().filter(|l| l.contains(id)) {
            left.push(format!("mount {line}"));
        }
        if self.root.join("sandboxes").join(id).exists() {
            left.push("its store directory".into());
        }
        for meta in self.rt.snapshots(Some(id)).unwrap() {
            left.push(format!("snapshot {}", meta.id));
        }
        for name in entries(&self.root.join("tmp")) {
            left.push(format!("store scratch {name}"));
        }
        left
    }
}
