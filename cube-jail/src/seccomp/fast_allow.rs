//! A prefix that lets a deny-list filter's unlisted system calls through in a few
//! instructions.
//!
//! seccompiler compiles a filter into one chain of comparisons, one per listed call, so
//! an allowed call walks the whole chain. The kernel walks it too, once per system call
//! number, when a filter is attached: it emulates the filter for every number to find
//! the calls it may allow without running it (the action cache), with interrupts off.
//! For the sandbox's deny list (~370 instructions) that emulation was the largest part
//! of the jail's set-up in `cube run` (0.3 ms of `seccomp()`, perf). The prefix is a
//! binary search over the listed numbers: a number not on the list is allowed after at
//! most ~2·log2(n) comparisons, one on the list goes on to the unchanged program, which
//! decides as before.

use seccompiler::{sock_filter, BpfProgram};

use super::bpf::{jump, stmt, ARCH_OFFSET, JA, JEQ, JGE, LD_ABS, NR_OFFSET, RET};

/// `AUDIT_ARCH_X86_64` of `<linux/audit.h>` (EM_X86_64 | 64-bit | little-endian): what
/// `seccomp_data.arch` holds for a native x86-64 system call.
pub(crate) const AUDIT_ARCH_X86_64: u32 = 62 | 0x8000_0000 | 0x4000_0000;

/// Why the prefix could not be built.
#[derive(Debug, thiserror::Error)]
pub enum FastAllowError {
    /// A conditional jump of classic BPF reaches at most 255 instructions ahead.
    #[error("{0} listed system calls are too many for the fast path's jumps")]
    TooMany(usize),
}

/// `program` behind a prefix that returns ALLOW for every native x86-64 system call
/// whose number is not in `listed`; listed numbers, and calls of any other
/// architecture, go on to `program` unchanged.
///
/// `listed` must hold every number `program` does anything but allow for, which is
/// true of a seccompiler filter whose default action is Allow and whose rules are
/// keyed by `listed`. The prefix's jumps are relative and `program`'s own jumps stay
/// within it, so prepending is safe.
pub fn allow_unlisted_first(
    program: &BpfProgram,
    listed: &[i64],
) -> Result<BpfProgram, FastAllowError> {
    let mut numbers: Vec<u32> = listed
        .iter()
        .filter_map(|n| u32::try_from(*n).ok())
        .collect();
    numbers.sort_unstable();
    numbers.dedup();

    let mut prefix = vec![
        stmt(LD_ABS, ARCH_OFFSET),
        jump(JEQ, AUDIT_ARCH_X86_64, 1, 0),
        stmt(JA, 0), // to the program: patched below
        stmt(LD_ABS, NR_OFFSET),
    ];
    let mut to_program = vec![2];
    search(&mut prefix, &mut to_program, &numbers)?;
    let end = prefix.len();
    for at in to_program {
        // A forward jump from `at` lands at `at + 1 + k`; `end` is the program's start.
        prefix[at].k =
            u32::try_from(end - at - 1).map_err(|_| FastAllowError::TooMany(numbers.len()))?;
    }
    prefix.extend_from_slice(program);
    Ok(prefix)
}

/// Appends the binary search over `numbers` (sorted, the accumulator holding the
/// system call number): ALLOW when the number is not among them, a jump to the program
/// (recorded in `to_program`) when it is.
fn search(
    out: &mut Vec<sock_filter>,
    to_program: &mut Vec<usize>,
    numbers: &[u32],
) -> Result<(), FastAllowError> {
    match numbers {
        [] => out.push(stmt(RET, libc::SECCOMP_RET_ALLOW)),
        [only] => {
            out.push(jump(JEQ, *only, 1, 0));
            out.push(stmt(RET, libc::SECCOMP_RET_ALLOW));
            to_program.push(out.len());
            out.push(stmt(JA, 0));
        }
        _ => {
            let mid = numbers.len() / 2;
            let at = out.len();
            // At or above numbers[mid]: the upper half, past the lower half's code.
            out.push(jump(JGE, numbers[mid], 0, 0));
            search(out, to_program, &numbers[..mid])?;
            out[at].jt = u8::try_from(out.len() - at - 1)
                .map_err(|_| FastAllowError::TooMany(numbers.len()))?;
            search(out, to_program, &numbers[mid..])?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::seccomp::bpf_interpreter::{run, SeccompData, AUDIT_ARCH_I386};

    /// A program that denies exactly `listed` (EPERM), in seccompiler's shape: the
    /// prefixed version must decide every input as it does.
    fn deny_only(listed: &[i64]) -> BpfProgram {
        let rules = listed.iter().map(|n| (*n, Vec::new())).collect();
        seccompiler::SeccompFilter::new(
            rules,
            seccompiler::SeccompAction::Allow,
            seccompiler::SeccompAction::Errno(1),
            seccompiler::TargetArch::x86_64,
        )
        .and_then(TryInto::try_into)
        .unwrap()
    }

    #[test]
    fn decides_every_number_as_the_program_does() {
        for listed in [
            vec![],
            vec![0],
            vec![59],
            vec![0, 1],
            vec![1, 3, 5, 7, 9, 11, 13],
            (0..120).step_by(3).collect::<Vec<i64>>(),
            (200..300).collect(),
        ] {
            let program = deny_only(&listed);
            let fast = allow_unlisted_first(&program, &listed).unwrap();
            for arch in [AUDIT_ARCH_X86_64, AUDIT_ARCH_I386] {
                for nr in 0..600 {
                    let data = SeccompData::call(arch, nr, [0; 6]);
                    assert_eq!(
                        run(&fast, &data),
                        run(&program, &data),
                        "listed {listed:?}, arch {arch:#x}, nr {nr}"
                    );
                }
            }
        }
    }

    #[test]
    fn an_unlisted_call_is_allowed_in_a_few_instructions() {
        let listed: Vec<i64> = (0..100).map(|n| n * 4).collect();
        let program = deny_only(&listed);
        let fast = allow_unlisted_first(&program, &listed).unwrap();
        let data = SeccompData::call(AUDIT_ARCH_X86_64, 401, [0; 6]);
        let (_, steps_fast) = crate::seccomp::bpf_interpreter::run_counting(&fast, &data);
        let (_, steps) = crate::seccomp::bpf_interpreter::run_counting(&program, &data);
        assert!(steps_fast <= 20, "{steps_fast} steps");
        assert!(
            steps > 100,
            "{steps} steps: the test's program is not a long chain"
        );
    }

    #[test]
    fn too_many_numbers_are_refused() {
        let listed: Vec<i64> = (0..400).collect();
        assert!(matches!(
            allow_unlisted_first(&Vec::new(), &listed),
            Err(FastAllowError::TooMany(_))
        ));
    }
}
