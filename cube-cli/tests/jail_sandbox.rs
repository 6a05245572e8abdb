//! `cube sandbox` on the jail engine across invocations: create with options, exec,
//! code contexts, snapshots (full with CRIU) whose kind every listing shows, rollback,
//! clone, and rm leaving nothing behind.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

const CUBE: &str = env!("CARGO_BIN_EXE_cube");

fn skip() -> bool {
    // SAFETY: geteuid has no failure mode.
    if unsafe { libc::geteuid() } != 0 {
        println!("skipped: jails need root (namespaces, mounts, cgroups)");
        return true;
    }
    if !cube_core::testing::cgroups_readable() {
        println!("skipped: no cgroup hierarchy is readable");
        return true;
    }
    for bin in ["cube-agent", "cube-supervisor"] {
        let path: PathBuf = Path::new(CUBE).with_file_name(bin);
        assert!(
            path.is_file(),
            "{} is missing: run the tests with -p cube-agent -p cube-supervisor -p cube-cli",
            path.display()
        );
    }
    false
}

fn cube(store: &Path, args: &[&str]) -> Output {
    Command::new(CUBE)
        .arg("--store")
        .arg(store)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn ok(store: &Path, args: &[&str]) -> Output {
    let out = cube(store, args);
    assert!(
        out.status.success(),
        "cube {args:?} failed: {}",
        text(&out.stderr)
    );
    out
}

fn json(store: &Path, args: &[&str]) -> serde_json::Value {
    serde_json::from_slice(&ok(store, args).stdout).unwrap()
}

#[test]
fn a_jail_sandbox_lives_across_invocations() {
    if skip() {
        return;
    }
    let store = tempfile::tempdir().unwrap();
    let s = store.path();

    let templates = json(s, &["template", "ls", "--json"]);
    assert!(
        templates
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t["name"] == "host" && t["engine"] == "jail"),
        "{templates}"
    );
    let table = text(&ok(s, &["template", "ls"]).stdout);
    assert!(table.contains("host") && table.contains("jail"), "{table}");

    let refused = cube(s, &["sandbox", "create", "--engine", "vm"]);
    assert!(!refused.status.success());
    assert!(
        text(&refused.stderr).contains("runs on the jail engine, not vm"),
        "{}",
        text(&refused.stderr)
    );

    let id = text(
        &ok(
            s,
            &[
                "sandbox",
                "create",
                "--engine",
                "jail",
                "--template",
                "host",
                "--env",
                "GREETING=hello",
                "--label",
                "team=blue",
                "--memory-mib",
                "256",
            ],
        )
        .stdout,
    )
    .trim()
    .to_string();
    assert!(id.starts_with("sb-"), "{id}");

    // exec streams the output and passes the exit code on; piped stdin reaches it.
    let mut child = Command::new(CUBE)
        .arg("--store")
        .arg(s)
        .args(["sandbox", "exec", &id, "--", "sh", "-c"])
        .arg("echo $GREETING; cat; echo saved > $HOME/f; exit 7")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"from stdin\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(7), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "hello\nfrom stdin\n");

    // A context keeps its variables between invocations.
    ok(s, &["sandbox", "code", &id, "x = 41"]);
    let out = ok(s, &["sandbox", "code", &id, "x + 1"]);
    assert_eq!(text(&out.stdout), "42\n");
    let out = ok(
        s,
        &[
            "sandbox",
            "code",
            &id,
            "--language",
            "bash",
            "--context",
            "sh",
            "echo $((6*7))",
        ],
    );
    assert_eq!(text(&out.stdout), "42\n");

    // The snapshot is a full one where CRIU works, else a filesystem one, and says so
    // everywhere.
    let full = cube_core::testing::criu_works();
    let kind = if full { "full" } else { "filesystem" };
    let out = ok(s, &["sandbox", "snapshot", &id]);
    let snap = text(&out.stdout).trim().to_string();
    assert!(snap.starts_with("snap-"), "{snap}");
    assert!(
        text(&out.stderr).contains(&format!("{kind} snapshot")),
        "{}",
        text(&out.stderr)
    );
    // A snapshot over the built-in template needs no template where it is imported.
    let archive = store.path().join("snap.cube");
    let out = ok(
        s,
        &["snapshot", "export", &snap, "-o", archive.to_str().unwrap()],
    );
    let said = text(&out.stderr);
    assert!(
        !said.contains("needs template") && said.contains("the importing host's userland"),
        "{said}"
    );
    std::fs::remove_file(&archive).unwrap();
    let listed = json(s, &["sandbox", "snapshots", &id, "--json"]);
    assert_eq!(listed[0]["id"], snap.as_str());
    assert_eq!(listed[0]["kind"], kind);
    let table = text(&ok(s, &["sandbox", "snapshots"]).stdout);
    assert!(table.contains(&snap) && table.contains(kind), "{table}");
    let snap_json = json(s, &["sandbox", "snapshot", &id, "--json"]);
    assert_eq!(snap_json["kind"], kind);
    let inspect = json(s, &["sandbox", "inspect", &id, "--json"]);
    assert_eq!(inspect["engine"], "jail");
    assert_eq!(inspect["status"], "Running");
    assert_eq!(inspect["metadata"]["team"], "blue");
    assert_eq!(inspect["snapshots"][0]["kind"], kind);

    // Rollback brings the files back and says the processes were restarted.
    ok(
        s,
        &[
            "sandbox",
            "exec",
            &id,
            "--",
            "sh",
            "-c",
            "echo changed > $HOME/f",
        ],
    );
    let out = ok(s, &["sandbox", "rollback", &id, &snap]);
    assert_eq!(
        text(&out.stderr).contains("restarted"),
        !full,
        "{}",
        text(&out.stderr)
    );
    let out = ok(s, &["sandbox", "exec", &id, "--", "cat", "/home/user/f"]);
    assert_eq!(text(&out.stdout), "saved\n");
    let after = cube(s, &["sandbox", "code", &id, "x"]);
    if full {
        // The processes came back: the context has its variable.
        assert_eq!(text(&after.stdout), "41\n", "{}", text(&after.stderr));
    } else {
        assert_eq!(
            after.status.code(),
            Some(1),
            "the context did not survive a rollback"
        );
    }

    // A clone has the files and is its own sandbox.
    let out = ok(s, &["sandbox", "clone", &id]);
    let clone = text(&out.stdout).trim().to_string();
    assert_eq!(text(&out.stderr).contains("filesystem snapshot"), !full);
    let out = ok(
        s,
        &[
            "sandbox",
            "exec",
            &clone,
            "--",
            "sh",
            "-c",
            "cat $HOME/f; echo c > $HOME/f",
        ],
    );
    assert_eq!(text(&out.stdout), "saved\n");
    let out = ok(s, &["sandbox", "exec", &id, "--", "cat", "/home/user/f"]);
    assert_eq!(text(&out.stdout), "saved\n");

    ok(s, &["sandbox", "rm", &id, &clone]);
    assert_eq!(json(s, &["sandbox", "ls", "--json"]), serde_json::json!([]));
    for dir in ["sandboxes", "snapshots"] {
        assert_eq!(std::fs::read_dir(s.join(dir)).unwrap().count(), 0, "{dir}");
    }
}

