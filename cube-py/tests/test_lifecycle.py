"""Snapshots, rollback, clones, pause/resume, hibernate/wake, list/connect, kill."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path
from typing import List

import pytest

import cubesandbox
from cubesandbox import Sandbox
from conftest import TEMPLATE, needs_root, new_sandbox


# State that must survive a file-system snapshot lives outside /tmp and /dev/shm, which
# are memory file systems (they are part of a full snapshot only).


def test_rollback_returns_to_the_snapshot(sandbox: Sandbox) -> None:
    sandbox.run_code("x = 'before'")
    sandbox.files.write("/home/user/state.txt", "before")
    snap = sandbox.create_snapshot()
    assert snap.id and snap.sandbox_id == sandbox.sandbox_id
    assert snap.kind in ("full", "filesystem")

    sandbox.run_code("x = 'after'")
    sandbox.files.write("/home/user/state.txt", "after")
    sandbox.files.write("/home/user/new.txt", "created after the snapshot")

    sandbox.rollback(snap)
    assert sandbox.sandbox_id == snap.sandbox_id
    assert sandbox.files.read("/home/user/state.txt") == "before"
    assert not sandbox.files.exists("/home/user/new.txt")
    if snap.is_full:
        # Memory came back too: the interpreter has the old value.
        assert sandbox.run_code("x").text == "'before'"
    else:
        # A file-system snapshot restarts the sandbox's processes: the variable is
        # gone, and the default context starts afresh.
        assert sandbox.run_code("'x' in globals()").text == "False"


def test_a_snapshot_of_another_sandbox_is_refused(sandbox: Sandbox) -> None:
    other = new_sandbox()
    try:
        snap = other.create_snapshot()
        with pytest.raises(cubesandbox.InvalidArgument) as refused:
            sandbox.rollback(snap)
        assert refused.value.kind == "invalid_argument"
    finally:
        other.kill()
    with pytest.raises(cubesandbox.SnapshotNotFound):
        sandbox.rollback("snap-doesnotexist")


def test_failures_raise_the_class_of_their_kind(sandbox: Sandbox) -> None:
    # The supervisor refuses to wake a running sandbox: a bad state, as a class and a
    # kind, though the refusal crossed a process boundary.
    with pytest.raises(cubesandbox.InvalidState) as bad_state:
        sandbox.wake()
    assert bad_state.value.kind == "bad_state"
    assert isinstance(bad_state.value, cubesandbox.SandboxError)
    # Names that exist nowhere.
    with pytest.raises(cubesandbox.SandboxNotFound) as missing:
        Sandbox.connect("sb-0000000000000000")
    assert missing.value.kind == "not_found"
    assert isinstance(missing.value, cubesandbox.NotFound)
    # A snapshot whose files are gone (only its record is left): the rollback fails
    # in the supervisor as a snapshot failure, and the sandbox runs on.
    store = os.environ.get("CUBE_HOME")
    if store is None:
        pytest.skip("skipping: the store is not named by $CUBE_HOME")
    snap = sandbox.create_snapshot()
    snap_dir = Path(store) / "snapshots" / snap.id
    for entry in snap_dir.iterdir():
        if entry.name != "snapshot.meta":
            if entry.is_dir():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    with pytest.raises(cubesandbox.SnapshotError) as failed:
        sandbox.rollback(snap)
    assert failed.value.kind == "snapshot_failed"
    assert sandbox.commands.run("echo still here").stdout == "still here\n"


def test_clones_start_from_the_parent_and_diverge(sandbox: Sandbox) -> None:
    sandbox.files.write("/home/user/origin.txt", "parent")
    sandbox.run_code("v = ['parent']")
    # What a clone's snapshot holds on this host: with processes where CRIU works.
    full = sandbox.create_snapshot().is_full
    clones = sandbox.clone(2)
    try:
        assert len(clones) == 2
        ids = {c.sandbox_id for c in clones}
        assert len(ids) == 2 and sandbox.sandbox_id not in ids
        for i, c in enumerate(clones):
            assert c.files.read("/home/user/origin.txt") == "parent"
            c.files.write("/home/user/origin.txt", f"clone {i}")
            if full:
                # The interpreter came along: the clone has the parent's variable.
                assert c.run_code("v").text == "['parent']"
                c.run_code(f"v.append('clone {i}')")
        assert [c.files.read("/home/user/origin.txt") for c in clones] == ["clone 0", "clone 1"]
        assert sandbox.files.read("/home/user/origin.txt") == "parent"
        if full:
            assert sandbox.run_code("v").text == "['parent']"
            assert [c.run_code("v").text for c in clones] == [
                "['parent', 'clone 0']",
                "['parent', 'clone 1']",
            ]
    finally:
        for c in clones:
            c.kill()


def test_a_paused_sandbox_answers_only_after_resume(sandbox: Sandbox) -> None:
    sandbox.run_code("counter = 5")
    sandbox.pause()
    answers: List[bool] = []
    t = threading.Thread(target=lambda: answers.append(sandbox.files.exists("/tmp")))
    t.start()
    t.join(timeout=1.0)
    # Frozen: the agent cannot answer while the sandbox is paused.
    assert t.is_alive() and answers == []
    sandbox.resume()
    t.join(timeout=60)
    assert answers == [True]
    assert sandbox.run_code("counter").text == "5"


def test_hibernate_and_wake_keep_the_files(sandbox: Sandbox) -> None:
    sandbox.files.write("/home/user/kept.txt", "kept")
    sandbox.run_code("kept = 41")
    # Hibernation keeps the processes where snapshots are full (CRIU works).
    full = sandbox.create_snapshot().is_full
    try:
        sandbox.hibernate()
    except cubesandbox.EngineUnavailable as e:
        pytest.skip(f"skipping: this host cannot hibernate a sandbox: {e}")
    sandbox.wake()
    assert sandbox.files.read("/home/user/kept.txt") == "kept"
    assert sandbox.commands.run("echo awake").stdout == "awake\n"
    if full:
        assert sandbox.run_code("kept").text == "41"


def test_list_shows_metadata_and_connect_reattaches() -> None:
    sb = new_sandbox(metadata={"owner": "pytest", "purpose": "list"})
    try:
        sb.run_code("shared = 'across handles'")
        listed = {i.sandbox_id: i for i in Sandbox.list()}
        assert sb.sandbox_id in listed
        info = listed[sb.sandbox_id]
        assert info.metadata == {"owner": "pytest", "purpose": "list"}
        assert info.engine == sb.engine
        assert info.template == TEMPLATE

        again = Sandbox.connect(sb.sandbox_id)
        assert again.sandbox_id == sb.sandbox_id
        assert again.run_code("shared").text == "'across handles'"
    finally:
        sb.kill()


def test_the_context_manager_kills_on_exit() -> None:
    with new_sandbox() as sb:
        sb_id = sb.sandbox_id
        assert sb.commands.run("echo inside").stdout == "inside\n"
    assert sb_id not in {i.sandbox_id for i in Sandbox.list()}
    with pytest.raises(cubesandbox.SandboxNotFound):
        Sandbox.connect(sb_id)
    with pytest.raises(cubesandbox.SandboxNotFound):
        sb.run_code("1")
    assert sb.kill() is False


def test_a_sandbox_with_a_timeout_ends_by_itself() -> None:
    sb = new_sandbox(timeout=1)
    sb_id = sb.sandbox_id
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if sb_id not in {i.sandbox_id for i in Sandbox.list()}:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"sandbox {sb_id} still listed a minute after its 1 s lifetime")
    with pytest.raises(cubesandbox.SandboxNotFound):
        Sandbox.connect(sb_id)


def test_threads_drive_several_sandboxes_at_once() -> None:
    needs_root()  # a skip raised inside a worker thread would count as its error
    results: List[str] = []
    errors: List[BaseException] = []
    lock = threading.Lock()

    def work(i: int) -> None:
        try:
            with new_sandbox() as sb:
                sb.run_code(f"n = {i}")
                out = sb.commands.run(f"echo sandbox-{i}").stdout.strip()
                value = sb.run_code("n * 10").text
            with lock:
                results.append(f"{out}:{value}")
        except BaseException as e:  # surfaced below
            with lock:
                errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == []
    assert sorted(results) == ["sandbox-0:0", "sandbox-1:10", "sandbox-2:20"]


# Children hold the command's stdout open: they are killed before it ends.
_FORKS = """
import os, signal, time
pids = []
try:
    while len(pids) < 100:
        pid = os.fork()
        if pid == 0:
            time.sleep(30)
            os._exit(0)
        pids.append(pid)
