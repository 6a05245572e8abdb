"""E2B's official Python SDKs (`e2b`, `e2b-code-interpreter`), unmodified, against a
`cube serve` that scripts/test-e2b-sdks.sh started; they find it through their own
settings (E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY)."""

import asyncio
import os
import time
import uuid

import httpx
import pytest
from e2b import AsyncSandbox, AuthenticationException, CommandExitException
from e2b import Sandbox as BaseSandbox
from e2b import SandboxQuery
from e2b_code_interpreter import Sandbox

RUN = uuid.uuid4().hex[:8]
API = os.environ["E2B_API_URL"]


@pytest.fixture(scope="module")
def sb():
    """One code-interpreter sandbox shared by the tests that only read and write in it."""
    sandbox = Sandbox.create(metadata={"suite": RUN, "role": "shared"})
    yield sandbox
    sandbox.kill()


def test_run_code_keeps_state_and_reports_errors_and_output(sb):
    sb.run_code("x = 41")
    assert sb.run_code("x + 1").text == "42"
    ex = sb.run_code("import sys\nprint('to out')\nprint('to err', file=sys.stderr)\n1/0")
    assert ex.logs.stdout == ["to out\n"]
    assert ex.logs.stderr == ["to err\n"]
    assert ex.error is not None and ex.error.name == "ZeroDivisionError"
    assert "division by zero" in ex.error.value
    # The context survives the error.
    assert sb.run_code("x").text == "41"
    seen = []
    sb.run_code("print('streamed')", on_stdout=lambda m: seen.append(m.line))
    assert seen == ["streamed\n"]


def test_code_contexts(sb):
    ctx = sb.create_code_context(cwd="/tmp")
    sb.run_code("import os\nwhere = os.getcwd()", context=ctx)
    assert sb.run_code("where", context=ctx).text == "'/tmp'"
    # The default context does not see the other one's variables.
    assert sb.run_code("where").error.name == "NameError"
    assert ctx.id in [c.id for c in sb.list_code_contexts()]
    assert sb.run_code("echo $((6*7))", language="bash").logs.stdout == ["42\n"]
    sb.remove_code_context(ctx)
    assert ctx.id not in [c.id for c in sb.list_code_contexts()]


def test_files_round_trip_text_and_binary(sb):
    sb.files.write("/home/user/notes/hello.txt", "hello from e2b\n")
    assert sb.files.read("/home/user/notes/hello.txt") == "hello from e2b\n"
    blob = os.urandom(1 << 20)
    sb.files.write("/home/user/blob.bin", blob)
    assert bytes(sb.files.read("/home/user/blob.bin", format="bytes")) == blob
    names = [e.name for e in sb.files.list("/home/user/notes")]
    assert names == ["hello.txt"]
    info = sb.files.get_info("/home/user/blob.bin")
    assert info.size == 1 << 20
    assert sb.files.exists("/home/user/blob.bin")
    assert sb.files.make_dir("/home/user/made")
    assert not sb.files.make_dir("/home/user/made")
    sb.files.rename("/home/user/blob.bin", "/home/user/made/blob.bin")
    assert not sb.files.exists("/home/user/blob.bin")
    sb.files.remove("/home/user/made")
    assert not sb.files.exists("/home/user/made/blob.bin")
    with pytest.raises(Exception) as missing:
        sb.files.read("/home/user/no-such-file")
    assert "not found" in str(missing.value).lower() or "no such" in str(missing.value).lower()


def test_commands_exit_codes_env_background_and_kill(sb):
    r = sb.commands.run("echo $GREETING; pwd", envs={"GREETING": "hi"}, cwd="/tmp")
    assert r.stdout == "hi\n/tmp\n" and r.exit_code == 0
    with pytest.raises(CommandExitException) as failed:
        sb.commands.run("echo oops >&2; exit 3")
    assert failed.value.exit_code == 3
    assert failed.value.stderr == "oops\n"
    handle = sb.commands.run("sleep 60", background=True)
    assert handle.pid in [p.pid for p in sb.commands.list()]
    assert handle.kill()
    with pytest.raises(CommandExitException):
        handle.wait()
    assert handle.pid not in [p.pid for p in sb.commands.list()]


def test_pty_takes_typed_input_and_resizes(sb):
    from e2b import PtySize

    term = sb.pty.create(PtySize(rows=33, cols=77))
    sb.pty.send_stdin(term.pid, b"stty size; echo mark-$((40+2))\n")
    shown = b""
    events = iter(term)
    while b"mark-42" not in shown:
        _, _, pty = next(events)
        shown += pty or b""
    assert b"33 77" in shown
    sb.pty.resize(term.pid, PtySize(rows=40, cols=100))
    sb.pty.send_stdin(term.pid, b"stty size; exit 0\n")
    rest = []
    assert term.wait(on_pty=rest.append).exit_code == 0
    assert b"40 100" in b"".join(rest)


def test_list_get_info_and_metadata(sb):
    info = sb.get_info()
    assert info.metadata == {"suite": RUN, "role": "shared"}
    assert info.state.value == "running"
    found = Sandbox.list(query=SandboxQuery(metadata={"suite": RUN})).next_items()
    assert sb.sandbox_id in [s.sandbox_id for s in found]
    assert Sandbox.list(query=SandboxQuery(metadata={"suite": "none-" + RUN})).next_items() == []


