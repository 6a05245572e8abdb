//! Helpers shared by the jail integration tests.
// Each test binary uses a different subset; helpers panic like the tests they serve.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::io::Read;
use std::path::{Path, PathBuf};

use cube_jail::{Jail, JailConfig, JailExit, Stdio};

/// Why this host cannot run jails, if it cannot.
pub fn missing_capability() -> Option<String> {
    // SAFETY: geteuid has no failure mode.
    if unsafe { libc::geteuid() } != 0 {
        return Some("jails need root (CAP_SYS_ADMIN for namespaces and mounts)".into());
    }
    if cube_jail::CgroupLayout::detect().is_err() {
        return Some("no cgroup hierarchy is readable".into());
    }
    None
}

/// Returns true (after printing the reason) when the test must be skipped.
pub fn skip() -> bool {
    match missing_capability() {
        Some(reason) => {
            println!("skipped: {reason}");
            true
        }
        None => false,
    }
}

/// A name unique to this test run.
pub fn unique(test: &str) -> String {
    format!("t{}-{test}", std::process::id())
}

/// A config whose state dir lives under `tmp`, with piped stdout and stderr.
pub fn config(tmp: &Path, test: &str) -> JailConfig {
    let mut c = JailConfig::new(unique(test), tmp.join(test));
    c.stdout = Stdio::Pipe;
    c.stderr = Stdio::Pipe;
    c
}

/// Output of a finished jail.
pub struct Finished {
    pub exit: JailExit,
    pub stdout: String,
    pub stderr: String,
}

/// Reads both pipes to the end (stderr on a thread) and waits for PID 1.
pub fn collect(jail: &mut Jail) -> Finished {
    let mut err_pipe = jail.take_stderr().expect("stderr is piped");
    let err_thread = std::thread::spawn(move || {
        let mut s = String::new();
        err_pipe.read_to_string(&mut s).unwrap();
        s
    });
    let mut stdout = String::new();
    jail.take_stdout()
        .expect("stdout is piped")
        .read_to_string(&mut stdout)
        .unwrap();
    let exit = jail.wait().unwrap();
    Finished {
        exit,
        stdout,
        stderr: err_thread.join().unwrap(),
    }
}

/// Spawns `sh -c script`, collects its output and destroys the jail.
pub fn run_sh(config: &JailConfig, script: &str) -> Finished {
    let mut jail = Jail::spawn(config, &["/bin/sh", "-c", script]).unwrap();
    let out = collect(&mut jail);
    jail.destroy().unwrap();
    out
}

/// Mount points of this (host) process under `dir`.
pub fn host_mounts_under(dir: &Path) -> Vec<PathBuf> {
    cube_jail::rootfs::mounts_under(dir).unwrap()
}

/// Whether some mounted hierarchy enforces `controller`.
pub fn has_controller(controller: &str) -> bool {
    cube_jail::CgroupLayout::detect()
        .unwrap()
        .provider(controller)
        .is_some()
}

/// The default template's promise: the host's /usr/bin/python3. Returns true (after
/// printing why) when the host lacks it.
pub fn skip_without_python() -> bool {
    if Path::new("/usr/bin/python3").exists() {
        return false;
    }
    println!("skipped: the host has no /usr/bin/python3");
    true
}
