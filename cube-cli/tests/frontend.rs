//! The `cube` binary's frontend as users and scripts meet it: help with examples and
//! exit codes, completions, usage errors (exit 2), unknown things (exit 3), and files
//! in and out of a jail sandbox with `cp`, `ls`, `cat`, with every `--json` parsed.

// Helpers outside #[test] functions may panic too: a failure there is a test failure.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

const CUBE: &str = env!("CARGO_BIN_EXE_cube");

fn cube(store: &Path, args: &[&str]) -> Output {
    Command::new(CUBE)
        .arg("--store")
        .arg(store)
        .args(args)
        .env_remove("CUBE_HOME")
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn ok(store: &Path, args: &[&str]) -> String {
    let out = cube(store, args);
    assert!(
        out.status.success(),
        "cube {args:?} failed ({:?}): {}",
        out.status.code(),
        text(&out.stderr)
    );
    text(&out.stdout)
}

fn json(store: &Path, args: &[&str]) -> serde_json::Value {
    let out = ok(store, args);
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("cube {args:?}: not JSON ({e}): {out}"))
}

/// Runs `cube` expecting exit `code`; returns its standard error.
fn fails(store: &Path, args: &[&str], code: i32) -> String {
    let out = cube(store, args);
    let stderr = text(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(code),
        "cube {args:?}: stdout {} stderr {stderr}",
        text(&out.stdout)
    );
    stderr
}

fn jail_skip() -> bool {
    // SAFETY: geteuid has no failure mode.
    if unsafe { libc::geteuid() } != 0 {
        println!("skipped: jails need root (namespaces, mounts, cgroups)");
        return true;
    }
    if cube_jail::CgroupLayout::detect().is_err() {
        println!("skipped: no cgroup hierarchy is readable");
        return true;
    }
    for bin in ["cube-agent", "cube-supervisor"] {
        let path: PathBuf = Path::new(CUBE).with_file_name(bin);
        assert!(
            path.is_file(),
            "{} is missing: run the tests with -p cube-agent -p cube-core -p cube-cli",
            path.display()
        );
    }
    false
}

#[test]
fn help_documents_exit_codes_and_examples() {
    let store = tempfile::tempdir().unwrap();
    let help = ok(store.path(), &["--help"]);
    for needle in ["Exit codes:", "124", "130", "not found", "Examples:"] {
        assert!(
            help.contains(needle),
            "cube --help lacks {needle:?}: {help}"
        );
    }
    for cmd in [
        &["sandbox", "cp", "--help"][..],
        &["sandbox", "ls", "--help"],
        &["sandbox", "cat", "--help"],
        &["sandbox", "inspect", "--help"],
        &["completions", "--help"],
    ] {
        let help = ok(store.path(), cmd);
        assert!(
            help.contains("Example"),
            "cube {cmd:?} has no example: {help}"
        );
    }
}

