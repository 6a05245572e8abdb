//! Root filesystem trees from container images: an OCI image layout (a directory, or a
//! tar of one) or a `docker save` archive. The image's layers are applied in order
//! (gzip, zstd or uncompressed tars), whiteouts honoured (`.wh.NAME` removes NAME of the
//! layers below, `.wh..wh..opq` empties its directory of them), and its config's Env,
//! WorkingDir and User kept for the sandbox's processes ([`ProcessDefaults`]).
//!
//! Nothing in the image is trusted: every blob is read through SHA-256 and compared
//! with its digest (a `docker save` layer with its config's diff id) before it is
//! applied; an entry naming `..` or lying under a symlink is refused, and a symlink an
//! entry writes is never followed on the host (links are made, not resolved).

use std::collections::HashSet;
use std::fs::File;
use std::io::{BufReader, Read};
use std::os::unix::fs::PermissionsExt;
use std::path::{Component, Path, PathBuf};

use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::records::ProcessDefaults;

/// Why an image could not be turned into a tree.
#[derive(Debug, thiserror::Error)]
pub enum OciError {
    /// A file of the image could not be read, or the tree could not be written.
    #[error("{0}")]
    Io(String, #[source] std::io::Error),
    /// A tar (the image archive or a layer) ends early or is not a tar.
    #[error("{0} is damaged or truncated")]
    Corrupt(String, #[source] std::io::Error),
    /// The archive is neither an OCI image layout nor a `docker save` archive.
    #[error(
        "{0} is not an OCI image layout or docker save archive (no index.json or manifest.json)"
    )]
    NotAnImage(PathBuf),
    /// A JSON document of the image is malformed.
    #[error("The image's {0} is malformed")]
    Json(String, #[source] serde_json::Error),
    /// The image names something this build does not take (a digest algorithm, a
    /// layer compression, several manifests without one for this machine).
    #[error("{0}")]
    Unsupported(String),
    /// A blob the image names is not in it.
    #[error("The image has no blob {0}")]
    MissingBlob(String),
    /// A blob's content is not what its digest says.
    #[error("Blob {digest} does not match its digest (its content hashes to {actual})")]
    DigestMismatch {
        /// The digest the image names.
        digest: String,
        /// What the content hashes to.
        actual: String,
    },
    /// A tar entry's path leaves the tree (`..`) or lies under a symlink.
    #[error("Layer {layer}: entry {entry:?} {why}")]
    UnsafeEntry {
        /// The layer (its digest or file).
        layer: String,
        /// The entry's path as the tar names it.
        entry: String,
        /// What is wrong with it.
        why: &'static str,
    },
}

fn io(what: impl std::fmt::Display) -> impl FnOnce(std::io::Error) -> OciError {
    let what = what.to_string();
    move |e| OciError::Io(what, e)
}

fn corrupt(what: impl std::fmt::Display) -> impl FnOnce(std::io::Error) -> OciError {
    let what = what.to_string();
    move |e| OciError::Corrupt(what, e)
}

/// What an image unpacked into: its process defaults and counts for people.
#[derive(Debug, Default)]
pub struct Unpacked {
    /// The config's Env, WorkingDir and User.
    pub defaults: ProcessDefaults,
    /// Layers applied.
    pub layers: usize,
    /// Device nodes left out (a sandbox's /dev is its own).
    pub skipped_devices: usize,
}

#[derive(Deserialize)]
struct Descriptor {
    #[serde(rename = "mediaType", default)]
    media_type: String,
    digest: String,
    #[serde(default)]
    size: Option<u64>,
    #[serde(default)]
    platform: Option<Platform>,
}

#[derive(Deserialize)]
struct Platform {
    architecture: String,
    os: String,
}

#[derive(Deserialize)]
struct Index {
    manifests: Vec<Descriptor>,
}

#[derive(Deserialize)]
struct Manifest {
    config: Descriptor,
    layers: Vec<Descriptor>,
}

#[derive(Deserialize)]
struct DockerManifest {
    #[serde(rename = "Config")]
    config: String,
    #[serde(rename = "Layers")]
    layers: Vec<String>,
}

#[derive(Deserialize, Default)]
struct ImageConfig {
    #[serde(default)]
    config: Option<RunConfig>,
    #[serde(default)]
    rootfs: Option<RootfsConfig>,
}

#[derive(Deserialize, Default)]
struct RunConfig {
    #[serde(rename = "Env", default)]
    env: Option<Vec<String>>,
    #[serde(rename = "WorkingDir", default)]
    working_dir: Option<String>,
    #[serde(rename = "User", default)]
    user: Option<String>,
}

#[derive(Deserialize, Default)]
struct RootfsConfig {
    #[serde(default)]
    diff_ids: Vec<String>,
}

/// One layer to apply: its file, the digest that file must have (an OCI blob's), and
/// the digest its uncompressed tar must have (a config's diff id), where known.
struct Layer {
    file: PathBuf,
    name: String,
    digest: Option<String>,
    diff_id: Option<String>,
}

/// Unpacks image `source` (a directory or a tar file) into `tree` (which must not
/// exist), using `scratch` (which must not exist; removed afterwards) to hold a tar's
/// files; calls `progress` with a line per step.
pub fn unpack(
    source: &Path,
    tree: &Path,
    scratch: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<Unpacked, OciError> {
    let meta = std::fs::metadata(source).map_err(io(format!("reading {}", source.display())))?;
    if meta.is_dir() {
        return unpack_dir(source, tree, progress);
    }
    progress(&format!("reading {}", source.display()));
    let result = (|| {
        extract_outer(source, scratch)?;
        unpack_dir(scratch, tree, progress)
    })();
    let _ = std::fs::remove_dir_all(scratch);
    result
}

/// Extracts the files of an image tar (plain files and directories only, paths
/// checked) into `dest`.
fn extract_outer(source: &Path, dest: &Path) -> Result<(), OciError> {
    let file = File::open(source).map_err(io(format!("opening {}", source.display())))?;
    let name = source.display().to_string();
    std::fs::create_dir(dest).map_err(io(format!("creating {}", dest.display())))?;
    let mut archive = tar::Archive::new(BufReader::new(file));
    let entries = archive.entries().map_err(corrupt(&name))?;
    for entry in entries {
        let mut entry = entry.map_err(corrupt(&name))?;
        let path = entry.path().map_err(corrupt(&name))?;
        let Some(relative) = inside(&path) else {
            return Err(OciError::UnsafeEntry {
                layer: name,
                entry: path.display().to_string(),
                why: "leaves the archive",
            });
        };
        if relative.as_os_str().is_empty() {
            continue;
        }
        let at = dest.join(&relative);
        check_parents(dest, &relative).map_err(|why| OciError::UnsafeEntry {
            layer: name.clone(),
            entry: relative.display().to_string(),
            why,
        })?;
        match entry.header().entry_type() {
            tar::EntryType::Directory => {
                std::fs::create_dir_all(&at).map_err(io(format!("creating {}", at.display())))?
            }
            tar::EntryType::Regular | tar::EntryType::Continuous => {
                if let Some(parent) = at.parent() {
                    std::fs::create_dir_all(parent)
                        .map_err(io(format!("creating {}", parent.display())))?;
                }
                let mut out =
                    File::create(&at).map_err(io(format!("creating {}", at.display())))?;
                std::io::copy(&mut entry, &mut out).map_err(corrupt(&name))?;
            }
            // Links and the rest have no place in an image archive's own files.
            _ => {}
        }
    }
    Ok(())
}

fn read_json<T: serde::de::DeserializeOwned>(path: &Path, what: &str) -> Result<T, OciError> {
    let bytes = std::fs::read(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => OciError::MissingBlob(what.to_string()),
        _ => OciError::Io(format!("reading {}", path.display()), e),
    })?;
    serde_json::from_slice(&bytes).map_err(|e| OciError::Json(what.to_string(), e))
}

/// The file of blob `digest` in layout `dir`; only `sha256:` and 64 hex digits, so a
/// digest can never name a path outside the blobs.
fn blob_path(dir: &Path, digest: &str) -> Result<PathBuf, OciError> {
    let hex = digest
        .strip_prefix("sha256:")
        .filter(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
        .ok_or_else(|| {
            OciError::Unsupported(format!("Unsupported digest {digest:?} (sha256 only)"))
        })?;
    let path = dir.join("blobs").join("sha256").join(hex);
    if !path.is_file() {
        return Err(OciError::MissingBlob(digest.to_string()));
    }
    Ok(path)
}

/// Reads `blob` whole through SHA-256 and checks it against `digest`.
fn verify_blob(path: &Path, digest: &str, size: Option<u64>) -> Result<(), OciError> {
    let mut file = File::open(path).map_err(io(format!("opening {}", path.display())))?;
    let mut hash = Sha256::new();
    let copied =
        std::io::copy(&mut file, &mut hash).map_err(io(format!("reading {}", path.display())))?;
    let actual = format!("sha256:{}", hex(&hash.finalize()));
    if actual != digest.to_ascii_lowercase() || size.is_some_and(|s| s != copied) {
        return Err(OciError::DigestMismatch {
            digest: digest.to_string(),
            actual,
        });
    }
    Ok(())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

const MANIFEST_TYPES: &[&str] = &[
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
];
const INDEX_TYPES: &[&str] = &[
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
];

/// The architecture as OCI names it.
fn oci_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}

/// Of an index's manifests, the one for this machine (or the only one).
fn pick(manifests: Vec<Descriptor>) -> Result<Descriptor, OciError> {
    let mut candidates: Vec<Descriptor> = manifests
        .into_iter()
        .filter(|d| {
            d.media_type.is_empty()
                || MANIFEST_TYPES.contains(&d.media_type.as_str())
                || INDEX_TYPES.contains(&d.media_type.as_str())
        })
        .collect();
    if candidates.len() > 1 {
        candidates.retain(|d| {
            d.platform
                .as_ref()
                .is_none_or(|p| p.os == "linux" && p.architecture == oci_arch())
        });
    }
    match candidates.len() {
        1 => Ok(candidates.remove(0)),
        0 => Err(OciError::Unsupported(format!(
            "The image has no manifest for linux/{}",
            oci_arch()
        ))),
        n => Err(OciError::Unsupported(format!(
            "The image has {n} manifests for linux/{}; keep one",
            oci_arch()
        ))),
    }
}

fn unpack_dir(
    dir: &Path,
    tree: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<Unpacked, OciError> {
    let (config, layers) = if dir.join("index.json").is_file() {
        oci_layers(dir)?
    } else if dir.join("manifest.json").is_file() {
        docker_layers(dir)?
    } else {
        return Err(OciError::NotAnImage(dir.to_path_buf()));
    };
    // Every blob checked before any is applied: by its digest, or (a `docker save`
    // layer) by its uncompressed content's diff id.
    for layer in &layers {
        match (&layer.digest, &layer.diff_id) {
            (Some(digest), _) => verify_blob(&layer.file, digest, None)?,
            (None, Some(diff_id)) => verify_diff_id(layer, diff_id)?,
            (None, None) => {}
        }
    }
    std::fs::create_dir(tree).map_err(io(format!("creating {}", tree.display())))?;
    let mut skipped_devices = 0;
    for (i, layer) in layers.iter().enumerate() {
        progress(&format!("layer {}/{}: {}", i + 1, layers.len(), layer.name));
        skipped_devices += apply_layer(layer, tree)?;
    }
    let run = config.config.unwrap_or_default();
    let defaults = ProcessDefaults {
        env: run
            .env
            .unwrap_or_default()
            .into_iter()
            .filter_map(|kv| {
                let (k, v) = kv.split_once('=')?;
                Some((k.to_string(), v.to_string()))
            })
            .collect(),
        cwd: run.working_dir.filter(|w| !w.is_empty()),
        user: run.user.filter(|u| !u.is_empty()),
    };
    if let Some(cwd) = &defaults.cwd {
        // As a container runtime does: the working directory exists when a process
        // starts in it.
        let relative = inside(Path::new(cwd)).ok_or_else(|| {
            OciError::Unsupported(format!("The image's WorkingDir {cwd:?} leaves the tree"))
        })?;
        check_parents(tree, &relative).map_err(|why| OciError::UnsafeEntry {
            layer: "config".into(),
            entry: cwd.clone(),
            why,
        })?;
        let at = tree.join(&relative);
        if !std::fs::symlink_metadata(&at).is_ok_and(|m| m.is_dir()) {
            std::fs::create_dir_all(&at).map_err(io(format!("creating {}", at.display())))?;
        }
    }
    Ok(Unpacked {
        defaults,
        layers: layers.len(),
        skipped_devices,
    })
}

fn oci_layers(dir: &Path) -> Result<(ImageConfig, Vec<Layer>), OciError> {
    let index: Index = read_json(&dir.join("index.json"), "index.json")?;
    let mut chosen = pick(index.manifests)?;
    // A nested index (as `docker save` writes one) names the manifest in turn.
    for _ in 0..4 {
        if !INDEX_TYPES.contains(&chosen.media_type.as_str()) {
            break;
        }
        let path = blob_path(dir, &chosen.digest)?;
        verify_blob(&path, &chosen.digest, chosen.size)?;
        let nested: Index = read_json(&path, &chosen.digest)?;
        chosen = pick(nested.manifests)?;
    }
    let path = blob_path(dir, &chosen.digest)?;
    verify_blob(&path, &chosen.digest, chosen.size)?;
    let manifest: Manifest = read_json(&path, &chosen.digest)?;
    let config_path = blob_path(dir, &manifest.config.digest)?;
    verify_blob(&config_path, &manifest.config.digest, manifest.config.size)?;
    let config: ImageConfig = read_json(&config_path, &manifest.config.digest)?;
    let diff_ids = config
        .rootfs
        .as_ref()
        .map(|r| r.diff_ids.clone())
        .unwrap_or_default();
    let layers = manifest
        .layers
        .iter()
        .enumerate()
        .map(|(i, d)| {
            Ok(Layer {
                file: blob_path(dir, &d.digest)?,
                name: d.digest.clone(),
                digest: Some(d.digest.clone()),
                diff_id: diff_ids.get(i).cloned(),
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok((config, layers))
}

fn docker_layers(dir: &Path) -> Result<(ImageConfig, Vec<Layer>), OciError> {
    let manifests: Vec<DockerManifest> = read_json(&dir.join("manifest.json"), "manifest.json")?;
    let [manifest] = <[DockerManifest; 1]>::try_from(manifests).map_err(|m| {
        OciError::Unsupported(format!("The archive holds {} images; save one", m.len()))
    })?;
    let file_in = |name: &str| -> Result<PathBuf, OciError> {
        let relative = inside(Path::new(name))
            .filter(|r| !r.as_os_str().is_empty())
            .ok_or_else(|| OciError::UnsafeEntry {
                layer: "manifest.json".into(),
                entry: name.to_string(),
                why: "leaves the archive",
            })?;
        let path = dir.join(relative);
        if !path.is_file() {
            return Err(OciError::MissingBlob(name.to_string()));
        }
        Ok(path)
    };
    let config_path = file_in(&manifest.config)?;
    // The config is named by its digest (`<hex>.json`, or `blobs/sha256/<hex>`).
    let stem = Path::new(&manifest.config)
        .file_name()
        .and_then(|n| n.to_str())
        .map(|n| n.trim_end_matches(".json").to_string())
        .unwrap_or_default();
    verify_blob(&config_path, &format!("sha256:{stem}"), None)?;
    let config: ImageConfig = read_json(&config_path, &manifest.config)?;
    let diff_ids = config
        .rootfs
        .as_ref()
        .map(|r| r.diff_ids.clone())
        .unwrap_or_default();
    if diff_ids.len() != manifest.layers.len() {
        return Err(OciError::Unsupported(format!(
            "The image's config names {} layers, its manifest {}",
            diff_ids.len(),
            manifest.layers.len()
        )));
    }
    let layers = manifest
        .layers
        .iter()
        .zip(diff_ids)
        .map(|(name, diff_id)| {
            Ok(Layer {
                file: file_in(name)?,
                name: name.clone(),
                digest: None,
                diff_id: Some(diff_id),
            })
        })
        .collect::<Result<Vec<_>, OciError>>()?;
    Ok((config, layers))
}

/// A reader that hashes what passes through it.
struct Hashing<R> {
    inner: R,
    hash: Sha256,
}

impl<R: Read> Read for Hashing<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hash.update(&buf[..n]);
        Ok(n)
    }
}

/// The layer file's content, uncompressed (gzip or zstd by its magic number).
fn layer_reader(layer: &Layer) -> Result<Box<dyn Read>, OciError> {
    let mut file = BufReader::new(
        File::open(&layer.file).map_err(io(format!("opening {}", layer.file.display())))?,
    );
    let mut magic = [0u8; 4];
    let n = {
        use std::io::BufRead;
        let buf = file
            .fill_buf()
            .map_err(io(format!("reading {}", layer.file.display())))?;
        let n = buf.len().min(4);
        magic[..n].copy_from_slice(&buf[..n]);
        n
    };
    Ok(match &magic[..n] {
        [0x1f, 0x8b, ..] => Box::new(flate2::read::GzDecoder::new(file)),
        [0x28, 0xb5, 0x2f, 0xfd] => Box::new(
            zstd::stream::read::Decoder::with_buffer(file)
                .map_err(io(format!("decoding {}", layer.file.display())))?,
        ),
        _ => Box::new(file),
    })
}

/// Reads `layer` whole, uncompressed, and checks it against `diff_id`.
fn verify_diff_id(layer: &Layer, diff_id: &str) -> Result<(), OciError> {
    let mut hash = Sha256::new();
    std::io::copy(&mut layer_reader(layer)?, &mut hash)
        .map_err(corrupt(format!("Layer {}", layer.name)))?;
    let actual = format!("sha256:{}", hex(&hash.finalize()));
    if actual != diff_id.to_ascii_lowercase() {
        return Err(OciError::DigestMismatch {
            digest: diff_id.to_string(),
            actual,
        });
    }
    Ok(())
}

/// Applies one layer onto `tree`; returns how many device nodes it left out.
fn apply_layer(layer: &Layer, tree: &Path) -> Result<usize, OciError> {
    let mut reader = Hashing {
        inner: layer_reader(layer)?,
        hash: Sha256::new(),
    };
    let name = layer.name.clone();
    let unsafe_entry = |entry: &Path, why: &'static str| OciError::UnsafeEntry {
        layer: name.clone(),
        entry: entry.display().to_string(),
        why,
    };
    let mut skipped = 0;
    // Paths this layer wrote: an opaque directory drops only what lower layers put.
    let mut written: HashSet<PathBuf> = HashSet::new();
    {
        let mut archive = tar::Archive::new(&mut reader);
        let entries = archive
            .entries()
            .map_err(corrupt(format!("Layer {name}")))?;
        for entry in entries {
            let mut entry = entry.map_err(corrupt(format!("Layer {name}")))?;
            let raw = entry
                .path()
                .map_err(corrupt(format!("Layer {name}")))?
                .into_owned();
            let relative = inside(&raw).ok_or_else(|| unsafe_entry(&raw, "leaves the tree"))?;
            if relative.as_os_str().is_empty() {
                continue;
            }
            check_parents(tree, &relative).map_err(|why| unsafe_entry(&raw, why))?;
            let at = tree.join(&relative);
            let file_name = relative
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or_default()
                .to_string();
            if file_name == ".wh..wh..opq" {
                let dir = relative.parent().unwrap_or(Path::new(""));
                empty_of_lower(tree, dir, &written)?;
                continue;
            }
            if let Some(hidden) = file_name.strip_prefix(".wh.") {
                remove_path(&at.with_file_name(hidden))?;
                continue;
            }
            let header = entry.header();
            let kind = header.entry_type();
            let mode = header.mode().unwrap_or(0o644) & 0o7777;
            let (uid, gid) = (
                header.uid().ok().and_then(|u| u32::try_from(u).ok()),
                header.gid().ok().and_then(|g| u32::try_from(g).ok()),
            );
            match kind {
                tar::EntryType::Directory => {
                    if !std::fs::symlink_metadata(&at).is_ok_and(|m| m.is_dir()) {
                        remove_path(&at)?;
                        std::fs::create_dir(&at)
                            .map_err(io(format!("creating {}", at.display())))?;
                    }
                    std::fs::set_permissions(&at, std::fs::Permissions::from_mode(mode))
                        .map_err(io(format!("setting the mode of {}", at.display())))?;
                }
                tar::EntryType::Regular | tar::EntryType::Continuous => {
                    remove_path(&at)?;
                    let mut out = std::fs::OpenOptions::new()
                        .write(true)
                        .create_new(true)
                        .open(&at)
                        .map_err(io(format!("creating {}", at.display())))?;
                    std::io::copy(&mut entry, &mut out)
                        .map_err(corrupt(format!("Layer {name}")))?;
                    out.set_permissions(std::fs::Permissions::from_mode(mode))
                        .map_err(io(format!("setting the mode of {}", at.display())))?;
                }
                tar::EntryType::Symlink => {
                    let target = entry
                        .link_name()
                        .map_err(io(format!("reading layer {name}")))?
                        .ok_or_else(|| unsafe_entry(&raw, "is a symlink without a target"))?;
                    remove_path(&at)?;
                    // Made, never followed: an absolute target means the sandbox's root.
                    std::os::unix::fs::symlink(&target, &at)
                        .map_err(io(format!("linking {}", at.display())))?;
                }
                tar::EntryType::Link => {
                    let target = entry
                        .link_name()
                        .map_err(io(format!("reading layer {name}")))?
                        .ok_or_else(|| unsafe_entry(&raw, "is a hard link without a target"))?;
                    let target = inside(&target)
                        .filter(|t| !t.as_os_str().is_empty())
                        .ok_or_else(|| unsafe_entry(&raw, "links to a file outside the tree"))?;
                    check_parents(tree, &target).map_err(|why| unsafe_entry(&raw, why))?;
                    remove_path(&at)?;
                    std::fs::hard_link(tree.join(&target), &at)
                        .map_err(io(format!("linking {}", at.display())))?;
                }
                tar::EntryType::Char | tar::EntryType::Block | tar::EntryType::Fifo => {
                    skipped += 1;
                    continue;
                }
                // PAX and GNU extension headers are read by the tar crate; anything
                // else carries no file.
                _ => continue,
            }
            if let (Some(uid), Some(gid)) = (uid, gid) {
                std::os::unix::fs::lchown(&at, Some(uid), Some(gid))
                    .map_err(io(format!("setting the owner of {}", at.display())))?;
                if kind != tar::EntryType::Symlink && mode & 0o6000 != 0 {
                    // chown clears set-id bits: put them back.
                    std::fs::set_permissions(&at, std::fs::Permissions::from_mode(mode))
                        .map_err(io(format!("setting the mode of {}", at.display())))?;
                }
            }
            written.insert(relative);
        }
    }
    // Whatever follows the tar's end counts too.
    std::io::copy(&mut reader, &mut std::io::sink()).map_err(corrupt(format!("Layer {name}")))?;
    if let Some(diff_id) = &layer.diff_id {
        let actual = format!("sha256:{}", hex(&reader.hash.finalize()));
        if actual != diff_id.to_ascii_lowercase() {
            return Err(OciError::DigestMismatch {
                digest: diff_id.clone(),
                actual,
            });
        }
    }
    Ok(skipped)
}

/// `path` as a relative path with only normal components (leading `/` and `.`
/// dropped); None when it has a `..`.
fn inside(path: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::RootDir | Component::CurDir => {}
            Component::ParentDir | Component::Prefix(_) => return None,
        }
    }
    Some(out)
}

/// Refuses `relative` when one of its parents inside `root` is a symlink (following
/// it would write wherever it points on the host). Parents not there yet are made by
/// the caller's entries in order, as tars list them.
fn check_parents(root: &Path, relative: &Path) -> Result<(), &'static str> {
    let mut at = root.to_path_buf();
    let Some(parent) = relative.parent() else {
        return Ok(());
    };
    for c in parent.components() {
        at.push(c);
        match std::fs::symlink_metadata(&at) {
            Ok(m) if m.file_type().is_symlink() => return Err("lies under a symlink"),
            Ok(m) if !m.is_dir() => return Err("lies under a file"),
            Ok(_) => {}
            Err(_) => {
                std::fs::create_dir(&at).map_err(|_| "has a parent that cannot be made")?;
            }
        }
    }
    Ok(())
}

/// Removes whatever is at `path` (a directory with its content), never following a
/// symlink; nothing there is fine.
fn remove_path(path: &Path) -> Result<(), OciError> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(path),
        Ok(_) => std::fs::remove_file(path),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
    .map_err(io(format!("removing {}", path.display())))
}

