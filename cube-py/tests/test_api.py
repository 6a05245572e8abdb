"""The package itself and the errors raised before or instead of a sandbox."""

from __future__ import annotations

import builtins
import os
import subprocess
import sys
from pathlib import Path

import pytest

import cubesandbox
from cubesandbox import Sandbox


def test_the_installed_package_is_typed_and_carries_its_helpers() -> None:
    pkg = Path(cubesandbox.__file__).parent
    assert (pkg / "py.typed").is_file()
    assert (pkg / "_native.pyi").is_file()
    for name, var in (("cube-supervisor", "CUBE_SUPERVISOR"), ("cube-agent", "CUBE_AGENT")):
        helper = pkg / "bin" / name
        assert helper.is_file(), f"{name} missing from the wheel"
        assert os.access(helper, os.X_OK), f"{name} is not executable"
        # scripts/test-python.sh leaves the variables unset: the package sets them to
        # its own copies.
        assert os.environ[var] == str(helper.resolve())
    assert cubesandbox.DEFAULT_TEMPLATE == "host"


def test_helpers_are_found_in_a_fresh_interpreter() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("CUBE_SUPERVISOR", "CUBE_AGENT")}
    out = subprocess.run(
        [sys.executable, "-c", "import cubesandbox, os; print(os.environ['CUBE_AGENT'])"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip().endswith("cubesandbox/bin/cube-agent")


def test_exceptions_derive_from_cube_error_and_the_matching_builtin() -> None:
    assert issubclass(cubesandbox.SandboxNotFound, cubesandbox.CubeError)
    assert issubclass(cubesandbox.TemplateNotFound, cubesandbox.CubeError)
    assert issubclass(cubesandbox.TimeoutError, builtins.TimeoutError)
    assert issubclass(cubesandbox.FileNotFound, builtins.FileNotFoundError)
    assert issubclass(cubesandbox.FileNotFound, cubesandbox.AgentError)
    assert issubclass(cubesandbox.CommandExitError, cubesandbox.CommandError)
    assert issubclass(cubesandbox.InvalidArgument, ValueError)
    assert issubclass(cubesandbox.ConnectionLost, cubesandbox.SandboxError)
    assert issubclass(cubesandbox.SandboxNotFound, cubesandbox.NotFound)
    assert issubclass(cubesandbox.NotFound, LookupError)
    assert issubclass(cubesandbox.InvalidState, cubesandbox.SandboxError)
    assert issubclass(cubesandbox.SnapshotError, cubesandbox.SandboxError)
    assert cubesandbox.CubeError("x").kind is None


def test_an_unknown_engine_is_rejected_by_name() -> None:
    with pytest.raises(cubesandbox.InvalidArgument, match="unknown engine 'qemu'|\"qemu\""):
        Sandbox.create(engine="qemu")


def test_a_bad_timeout_is_rejected() -> None:
    with pytest.raises(cubesandbox.InvalidArgument, match="timeout"):
        Sandbox.create(timeout=-3)


@pytest.mark.parametrize("limit", ["memory_mib", "cpu_millis", "pids_max"])
def test_a_limit_that_is_not_a_positive_integer_is_rejected(limit: str) -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(cubesandbox.InvalidArgument, match=limit):
            Sandbox.create(**{limit: bad})  # type: ignore[arg-type]


def _root() -> None:
    if os.geteuid() != 0:
        pytest.skip("skipping: the store and supervisors need root")


def test_an_unknown_template_raises_template_not_found() -> None:
    _root()
    with pytest.raises(cubesandbox.TemplateNotFound, match="no-such-template"):
        Sandbox.create("no-such-template")


def test_an_unknown_sandbox_raises_sandbox_not_found() -> None:
    _root()
    with pytest.raises(cubesandbox.SandboxNotFound, match="sb-doesnotexist"):
        Sandbox.connect("sb-doesnotexist")


def test_a_malformed_id_is_an_error_not_a_path() -> None:
    _root()
    with pytest.raises(cubesandbox.CubeError):
        Sandbox.connect("../../etc")


def test_asking_the_host_template_for_the_vm_engine_is_refused() -> None:
    _root()
    with pytest.raises(cubesandbox.InvalidArgument, match="jail"):
        Sandbox.create(engine="vm")