#[test]
fn completions_are_generated_for_each_shell() {
    let store = tempfile::tempdir().unwrap();
    let bash = ok(store.path(), &["completions", "bash"]);
    assert!(
        bash.contains("complete") && bash.contains("sandbox"),
        "{bash}"
    );
    let zsh = ok(store.path(), &["completions", "zsh"]);
    assert!(zsh.starts_with("#compdef cube"), "{zsh}");
    let fish = ok(store.path(), &["completions", "fish"]);
    assert!(fish.contains("complete -c cube"), "{fish}");
    // bash itself accepts the script.
    if Path::new("/bin/bash").exists() {
        let mut child = Command::new("/bin/bash")
            .args(["-n"])
            .stdin(Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(bash.as_bytes())
            .unwrap();
        assert!(
            child.wait().unwrap().success(),
            "bash -n rejects the script"
        );
    }
    let err = fails(store.path(), &["completions", "tcsh"], 2);
    assert!(err.contains("invalid value"), "{err}");
}

#[test]
fn usage_errors_exit_2() {
    let store = tempfile::tempdir().unwrap();
    let s = store.path();
    // Missing arguments.
    fails(s, &["sandbox", "exec"], 2);
    fails(s, &["sandbox", "cp", "only-one"], 2);
    fails(s, &["sandbox", "cat", "sb-0000000000000000"], 2);
    fails(s, &["sandbox", "rm"], 2);
    fails(s, &["sandbox", "rollback", "sb-0000000000000000"], 2);
    // Bad flag values.
    fails(
        s,
        &["sandbox", "ls", "sb-0000000000000000", "/", "--depth", "0"],
        2,
    );
    fails(s, &["sandbox", "ls", "--depth", "2"], 2);
    fails(s, &["sandbox", "create", "--engine", "qemu"], 2);
    fails(s, &["sandbox", "create", "--env", "NOEQUALS"], 2);
    fails(
        s,
        &["sandbox", "clone", "sb-0000000000000000", "-n", "many"],
        2,
    );
    let err = fails(
        s,
        &[
            "sandbox",
            "exec",
            "sb-0000000000000000",
            "--timeout",
            "-1",
            "--",
            "true",
        ],
        2,
    );
    assert!(err.contains("--timeout must be a positive"), "{err}");
    fails(s, &["run", "--timeout", "0", "--", "true"], 2);
    // Impossible copies.
    let err = fails(s, &["sandbox", "cp", "/tmp/a", "/tmp/b"], 2);
    assert!(
        err.contains("ID:/path") && err.contains("cube sandbox ls"),
        "{err}"
    );
    let err = fails(s, &["sandbox", "cp", "sb-1:relative", "/tmp/b"], 2);
    assert!(err.contains("must be absolute"), "{err}");
    fails(s, &["sandbox", "cp", "sb-1:/a", "sb-2:/b"], 2);
    fails(s, &["no-such-command"], 2);
    // A malformed id (here a path given where the id goes) names nothing.
    let err = fails(s, &["sandbox", "ls", "/tmp"], 2);
    assert!(
        err.contains("Invalid sandbox") && err.contains("cube sandbox ls"),
        "{err}"
    );
    fails(s, &["sandbox", "inspect", "../etc"], 2);
}

#[test]
fn unknown_things_exit_3_with_what_to_do() {
    let store = tempfile::tempdir().unwrap();
    let s = store.path();
    let unknown = "sb-0000000000000000";
    for args in [
        &["sandbox", "inspect", unknown][..],
        &["sandbox", "inspect", unknown, "--json"],
        &["sandbox", "snapshots", unknown],
        &["sandbox", "cat", unknown, "/etc/hostname"],
        &["sandbox", "ls", unknown, "/"],
        &["sandbox", "cp", "sb-0000000000000000:/etc/hostname", "-"],
        &["sandbox", "code", unknown, "1"],
        &["sandbox", "exec", unknown, "--", "true"],
        &["sandbox", "pause", unknown],
    ] {
        let err = fails(s, args, 3);
        assert!(err.contains(unknown), "cube {args:?}: {err}");
        assert!(
            err.contains("hint: list sandboxes with `cube sandbox ls`"),
            "{err}"
        );
    }
    let err = fails(s, &["sandbox", "create", "no-such-template"], 3);
    assert!(err.contains("cube template ls"), "{err}");
    let err = fails(s, &["template", "rm", "no-such-template"], 3);
    assert!(err.contains("no-such-template"), "{err}");
    // A missing local source is "not found" too.
    fails(
        s,
        &["sandbox", "cp", "/nonexistent/cube-test", "sb-1:/tmp/x"],
        3,
    );
    // A store that does not exist.
    let missing = s.join("no-store-here");
    let err = fails(&missing, &["store", "info"], 3);
    assert!(err.contains("cube store setup"), "{err}");
    // Empty listings are valid JSON.
    assert_eq!(json(s, &["sandbox", "ls", "--json"]), serde_json::json!([]));
    assert_eq!(
        json(s, &["sandbox", "snapshots", "--json"]),
        serde_json::json!([])
    );
    let table = ok(s, &["sandbox", "ls"]);
    assert!(table.starts_with("ID "), "{table}");
    let info = json(s, &["store", "info", "--json"]);
    assert_eq!(info["store"], s.to_str().unwrap());
    assert!(
        info["reflink"].is_boolean() && info["filesystem"].is_string(),
        "{info}"
    );
    let templates = json(s, &["template", "ls", "--json"]);
    assert!(
        templates
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t["name"] == "host"),
        "{templates}"
    );
}

/// Removes the sandbox even when an assertion fails half-way.
struct Cleanup<'a>(&'a Path, String);

impl Drop for Cleanup<'_> {
    fn drop(&mut self) {
        let _ = cube(self.0, &["sandbox", "rm", &self.1]);
    }
}

