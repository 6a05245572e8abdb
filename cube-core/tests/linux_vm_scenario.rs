//! The whole Linux VM path through the public API, with Cube's own guest kernel: a VM
//! template built through the supervisor layer (image, boot, agent over vsock,
//! snapshot), a sandbox created from it, a command, a Python cell and files through
//! its agent, then snapshot / rollback / clone / hibernate / wake of the live guest,
//! its agent answering after each.
//!
//! On PVM hosts the guest kernel runs emulated (the host probe chooses it): slow, but
//! this is the proof that the Linux path works there. Skipped, saying why, without
//! `/dev/kvm`, without Cube's guest kernel (`scripts/build-guest-kernel.sh`), without
//! the host's Debian Python (`/usr/bin/python3`, copied into the image with the
//! libraries it links), without `mkfs.ext4`, or without a statically linked agent
//! (`scripts/build-static.sh`, run by set-up).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use cube_agent::protocol::{ExecRequest, Language};
use cube_core::templates::{image_agent, MachineConfig, TreeSource, VmTemplateSpec};
use cube_core::{CreateOptions, Engine, Runtime, RuntimeConfig, Sandbox};
use cube_vmm::testing::cube_guest_kernel;

/// The Python the image carries: Debian's, whose standard library is under /usr/lib.
const PYTHON: &str = "/usr/bin/python3";
/// Programs the image carries besides Python (with the libraries they link).
const PROGRAMS: [&str; 4] = ["/bin/sh", "/bin/cat", "/bin/ls", "/bin/uname"];
/// Guest RAM: small, so every snapshot writes little.
const GUEST_MEMORY: u64 = 256 << 20;
/// A bound on a hung boot, not a timing assertion (emulated, the template's boot
/// takes about half a minute here).
const BOOT_LIMIT: Duration = Duration::from_secs(900);

/// The shared libraries `binary` links, as `ldd` resolves them (the dynamic loader
/// included).
fn linked_libraries(binary: &Path) -> Vec<PathBuf> {
    let out = Command::new("ldd").arg(binary).output().unwrap();
    assert!(out.status.success(), "ldd {}", binary.display());
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| {
            // "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)" or
            // "/lib64/ld-linux-x86-64.so.2 (0x...)"; the vDSO has no file.
            let path = match line.split_once("=>") {
                Some((_, right)) => right.split_whitespace().next()?,
                None => line.split_whitespace().next()?,
            };
            path.starts_with('/').then(|| PathBuf::from(path))
        })
        .collect()
}

/// Copies `from` to the same path under `tree`, following links (the image needs the
/// files, and Debian's /bin is a link to /usr/bin).
fn copy_into(tree: &Path, from: &Path) {
    let to = tree.join(from.strip_prefix("/").unwrap());
    std::fs::create_dir_all(to.parent().unwrap()).unwrap();
    std::fs::copy(from, &to).unwrap_or_else(|e| panic!("copying {}: {e}", from.display()));
}

/// A root tree with the host's Python and a few programs, their libraries, and
/// Python's standard library (less its test suite).
fn python_tree(tree: &Path) {
    let python = std::fs::canonicalize(PYTHON).unwrap();
    let mut files = BTreeSet::new();
    for program in PROGRAMS.iter().map(PathBuf::from).chain([python.clone()]) {
        files.extend(linked_libraries(&program));
        files.insert(program);
    }
    for file in &files {
        copy_into(tree, file);
    }
    // `python3` on the agent's PATH.
    let link = tree.join("usr/bin/python3");
    if !link.exists() {
        std::os::unix::fs::symlink(python.file_name().unwrap(), link).unwrap();
    }
    let version = python.file_name().unwrap().to_str().unwrap().to_string();
    let stdlib = Path::new("/usr/lib").join(&version);
    // Into usr/lib, which must exist: `cp -a` would otherwise make the library
    // directory usr/lib itself.
    std::fs::create_dir_all(tree.join("usr/lib")).unwrap();
    let status = Command::new("cp")
        .arg("-a")
        .arg(&stdlib)
        .arg(tree.join("usr/lib"))
        .status()
        .unwrap();
    assert!(status.success(), "copying {}", stdlib.display());
    let _ = std::fs::remove_dir_all(tree.join("usr/lib").join(&version).join("test"));
    for dir in ["root", "home/user"] {
        std::fs::create_dir_all(tree.join(dir)).unwrap();
    }
}

/// Whatever this test needs and the host lacks, said once.
fn missing() -> Option<String> {
    if !Path::new(PYTHON).is_file() {
        return Some(format!(
            "no Debian Python at {PYTHON} to put into the image"
        ));
    }
    if Command::new("mkfs.ext4").arg("-V").output().is_err() {
        return Some("mkfs.ext4 is not installed (e2fsprogs)".into());
    }
    if Command::new("ldd").arg("--version").output().is_err() {
        return Some("ldd is not installed (libc-bin)".into());
    }
    image_agent::locate().err().map(|e| e.to_string())
}