/// Removes from directory `dir` (relative to `tree`) what lower layers put there,
/// not what this layer wrote (`written`, relative to the tree).
fn empty_of_lower(tree: &Path, dir: &Path, written: &HashSet<PathBuf>) -> Result<(), OciError> {
    let at = tree.join(dir);
    if !std::fs::symlink_metadata(&at).is_ok_and(|m| m.is_dir()) {
        return Ok(());
    }
    let entries = std::fs::read_dir(&at).map_err(io(format!("reading {}", at.display())))?;
    for entry in entries {
        let entry = entry.map_err(io(format!("reading {}", at.display())))?;
        if !written.contains(&dir.join(entry.file_name())) {
            remove_path(&entry.path())?;
        }
    }
    Ok(())
}

/// Container images written by tests (this crate's, and the CLI's and cube-core's
/// through `cube_core::testing`): layer tars, OCI image layouts and `docker save`
/// archives, made offline from entries the test names.
#[doc(hidden)]
pub mod test_image {
    use std::io::Write;
    use std::path::Path;

    use sha2::{Digest, Sha256};

    /// One entry of a layer.
    pub enum Entry<'a> {
        /// A directory.
        Dir(&'a str),
        /// A regular file and its content.
        File(&'a str, &'a [u8]),
        /// A file with this mode.
        Mode(&'a str, &'a [u8], u32),
        /// A symlink and its target.
        Symlink(&'a str, &'a str),
        /// A hard link to an earlier entry.
        Hardlink(&'a str, &'a str),
        /// A file whose name is written as given, unchecked (`../x`).
        Raw(&'a str, &'a [u8]),
    }

