"""Snapshots as files that travel between stores and hosts (``cube snapshot export`` /
``cube snapshot import`` from Python)."""

from __future__ import annotations

import os
from typing import Union

from . import _native
from .models import Snapshot, SnapshotArchive
from .sandbox import StorePath, _store

PathLike = Union[str, "os.PathLike[str]"]


def export_snapshot(
    snapshot: Union[Snapshot, str], path: PathLike, *, store: StorePath = None
) -> SnapshotArchive:
    """Writes ``snapshot`` into one self-contained, checksummed archive at ``path``
    (replaced if it exists; a failed export leaves no file).

    Raises :class:`SnapshotNotFound` for an unknown snapshot.
    """
    snapshot_id = snapshot.id if isinstance(snapshot, Snapshot) else snapshot
    raw = _native.export_snapshot(snapshot_id, os.fspath(path), _store(store))
    return SnapshotArchive(
        snapshot_id=raw["id"],
        path=os.fspath(path),
        archive_bytes=raw["archive_bytes"],
        file_bytes=raw["file_bytes"],
        data_bytes=raw["data_bytes"],
        template=raw["template"],
        required_template=raw["required_template"],
        rootfs=raw["rootfs"],
    )


def import_snapshot(path: PathLike, *, store: StorePath = None) -> Snapshot:
    """Adds the snapshot in archive ``path`` to the store, under its own id, after
    checking every byte of it; pass the result to ``Sandbox.create(snapshot=...)``.

    Raises :class:`ArchiveError` for a damaged, truncated or tampered archive,
    :class:`TemplateNotFound` when the store lacks the template it lies over,
    :class:`AlreadyExists` when the snapshot is there already; on any error the store
    is unchanged.
    """
    raw = _native.import_snapshot(os.fspath(path), _store(store))
    return Snapshot(id=raw["id"], kind=raw["kind"], sandbox_id=raw["sandbox_id"])


__all__ = ["export_snapshot", "import_snapshot"]
