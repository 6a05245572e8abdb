//! A jail runs a program with every isolation layer in place, reports set-up errors, and
//! leaves nothing behind.

mod common;

use cube_jail::{Jail, JailError, JailExit, SetupStage};

#[test]
fn runs_a_program_as_an_unprivileged_isolated_pid_1() {
    if common::skip() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let mut c = common::config(tmp.path(), "basic");
    c.hostname = "jailbox".into();
    let out = common::run_sh(
        &c,
        "echo pid=$$; id -u; id -g; hostname; pwd; \
         grep -E '^(CapInh|CapPrm|CapEff|CapBnd|CapAmb|NoNewPrivs|Seccomp):' /proc/self/status; \
         cat /proc/self/cgroup",
    );
    assert_eq!(out.exit, JailExit::Exited(0), "stderr: {}", out.stderr);
    let o = &out.stdout;
    assert!(o.contains("pid=1\n"), "{o}");
    // A uid (and gid) of the sandbox's own, never root or the host's nobody.
    let lines: Vec<&str> = o.lines().collect();
    let uid: u32 = lines[1].parse().unwrap();
    let gid: u32 = lines[2].parse().unwrap();
    assert!(cube_jail::sandbox_uid::RANGE.contains(&uid), "{o}");
    assert_eq!(uid, gid, "{o}");
    assert_eq!(&lines[3..5], ["jailbox", "/home/user"], "{o}");
    for set in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        assert!(
            o.contains(&format!("{set}:\t0000000000000000")),
            "{set} not empty: {o}"
        );
    }
    assert!(o.contains("NoNewPrivs:\t1"), "{o}");
    assert!(o.contains("Seccomp:\t2"), "{o}");
    // The cgroup namespace is rooted at the sandbox's own cgroup.
    for line in o.lines().filter(|l| l.contains(":/")) {
        assert!(
            line.ends_with(":/"),
            "cgroup path leaks the host tree: {line}"
        );
    }
}

#[test]
fn every_namespace_differs_from_the_hosts() {
    if common::skip() {
        return;
    }
    let kinds = ["mnt", "pid", "net", "ipc", "uts", "cgroup"];
    let tmp = tempfile::tempdir().unwrap();
    let c = common::config(tmp.path(), "ns");
    let script: String = kinds
        .iter()
        .map(|k| format!("readlink /proc/self/ns/{k};"))
        .collect();
    let out = common::run_sh(&c, &script);
    assert_eq!(out.exit, JailExit::Exited(0), "stderr: {}", out.stderr);
    let inside: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(inside.len(), kinds.len(), "{}", out.stdout);
    for (kind, inner) in kinds.iter().zip(inside) {
        let host = std::fs::read_link(format!("/proc/self/ns/{kind}")).unwrap();
        assert_ne!(host.to_str().unwrap(), inner, "{kind} namespace is shared");
    }
}

#[test]
fn set_up_failures_are_reported_and_cleaned_up() {
    if common::skip() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let c = common::config(tmp.path(), "fail");
    let err = Jail::spawn(&c, &["/no/such/program"]).unwrap_err();
    match &err {
        JailError::Setup { stage, source, .. } => {
            assert_eq!(*stage, SetupStage::Exec);
            assert_eq!(*source, nix::errno::Errno::ENOENT);
        }
        e => panic!("unexpected error {e:?}"),
    }
    assert!(err.to_string().contains("executing the program"), "{err}");
    assert!(!c.state_dir.exists(), "sandbox directory left behind");
}

#[test]
fn pid1_may_chroot_keeps_cap_sys_chroot_for_pid_1_alone() {
    if common::skip() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    // Without it, as every sandbox: no capability, and chroot is refused.
    let plain = common::run_sh(
        &common::config(tmp.path(), "nochroot"),
        "chroot / /bin/true && echo CHROOTED",
    );
    assert!(!plain.stdout.contains("CHROOTED"), "{}", plain.stdout);
    let mut c = common::config(tmp.path(), "chroot");
    c.pid1_may_chroot = true;
    // PID 1 (this shell) holds CAP_SYS_CHROOT (bit 18) and nothing else, as an ambient
    // capability it would pass on unless it empties that set (the agent does); the
    // filter lets chroot through; no_new_privs stays.
    let out = common::run_sh(
        &c,
        "grep -E '^(CapInh|CapPrm|CapEff|CapBnd|CapAmb|NoNewPrivs):' /proc/1/status; \
         chroot / /bin/true && echo CHROOTED",
    );
    assert_eq!(out.exit, JailExit::Exited(0), "stderr: {}", out.stderr);
    let o = &out.stdout;
    for set in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        assert!(
            o.contains(&format!("{set}:\t0000000000040000")),
            "{set} is not CAP_SYS_CHROOT alone: {o}"
        );
    }
    assert!(o.contains("NoNewPrivs:\t1"), "{o}");
    assert!(o.contains("CHROOTED"), "{o}\n{}", out.stderr);
}
