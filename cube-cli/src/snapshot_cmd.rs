//! `cube snapshot`: snapshots as files that travel between hosts.

use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Subcommand;

use crate::cli_error::CliError;

#[derive(Subcommand)]
pub enum SnapshotCommand {
    /// Write a snapshot into one self-contained, checksummed file (memory as sparse,
    /// compressed chunks; files as their difference from the template).
    ///
    /// Example: cube snapshot export snap-0123456789abcdef -o snap.cube
    Export {
        /// Snapshot id.
        id: String,
        /// The archive to write.
        #[arg(short, long, value_name = "FILE")]
        output: PathBuf,
    },
    /// Add the snapshot in an archive to this store (every byte checked first; on any
    /// error the store is unchanged); prints its id.
    ///
    /// Example: cube snapshot import snap.cube && cube sandbox create --snapshot snap-0123456789abcdef
    Import {
        /// The archive.
        file: PathBuf,
    },
    /// Check an archive end to end without importing it.
    ///
    /// Example: cube snapshot verify snap.cube
    Verify {
        /// The archive.
        file: PathBuf,
    },
    /// Remove a snapshot from the store.
    ///
    /// Example: cube snapshot rm snap-0123456789abcdef
    Rm {
        /// Snapshot id.
        id: String,
    },
}

/// Runs `cube snapshot`.
pub fn run(store: Option<&Path>, command: SnapshotCommand) -> Result<(), CliError> {
    let rt = crate::sandbox_cmd::runtime(store, 0)?;
    match command {
        SnapshotCommand::Export { id, output } => {
            let start = Instant::now();
            let r = rt.export_snapshot(&id, &output)?;
            let secs = start.elapsed().as_secs_f64();
            eprintln!(
                "{}: {} MiB of files, {} MiB of data, archive {} MiB ({:.0} MiB/s of data); {}",
                output.display(),
                r.file_bytes >> 20,
                r.data_bytes >> 20,
                r.archive_bytes >> 20,
                r.data_bytes as f64 / f64::from(1 << 20) / secs.max(1e-9),
                r.requirement()
            );
        }
        SnapshotCommand::Import { file } => {
            let r = rt.import_snapshot(&file)?;
            eprintln!(
                "imported a {} {} snapshot{}",
                r.kind,
                r.engine,
                match (&r.template, &r.rootfs) {
                    (Some(t), _) => format!(" over template {t}"),
                    (None, Some(tree)) => format!(
                        " over a root directory it does not hold ({} where it was taken): create from it with a tree like it",
                        tree.display()
                    ),
                    (None, None) => String::new(),
                }
            );
            println!("{}", r.snapshot);
        }
        SnapshotCommand::Verify { file } => {
            let properties = rt.verify_snapshot_archive(&file)?;
            for (k, v) in properties {
                println!("{k}: {v}");
            }
        }
        SnapshotCommand::Rm { id } => rt.remove_snapshot(&id)?,
    }
    Ok(())
}
