//! A tiny real-mode guest for tests: it stores a byte into four known pages and halts.
//! Real mode keeps it to a handful of instructions (CPL0 code is emulated on PVM hosts)
//! and has no guest page tables for shadow paging to dirty.

use std::path::Path;

use kvm_bindings::kvm_regs;
use kvm_ioctls::{VcpuExit, VmFd};
use vm_memory::{Bytes, GuestAddress};

use crate::guest_memory::{GuestMemory, MemoryLayout};

/// Where the code is loaded (page 1 of region 0).
pub const CODE_ADDR: u64 = 0x1000;
/// The byte the guest stores.
pub const VALUE: u8 = 0x5a;
/// Pages the guest writes, as (region, page) of [`layout`].
pub const WRITTEN: [(usize, usize); 4] = [(0, 2), (0, 5), (0, 7), (1, 3)];

/// Two 64 KiB regions back to back at guest address 0.
pub fn layout() -> MemoryLayout {
    MemoryLayout::new(&[(GuestAddress(0), 0x10000), (GuestAddress(0x10000), 0x10000)]).unwrap()
}

/// Whether the test can run; prints the skip line when not.
pub fn kvm_present() -> bool {
    if Path::new("/dev/kvm").exists() {
        true
    } else {
        println!("skipped: /dev/kvm not present");
        false
    }
}

/// Loads the code into `mem` (through vm-memory, so the VMM log marks page 1).
pub fn load(mem: &GuestMemory) {
    #[rustfmt::skip]
    let code: [u8; 21] = [
        0xb8, 0x00, 0x10,       // mov ax, 0x1000
        0x8e, 0xc0,             // mov es, ax
        0xb0, VALUE,            // mov al, VALUE
        0xa2, 0x00, 0x20,       // mov [0x2000], al
        0xa2, 0x00, 0x50,       // mov [0x5000], al
        0xa2, 0xf0, 0x7f,       // mov [0x7ff0], al
        0x26, 0xa2, 0x00, 0x30, // mov es:[0x3000], al   (0x13000: region 1, page 3)
        0xf4,                   // hlt
    ];
    mem.inner()
        .write_slice(&code, GuestAddress(CODE_ADDR))
        .unwrap();
}

/// Runs one vCPU from [`CODE_ADDR`] in real mode until it halts.
pub fn run(vm: &VmFd) {
    let mut vcpu = vm.create_vcpu(0).unwrap();
    let mut sregs = vcpu.get_sregs().unwrap();
    sregs.cs.base = 0;
    sregs.cs.selector = 0;
    vcpu.set_sregs(&sregs).unwrap();
    vcpu.set_regs(&kvm_regs {
        rip: CODE_ADDR,
        rflags: 2,
        ..Default::default()
    })
    .unwrap();
    match vcpu.run().unwrap() {
        VcpuExit::Hlt => {}
        other => panic!("unexpected exit {other:?}"),
    }
}

/// Checks the guest's stores landed in memory.
pub fn check_stores(mem: &GuestMemory) {
    for addr in [0x2000u64, 0x5000, 0x7ff0, 0x13000] {
        let v: u8 = mem.inner().read_obj(GuestAddress(addr)).unwrap();
        assert_eq!(v, VALUE, "guest store to {addr:#x}");
    }
}
