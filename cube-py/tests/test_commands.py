"""commands.run: streaming output, exit codes, environment, background processes,
timeouts, Ctrl-C and threads."""

from __future__ import annotations

import threading
from typing import List

import pytest

import cubesandbox
from cubesandbox import Sandbox
from conftest import ctrl_c_after, new_sandbox


def test_output_streams_to_callbacks_and_the_result(sandbox: Sandbox) -> None:
    out: List[str] = []
    err: List[str] = []
    result = sandbox.commands.run(
        "for i in 1 2 3; do echo line$i; done; echo oops >&2",
        on_stdout=out.append,
        on_stderr=err.append,
    )
    assert result.exit_code == 0
    assert result.stdout == "line1\nline2\nline3\n"
    assert "".join(out) == result.stdout
    assert result.stderr == "oops\n"
    assert "".join(err) == "oops\n"


def test_a_non_zero_exit_raises_with_the_output(sandbox: Sandbox) -> None:
    with pytest.raises(cubesandbox.CommandExitError) as info:
        sandbox.commands.run("echo partial; echo bad >&2; exit 3")
    assert info.value.exit_code == 3
    assert info.value.stdout == "partial\n"
    assert info.value.stderr == "bad\n"


def test_cwd_envs_and_stdin(sandbox: Sandbox) -> None:
    sandbox.files.make_dir("/tmp/work")
    result = sandbox.commands.run(
        'pwd; echo "$GREETING"; cat', cwd="/tmp/work", envs={"GREETING": "hello"}, stdin="fed"
    )
    assert result.stdout == "/tmp/work\nhello\nfed"


def test_sandbox_wide_envs_reach_every_process() -> None:
    sb = new_sandbox(envs={"CUBE_TEST_VAR": "everywhere"})
    try:
        assert sb.commands.run("echo $CUBE_TEST_VAR").stdout == "everywhere\n"
        assert sb.run_code("import os; os.environ['CUBE_TEST_VAR']").text == "'everywhere'"
    finally:
        sb.kill()


def test_a_background_command_can_be_waited_for(sandbox: Sandbox) -> None:
    seen: List[str] = []
    sandbox.commands.run("mkfifo /tmp/fifo")
    handle = sandbox.commands.run(
        "read line < /tmp/fifo; echo got $line", background=True, on_stdout=seen.append
    )
    assert handle.pid > 0
    assert not handle.finished
    # The foreground can go on while it runs; this unblocks it.
    sandbox.commands.run("echo go > /tmp/fifo")
    result = handle.wait(timeout=30)
    assert result.stdout == "got go\n"
    assert "".join(seen) == "got go\n"


def test_a_background_command_can_be_killed(sandbox: Sandbox) -> None:
    handle = sandbox.commands.run("sleep 300", background=True)
    assert handle.kill()
    with pytest.raises(cubesandbox.CommandExitError) as info:
        handle.wait(timeout=30)
    assert info.value.exit_code == 128 + 9
    assert not handle.kill()  # already ended


def test_a_command_past_its_timeout_is_killed(sandbox: Sandbox) -> None:
    with pytest.raises(cubesandbox.TimeoutError):
        sandbox.commands.run("sleep 300", timeout=1)


def test_ctrl_c_interrupts_a_command_and_kills_it(sandbox: Sandbox) -> None:
    with ctrl_c_after(0.5), pytest.raises(KeyboardInterrupt):
        sandbox.commands.run("sleep 299", timeout=None)
    left = sandbox.commands.run("pgrep -f 'sleep 29[9]' || true")
    assert left.stdout == ""


def test_blocking_calls_release_the_gil(sandbox: Sandbox) -> None:
    # The thread's command waits for a file that only this thread creates: if the
    # waiting call held the GIL, the write below could never run.
    done: List[str] = []

    def waiter() -> None:
        done.append(
            sandbox.commands.run(
                "while [ ! -e /tmp/go ]; do sleep 0.05; done; echo released", timeout=60
            ).stdout
        )

    t = threading.Thread(target=waiter)
    t.start()
    sandbox.files.write("/tmp/go", "")
    t.join(timeout=90)
    assert done == ["released\n"]