except OSError:
    pass
for pid in pids:
    os.kill(pid, signal.SIGKILL)
print(len(pids))
"""


def test_limits_contain_memory_and_forks() -> None:
    sb = new_sandbox(memory_mib=64, pids_max=32)
    # 256 MiB touched page by page cannot fit into 64 MiB: the kernel kills the hog.
    hog = "b = bytearray(256 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\nprint('fit')"
    with pytest.raises(cubesandbox.CommandExitError) as info:
        sb.commands.run(f"python3 -c \"{hog}\"")
    assert "fit" not in info.value.stdout
    # Forks stop below the pids limit (the agent and the shell count too).
    forked = int(sb.commands.run(f"python3 -c '{_FORKS}'").stdout)
    assert 0 < forked < 32
    sb.kill()


_FORK_64 = """
import os, time
pids = []
for _ in range(64):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    pids.append(pid)
for p in pids:
    os.kill(p, 9)
for p in pids:
    os.waitpid(p, 0)
len(pids)
"""


def test_limits_change_while_the_sandbox_runs(sandbox: Sandbox) -> None:
    sandbox.set_limits(pids_max=16)
    assert 0 < int(sandbox.run_code(_FORK_64).text) < 16
    sandbox.set_limits(pids_max=256)
    assert sandbox.run_code(_FORK_64).text == "64"
    with pytest.raises(cubesandbox.InvalidArgument, match="pids_max"):
        sandbox.set_limits(pids_max=0)