    fn header(kind: tar::EntryType, mode: u32, size: u64) -> tar::Header {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_size(size);
        // SAFETY: geteuid and getegid have no failure mode.
        let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
        h.set_uid(u64::from(uid));
        h.set_gid(u64::from(gid));
        h
    }

    /// An uncompressed layer tar of `entries`, in order.
    pub fn layer(entries: &[Entry<'_>]) -> std::io::Result<Vec<u8>> {
        let mut b = tar::Builder::new(Vec::new());
        for e in entries {
            match e {
                Entry::Dir(p) => {
                    let mut h = header(tar::EntryType::Directory, 0o755, 0);
                    b.append_data(&mut h, p, std::io::empty())?;
                }
                Entry::File(p, data) => {
                    let mut h = header(tar::EntryType::Regular, 0o644, data.len() as u64);
                    b.append_data(&mut h, p, *data)?;
                }
                Entry::Mode(p, data, mode) => {
                    let mut h = header(tar::EntryType::Regular, *mode, data.len() as u64);
                    b.append_data(&mut h, p, *data)?;
                }
                Entry::Symlink(p, target) => {
                    let mut h = header(tar::EntryType::Symlink, 0o777, 0);
                    b.append_link(&mut h, p, target)?;
                }
                Entry::Hardlink(p, target) => {
                    let mut h = header(tar::EntryType::Link, 0o644, 0);
                    b.append_link(&mut h, p, target)?;
                }
                Entry::Raw(name, data) => {
                    let mut h = header(tar::EntryType::Regular, 0o644, data.len() as u64);
                    let field = &mut h.as_old_mut().name;
                    let n = name.len().min(field.len());
                    field[..n].copy_from_slice(&name.as_bytes()[..n]);
                    h.set_cksum();
                    b.append(&h, *data)?;
                }
            }
        }
        b.into_inner()
    }

    /// A base layer of static busybox (`/bin/busybox`, which must exist) with links
    /// for a shell's common applets and the usual directories, then `extra`.
    pub fn busybox_layer(extra: &[Entry<'_>]) -> std::io::Result<Vec<u8>> {
        const APPLETS: &[&str] = &["sh", "cat", "env", "pwd", "id", "ls", "echo", "test"];
        let busybox = std::fs::read("/bin/busybox")?;
        let links: Vec<String> = APPLETS.iter().map(|a| format!("bin/{a}")).collect();
        let mut entries: Vec<Entry<'_>> = ["bin", "etc", "tmp", "proc", "dev", "sys", "home"]
            .into_iter()
            .map(Entry::Dir)
            .collect();
        entries.push(Entry::Mode("bin/busybox", &busybox, 0o755));
        entries.extend(links.iter().map(|l| Entry::Symlink(l, "busybox")));
        let mut all = layer(&entries)?;
        // Two tars end to end are not one: the extra entries go before the end marker.
        let extra = layer(extra)?;
        let end = |t: &[u8]| t.len() - trailing_zero_blocks(t);
        all.truncate(end(&all));
        all.extend_from_slice(&extra);
        Ok(all)
    }

    /// Bytes of zero blocks at the end of tar `t` (its end marker and padding).
    fn trailing_zero_blocks(t: &[u8]) -> usize {
        t.chunks(512)
            .rev()
            .take_while(|b| b.iter().all(|x| *x == 0))
            .count()
            * 512
    }

    /// `data` gzip-compressed.
    pub fn gzip(data: &[u8]) -> std::io::Result<Vec<u8>> {
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        enc.write_all(data)?;
        enc.finish()
    }

    /// How a layer blob is stored.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Compression {
        /// An uncompressed tar.
        Plain,
        /// gzip (`tar+gzip`).
        Gzip,
        /// zstd (`tar+zstd`).
        Zstd,
    }

    impl Compression {
        /// `layer` stored this way, and its media type.
        fn store(self, layer: &[u8]) -> std::io::Result<(Vec<u8>, &'static str)> {
            Ok(match self {
                Compression::Plain => (layer.to_vec(), "application/vnd.oci.image.layer.v1.tar"),
                Compression::Gzip => (gzip(layer)?, "application/vnd.oci.image.layer.v1.tar+gzip"),
                Compression::Zstd => (
                    zstd::encode_all(layer, 3)?,
                    "application/vnd.oci.image.layer.v1.tar+zstd",
                ),
            })
        }
    }

    /// `sha256:<hex>` of `data`.
    pub fn digest(data: &[u8]) -> String {
        format!("sha256:{}", super::hex(&Sha256::digest(data)))
    }

    /// An image config with `env` (`K=V`), `workdir` and `user`, over layers whose
    /// uncompressed tars are `layers`.
    pub fn config(env: &[&str], workdir: &str, user: &str, layers: &[Vec<u8>]) -> Vec<u8> {
        serde_json::json!({
            "architecture": super::oci_arch(),
            "os": "linux",
            "config": {"Env": env, "WorkingDir": workdir, "User": user},
            "rootfs": {"type": "layers", "diff_ids": layers.iter().map(|l| digest(l)).collect::<Vec<_>>()},
        })
        .to_string()
        .into_bytes()
    }

    fn blob(dir: &Path, data: &[u8]) -> std::io::Result<String> {
        let d = digest(data);
        let blobs = dir.join("blobs/sha256");
        std::fs::create_dir_all(&blobs)?;
        std::fs::write(blobs.join(d.trim_start_matches("sha256:")), data)?;
        Ok(d)
    }

    /// Writes an OCI image layout into directory `dir`: `config`, and `layers`
    /// (uncompressed tars) stored as `compression` says (uncompressed past its end);
    /// returns the layers' blob digests.
    pub fn oci_layout(
        dir: &Path,
        config: &[u8],
        layers: &[Vec<u8>],
        compression: &[Compression],
    ) -> std::io::Result<Vec<String>> {
        std::fs::create_dir_all(dir)?;
        std::fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#)?;
        let config_digest = blob(dir, config)?;
        let mut descriptors = Vec::new();
        let mut digests = Vec::new();
        for (i, l) in layers.iter().enumerate() {
            let (data, media) = compression
                .get(i)
                .copied()
                .unwrap_or(Compression::Plain)
                .store(l)?;
            let d = blob(dir, &data)?;
            descriptors
                .push(serde_json::json!({"mediaType": media, "digest": d, "size": data.len()}));
            digests.push(d);
        }
        let manifest = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config_digest, "size": config.len()},
            "layers": descriptors,
        })
        .to_string();
        let manifest_digest = blob(dir, manifest.as_bytes())?;
        let index = serde_json::json!({
            "schemaVersion": 2,
            "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": manifest_digest, "size": manifest.len()}],
        });
        std::fs::write(dir.join("index.json"), index.to_string())?;
        Ok(digests)
    }

    /// Writes a `docker save` archive (the legacy layout: `manifest.json`,
    /// `<hex>.json`, `<n>/layer.tar`) of `config` and `layers` to file `dest`.
    pub fn docker_save(dest: &Path, config: &[u8], layers: &[Vec<u8>]) -> std::io::Result<()> {
        let mut b = tar::Builder::new(std::fs::File::create(dest)?);
        let add = |b: &mut tar::Builder<std::fs::File>, name: &str, data: &[u8]| {
            let mut h = header(tar::EntryType::Regular, 0o644, data.len() as u64);
            b.append_data(&mut h, name, data)
        };
        let config_name = format!("{}.json", digest(config).trim_start_matches("sha256:"));
        add(&mut b, &config_name, config)?;
        let mut names = Vec::new();
        for (i, l) in layers.iter().enumerate() {
            let name = format!("layer{i}/layer.tar");
            add(&mut b, &name, l)?;
            names.push(name);
        }
        let manifest = serde_json::json!([{"Config": config_name, "RepoTags": ["cube/test:1"], "Layers": names}]);
        add(&mut b, "manifest.json", manifest.to_string().as_bytes())?;
        b.into_inner()?.sync_all()
    }

    /// Writes the files of directory `dir` into tar file `dest` (an image layout as
    /// one file).
    pub fn tar_dir(dir: &Path, dest: &Path) -> std::io::Result<()> {
        let mut b = tar::Builder::new(std::fs::File::create(dest)?);
        b.append_dir_all(".", dir)?;
        b.into_inner()?.sync_all()
    }
}

