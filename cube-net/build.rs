//! Compiles the eBPF datapath (bpf/datapath.c) with clang for the BPF target.
//!
//! Without clang the crate still builds, with an empty object: loading the datapath
//! then fails with `DatapathError::NotBuilt` and the tests skip, naming the reason.
//! A datapath that clang rejects fails the build.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let source = "bpf/datapath.c";
    println!("cargo:rerun-if-changed={source}");
    println!("cargo:rerun-if-env-changed=CLANG");
    let Some(out) = std::env::var_os("OUT_DIR").map(PathBuf::from) else {
        panic!("OUT_DIR unset: build.rs runs under cargo");
    };
    let object = out.join("datapath.o");
    let clang = std::env::var("CLANG").unwrap_or_else(|_| "clang".to_string());
    // Debian keeps asm/ under the multiarch include directory.
    let multiarch = format!("/usr/include/{}-linux-gnu", std::env::consts::ARCH);
    let status = Command::new(&clang)
        .args(["-target", "bpf", "-O2", "-g", "-Wall", "-Werror"])
        .arg(format!("-I{multiarch}"))
        .args(["-c", source, "-o"])
        .arg(&object)
        .status();
    match status {
        Ok(status) if status.success() => {}
        Ok(status) => panic!(
            "{clang} failed on {source} ({status}); bpf/bpf_helpers.h comes with libbpf-dev (scripts/setup-net.sh)"
        ),
        Err(error) => {
            println!(
                "cargo:warning=cube-net: cannot run {clang} ({error}): building without the eBPF datapath; run scripts/setup-net.sh"
            );
            if let Err(error) = std::fs::write(&object, []) {
                panic!("write {}: {error}", object.display());
            }
        }
    }
}
