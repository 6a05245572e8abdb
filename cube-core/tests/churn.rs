//! Churn: many sandboxes of both engines, with a network or without, created and
//! destroyed (some with their supervisor killed outright and then removed as stale),
//! then a census of the host: no process, mount, cgroup, network device, datapath
//! entry, loop device or store entry of any of them is left, and this process holds
//! no more file descriptors than before.
//!
//! Size: `CUBE_CHURN` sandboxes (default 40); `scripts/fault-suite.sh churn` runs 500.
//! One test in this binary, so the descriptor count is this test's alone.

#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::engines::{processes_of, Suite};
use common::workload::count_from_env;
use common::*;
use cube_agent::protocol::ExecRequest;
use cube_core::network::{NetworkOptions, NetworkPolicy};
use cube_core::HOST_TEMPLATE;

/// How one sandbox of the churn is made and ended.
#[derive(Clone, Copy, Debug)]
struct Kind {
    vm: bool,
    network: bool,
    killed: bool,
}

/// The mix, in turn: jails with and without a network, VMs (where KVM is), and one in
/// four of each ended by SIGKILL of its supervisor.
fn kind(i: usize, vm_allowed: bool) -> Kind {
    let vm = vm_allowed && i % 3 == 2;
    Kind {
        vm,
        network: !vm && i % 3 == 1,
        killed: (i / 3) % 4 == 3,
    }
}

/// What a sandbox left a trace of, to look for afterwards.
struct Trace {
    id: String,
    cgroup_parents: Vec<PathBuf>,
    device: Option<(String, u32)>,
}

fn open_fds() -> usize {
    entries(std::path::Path::new("/proc/self/fd")).len()
}

fn ifindex(name: &str) -> Option<u32> {
    std::fs::read_to_string(format!("/sys/class/net/{name}/ifindex"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
}

fn one(rt: &Runtime, template: Option<&str>, kind: Kind) -> Trace {
    let options = CreateOptions {
        network: kind.network.then(|| NetworkOptions {
            policy: NetworkPolicy::default(),
            expose: Vec::new(),
        }),
        ..PERSISTENT
    };
    let mut sb = if kind.vm {
        rt.create(template.unwrap(), options).unwrap()
    } else {
        rt.create(HOST_TEMPLATE, options).unwrap()
    };
    let id = sb.id().to_string();
    let status = sb.status().unwrap();
    if kind.vm {
        assert_eq!(status.status, MachineStatus::Running);
    } else {
        let out = sb
            .agent()
            .unwrap()
            .exec(ExecRequest {
                argv: vec!["/bin/true".into()],
                ..ExecRequest::default()
            })
            .unwrap();
        assert_eq!(out.exit.code, Some(0));
    }
    let device = kind.network.then(|| {
        let name = sb.network().unwrap().host_ifname;
        let index = ifindex(&name).expect("the host end exists while attached");
        (name, index)
    });
    let cgroup_parents = status
        .jail
        .as_ref()
        .map(|j| {
            j.cgroups
                .iter()
                .filter_map(|c| c.parent().map(|p| p.to_path_buf()))
                .collect()
        })
        .unwrap_or_default();
    if kind.killed {
        drop(sb);
        // SAFETY: signals the supervisor this test's runtime started.
        unsafe { libc::kill(status.pid as i32, libc::SIGKILL) };
        assert!(wait_exit(status.pid, Duration::from_secs(10)));
        let gone = wait_until(Duration::from_secs(30), || processes_of(&id).is_empty());
        assert!(gone, "{id}: processes outlived the killed supervisor");
        rt.remove_stale(&id).unwrap();
    } else {
        sb.destroy().unwrap();
    }
    Trace {
        id,
        cgroup_parents,
        device,
    }
}

/// Everything of the churned sandboxes still on the host.
fn census(root: &std::path::Path, traces: &[Trace]) -> Vec<String> {
    let mut left = Vec::new();
    for pid in supervisors_of_store(&supervisor(), root) {
        left.push(format!("supervisor {pid}"));
    }
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let root_text = root.to_string_lossy();
    for line in mountinfo.lines().filter(|l| l.contains(root_text.as_ref())) {
        left.push(format!("mount {line}"));
    }
    for block in entries(std::path::Path::new("/sys/block")) {
        let backing = std::fs::read_to_string(format!("/sys/block/{block}/loop/backing_file"))
            .unwrap_or_default();
        if backing.contains(root_text.as_ref()) {
            left.push(format!("loop device {block} on {}", backing.trim()));
        }
    }
    for dir in ["sandboxes", "snapshots", "tmp"] {
        for name in entries(&root.join(dir)) {
            left.push(format!("store {dir}/{name}"));
        }
    }
    let (pool, lock) = cube_core::testing::open_pool().ok().unzip();
    drop(lock);
    for trace in traces {
        for pid in processes_of(&trace.id) {
            left.push(format!("process {pid} of {}", trace.id));
        }
        for parent in &trace.cgroup_parents {
            for name in entries(parent) {
                if name.starts_with(&trace.id) {
                    left.push(format!("cgroup {}", parent.join(name).display()));
                }
            }
        }
        if let Some((name, index)) = &trace.device {
            if ifindex(name) == Some(*index) {
                left.push(format!("device {name} of {}", trace.id));
            }
            if let Some(pool) = &pool {
                let residue = pool.residue(name, *index).unwrap();
                if residue != cube_net::Residue::default() {
                    left.push(format!("datapath entries of {name}: {residue:?}"));
                }
            }
        }
    }
    left
}

#[test]
fn churned_sandboxes_leave_nothing_behind() {
    if skip_full_jail() {
        return;
    }
    let vm_allowed = kvm_present();
    let network = std::process::Command::new("ip").arg("-V").output().is_ok();
    if !network {
        eprintln!("skipped (networked part): iproute2 (`ip`) is missing");
    }
    let n = count_from_env("CUBE_CHURN", 40);
    let suite = Suite::open(vm_allowed, None);
    let (rt, root) = (&suite.rt, suite.root.clone());
    let template = vm_allowed.then(|| suite.template.clone());
    // A first round of each kind opens whatever this process keeps open for good
    // (the datapath's handles, the runtime's files): the count starts after it.
    let mut traces = Vec::new();
    for i in 0..3 {
        let mut k = kind(i, vm_allowed);
        k.network &= network;
        traces.push(one(rt, template.as_deref(), k));
    }
    let fds_before = open_fds();
    let start = Instant::now();
    let mut made = [0usize; 4];
    for i in 0..n {
        let mut k = kind(i, vm_allowed);
        k.network &= network;
        traces.push(one(rt, template.as_deref(), k));
        made[usize::from(k.vm) * 2 + usize::from(k.killed)] += 1;
    }
    let elapsed = start.elapsed();
    let mut left = Vec::new();
    wait_until(Duration::from_secs(30), || {
        left = census(&root, &traces);
        left.is_empty()
    });
    assert!(left.is_empty(), "left on the host: {left:#?}");
    let fds_after = open_fds();
    eprintln!(
        "churn: {n} sandboxes in {elapsed:?} (jails destroyed {}, jails killed {}, VMs \
         destroyed {}, VMs killed {}, {} networked); fds {fds_before} -> {fds_after}",
        made[0],
        made[1],
        made[2],
        made[3],
        traces.iter().filter(|t| t.device.is_some()).count()
    );
    assert!(
        fds_after <= fds_before,
        "this process holds {} more descriptors after the churn",
        fds_after - fds_before
    );
}
