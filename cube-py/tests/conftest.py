"""Fixtures of the cubesandbox suite: real sandboxes (the jail engine on Cube's CI
hosts) in the store named by $CUBE_HOME (scripts/test-python.sh makes a fresh one)."""

from __future__ import annotations

import _thread
import contextlib
import os
import signal
import threading
from typing import Iterator, List

import pytest

import cubesandbox
from cubesandbox import Sandbox

ENGINE = os.environ.get("CUBE_TEST_ENGINE", "auto")
TEMPLATE = os.environ.get("CUBE_TEST_TEMPLATE") or cubesandbox.DEFAULT_TEMPLATE

_created: List[Sandbox] = []


@contextlib.contextmanager
def ctrl_c_after(seconds: float) -> Iterator[None]:
    """Presses Ctrl-C (SIGINT, as the main thread sees it) after `seconds`. Python's
    own handler is installed meanwhile: a process started with SIGINT ignored (a
    background job of a non-interactive shell) has none, and the press would do
    nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(seconds, _thread.interrupt_main)
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)


def needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("skipping: sandboxes need root (namespaces, mounts, cgroups)")


def new_sandbox(**kwargs: object) -> Sandbox:
    """A sandbox that the session kills at its end if the test did not."""
    needs_root()
    kwargs.setdefault("engine", ENGINE)
    kwargs.setdefault("template", TEMPLATE)
    try:
        sb = Sandbox.create(**kwargs)  # type: ignore[arg-type]
    except cubesandbox.EngineUnavailable as e:
        pytest.skip(f"skipping: no engine can run sandboxes on this host: {e}")
    _created.append(sb)
    return sb


@pytest.fixture
def sandbox() -> Iterator[Sandbox]:
    sb = new_sandbox()
    yield sb
    sb.kill()


@pytest.fixture(scope="session", autouse=True)
def _kill_leftovers() -> Iterator[None]:
    """Kills every sandbox a failed test left running, clones included."""
    yield
    for sb in _created:
        try:
            sb.kill()
        except cubesandbox.CubeError:
            pass
    if os.geteuid() != 0:
        return
    try:
        leftovers = Sandbox.list()
    except cubesandbox.CubeError:
        return
    for info in leftovers:
        try:
            Sandbox.connect(info.sandbox_id).kill()
        except cubesandbox.CubeError:
            pass