#[cfg(test)]
mod tests {
    use super::test_image::{self, Compression::*, Entry};
    use super::*;

    /// Two layers: a base, then one that replaces a file, whites one out and makes a
    /// directory opaque (keeping the file it adds there itself).
    fn two_layers() -> Vec<Vec<u8>> {
        let base = test_image::layer(&[
            Entry::Dir("etc"),
            Entry::File("etc/hello", b"one"),
            Entry::File("etc/gone", b"x"),
            Entry::Hardlink("etc/hello-link", "etc/hello"),
            Entry::Dir("opq"),
            Entry::File("opq/old", b"old"),
            Entry::Dir("opq/sub"),
            Entry::Symlink("lib", "/usr/lib"),
            Entry::Mode("run.sh", b"#!/bin/sh\n", 0o755),
        ])
        .unwrap();
        let top = test_image::layer(&[
            Entry::File("etc/hello", b"two"),
            Entry::File("etc/.wh.gone", b""),
            Entry::File("opq/new", b"new"),
            Entry::File("opq/.wh..wh..opq", b""),
        ])
        .unwrap();
        vec![base, top]
    }

    fn config(layers: &[Vec<u8>]) -> Vec<u8> {
        test_image::config(
            &["PATH=/usr/bin:/bin", "GREETING=hello world"],
            "/work/dir",
            "1000:1000",
            layers,
        )
    }

