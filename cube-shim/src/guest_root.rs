//! A container's root filesystem in a VM pod's guest. The host cannot mount anything
//! inside a guest, so the shim packs the root as containerd's snapshotter mounts it on
//! the host (links kept as links, never followed) into a tar stream, gzipped at the
//! fastest level (where the guest kernel is emulated, every byte through the vsock
//! costs more than compressing it on the host and inflating it in the guest's
//! userland), writes it to a file in the guest through the agent, and has the agent
//! unpack it at
//! `/.cube-containers/<id>` with the guest's `/proc` and `/dev` in it
//! ([`cube_agent::container_root`]); the container's processes then run chrooted
//! there, as in a jail pod. The copy is the container's: what its processes write
//! stays in the guest's disk and goes with the root.
//!
//! The spec's binds (the CRI gives every container `/etc/hosts`, `/etc/resolv.conf`,
//! `/etc/hostname` and its volumes: configuration, secrets, the service account's
//! token) are copied into the same stream at their destinations, as they are at
//! create: a copy, not a share. What the host changes later is not seen in the guest,
//! what the container writes there is not seen on the host or by the pod's other
//! containers, and a read-only bind's copy is writable.

use std::path::Path;

use cube_agent::client::{Client, ClientError};

use crate::pod_mount::inner_path;