/// The exit code of a failure follows its kind, also when the failure happened in the
/// sandbox's supervisor, another process: a sandbox that is not hibernated cannot be
/// woken (a bad state: 1), a snapshot of another sandbox is refused (a bad argument:
/// 2), a sandbox that does not exist is not found (3), and a supervisor on a host
/// without KVM cannot start a VM (the host cannot: 4, pointing at `cube doctor`).
#[test]
fn exit_codes_follow_the_kind_of_failure_across_the_supervisor() {
    if skip() {
        return;
    }
    let store = tempfile::tempdir().unwrap();
    let s = store.path();
    let id = text(&ok(s, &["sandbox", "create"]).stdout)
        .trim()
        .to_string();
    let other = text(&ok(s, &["sandbox", "create"]).stdout)
        .trim()
        .to_string();

    let woken = cube(s, &["sandbox", "wake", &id]);
    assert_eq!(woken.status.code(), Some(1), "{}", text(&woken.stderr));
    assert!(text(&woken.stderr).contains("not hibernated"));

    let snap = text(&ok(s, &["sandbox", "snapshot", &other]).stdout)
        .trim()
        .to_string();
    let foreign = cube(s, &["sandbox", "rollback", &id, &snap]);
    assert_eq!(foreign.status.code(), Some(2), "{}", text(&foreign.stderr));
    assert!(text(&foreign.stderr).contains("belongs to sandbox"));

    ok(s, &["sandbox", "rm", &id, &other]);
    let gone = cube(s, &["sandbox", "wake", &id]);
    assert_eq!(gone.status.code(), Some(3), "{}", text(&gone.stderr));

    // A supervisor that cannot see /dev/kvm (hidden in its own mount namespace): the
    // CLI sees KVM, the supervisor reports that the host cannot run the VM.
    let unshare_works = Command::new("unshare")
        .args(["-m", "true"])
        .status()
        .is_ok_and(|s| s.success());
    if !unshare_works || !Path::new("/dev/kvm").exists() {
        println!("skipped (host-cannot part): unshare -m or /dev/kvm is missing");
        return;
    }
    let supervisor = Path::new(CUBE).with_file_name("cube-supervisor");
    let wrapper = s.join("no-kvm-supervisor");
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\nexec unshare -m sh -c 'mount --bind /dev/null /dev/kvm || exit 1; \
             exec \"$0\" \"$@\"' {} \"$@\"\n",
            supervisor.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(
        &wrapper,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let out = Command::new(CUBE)
        .arg("--store")
        .arg(s)
        .args([
            "template",
            "build-test",
            "t",
            "--memory-mib",
            "128",
            "--disk-mib",
            "0",
        ])
        .env("CUBE_SUPERVISOR", &wrapper)
        .env("CUBE_AGENT", supervisor.with_file_name("cube-agent"))
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "{stderr}");
    assert!(stderr.contains("needs KVM"), "{stderr}");
    assert!(stderr.contains("cube doctor"), "{stderr}");
}
