//! The agent a VM image carries. The kernel starts it as PID 1 from an image that may
//! hold no C library at all, or another than the host's, so it must be statically
//! linked (an ELF without an interpreter): a dynamically linked one fails the boot
//! with the kernel's "Requested init ... failed (error -2)".
//!
//! `cargo build` leaves a dynamically linked agent in `target/<profile>`;
//! `scripts/build-static.sh` (run by set-up) puts a static one in
//! `target/static/<profile>`, and set-up installs that one.

use std::path::{Path, PathBuf};

use crate::jail_spec::{AGENT_BIN, AGENT_ENV};

/// ELF program header type of the interpreter (dynamic loader) path.
const PT_INTERP: u32 = 3;
/// Bytes of the ELF64 file header.
const ELF64_HEADER: usize = 64;

/// Why no agent fit for a VM image was found.
#[derive(Debug, thiserror::Error)]
pub enum ImageAgentError {
    /// The agent could not be read.
    #[error("Reading the agent {0}")]
    Read(PathBuf, #[source] std::io::Error),
    /// The file is no 64-bit ELF executable.
    #[error("The agent {0} is not a 64-bit ELF executable")]
    NotElf(PathBuf),
    /// The agent needs a dynamic loader, which an image need not have.
    #[error("The agent {0} is dynamically linked; a VM image needs a static one (scripts/build-static.sh --musl cube-agent cube-agent --release, or set {AGENT_ENV})")]
    Dynamic(PathBuf),
    /// No statically linked agent was found.
    #[error("No statically linked {AGENT_BIN} found (looked at {0}); build one with scripts/build-static.sh --musl cube-agent cube-agent --release, or set {AGENT_ENV}")]
    NotFound(String),
}

/// Whether the ELF executable at `path` is statically linked (has no `PT_INTERP`).
pub fn is_static(path: &Path) -> Result<bool, ImageAgentError> {
    let bytes = std::fs::read(path).map_err(|e| ImageAgentError::Read(path.to_path_buf(), e))?;
    let not_elf = || ImageAgentError::NotElf(path.to_path_buf());
    let header = bytes.get(..ELF64_HEADER).ok_or_else(not_elf)?;
    // Magic, 64-bit class, little-endian.
    if &header[..4] != b"\x7fELF" || header[4] != 2 || header[5] != 1 {
        return Err(not_elf());
    }
    let u16_at = |at: usize| usize::from(u16::from_le_bytes([header[at], header[at + 1]]));
    let mut phoff = [0u8; 8];
    phoff.copy_from_slice(&header[0x20..0x28]);
    let (entry_size, count) = (u16_at(0x36), u16_at(0x38));
    if entry_size < 4 {
        return Err(not_elf());
    }
    let table = usize::try_from(u64::from_le_bytes(phoff))
        .ok()
        .and_then(|start| bytes.get(start..start.checked_add(entry_size * count)?))
        .ok_or_else(not_elf)?;
    Ok(!table
        .chunks_exact(entry_size)
        .any(|entry| u32::from_le_bytes([entry[0], entry[1], entry[2], entry[3]]) == PT_INTERP))
}

/// Checks that `agent` can go into a VM image (see the module documentation).
pub fn check(agent: &Path) -> Result<(), ImageAgentError> {
    if is_static(agent)? {
        Ok(())
    } else {
        Err(ImageAgentError::Dynamic(agent.to_path_buf()))
    }
}

/// A statically linked agent: `$CUBE_AGENT` (which must be one), else the first static
/// one next to the running executable, one directory up (where cargo puts binaries
/// for test executables), or in `target/static/<profile>` beside either.
pub fn locate() -> Result<PathBuf, ImageAgentError> {
    if let Some(path) = std::env::var_os(AGENT_ENV) {
        let path = PathBuf::from(path);
        check(&path)?;
        return Ok(path);
    }
    let exe = std::env::current_exe().unwrap_or_default();
    let candidates = candidates(&exe);
    candidates
        .iter()
        .find(|c| c.is_file() && is_static(c).unwrap_or(false))
        .cloned()
        .ok_or_else(|| {
            let looked: Vec<String> = candidates.iter().map(|c| c.display().to_string()).collect();
            ImageAgentError::NotFound(looked.join(", "))
        })
}

/// Where [`locate`] looks, in order, for the executable `exe`.
fn candidates(exe: &Path) -> Vec<PathBuf> {
    let Some(dir) = exe.parent() else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for dir in [Some(dir), dir.parent()].into_iter().flatten() {
        out.push(dir.join(AGENT_BIN));
        // target/<profile> -> target/static/<profile>.
        if let (Some(profile), Some(target)) = (dir.file_name(), dir.parent()) {
            out.push(target.join("static").join(profile).join(AGENT_BIN));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn static_and_dynamic_executables_are_told_apart() {
        // The test executable is linked dynamically (cargo's default for glibc).
        let exe = std::env::current_exe().unwrap();
        assert!(!is_static(&exe).unwrap());
        assert!(matches!(check(&exe), Err(ImageAgentError::Dynamic(_))));
        let dir = tempfile::tempdir().unwrap();
        let text = dir.path().join("script");
        std::fs::write(&text, "#!/bin/sh\n").unwrap();
        assert!(matches!(is_static(&text), Err(ImageAgentError::NotElf(_))));
        // A static executable: one whose program headers name no interpreter.
        let mut elf = vec![0u8; ELF64_HEADER + 56];
        elf[..6].copy_from_slice(b"\x7fELF\x02\x01");
        elf[0x20..0x28].copy_from_slice(&(ELF64_HEADER as u64).to_le_bytes());
        elf[0x36..0x38].copy_from_slice(&56u16.to_le_bytes());
        elf[0x38..0x3a].copy_from_slice(&1u16.to_le_bytes());
        // PT_LOAD.
        elf[ELF64_HEADER] = 1;
        let fake = dir.path().join("static");
        std::fs::write(&fake, &elf).unwrap();
        assert!(is_static(&fake).unwrap());
        elf[ELF64_HEADER] = PT_INTERP as u8;
        std::fs::write(&fake, &elf).unwrap();
        assert!(!is_static(&fake).unwrap());
        // Program headers past the end of the file.
        elf[0x38..0x3a].copy_from_slice(&9u16.to_le_bytes());
        std::fs::write(&fake, &elf).unwrap();
        assert!(matches!(is_static(&fake), Err(ImageAgentError::NotElf(_))));
    }

    #[test]
    fn static_builds_are_looked_for_beside_cargos() {
        let found = candidates(Path::new("/w/target/release/deps/test-123"));
        let has = |p: &str| found.iter().any(|c| c == Path::new(p));
        assert!(has("/w/target/release/deps/cube-agent"), "{found:?}");
        assert!(has("/w/target/release/cube-agent"), "{found:?}");
        assert!(has("/w/target/static/release/cube-agent"), "{found:?}");
    }
}
