//! Puts the helper programs a sandbox needs (`cube-supervisor`, `cube-agent`) into the
//! Python package when maturin builds the wheel (`maturin build`, `pip install
//! ./cube-py`), so every wheel carries them; maturin includes
//! `python/cubesandbox/bin/*` (see pyproject.toml).
//!
//! maturin marks its builds with `PYO3_ENVIRONMENT_SIGNATURE` (not
//! `PYO3_BUILD_EXTENSION_MODULE`, which the workspace's `.cargo/config.toml` sets for
//! every build); a plain `cargo build` of the workspace does nothing here. `scripts/build-wheel.sh` builds and copies the
//! helpers itself and sets `CUBE_PY_HELPERS=prebuilt`. Otherwise the helpers are built
//! by a nested cargo in a target directory of their own (so the outer build's lock is
//! not waited for), the agent linked statically (musl where its Rust target is
//! installed, else static glibc) since it is bound into sandbox roots whose C library
//! may not be the host's.

// A build script reports failure by panicking: cargo shows the message and stops.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=PYO3_ENVIRONMENT_SIGNATURE");
    println!("cargo:rerun-if-env-changed=CUBE_PY_HELPERS");
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("PYO3_ENVIRONMENT_SIGNATURE").is_none()
        || std::env::var("CUBE_PY_HELPERS").as_deref() == Ok("prebuilt")
    {
        return;
    }
    let manifest = PathBuf::from(env("CARGO_MANIFEST_DIR"));
    let workspace = manifest
        .parent()
        .expect("cube-py lies in the workspace")
        .to_path_buf();
    for dir in [
        "cube-core/src",
        "cube-supervisor/src",
        "cube-vmm/src",
        "cube-devices/src",
        "cube-agent/src",
        "cube-jail/src",
        "cube-net/src",
        "cube-storage/src",
        "cube-mem/src",
    ] {
        println!("cargo:rerun-if-changed={}", workspace.join(dir).display());
    }
    let release = env("PROFILE") == "release";
    let target_dir = PathBuf::from(env("OUT_DIR")).join("helpers");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let profile_args: &[&str] = if release { &["--release"] } else { &[] };
    let profile_dir = if release { "release" } else { "debug" };

    run(Command::new(&cargo)
        .current_dir(&workspace)
        .args(["build", "-p", "cube-supervisor", "--bin", "cube-supervisor"])
        .args(profile_args)
        .arg("--target-dir")
        .arg(&target_dir));
    let supervisor = target_dir.join(profile_dir).join("cube-supervisor");

    let musl = "x86_64-unknown-linux-musl";
    let has_musl = cfg!(target_arch = "x86_64")
        && Command::new("rustup")
            .args(["target", "list", "--installed"])
            .output()
            .map(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .lines()
                    .any(|l| l.trim() == musl)
            })
            .unwrap_or(false);
    let agent = if has_musl {
        run(Command::new(&cargo)
            .current_dir(&workspace)
            .args([
                "build",
                "-p",
                "cube-agent",
                "--bin",
                "cube-agent",
                "--target",
                musl,
            ])
            .args(profile_args)
            .arg("--target-dir")
            .arg(&target_dir));
        target_dir.join(musl).join(profile_dir).join("cube-agent")
    } else {
        println!("cargo:warning=the {musl} Rust target is not installed: cube-agent is linked with static glibc");
        run(Command::new(&cargo)
            .current_dir(&workspace)
            .args(["rustc", "-p", "cube-agent", "--bin", "cube-agent"])
            .args(profile_args)
            .arg("--target-dir")
            .arg(&target_dir)
            .args(["--", "-C", "target-feature=+crt-static"]));
        target_dir.join(profile_dir).join("cube-agent")
    };

    let bin = manifest.join("python/cubesandbox/bin");
    std::fs::create_dir_all(&bin).expect("creating python/cubesandbox/bin");
    for helper in [&supervisor, &agent] {
        install(helper, &bin);
    }
}

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("cargo sets {name} for build scripts"))
}

fn run(cmd: &mut Command) {
    // The outer build's settings are for the extension, not for these programs.
    cmd.env_remove("RUSTFLAGS")
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("PYO3_BUILD_EXTENSION_MODULE");
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    assert!(
        status.success(),
        "building a helper program failed: {cmd:?}"
    );
}

/// Copies `from` into `dir` (by rename of a temporary copy, so a running copy of the
/// old file is never overwritten in place).
fn install(from: &Path, dir: &Path) {
    let name = from.file_name().expect("a helper has a file name");
    let tmp = dir.join(format!(".{}.tmp", name.to_string_lossy()));
    std::fs::copy(from, &tmp).unwrap_or_else(|e| panic!("copying {}: {e}", from.display()));
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755))
        .expect("making the helper executable");
    std::fs::rename(&tmp, dir.join(name)).expect("installing the helper");
}