    fn check_tree(tree: &Path, unpacked: &Unpacked) {
        assert_eq!(std::fs::read(tree.join("etc/hello")).unwrap(), b"two");
        // The hard link was to the lower layer's file, replaced since.
        assert_eq!(std::fs::read(tree.join("etc/hello-link")).unwrap(), b"one");
        assert!(!tree.join("etc/gone").exists());
        assert!(!tree.join("etc/.wh.gone").exists());
        let mut opq: Vec<String> = std::fs::read_dir(tree.join("opq"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        opq.sort();
        assert_eq!(opq, ["new"]);
        // An absolute symlink is kept as it is: the sandbox's /usr/lib, not the host's.
        assert_eq!(
            std::fs::read_link(tree.join("lib")).unwrap(),
            Path::new("/usr/lib")
        );
        let mode = std::fs::metadata(tree.join("run.sh"))
            .unwrap()
            .permissions();
        assert_eq!(mode.mode() & 0o777, 0o755);
        assert!(tree.join("work/dir").is_dir());
        assert_eq!(unpacked.layers, 2);
        assert_eq!(
            unpacked.defaults,
            ProcessDefaults {
                env: vec![
                    ("PATH".into(), "/usr/bin:/bin".into()),
                    ("GREETING".into(), "hello world".into())
                ],
                cwd: Some("/work/dir".into()),
                user: Some("1000:1000".into()),
            }
        );
    }

    #[test]
    fn an_oci_layout_directory_or_tar_and_a_docker_save_archive_unpack_alike() {
        let tmp = tempfile::tempdir().unwrap();
        let layers = two_layers();
        let cfg = config(&layers);
        let layout = tmp.path().join("layout");
        test_image::oci_layout(&layout, &cfg, &layers, &[Gzip, Plain]).unwrap();
        let mut lines = Vec::new();
        let tree = tmp.path().join("t1");
        let u = unpack(&layout, &tree, &tmp.path().join("s1"), &mut |l| {
            lines.push(l.to_string())
        })
        .unwrap();
        check_tree(&tree, &u);
        assert_eq!(lines.len(), 2, "{lines:?}");

        let archive = tmp.path().join("layout.tar");
        test_image::tar_dir(&layout, &archive).unwrap();
        let tree = tmp.path().join("t2");
        let scratch = tmp.path().join("s2");
        check_tree(
            &tree,
            &unpack(&archive, &tree, &scratch, &mut |_| {}).unwrap(),
        );
        assert!(!scratch.exists(), "the archive's files were removed");

        let saved = tmp.path().join("saved.tar");
        test_image::docker_save(&saved, &cfg, &layers).unwrap();
        let tree = tmp.path().join("t3");
        check_tree(
            &tree,
            &unpack(&saved, &tree, &tmp.path().join("s3"), &mut |_| {}).unwrap(),
        );
    }

    #[test]
    fn zstd_layers_unpack_like_gzip_ones_and_a_damaged_one_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let layers = two_layers();
        let cfg = config(&layers);
        for (name, compression) in [("zstd", [Zstd, Zstd]), ("mixed", [Zstd, Gzip])] {
            let layout = tmp.path().join(name);
            test_image::oci_layout(&layout, &cfg, &layers, &compression).unwrap();
            let tree = tmp.path().join(format!("{name}-tree"));
            let scratch = tmp.path().join(format!("{name}-scratch"));
            check_tree(
                &tree,
                &unpack(&layout, &tree, &scratch, &mut |_| {}).unwrap(),
            );
        }

        // A zstd stream cut short, stored as the blob (whose digest matches): the
        // layer's content is what is found wrong.
        let whole = zstd::encode_all(layers[0].as_slice(), 3).unwrap();
        let cut = whole[..whole.len() / 2].to_vec();
        let layout = tmp.path().join("cut");
        test_image::oci_layout(&layout, &config(&layers[..1]), &[cut], &[Plain]).unwrap();
        let tree = tmp.path().join("cut-tree");
        let err = unpack(&layout, &tree, &tmp.path().join("cut-scratch"), &mut |_| {}).unwrap_err();
        // (What was applied before is the caller's to remove, as for any failure.)
        assert!(matches!(err, OciError::Corrupt(..)), "{err}");
    }

    fn unpack_layers(tmp: &Path, layers: Vec<Vec<u8>>) -> Result<Unpacked, OciError> {
        let layout = tmp.join("bad-layout");
        let cfg = config(&layers);
        let plain = vec![Plain; layers.len()];
        test_image::oci_layout(&layout, &cfg, &layers, &plain).unwrap();
        unpack(
            &layout,
            &tmp.join("bad-tree"),
            &tmp.join("bad-scratch"),
            &mut |_| {},
        )
    }

    #[test]
    fn entries_that_leave_the_tree_or_pass_through_a_symlink_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let escape = test_image::layer(&[Entry::Raw("../escaped", b"x")]).unwrap();
        let err = unpack_layers(tmp.path(), vec![escape]).unwrap_err();
        assert!(matches!(err, OciError::UnsafeEntry { .. }), "{err}");
        assert!(err.to_string().contains("leaves the tree"), "{err}");
        assert!(!tmp.path().join("escaped").exists());

        // A symlink to a host directory, then a file under it: never written there.
        let tmp = tempfile::tempdir().unwrap();
        let host = tmp.path().join("host-dir");
        std::fs::create_dir(&host).unwrap();
        let link = test_image::layer(&[Entry::Symlink("esc", host.to_str().unwrap())]).unwrap();
        let through = test_image::layer(&[Entry::File("esc/planted", b"x")]).unwrap();
        let err = unpack_layers(tmp.path(), vec![link, through]).unwrap_err();
        assert!(err.to_string().contains("lies under a symlink"), "{err}");
        assert_eq!(std::fs::read_dir(&host).unwrap().count(), 0);

        let tmp = tempfile::tempdir().unwrap();
        let hard = test_image::layer(&[Entry::Hardlink("h", "../../etc/passwd")]).unwrap();
        let err = unpack_layers(tmp.path(), vec![hard]).unwrap_err();
        assert!(err.to_string().contains("outside the tree"), "{err}");
    }

