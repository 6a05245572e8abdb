"""sandbox.files: a round trip through every operation, and the errors."""

from __future__ import annotations

import pytest

import cubesandbox
from cubesandbox import Sandbox


def test_files_round_trip(sandbox: Sandbox) -> None:
    info = sandbox.files.write("/tmp/data/hello.txt", "héllo\n")
    assert info.path == "/tmp/data/hello.txt" and info.name == "hello.txt"
    assert info.size == len("héllo\n".encode())
    assert sandbox.files.read("/tmp/data/hello.txt") == "héllo\n"

    blob = bytes(range(256)) * 4096  # 1 MiB, every byte value, more than one chunk
    sandbox.files.write("/tmp/data/blob.bin", blob)
    assert sandbox.files.read("/tmp/data/blob.bin", format="bytes") == blob
    # What the files API wrote, processes in the sandbox see.
    assert sandbox.commands.run("wc -c < /tmp/data/blob.bin").stdout.strip() == str(len(blob))

    entries = {e.name: e for e in sandbox.files.list("/tmp/data")}
    assert set(entries) == {"hello.txt", "blob.bin"}
    assert entries["blob.bin"].type == "file" and entries["blob.bin"].size == len(blob)

    assert sandbox.files.make_dir("/tmp/data/sub/deeper") is True
    assert sandbox.files.make_dir("/tmp/data/sub/deeper") is False
    assert sandbox.files.get_info("/tmp/data/sub").type == "dir"

    moved = sandbox.files.rename("/tmp/data/hello.txt", "/tmp/data/sub/moved.txt")
    assert moved.path == "/tmp/data/sub/moved.txt" and moved.type == "file"
    assert not sandbox.files.exists("/tmp/data/hello.txt")
    assert sandbox.files.read("/tmp/data/sub/moved.txt") == "héllo\n"

    sandbox.files.write([{"path": "/tmp/data/a", "data": b"A"}, {"path": "/tmp/data/b", "data": "B"}])
    assert sandbox.files.read("/tmp/data/a") + sandbox.files.read("/tmp/data/b") == "AB"

    sandbox.files.remove("/tmp/data")
    assert not sandbox.files.exists("/tmp/data")


def test_missing_paths_raise_file_not_found(sandbox: Sandbox) -> None:
    with pytest.raises(cubesandbox.FileNotFound):
        sandbox.files.read("/tmp/does/not/exist")
    with pytest.raises(FileNotFoundError):  # the built-in works too
        sandbox.files.list("/tmp/does/not/exist")
    with pytest.raises(cubesandbox.FileNotFound):
        sandbox.files.remove("/tmp/does/not/exist")


def test_reading_a_directory_is_an_error(sandbox: Sandbox) -> None:
    with pytest.raises(cubesandbox.AgentError):
        sandbox.files.read("/tmp")
