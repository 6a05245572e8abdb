//! A supervisor's confinement on a whole multi-threaded process: every thread (those
//! blocked in the kernel, those started later) ends with the profile's capabilities,
//! no_new_privs and the seccomp filters, blocked reads carry on, and a forbidden system
//! call kills the process with SIGSYS.
//!
//! Confinement cannot be undone, so each profile runs in a child: this test binary run
//! again with `CUBE_CONFINE_CHILD` naming the profile and the forbidden call to make.

#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::io::{Read, Write};
use std::os::unix::process::ExitStatusExt;
use std::process::Command;
use std::time::Duration;

use cube_supervisor::confinement::all_threads::{
    held_capabilities, status_field, verify_all_threads,
};
use cube_supervisor::confinement::{confine, Profile};

const CHILD: &str = "CUBE_CONFINE_CHILD";

fn root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn profile_named(name: &str) -> Profile {
    match name {
        "vm" => Profile::Vm,
        "vm-networked" => Profile::VmNetworked,
        "jail" => Profile::Jail,
        other => panic!("unknown profile {other}"),
    }
}

/// Calls the forbidden system call `name` with harmless arguments (were the filter
/// missing, each would fail or do nothing).
fn forbidden(name: &str) -> libc::c_long {
    let nul = std::ptr::null::<libc::c_char>();
    // SAFETY: every call passes null pointers or zeros, which the kernel checks; none
    // of them changes anything with these arguments.
    unsafe {
        match name {
            "mount" => libc::syscall(libc::SYS_mount, nul, nul, nul, 0, nul),
            "execve" => libc::syscall(libc::SYS_execve, c"/nonexistent".as_ptr(), nul, nul),
            "fork" => libc::syscall(libc::SYS_clone, libc::SIGCHLD as libc::c_ulong, 0, 0, 0, 0),
            "x32" => libc::syscall(libc::SYS_getpid | 0x4000_0000),
            other => panic!("no call {other}"),
        }
    }
}

/// The child: starts threads in the states a supervisor's threads are in, confines
/// itself, checks every thread, then makes the forbidden call.
fn child(spec: &str) {
    let (profile, call) = spec.split_once(':').unwrap();
    let profile = profile_named(profile);
    let (mut reader, mut writer) = std::io::pipe().unwrap();
    let blocked = std::thread::spawn(move || {
        let mut byte = [0u8; 1];
        reader.read_exact(&mut byte).unwrap();
        byte[0]
    });
    let sleeper = std::thread::spawn(|| {
        for _ in 0..50 {
            std::thread::sleep(Duration::from_millis(20));
        }
    });
    std::thread::sleep(Duration::from_millis(50));
    let held = held_capabilities().unwrap();
    confine(profile).unwrap();

    // A thread started after the confinement inherits it.
    let late = std::thread::spawn(|| std::fs::read_to_string("/proc/thread-self/status").unwrap())
        .join()
        .unwrap();
    let filtered = if profile == Profile::Jail { "0" } else { "2" };
    assert_eq!(status_field(&late, "Seccomp"), Some(filtered));
    verify_all_threads(profile.kept(held)).unwrap();
    for task in std::fs::read_dir("/proc/self/task").unwrap() {
        let status = std::fs::read_to_string(task.unwrap().path().join("status")).unwrap();
        assert_eq!(status_field(&status, "Seccomp"), Some(filtered), "{status}");
    }
    // The blocked read was interrupted by the confinement signal and carried on.
    writer.write_all(b"x").unwrap();
    assert_eq!(blocked.join().unwrap(), b'x');
    sleeper.join().unwrap();
    // Allowed work goes on: files, threads.
    std::fs::write("/proc/self/comm", "confined").unwrap();
    if profile == Profile::Jail {
        // A jail supervisor starts CRIU and jails after its confinement; CRIU needs to
        // be under no seccomp filter (see `syscall_filter`).
        assert!(Command::new("true").status().unwrap().success());
        let criu_view = Command::new("grep")
            .args(["^Seccomp:", "/proc/self/status"])
            .output()
            .unwrap();
        assert_eq!(
            String::from_utf8_lossy(&criu_view.stdout).trim(),
            "Seccomp:\t0"
        );
    }
    println!("confined");
    std::io::stdout().flush().unwrap();
    let r = forbidden(call);
    println!("survived {call}: {r}");
    std::process::exit(0);
}

#[test]
fn confinement_reaches_every_thread_and_a_forbidden_call_kills_the_process() {
    if let Ok(spec) = std::env::var(CHILD) {
        child(&spec);
        return;
    }
    if !root() {
        eprintln!("skipped: confining a supervisor needs root (capabilities to drop)");
        return;
    }
    let cases = [
        ("vm", "mount"),
        ("vm", "execve"),
        ("vm", "fork"),
        ("vm", "x32"),
        ("vm-networked", "execve"),
    ];
    for (profile, call) in cases {
        let out = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "confinement_reaches_every_thread_and_a_forbidden_call_kills_the_process",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD, format!("{profile}:{call}"))
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            stdout.contains("confined"),
            "{profile}: the child did not confine itself: {out:?}"
        );
        assert_eq!(
            out.status.signal(),
            Some(libc::SIGSYS),
            "{profile}: {call} did not kill the process: {stdout}"
        );
    }
    // The jail profile: capabilities and no_new_privs, no filter (CRIU runs under it).
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "confinement_reaches_every_thread_and_a_forbidden_call_kills_the_process",
            "--nocapture",
        ])
        .env(CHILD, "jail:x32")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("confined") && stdout.contains("survived x32") && out.status.success(),
        "jail: {out:?}"
    );
}
