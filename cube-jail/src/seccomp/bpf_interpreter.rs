//! A classic-BPF interpreter for seccomp filters, for tests: it runs a program over a
//! `seccomp_data` the way the kernel would, so two programs can be compared on every
//! input a test names. It knows the instructions seccompiler and this crate emit and
//! fails the test on any other.

use seccompiler::sock_filter;

/// `AUDIT_ARCH_I386` (EM_386 | little-endian): a 32-bit call through `int 0x80`, whose
/// numbers mean other calls than x86-64's.
pub const AUDIT_ARCH_I386: u32 = 3 | 0x4000_0000;

/// The kernel's `struct seccomp_data`, as a filter sees it.
#[derive(Clone, Copy, Debug)]
pub struct SeccompData {
    bytes: [u8; 64],
}

impl SeccompData {
    /// A call of number `nr` under audit architecture `arch`, with `args`.
    pub fn call(arch: u32, nr: u32, args: [u64; 6]) -> SeccompData {
        let mut bytes = [0u8; 64];
        bytes[0..4].copy_from_slice(&nr.to_ne_bytes());
        bytes[4..8].copy_from_slice(&arch.to_ne_bytes());
        for (i, a) in args.iter().enumerate() {
            bytes[16 + 8 * i..24 + 8 * i].copy_from_slice(&a.to_ne_bytes());
        }
        SeccompData { bytes }
    }

    fn word(&self, offset: u32) -> u32 {
        let at = usize::try_from(offset).expect("offset fits");
        assert!(
            at % 4 == 0 && at + 4 <= self.bytes.len(),
            "load at {offset}"
        );
        u32::from_ne_bytes(self.bytes[at..at + 4].try_into().expect("four bytes"))
    }
}

/// The action `program` returns for `data`.
pub fn run(program: &[sock_filter], data: &SeccompData) -> u32 {
    run_counting(program, data).0
}

/// The action `program` returns for `data`, and how many instructions it ran.
pub fn run_counting(program: &[sock_filter], data: &SeccompData) -> (u32, usize) {
    let mut acc = 0u32;
    let mut pc = 0usize;
    let mut steps = 0;
    loop {
        let insn = program.get(pc).expect("the program ran off its end");
        steps += 1;
        let code = u32::from(insn.code);
        let (jt, jf) = (usize::from(insn.jt), usize::from(insn.jf));
        pc += 1;
        match code {
            c if c == libc::BPF_LD | libc::BPF_W | libc::BPF_ABS => acc = data.word(insn.k),
            c if c == libc::BPF_ALU | libc::BPF_AND | libc::BPF_K => acc &= insn.k,
            c if c == libc::BPF_RET | libc::BPF_K => return (insn.k, steps),
            c if c == libc::BPF_JMP | libc::BPF_JA => {
                pc += usize::try_from(insn.k).expect("jump fits")
            }
            c if c == libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K => {
                pc += if acc == insn.k { jt } else { jf }
            }
            c if c == libc::BPF_JMP | libc::BPF_JGE | libc::BPF_K => {
                pc += if acc >= insn.k { jt } else { jf }
            }
            c if c == libc::BPF_JMP | libc::BPF_JGT | libc::BPF_K => {
                pc += if acc > insn.k { jt } else { jf }
            }
            c if c == libc::BPF_JMP | libc::BPF_JSET | libc::BPF_K => {
                pc += if acc & insn.k != 0 { jt } else { jf }
            }
            other => panic!("instruction {other:#x} at {} is not interpreted", pc - 1),
        }
    }
}
