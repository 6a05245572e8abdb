//! The classic-BPF instructions the hand-written parts of the filters use (the x32
//! guard, the fast path), built as seccompiler's `sock_filter`s.

use seccompiler::sock_filter;

/// Offset of the system call number in `struct seccomp_data`.
pub(super) const NR_OFFSET: u32 = 0;
/// Offset of the audit architecture in `struct seccomp_data`.
pub(super) const ARCH_OFFSET: u32 = 4;

/// Load a word of `seccomp_data` into the accumulator.
pub(super) const LD_ABS: u16 = (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16;
/// Jump if the accumulator equals `k`.
pub(super) const JEQ: u16 = (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16;
/// Jump if the accumulator is at least `k`.
pub(super) const JGE: u16 = (libc::BPF_JMP | libc::BPF_JGE | libc::BPF_K) as u16;
/// Jump `k` instructions ahead.
pub(super) const JA: u16 = (libc::BPF_JMP | libc::BPF_JA) as u16;
/// Return `k` as the action.
pub(super) const RET: u16 = (libc::BPF_RET | libc::BPF_K) as u16;

/// An instruction without jump offsets.
pub(super) fn stmt(code: u16, k: u32) -> sock_filter {
    sock_filter {
        code,
        jt: 0,
        jf: 0,
        k,
    }
}

/// A conditional jump: `jt` ahead when true, `jf` when false.
pub(super) fn jump(code: u16, k: u32, jt: u8, jf: u8) -> sock_filter {
    sock_filter { code, jt, jf, k }
}