    #[test]
    fn missing_or_altered_blobs_are_refused_before_anything_is_applied() {
        let tmp = tempfile::tempdir().unwrap();
        let layers = two_layers();
        let cfg = config(&layers);
        let layout = tmp.path().join("layout");
        let digests = test_image::oci_layout(&layout, &cfg, &layers, &[Gzip, Plain]).unwrap();
        let blob = |d: &str| {
            layout
                .join("blobs/sha256")
                .join(d.trim_start_matches("sha256:"))
        };
        let tree = tmp.path().join("tree");
        let scratch = tmp.path().join("scratch");

        // The second layer altered: the first is not applied either.
        let mut data = std::fs::read(blob(&digests[1])).unwrap();
        data[600] ^= 1;
        std::fs::write(blob(&digests[1]), &data).unwrap();
        let err = unpack(&layout, &tree, &scratch, &mut |_| {}).unwrap_err();
        assert!(matches!(err, OciError::DigestMismatch { .. }), "{err}");
        assert!(!tree.exists());

        std::fs::remove_file(blob(&digests[1])).unwrap();
        let err = unpack(&layout, &tree, &scratch, &mut |_| {}).unwrap_err();
        assert!(
            matches!(&err, OciError::MissingBlob(d) if *d == digests[1]),
            "{err}"
        );

        // A digest naming a path, and a directory that is no image.
        let index = std::fs::read_to_string(layout.join("index.json")).unwrap();
        let manifest = index.split("sha256:").nth(1).unwrap()[..64].to_string();
        std::fs::write(
            layout.join("index.json"),
            index.replace(
                &format!("sha256:{manifest}"),
                "sha256:../../../../etc/passwd",
            ),
        )
        .unwrap();
        let err = unpack(&layout, &tree, &scratch, &mut |_| {}).unwrap_err();
        assert!(matches!(err, OciError::Unsupported(_)), "{err}");
        let err = unpack(tmp.path(), &tree, &scratch, &mut |_| {}).unwrap_err();
        assert!(matches!(err, OciError::NotAnImage(_)), "{err}");

        // A docker save archive whose layer is not the one its config names.
        let saved = tmp.path().join("saved.tar");
        let other = config(&[layers[1].clone(), layers[0].clone()]);
        test_image::docker_save(&saved, &other, &layers).unwrap();
        let err = unpack(&saved, &tree, &scratch, &mut |_| {}).unwrap_err();
        assert!(matches!(err, OciError::DigestMismatch { .. }), "{err}");
        assert!(!scratch.exists());
        assert!(!tree.exists());
    }
}
