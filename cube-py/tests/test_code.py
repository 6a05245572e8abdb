"""run_code: stateful cells, rich results, errors, contexts, timeouts."""

from __future__ import annotations

import base64
from typing import List

import pytest

import cubesandbox
from cubesandbox import Sandbox
from conftest import ctrl_c_after


def test_a_variable_is_kept_across_two_cells(sandbox: Sandbox) -> None:
    first = sandbox.run_code("x = 41\nprint('set')")
    assert first.error is None
    assert first.logs.stdout == ["set\n"]
    assert first.text is None  # an assignment has no value
    second = sandbox.run_code("x + 1")
    assert second.text == "42"
    assert second.results[0].is_main_result


def test_a_rich_result_carries_its_png(sandbox: Sandbox) -> None:
    png = b"\x89PNG\r\n\x1a\nfake-but-bytes"
    code = (
        "class Chart:\n"
        f"    def _repr_png_(self): return {png!r}\n"
        "    def _repr_html_(self): return '<b>chart</b>'\n"
        "    def __repr__(self): return 'Chart()'\n"
        "Chart()"
    )
    execution = sandbox.run_code(code)
    main = execution.results[0]
    assert main.text == "Chart()"
    assert main.png is not None and base64.b64decode(main.png) == png
    assert main.png_bytes() == png
    assert main.html == "<b>chart</b>"
    assert set(main.formats()) == {"png", "html"}


def test_an_error_has_name_value_and_traceback(sandbox: Sandbox) -> None:
    errors: List[cubesandbox.ExecutionError] = []
    execution = sandbox.run_code(
        "def divide(a, b):\n    return a / b\ndivide(1, 0)", on_error=errors.append
    )
    assert execution.error is not None
    assert execution.error.name == "ZeroDivisionError"
    assert "division by zero" in execution.error.value
    assert "divide" in execution.error.traceback
    assert errors == [execution.error]
    # The context survives the error.
    assert sandbox.run_code("'still here'").text == "'still here'"


def test_output_callbacks_get_what_the_cell_printed(sandbox: Sandbox) -> None:
    out: List[str] = []
    err: List[str] = []
    sandbox.run_code(
        "import sys\nprint('to out')\nprint('to err', file=sys.stderr)",
        on_stdout=out.append,
        on_stderr=err.append,
    )
    assert "".join(out) == "to out\n"
    assert "".join(err) == "to err\n"


def test_bash_cells_and_named_contexts_are_separate(sandbox: Sandbox) -> None:
    bash = sandbox.run_code("A=7; echo $((A * 6))", language="bash")
    assert bash.logs.stdout == ["42\n"]
    assert bash.exit_status == 0
    assert sandbox.run_code("echo $A", language="bash").logs.stdout == ["7\n"]

    ctx = sandbox.create_code_context(language="python")
    sandbox.run_code("y = 'isolated'", context=ctx)
    assert sandbox.run_code("y", context=ctx).text == "'isolated'"
    missing = sandbox.run_code("'y' in globals()")
    assert missing.text == "False"
    sandbox.remove_code_context(ctx)
    with pytest.raises(cubesandbox.ContextError):
        sandbox.run_code("y", context=ctx)


def test_a_cell_past_its_timeout_is_interrupted(sandbox: Sandbox) -> None:
    with pytest.raises(cubesandbox.TimeoutError):
        sandbox.run_code("import time\nz = 1\ntime.sleep(30)", timeout=1)
    # The interpreter lives on with what it had before the interruption.
    assert sandbox.run_code("z").text == "1"


def test_an_unknown_language_is_rejected(sandbox: Sandbox) -> None:
    with pytest.raises(cubesandbox.InvalidArgument, match="cobol"):
        sandbox.run_code("DISPLAY 'HI'", language="cobol")


def test_ctrl_c_interrupts_the_wait_for_a_cell(sandbox: Sandbox) -> None:
    with ctrl_c_after(0.5), pytest.raises(KeyboardInterrupt):
        sandbox.run_code("import time\ntime.sleep(3)\nlate = True")
    # The cell itself runs to its end in the sandbox; the context stays usable.
    assert sandbox.run_code("late").text == "True"
