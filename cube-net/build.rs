//! Compiles the eBPF datapath (bpf/datapath.c) with clang for the BPF target.

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
        Ok(status) => {
            panic!("{clang} failed on {source} ({status}); needs libbpf-dev: scripts/setup-net.sh")
        }
        Err(error) => {
            panic!("cannot run {clang} for {source}: {error}; install clang: scripts/setup-net.sh")
        }
    }
}
