//! Debian's cloud kernel booted in Cube's VMM: the serial console shows the version
//! banner and the e820 map Cube handed over, which proves the PVH entry point, the boot
//! parameters, the initial CPU state and the serial device.

use std::path::PathBuf;
use std::process::Command;

use cube_core::testing::linux_kernel as kernel;

#[test]
fn debian_kernel_prints_its_banner_and_our_memory_map() {
    let Some(kernel) = kernel() else {
        return;
    };
    // 512 MiB: Cube's map is conventional memory below 640 KiB plus 1 MiB..512 MiB.
    let out = Command::new(env!("CARGO_BIN_EXE_cube"))
        .args([
            "debug",
            "boot",
            "--memory-mib",
            "512",
            "--timeout",
            "180",
            "--until",
        ])
        .arg(r"BIOS-e820: \[mem 0x0000000000100000-0x000000001fffffff\] usable")
        .arg("--kernel")
        .arg(&kernel)
        .output()
        .unwrap();
    let console = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "boot failed: {}\nconsole:\n{console}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(console.contains("Linux version 6."), "{console}");
    assert!(
        console.contains("BIOS-e820: [mem 0x0000000000000000-0x000000000009fbff] usable"),
        "{console}"
    );
    assert!(console.contains("Command line: console=ttyS0"), "{console}");
}

#[test]
fn a_missing_pattern_times_out_with_a_clear_error() {
    let Some(kernel) = kernel() else {
        return;
    };
    let out = Command::new(env!("CARGO_BIN_EXE_cube"))
        .args([
            "debug",
            "boot",
            "--memory-mib",
            "256",
            "--timeout",
            "3",
            "--until",
            "no such line ever",
        ])
        .arg("--kernel")
        .arg(&kernel)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("timed out after 3 s"), "{stderr}");
}

#[test]
fn a_kernel_that_is_not_an_elf_is_refused() {
    if !std::path::Path::new("/dev/kvm").exists() {
        eprintln!("skipped: /dev/kvm not present");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let fake = dir.path().join("vmlinux");
    std::fs::write(&fake, b"not a kernel").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_cube"))
        .args(["debug", "boot", "--timeout", "5", "--kernel"])
        .arg(&fake)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("Loading kernel"));
}

/// The bzImage and initramfs `scripts/build-initramfs.sh` puts beside the vmlinux.
fn bzimage_and_initramfs() -> Option<(PathBuf, PathBuf)> {
    let vmlinux = kernel()?;
    let dir = vmlinux.parent()?.to_path_buf();
    let (bz, initrd) = (dir.join("bzImage"), dir.join("initramfs-cube.cpio.gz"));
    if !bz.is_file() || !initrd.is_file() {
        eprintln!(
            "skipped: no bzImage/initramfs in {} (scripts/build-initramfs.sh builds them)",
            dir.display()
        );
        return None;
    }
    Some((bz, initrd))
}

/// The bzImage path with an initramfs, two vCPUs and virtio devices: the kernel
/// takes Cube's zero page (initrd placement), finds the ACPI tables and brings up
/// the CPUs the MADT lists.
#[test]
fn debian_bzimage_takes_our_initrd_and_acpi_tables() {
    let Some((bzimage, initrd)) = bzimage_and_initramfs() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_cube"))
        .args([
            "debug",
            "boot",
            "--memory-mib",
            "512",
            "--vcpus",
            "2",
            "--rng",
            "--cmdline-devices",
            // The line awaited comes before anything the emulated mode's switches are
            // for; native keeps this test about boot protocol and ACPI. The decompressor
            // alone runs ~150 s emulated at CPL0 on a busy host: the limit leaves room.
            "--kernel-mode",
            "native",
        ])
        .args(["--timeout", "400", "--until", "smpboot: Allowing 2 CPUs"])
        .arg("--vsock-dir")
        .arg(dir.path())
        .arg("--kernel")
        .arg(&bzimage)
        .arg("--initrd")
        .arg(&initrd)
        .output()
        .unwrap();
    let console = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "boot failed: {}\nconsole:\n{console}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(console.contains("Linux version 6."), "{console}");
    assert!(console.contains("RAMDISK: [mem "), "{console}");
    assert!(console.contains("ACPI: DSDT"), "{console}");
    assert!(console.contains("ACPI: APIC"), "{console}");
    assert!(
        console.contains("virtio_mmio.device=4K@0xd0001000:5"),
        "{console}"
    );
}

/// Cube's own guest kernel (`scripts/build-guest-kernel.sh`) with a root disk holding
/// only the agent: `cube debug boot` gets it to user space. On PVM hosts the host
/// probe picks the emulated-kernel mode and the VMM finishes the kernel's `int3`
/// self-test; the CLI says both.
#[test]
fn cubes_kernel_reaches_its_init_from_the_root_disk() {
    let Some(kernel) = cube_core::testing::cube_guest_kernel() else {
        return;
    };
    let agent = match cube_core::templates::image_agent::locate() {
        Ok(agent) => agent,
        Err(e) => {
            println!("skipped: {e}");
            return;
        }
    };
    let dir = tempfile::tempdir().unwrap();
    let tree = dir.path().join("tree");
    for sub in [".cube", "dev", "proc", "sys", "tmp"] {
        std::fs::create_dir_all(tree.join(sub)).unwrap();
    }
    std::fs::copy(&agent, tree.join(".cube/cube-agent")).unwrap();
    let image = dir.path().join("root.img");
    let mkfs = Command::new("mkfs.ext4")
        .args(["-q", "-F", "-d"])
        .arg(&tree)
        .arg(&image)
        .arg("64M")
        .output();
    match mkfs {
        Ok(out) if out.status.success() => {}
        other => {
            println!("skipped: mkfs.ext4 could not make the image ({other:?})");
            return;
        }
    }
    let out = Command::new(env!("CARGO_BIN_EXE_cube"))
        .args([
            "debug",
            "boot",
            "--memory-mib",
            "256",
            "--rng",
            "--timeout",
            "600",
            "--timestamps",
            "--cmdline",
            "console=ttyS0 reboot=k panic=-1 root=/dev/vda rw rootfstype=ext4 \
             init=/.cube/cube-agent",
            "--until",
            r"Run /\.cube/cube-agent as init process",
            "--disk",
        ])
        .arg(&image)
        .arg("--kernel")
        .arg(&kernel)
        .output()
        .unwrap();
    let console = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "boot failed: {stderr}\nconsole:\n{console}"
    );
    // The kernel found the disk through the ACPI DSDT and mounted it as its root.
    assert!(console.contains("Linux version 6.1"), "{console}");
    assert!(console.contains("VFS: Mounted root (ext4"), "{console}");
    // Every console line carries the host clock since the boot started.
    assert!(console.lines().any(|l| l.starts_with("[+")), "{console}");
    let emulated =
        cube_core::host::KernelMode::of_this_host() == Some(cube_core::host::KernelMode::Emulated);
    if emulated {
        assert!(stderr.contains("runs emulated"), "{stderr}");
        // The kernel's int3 self-test, finished by the VMM.
        assert!(!stderr.contains("(0 int3"), "{stderr}");
    }
    println!("{}", stderr.lines().last().unwrap_or_default());
}