#[test]
fn files_go_in_and_out_of_a_jail_sandbox() {
    if jail_skip() {
        return;
    }
    let store = tempfile::tempdir().unwrap();
    let s = store.path();
    let id = ok(s, &["sandbox", "create", "--label", "suite=frontend"])
        .trim()
        .to_string();
    let _cleanup = Cleanup(s, id.clone());

    // Host → sandbox, a file larger than one agent chunk, into a directory.
    let local = tempfile::tempdir().unwrap();
    let data: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
    let src = local.path().join("blob.bin");
    std::fs::write(&src, &data).unwrap();
    ok(s, &["sandbox", "exec", &id, "--", "mkdir", "-p", "/tmp/in"]);
    ok(
        s,
        &[
            "sandbox",
            "cp",
            src.to_str().unwrap(),
            &format!("{id}:/tmp/in/"),
        ],
    );

    // ls with --json and --depth, and the table for people.
    let listed = json(s, &["sandbox", "ls", &id, "/tmp", "--depth", "2", "--json"]);
    let blob = listed
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["path"] == "/tmp/in/blob.bin")
        .unwrap_or_else(|| panic!("no /tmp/in/blob.bin in {listed}"));
    assert_eq!(blob["kind"], "file");
    assert_eq!(blob["size"], data.len() as u64);
    let shallow = json(s, &["sandbox", "ls", &id, "/tmp", "--json"]);
    assert!(
        !shallow.to_string().contains("blob.bin"),
        "depth 1 went deeper: {shallow}"
    );
    let table = ok(s, &["sandbox", "ls", &id, "/tmp/in"]);
    assert!(
        table.contains("2.9 MiB") && table.contains("/tmp/in/blob.bin"),
        "{table}"
    );

    // Sandbox → host, into a directory and to a named file; cat and `cp ... -`.
    let back = tempfile::tempdir().unwrap();
    ok(
        s,
        &[
            "sandbox",
            "cp",
            &format!("{id}:/tmp/in/blob.bin"),
            back.path().to_str().unwrap(),
        ],
    );
    assert!(std::fs::read(back.path().join("blob.bin")).unwrap() == data);
    let named = back.path().join("copy.bin");
    ok(
        s,
        &[
            "sandbox",
            "cp",
            &format!("{id}:/tmp/in/blob.bin"),
            named.to_str().unwrap(),
        ],
    );
    assert!(std::fs::read(&named).unwrap() == data);
    let out = cube(s, &["sandbox", "cat", &id, "/tmp/in/blob.bin"]);
    assert!(out.status.success() && out.stdout == data);
    let out = cube(
        s,
        &["sandbox", "cp", &format!("{id}:/tmp/in/blob.bin"), "-"],
    );
    assert!(out.status.success() && out.stdout == data);

    // Standard input in.
    let mut child = Command::new(CUBE)
        .arg("--store")
        .arg(s)
        .args(["sandbox", "cp", "-", &format!("{id}:/tmp/from-stdin.txt")])
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"piped\n").unwrap();
    assert!(child.wait().unwrap().success());
    assert_eq!(
        ok(s, &["sandbox", "cat", &id, "/tmp/from-stdin.txt"]),
        "piped\n"
    );

    // Error paths inside a live sandbox.
    fails(s, &["sandbox", "cat", &id, "/tmp/no-such-file"], 3);
    let err = fails(
        s,
        &[
            "sandbox",
            "cp",
            &format!("{id}:/tmp/in"),
            back.path().to_str().unwrap(),
        ],
        2,
    );
    assert!(err.contains("is a directory"), "{err}");
    fails(s, &["sandbox", "ls", &id, "/tmp/no-such-dir"], 3);
    // A failed download leaves no partial file behind.
    let partial = back.path().join("partial.bin");
    fails(
        s,
        &[
            "sandbox",
            "cp",
            &format!("{id}:/tmp/nope"),
            partial.to_str().unwrap(),
        ],
        3,
    );
    assert!(!partial.exists());
    let leftovers: Vec<_> = std::fs::read_dir(back.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("cube-partial"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");

    // inspect: JSON for scripts, a table for people; both name the labels.
    let inspect = json(s, &["sandbox", "inspect", &id, "--json"]);
    assert_eq!(inspect["id"], id.as_str());
    assert_eq!(inspect["engine"], "jail");
    assert_eq!(inspect["metadata"]["suite"], "frontend");
    assert!(inspect["created_unix"].as_u64().unwrap() > 0);
    let human = ok(s, &["sandbox", "inspect", &id]);
    assert!(
        human.contains("status") && human.contains("running") && human.contains("suite=frontend"),
        "{human}"
    );
    let listed = ok(s, &["sandbox", "ls"]);
    let row = listed.lines().find(|l| l.starts_with(&id)).unwrap();
    assert!(
        row.contains("running") && row.contains("suite=frontend"),
        "{listed}"
    );
    // Columns line up: every row's STATE starts where the header's does.
    let column = listed.lines().next().unwrap().find("STATE").unwrap();
    assert_eq!(&row[column..column + 7], "running", "{listed}");

    // Snapshots listed per sandbox, JSON parsed.
    let snap = json(s, &["sandbox", "snapshot", &id, "--json"]);
    let snaps = json(s, &["sandbox", "snapshots", &id, "--json"]);
    assert_eq!(snaps[0]["id"], snap["id"]);
    assert_eq!(snaps[0]["sandbox"], id.as_str());
    let table = ok(s, &["sandbox", "snapshots", &id]);
    assert!(
        table.contains(snap["id"].as_str().unwrap()) && table.contains("ago"),
        "{table}"
    );
}