/// Runs `argv` in the sandbox; returns standard output, asserting success.
fn exec(sandbox: &Sandbox, argv: &[&str]) -> String {
    let agent = sandbox.agent().unwrap();
    let out = agent
        .exec(ExecRequest {
            argv: argv.iter().map(|a| a.to_string()).collect(),
            env: Vec::new(),
            cwd: Some("/root".into()),
            user: None,
            stdin: Vec::new(),
            timeout_ms: Some(300_000),
            background: false,
        })
        .unwrap();
    assert_eq!(
        out.exit.code,
        Some(0),
        "{argv:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The value of the Python expression `code` in context `main`.
fn python(sandbox: &Sandbox, code: &str) -> Option<String> {
    let agent = sandbox.agent().unwrap();
    let result = agent
        .run_code("main", code, Some(Duration::from_secs(300)))
        .unwrap();
    assert!(result.error.is_none(), "{code}: {result:?}");
    result.value
}

fn read(sandbox: &Sandbox, path: &str) -> String {
    let mut out = Vec::new();
    sandbox.agent().unwrap().read_file(path, &mut out).unwrap();
    String::from_utf8(out).unwrap()
}

fn write(sandbox: &Sandbox, path: &str, text: &str) {
    sandbox
        .agent()
        .unwrap()
        .write_file(path, &mut text.as_bytes())
        .unwrap();
}

/// Prints how long `what` took: the scenario's timeline, for the note.
fn timed<T>(what: &str, f: impl FnOnce() -> T) -> T {
    let started = Instant::now();
    let value = f();
    println!("{what}: {:.2} s", started.elapsed().as_secs_f64());
    value
}

#[test]
fn a_linux_vm_template_serves_sandboxes_through_their_whole_life() {
    let Some(kernel) = cube_guest_kernel() else {
        return;
    };
    if let Some(reason) = missing() {
        println!("skipped: {reason}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let tree = dir.path().join("tree");
    python_tree(&tree);
    let rt = Runtime::open(RuntimeConfig {
        store_root: dir.path().join("store"),
        pool_size: 0,
        network_pool_size: 0,
        supervisor: Some(common::supervisor()),
    })
    .unwrap();
    let spec = VmTemplateSpec {
        tree: TreeSource::Directory(tree),
        kernel: Some(kernel),
        initrd: None,
        machine: MachineConfig {
            vcpus: 1,
            memory_bytes: GUEST_MEMORY,
            irqchip: true,
        },
        boot_timeout: BOOT_LIMIT,
        agent: image_agent::locate().unwrap(),
    };
    let meta = timed("template build (image, boot to agent, snapshot)", || {
        rt.build_vm_template("linux", &spec, &mut |_| {})
    })
    .unwrap();
    assert_eq!(meta.engine, Engine::Vm);

    let mut sandbox = timed("create from the template", || {
        rt.create("linux", CreateOptions::new(true))
    })
    .unwrap();
    assert_eq!(sandbox.engine(), Engine::Vm);
    let uname = timed("exec uname", || exec(&sandbox, &["uname", "-r"]));
    assert!(uname.trim_end().ends_with("-cube"), "{uname}");
    timed("python context", || {
        sandbox
            .agent()
            .unwrap()
            .create_context("main", Language::Python, Some("/root"))
            .unwrap()
    });
    let value = timed("python cell", || python(&sandbox, "x = 6 * 7\nx"));
    assert_eq!(value.as_deref(), Some("42"));
    write(&sandbox, "/root/notes", "v1\n");
    assert_eq!(exec(&sandbox, &["cat", "/root/notes"]), "v1\n");

    // Snapshot, then change the file and the interpreter's state.
    let snapshot = timed("snapshot", || sandbox.snapshot()).unwrap();
    write(&sandbox, "/root/notes", "v2\n");
    python(&sandbox, "x = 0");
    assert_eq!(read(&sandbox, "/root/notes"), "v2\n");

    // Rollback: the file and the interpreter are as they were at the snapshot.
    timed("rollback", || sandbox.rollback(&snapshot.id)).unwrap();
    assert_eq!(read(&sandbox, "/root/notes"), "v1\n");
    assert_eq!(python(&sandbox, "x").as_deref(), Some("42"));

    // Clone: a second guest with the same state, apart from the first.
    let clones = timed("clone", || {
        rt.clone_sandbox(&mut sandbox, 1, 1, CreateOptions::new(true))
    })
    .unwrap();
    let clone = &clones[0];
    assert_ne!(clone.id(), sandbox.id());
    assert_eq!(read(clone, "/root/notes"), "v1\n");
    assert_eq!(python(clone, "x").as_deref(), Some("42"));
    write(clone, "/root/notes", "clone\n");
    assert_eq!(read(&sandbox, "/root/notes"), "v1\n");

    // Hibernate and wake: memory written out and released, then restored.
    timed("hibernate", || sandbox.hibernate()).unwrap();
    timed("wake", || sandbox.wake()).unwrap();
    assert_eq!(read(&sandbox, "/root/notes"), "v1\n");
    assert_eq!(python(&sandbox, "x + 1").as_deref(), Some("43"));
    assert_eq!(exec(&sandbox, &["ls", "/root"]), "notes\n");

    for clone in clones {
        clone.destroy().unwrap();
    }
    sandbox.destroy().unwrap();
}
