"""Snapshots that travel: export to a file, import into a fresh store (another
CUBE_HOME, as on another host), create from it; damaged archives refused."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Set

import pytest

import cubesandbox
from cubesandbox import Sandbox
from conftest import needs_root, new_sandbox

# Run in a process of its own whose $CUBE_HOME is the fresh store.
IMPORT_AND_READ = """
import sys
import cubesandbox
snap = cubesandbox.import_snapshot(sys.argv[1])
sb = cubesandbox.Sandbox.create(snapshot=snap)
try:
    print(snap.kind, sb.run_code("secret + 1").text)
finally:
    sb.kill()
"""


@pytest.fixture
def fresh_store() -> Path:
    """An empty store of its own, inside the suite's store ($CUBE_HOME), which
    scripts/test-python.sh removes once every supervisor of it is gone (a runtime
    keeps jails started ahead until its process ends: no test may remove its store).
    Short: a sandbox's socket paths lie under its store, and pytest's tmp_path is too
    long for them."""
    home = os.environ.get("CUBE_HOME")
    return Path(tempfile.mkdtemp(prefix="fresh-", dir=home or "/tmp"))


def exported_snapshot(tmp_path: Path) -> cubesandbox.SnapshotArchive:
    """A jail sandbox on the host template with a Python variable set, snapshotted
    and exported to tmp_path/snap.cube; the sandbox is killed."""
    sb = new_sandbox(template=cubesandbox.DEFAULT_TEMPLATE, engine="jail")
    try:
        sb.run_code("secret = 41")
        snap = sb.create_snapshot()
        if not snap.is_full:
            pytest.skip("skipping: no working CRIU, so no snapshot holds a Python variable")
        archive = cubesandbox.export_snapshot(snap, tmp_path / "snap.cube")
    finally:
        sb.kill()
    assert archive.snapshot_id == snap.id
    assert archive.archive_bytes == (tmp_path / "snap.cube").stat().st_size
    # Every store has the built-in template: the importer needs none.
    assert archive.template == "host" and archive.required_template is None
    return archive


def test_a_variable_set_before_export_is_there_after_import_into_a_fresh_store(
    tmp_path: Path, fresh_store: Path
) -> None:
    needs_root()
    archive = exported_snapshot(tmp_path)
    fresh = fresh_store
    run = subprocess.run(
        [sys.executable, "-c", IMPORT_AND_READ, archive.path],
        env={**os.environ, "CUBE_HOME": str(fresh)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["full", "42"], run.stdout + run.stderr


def files_of(store: Path) -> Set[str]:
    """Every path in the store but the jails its runtime started ahead."""
    found = set()
    for d, dirs, names in os.walk(store):
        rel = os.path.relpath(d, store)
        if rel == "tmp":
            dirs[:] = [n for n in dirs if not n.startswith("jail-")]
        found.update(os.path.normpath(os.path.join(rel, n)) for n in dirs + names)
    return found


def test_a_truncated_or_tampered_archive_is_refused_and_the_store_is_unchanged(
    tmp_path: Path, fresh_store: Path
) -> None:
    needs_root()
    archive = exported_snapshot(tmp_path)
    data = Path(archive.path).read_bytes()
    truncated = tmp_path / "truncated.cube"
    truncated.write_bytes(data[: len(data) // 2])
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF
    tampered = tmp_path / "tampered.cube"
    tampered.write_bytes(bytes(flipped))

    fresh = fresh_store
    Sandbox.list(store=fresh)  # opens (makes) the store
    before = files_of(fresh)
    for bad, why in ((truncated, "truncated"), (tampered, "")):
        with pytest.raises(cubesandbox.ArchiveError) as refused:
            cubesandbox.import_snapshot(bad, store=fresh)
        message = str(refused.value)
        assert str(bad) in message and why in message, message
        assert isinstance(refused.value, cubesandbox.InvalidArgument)
        assert refused.value.kind == "invalid_argument"
        assert files_of(fresh) == before
    with pytest.raises(cubesandbox.SnapshotNotFound):
        Sandbox.create(snapshot=archive.snapshot_id, store=fresh)

    # The intact archive still imports; a second import of it is refused.
    imported = cubesandbox.import_snapshot(archive.path, store=fresh)
    assert imported.id == archive.snapshot_id and imported.kind == "full"
    with pytest.raises(cubesandbox.AlreadyExists):
        cubesandbox.import_snapshot(archive.path, store=fresh)


def test_a_template_and_a_snapshot_cannot_both_be_named() -> None:
    with pytest.raises(cubesandbox.InvalidArgument):
        Sandbox.create("host", snapshot="snap-0000000000000000")
