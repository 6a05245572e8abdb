//! `cube store`: prepare the on-disk store.

use std::path::{Path, PathBuf};

use clap::Subcommand;

use crate::cli_error::{chain, CliError};

#[derive(Subcommand)]
pub enum StoreCommand {
    /// Put the store on a reflink-capable filesystem: an XFS image on a loop device
    /// when the host's filesystem cannot reflink. Idempotent.
    ///
    /// Example: cube store setup --size 16G
    Setup {
        /// The image file (default: <store>.img next to the store).
        #[arg(long)]
        image: Option<PathBuf>,
        /// Image size, with K/M/G suffix.
        #[arg(long, default_value = "16G")]
        size: String,
    },
    /// Show where the store is and whether it can reflink.
    ///
    /// Example: cube store info --json
    Info {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

fn parse_size(text: &str) -> Result<u64, CliError> {
    let text = text.trim();
    let (digits, shift) = match text.chars().last() {
        Some('K' | 'k') => (&text[..text.len() - 1], 10),
        Some('M' | 'm') => (&text[..text.len() - 1], 20),
        Some('G' | 'g') => (&text[..text.len() - 1], 30),
        _ => (text, 0),
    };
    digits
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(1u64 << shift))
        .ok_or_else(|| CliError::failed(format!("invalid size {text:?} (use e.g. 512M or 16G)")))
}

fn default_image(root: &Path) -> PathBuf {
    let mut name = root.as_os_str().to_owned();
    name.push(".img");
    PathBuf::from(name)
}

pub fn run(store: Option<&Path>, command: StoreCommand) -> Result<(), CliError> {
    let root = store_root(store)?;
    match command {
        StoreCommand::Setup { image, size } => {
            let image = image.unwrap_or_else(|| default_image(&root));
            let size = parse_size(&size)?;
            std::fs::create_dir_all(&root)
                .map_err(|e| CliError::failed(format!("creating {}: {e}", root.display())))?;
            if cube_core::store::supports_reflink(&root).unwrap_or(false) {
                println!(
                    "store {} already reflinks ({})",
                    root.display(),
                    cube_core::store::filesystem_name(&root).unwrap_or_default()
                );
                return Ok(());
            }
            let mounted =
                cube_core::store::prepare_xfs_loop_store(&image, size, &root).map_err(|e| {
                    CliError::failed(chain(&e))
                        .hint("run as root with xfsprogs installed (apt-get install xfsprogs)")
                })?;
            let device = mounted
                .loop_device()
                .map(|d| d.display().to_string())
                .unwrap_or_else(|| "an existing mount".to_string());
            println!(
                "store {} is now XFS with reflink on {device}",
                root.display()
            );
            Ok(())
        }
        StoreCommand::Info { json } => {
            if !root.exists() {
                return Err(CliError::not_found(format!(
                    "there is no store at {}",
                    root.display()
                ))
                .hint("create one with `cube store setup`, or pass --store"));
            }
            let fs = cube_core::store::filesystem_name(&root)
                .map_err(|e| CliError::failed(chain(&e)))?;
            let reflink = cube_core::store::supports_reflink(&root).unwrap_or(false);
            if json {
                return crate::table::print_json(&serde_json::json!({
                    "store": root,
                    "filesystem": fs,
                    "reflink": reflink,
                }));
            }
            println!("store      {}", root.display());
            println!("filesystem {fs}");
            println!("reflink    {reflink}");
            if !reflink {
                eprintln!("hint: snapshots fall back to sparse copies; `cube store setup` puts the store on a reflink-capable XFS image");
            }
            Ok(())
        }
    }
}

/// The store root chosen on the command line or by default.
pub fn store_root(store: Option<&std::path::Path>) -> Result<std::path::PathBuf, CliError> {
    match store {
        Some(p) => Ok(p.to_path_buf()),
        None => cube_core::store::Store::default_root().map_err(|e| CliError::failed(chain(&e))),
    }
}