/// Why a container's root could not be put in (or taken out of) its VM pod's guest.
#[derive(Debug, thiserror::Error)]
pub enum GuestRootError {
    /// The container id cannot name a directory.
    #[error("container id {0:?} cannot name a directory")]
    BadId(String),
    /// The host-side root could not be packed.
    #[error("packing the container's root {0}")]
    Pack(String, #[source] std::io::Error),
    /// A bind cannot be copied into the guest.
    #[error("bind {destination}: {why} (a VM pod copies binds into its guest)")]
    Bind {
        /// Its destination in the container.
        destination: String,
        /// What is wrong.
        why: &'static str,
    },
    /// The agent refused or failed.
    #[error("{0} in the pod's guest")]
    Agent(&'static str, #[source] ClientError),
}

/// A host file or directory to copy into the container's root: a bind of its spec.
#[derive(Debug, Clone)]
pub struct Copy {
    /// The host path (followed, as a bind mount follows it; links beneath it are
    /// kept as links).
    pub source: std::path::PathBuf,
    /// The absolute path in the container.
    pub destination: String,
}

impl Copy {
    /// Its destination relative to the container's root; refused where it has `..`
    /// in it or is the root itself.
    fn relative_destination(&self) -> Result<std::path::PathBuf, GuestRootError> {
        let refuse = |why| GuestRootError::Bind {
            destination: self.destination.clone(),
            why,
        };
        let mut relative = std::path::PathBuf::new();
        for part in Path::new(&self.destination).components() {
            match part {
                std::path::Component::Normal(p) => relative.push(p),
                std::path::Component::RootDir | std::path::Component::CurDir => {}
                _ => return Err(refuse("the destination has .. in it")),
            }
        }
        if relative.as_os_str().is_empty() {
            return Err(refuse("the destination is the root"));
        }
        Ok(relative)
    }
}

/// A container's root in its VM pod's guest; [`GuestRoot::remove`] takes it away.
#[derive(Debug)]
pub struct GuestRoot {
    inner: String,
    removed: bool,
}

impl GuestRoot {
    /// Copies `host_root`, with `copies` at their destinations in it, into the guest
    /// `agent` serves, as the root of container `id`.
    pub fn install(
        agent: &Client,
        host_root: &Path,
        copies: &[Copy],
        id: &str,
    ) -> Result<GuestRoot, GuestRootError> {
        let inner = inner_path(id).map_err(|_| GuestRootError::BadId(id.to_string()))?;
        let copies = copies
            .iter()
            .map(|c| Ok((c.relative_destination()?, c.clone())))
            .collect::<Result<Vec<_>, GuestRootError>>()?;
        let archive = format!("{inner}.tar.gz");
        let (mut reader, writer) = std::io::pipe()
            .map_err(|e| GuestRootError::Pack(host_root.display().to_string(), e))?;
        let source = host_root.to_path_buf();
        let packer = std::thread::Builder::new()
            .name("pack-root".into())
            .spawn(move || pack(&source, &copies, writer))
            .map_err(|e| GuestRootError::Pack(host_root.display().to_string(), e))?;
        let started = std::time::Instant::now();
        let written = agent.write_file(&archive, &mut reader);
        let wrote = started.elapsed();
        // A failed packer dropped its end: the write ended early, and is not used.
        drop(reader);
        let packed = packer
            .join()
            .unwrap_or_else(|_| Err(std::io::Error::other("the packing thread panicked")));
        // A failed write closed the packer's pipe (its error is the write's then).
        let outcome = match (packed, written) {
            (_, Err(e)) => Err(GuestRootError::Agent("writing the root's archive", e)),
            (Err(e), Ok(_)) => Err(GuestRootError::Pack(host_root.display().to_string(), e)),
            (Ok(()), Ok(_)) => agent
                .install_root(&archive, &inner)
                .map_err(|e| GuestRootError::Agent("unpacking the root", e)),
        };
        log::info!(
            "container {id}: root archive written in {:.2} s, unpacked in {:.2} s",
            wrote.as_secs_f64(),
            (started.elapsed() - wrote).as_secs_f64()
        );
        if let Err(e) = outcome {
            // install_root removes the archive itself; a failed write may leave it.
            let _ = agent.remove(&archive, false);
            return Err(e);
        }
        Ok(GuestRoot {
            inner,
            removed: false,
        })
    }

    /// Its path in the guest.
    pub fn inner(&self) -> &str {
        &self.inner
    }

    /// Unmounts and removes it in the guest (idempotent).
    pub fn remove(&mut self, agent: &Client) -> Result<(), GuestRootError> {
        if self.removed {
            return Ok(());
        }
        agent
            .remove_root(&self.inner)
            .map_err(|e| GuestRootError::Agent("removing the root", e))?;
        self.removed = true;
        Ok(())
    }
}

/// Writes `root` as a gzipped tar stream: owners, modes and times kept, links stored as
/// links, devices and FIFOs as such (a socket in an image is refused); then each copy
/// at its (relative) destination, replacing what the image has there.
fn pack(
    root: &Path,
    copies: &[(std::path::PathBuf, Copy)],
    out: std::io::PipeWriter,
) -> std::io::Result<()> {
    let gzip =
        flate2::write::GzEncoder::new(std::io::BufWriter::new(out), flate2::Compression::fast());
    let mut builder = tar::Builder::new(gzip);
    builder.follow_symlinks(false);
    builder.mode(tar::HeaderMode::Complete);
    builder.append_dir_all(".", root)?;
    for (destination, copy) in copies {
        let what = |e: std::io::Error| {
            std::io::Error::new(e.kind(), format!("bind {}: {e}", copy.destination))
        };
        let meta = std::fs::metadata(&copy.source).map_err(what)?;
        if meta.is_dir() {
            builder
                .append_dir_all(destination, &copy.source)
                .map_err(what)?;
        } else if meta.is_file() {
            let mut file = std::fs::File::open(&copy.source).map_err(what)?;
            builder.append_file(destination, &mut file).map_err(what)?;
        } else {
            return Err(what(std::io::Error::new(
                std::io::ErrorKind::Unsupported,
                "neither a file nor a directory",
            )));
        }
    }
    builder
        .into_inner()?
        .finish()?
        .into_inner()
        .map_err(|e| e.into_error())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The stream holds the tree as it is, links as links (one pointing out of the
    /// tree included: its target is not read).
    #[test]
    fn a_root_packs_with_its_links_unfollowed() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        std::fs::create_dir_all(root.join("bin")).unwrap();
        std::fs::write(root.join("bin/tool"), b"#!/bin/sh\n").unwrap();
        std::os::unix::fs::symlink("/etc/shadow", root.join("shadow")).unwrap();
        let (mut reader, writer) = std::io::pipe().unwrap();
        let hosts = dir.path().join("hosts");
        std::fs::write(&hosts, b"127.0.0.1 pod\n").unwrap();
        let volume = dir.path().join("volume");
        std::fs::create_dir(&volume).unwrap();
        std::fs::write(volume.join("token"), b"t0k3n").unwrap();
        let copies = [
            Copy {
                source: hosts,
                destination: "/etc/hosts".into(),
            },
            Copy {
                source: volume,
                destination: "/var/run/secrets/sa".into(),
            },
        ];
        let copies: Vec<_> = copies
            .iter()
            .map(|c| (c.relative_destination().unwrap(), c.clone()))
            .collect();
        let packer = std::thread::spawn(move || pack(&root, &copies, writer));
        let mut bytes = Vec::new();
        std::io::Read::read_to_end(&mut reader, &mut bytes).unwrap();
        packer.join().unwrap().unwrap();
        let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(bytes.as_slice()));
        let mut seen = Vec::new();
        for entry in archive.entries().unwrap() {
            let entry = entry.unwrap();
            let name = entry.path().unwrap().display().to_string();
            let link = entry.link_name().unwrap().map(|l| l.display().to_string());
            seen.push((name, entry.header().entry_type(), link, entry.size()));
        }
        assert!(
            seen.iter().any(|(n, t, l, _)| n == "shadow"
                && *t == tar::EntryType::Symlink
                && l.as_deref() == Some("/etc/shadow")),
            "{seen:?}"
        );
        assert!(
            seen.iter()
                .any(|(n, t, _, s)| n == "bin/tool" && t.is_file() && *s == 10),
            "{seen:?}"
        );
        // The binds, after the image's files, at their destinations.
        let names: Vec<&str> = seen.iter().map(|(n, ..)| n.as_str()).collect();
        let at = |name: &str| names.iter().position(|n| *n == name);
        assert!(at("etc/hosts") > at("bin/tool"), "{names:?}");
        assert!(at("var/run/secrets/sa/token").is_some(), "{names:?}");
    }

    #[test]
    fn a_socket_in_the_root_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let _socket = std::os::unix::net::UnixListener::bind(dir.path().join("s")).unwrap();
        let (_reader, writer) = std::io::pipe().unwrap();
        let reader = std::thread::spawn(move || {
            let mut r = _reader;
            let mut sink = Vec::new();
            std::io::Read::read_to_end(&mut r, &mut sink).map(|_| ())
        });
        assert!(pack(dir.path(), &[], writer).is_err());
        reader.join().unwrap().unwrap();
    }
}

#[cfg(test)]
mod copy_tests {
    use super::*;

    #[test]
    fn bind_destinations_stay_in_the_root() {
        let copy = |d: &str| Copy {
            source: "/x".into(),
            destination: d.into(),
        };
        assert_eq!(
            copy("/etc/hosts").relative_destination().unwrap(),
            Path::new("etc/hosts")
        );
        for bad in ["/", "", "/etc/../../x", "/a/.."] {
            assert!(
                matches!(
                    copy(bad).relative_destination(),
                    Err(GuestRootError::Bind { .. })
                ),
                "{bad:?}"
            );
        }
    }
}