def test_pause_and_connect_keep_state():
    sandbox = Sandbox.create(metadata={"suite": RUN})
    try:
        sandbox.run_code("kept = 'still here'")
        sandbox.files.write("/home/user/kept.txt", "file kept")
        sandbox.pause()
        assert Sandbox.get_info(sandbox.sandbox_id).state.value == "paused"
        resumed = Sandbox.connect(sandbox.sandbox_id)
        assert resumed.run_code("kept").text == "'still here'"
        assert resumed.files.read("/home/user/kept.txt") == "file kept"
    finally:
        sandbox.kill()


def test_snapshot_then_create_from_it():
    sandbox = Sandbox.create(metadata={"suite": RUN})
    try:
        sandbox.files.write("/home/user/state.txt", "before the snapshot")
        snap = sandbox.create_snapshot()
        sandbox.files.write("/home/user/state.txt", "after the snapshot")
        assert snap.snapshot_id in [s.snapshot_id for s in Sandbox.list_snapshots(sandbox_id=sandbox.sandbox_id).next_items()] \
            if hasattr(Sandbox, "list_snapshots") else True
        clone = Sandbox.create(snap.snapshot_id, metadata={"suite": RUN})
        try:
            assert clone.files.read("/home/user/state.txt") == "before the snapshot"
        finally:
            clone.kill()
        assert sandbox.files.read("/home/user/state.txt") == "after the snapshot"
    finally:
        sandbox.kill()


@pytest.mark.skipif(not hasattr(BaseSandbox, "fork"), reason="this SDK version has no fork")
def test_fork():
    sandbox = Sandbox.create(metadata={"suite": RUN})
    try:
        sandbox.run_code("n = 5")
        forks = sandbox.fork(count=2)
        assert len(forks) == 2
        for f in forks:
            assert not isinstance(f, Exception), f
            try:
                f.run_code("n += 1")
                assert f.run_code("n").text == "6"
            finally:
                f.kill()
        assert sandbox.run_code("n").text == "5"
    finally:
        sandbox.kill()


def test_set_timeout_and_expiry():
    sandbox = BaseSandbox.create(timeout=300, metadata={"suite": RUN})
    before = sandbox.get_info().end_at
    sandbox.set_timeout(2)
    assert sandbox.get_info().end_at < before
    deadline = time.time() + 30
    while time.time() < deadline and sandbox.is_running():
        time.sleep(0.5)
    assert not sandbox.is_running()
    assert sandbox.sandbox_id not in [s.sandbox_id for s in BaseSandbox.list().next_items()]


def test_kill():
    sandbox = BaseSandbox.create(metadata={"suite": RUN})
    assert sandbox.kill()
    assert not BaseSandbox.kill(sandbox.sandbox_id)
    assert not sandbox.is_running()


def test_wrong_api_key_is_refused():
    with pytest.raises(AuthenticationException):
        BaseSandbox.create(api_key="not-the-right-key-at-all")
    with pytest.raises(AuthenticationException):
        BaseSandbox.list(api_key="not-the-right-key-at-all").next_items()


def test_one_sandbox_token_cannot_drive_another(sb):
    other = BaseSandbox.create(metadata={"suite": RUN})
    try:
        # The other sandbox's id with this one's token: refused by the sandbox plane.
        r = httpx.get(
            f"{API}/files",
            params={"path": "/etc/hostname"},
            headers={
                "E2b-Sandbox-Id": other.sandbox_id,
                "E2b-Sandbox-Port": "49983",
                "X-Access-Token": sb._envd_access_token,
            },
        )
        assert r.status_code == 401, r.text
        assert r.json()["code"] == 401
        ok = httpx.get(
            f"{API}/files",
            params={"path": "/etc/hostname"},
            headers={
                "E2b-Sandbox-Id": other.sandbox_id,
                "X-Access-Token": other._envd_access_token,
            },
        )
        assert ok.status_code == 200, ok.text
    finally:
        other.kill()


def test_eight_concurrent_async_sandboxes():
    async def one(i):
        s = await AsyncSandbox.create(metadata={"suite": RUN, "n": str(i)})
        try:
            r = await s.commands.run(f"echo sandbox-{i}")
            await s.files.write("/home/user/i.txt", str(i))
            return r.stdout.strip(), await s.files.read("/home/user/i.txt")
        finally:
            await s.kill()

    async def main():
        return await asyncio.gather(*(one(i) for i in range(8)))

    results = asyncio.run(main())
    assert results == [(f"sandbox-{i}", str(i)) for i in range(8)]


@pytest.mark.skipif(os.environ.get("CUBE_FIFTY") != "1", reason="run for one SDK version only")
def test_fifty_concurrent_sdk_creates_all_succeed():
    async def one(i):
        s = await AsyncSandbox.create(metadata={"suite": RUN, "fifty": str(i)})
        return s

    async def main():
        started = time.time()
        made = await asyncio.gather(*(one(i) for i in range(50)), return_exceptions=True)
        took = time.time() - started
        ok = [s for s in made if not isinstance(s, Exception)]
        await asyncio.gather(*(s.kill() for s in ok))
        return made, took

    made, took = asyncio.run(main())
    failures = [m for m in made if isinstance(m, Exception)]
    print(f"50 concurrent creates: {50 - len(failures)} succeeded in {took:.2f} s")
    assert failures == [], failures[:3]
