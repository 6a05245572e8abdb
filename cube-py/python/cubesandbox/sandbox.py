"""`Sandbox`: an E2B-style handle on one Cube sandbox."""

from __future__ import annotations

import os
import uuid
from typing import (
    IO,
    Any,
    Callable,
    Dict,
    List,
    Literal,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    Union,
    overload,
)

from . import _native
from .exceptions import CommandExitError, InvalidArgument, TimeoutError
from .models import (
    CommandResult,
    Context,
    EntryInfo,
    Execution,
    ExecutionError,
    NetworkCounters,
    NetworkInfo,
    Result,
    SandboxInfo,
    Snapshot,
    WriteInfo,
)

OutputHandler = Callable[[str], Any]
StorePath = Union[str, "os.PathLike[str]", None]

#: Seconds a foreground command may run unless told otherwise (as in E2B).
DEFAULT_COMMAND_TIMEOUT = 60.0

_Outcome = Tuple[bytes, bytes, Optional[int], Optional[int], bool]


def _store(store: StorePath) -> Optional[str]:
    return None if store is None else os.fspath(store)


def _decode(data: bytes) -> str:
    return data.decode("utf-8", "replace")


def _command_result(outcome: _Outcome, what: str) -> CommandResult:
    """A result from a native outcome; raises when the command failed."""
    stdout, stderr, code, signal, timed_out = outcome
    out, err = _decode(stdout), _decode(stderr)
    if timed_out:
        raise TimeoutError(f"{what} ran past its timeout and was killed")
    error = None
    if code is None:
        # Killed by a signal: report it the way shells do.
        code = 128 + (signal or 0)
        error = f"killed by signal {signal}"
    if code != 0:
        raise CommandExitError(
            f"{what} exited with code {code}" + (f" ({error})" if error else "")
            + (f": {err.strip()[-500:]}" if err.strip() else ""),
            stdout=out,
            stderr=err,
            exit_code=code,
            error=error,
        )
    return CommandResult(stdout=out, stderr=err, exit_code=code, error=error)


class CommandHandle:
    """A command started with ``background=True``."""

    def __init__(self, native: Any, cmd: str) -> None:
        self._native = native
        self._cmd = cmd

    @property
    def pid(self) -> int:
        """Its process id inside the sandbox."""
        return int(self._native.pid)

    @property
    def stdout(self) -> str:
        """Standard output so far."""
        return _decode(self._native.stdout)

    @property
    def stderr(self) -> str:
        """Standard error so far."""
        return _decode(self._native.stderr)

    @property
    def finished(self) -> bool:
        """Whether it has ended."""
        return bool(self._native.finished())

    def wait(self, timeout: Optional[float] = None) -> CommandResult:
        """Waits for the end; raises :class:`CommandExitError` on a non-zero exit and
        :class:`TimeoutError` when ``timeout`` seconds pass first."""
        return _command_result(self._native.wait(timeout), repr(self._cmd))

    def kill(self, signal: int = 9) -> bool:
        """Sends ``signal`` (default SIGKILL); false when it had already ended."""
        return bool(self._native.kill(signal))

    def __repr__(self) -> str:
        return f"CommandHandle(pid={self.pid}, cmd={self._cmd!r})"


class Commands:
    """Processes in the sandbox (``sandbox.commands``)."""

    def __init__(self, native: Any) -> None:
        self._native = native

    @overload
    def run(
        self,
        cmd: str,
        background: Literal[False] = False,
        cwd: Optional[str] = None,
        envs: Optional[Mapping[str, str]] = None,
        on_stdout: Optional[OutputHandler] = None,
        on_stderr: Optional[OutputHandler] = None,
        timeout: Optional[float] = DEFAULT_COMMAND_TIMEOUT,
        stdin: Union[str, bytes, None] = None,
    ) -> CommandResult: ...

    @overload
    def run(
        self,
        cmd: str,
        background: Literal[True],
        cwd: Optional[str] = None,
        envs: Optional[Mapping[str, str]] = None,
        on_stdout: Optional[OutputHandler] = None,
        on_stderr: Optional[OutputHandler] = None,
        timeout: Optional[float] = DEFAULT_COMMAND_TIMEOUT,
        stdin: Union[str, bytes, None] = None,
    ) -> CommandHandle: ...

    def run(
        self,
        cmd: str,
        background: bool = False,
        cwd: Optional[str] = None,
        envs: Optional[Mapping[str, str]] = None,
        on_stdout: Optional[OutputHandler] = None,
        on_stderr: Optional[OutputHandler] = None,
        timeout: Optional[float] = DEFAULT_COMMAND_TIMEOUT,
        stdin: Union[str, bytes, None] = None,
    ) -> Union[CommandResult, CommandHandle]:
        """Runs ``cmd`` with bash in the sandbox.

        In the foreground, waits for it and returns a :class:`CommandResult`, calling
        ``on_stdout``/``on_stderr`` with each piece of output as it arrives; a non-zero
        exit raises :class:`CommandExitError` (which carries the output), and running
        past ``timeout`` seconds (``None``: no limit) kills it and raises
        :class:`TimeoutError`. Ctrl-C kills it too. With ``background=True`` it returns
        a :class:`CommandHandle` at once; the callbacks then run on a helper thread.
        """
        argv = ["bash", "-c", cmd]
        data = stdin.encode() if isinstance(stdin, str) else stdin
        env = dict(envs) if envs else None
        if background:
            native = self._native.spawn(argv, env, cwd, data, timeout, on_stdout, on_stderr)
            return CommandHandle(native, cmd)
        outcome = self._native.exec(argv, env, cwd, data, timeout, on_stdout, on_stderr)
        return _command_result(outcome, repr(cmd))


class Files:
    """Files in the sandbox (``sandbox.files``)."""

    def __init__(self, native: Any) -> None:
        self._native = native

    @overload
    def read(self, path: str, format: Literal["text"] = "text") -> str: ...

    @overload
    def read(self, path: str, format: Literal["bytes"]) -> bytes: ...

    def read(self, path: str, format: str = "text") -> Union[str, bytes]:
        """A file's content, as text (UTF-8) or, with ``format="bytes"``, as bytes."""
        data: bytes = self._native.read_file(path)
        if format == "bytes":
            return data
        if format == "text":
            return data.decode("utf-8")
        raise InvalidArgument(f'unknown format {format!r} (use "text" or "bytes")')

    @overload
    def write(self, path: str, data: Union[str, bytes, IO[Any]]) -> WriteInfo: ...

    @overload
    def write(self, path: Sequence[Mapping[str, Any]]) -> List[WriteInfo]: ...

    def write(
        self,
        path: Union[str, Sequence[Mapping[str, Any]]],
        data: Union[str, bytes, IO[Any], None] = None,
    ) -> Union[WriteInfo, List[WriteInfo]]:
        """Writes a file (creating missing parent directories) and returns what was
        written. Also takes a list of ``{"path": ..., "data": ...}`` entries."""
        if not isinstance(path, str):
            return [self.write(entry["path"], entry["data"]) for entry in path]
        if data is None:
            raise InvalidArgument("no data to write")
        content: Any = data.read() if hasattr(data, "read") else data
        raw = content.encode("utf-8") if isinstance(content, str) else bytes(content)
        size = self._native.write_file(path, raw)
        return WriteInfo(path=path, size=int(size))

    def list(self, path: str, depth: int = 1) -> List[EntryInfo]:
        """Entries of a directory, ``depth`` levels down."""
        return [EntryInfo._from_native(d) for d in self._native.list_dir(path, depth)]

    def get_info(self, path: str) -> EntryInfo:
        """A path's metadata (a link is described, not followed)."""
        return EntryInfo._from_native(self._native.stat(path))

    def exists(self, path: str) -> bool:
        """Whether a path exists."""
        return bool(self._native.exists(path))

    def make_dir(self, path: str) -> bool:
        """Creates a directory and its parents; false when it already existed."""
        if self._native.exists(path):
            return False
        self._native.make_dir(path)
        return True

    def remove(self, path: str) -> None:
        """Removes a file, link or directory (with its contents)."""
        self._native.remove(path)

    def rename(self, old_path: str, new_path: str) -> EntryInfo:
        """Renames (moves) a path; returns the entry at its new place."""
        self._native.rename(old_path, new_path)
        return self.get_info(new_path)


PortSpec = Union[int, str, Tuple[int, int]]


def _check_limits(**limits: Optional[int]) -> None:
    """Refuses a limit that is given but is no positive integer, naming it."""
    for name, value in limits.items():
        positive = isinstance(value, int) and not isinstance(value, bool) and value > 0
        if value is not None and not positive:
            raise InvalidArgument(f"{name} must be a positive integer, not {value!r}")


def _port(spec: PortSpec) -> str:
    """``8080``, ``"8080:80"`` or ``(8080, 80)`` as ``"HOST:SANDBOX"``."""
    if isinstance(spec, bool):
        raise InvalidArgument(f"bad port {spec!r}")
    if isinstance(spec, int):
        return str(spec)
    if isinstance(spec, tuple):
        host, sandbox = spec
        return f"{int(host)}:{int(sandbox)}"
    return str(spec)


class Network:
    """The sandbox's network (``sandbox.network``): its egress policy, exposed ports
    and traffic counters. Only sandboxes created with a network have one."""

    def __init__(self, native: Any) -> None:
        self._native = native

    def info(self) -> NetworkInfo:
        """Device, policy, exposed ports and counters now."""
        return NetworkInfo._from_native(self._native.network_status())

    @property
    def counters(self) -> NetworkCounters:
        """Traffic so far (:class:`NetworkCounters`)."""
        return self.info().counters

    def set_policy(
        self,
        *,
        internet: bool = True,
        allow_out: Sequence[str] = (),
        deny_out: Sequence[str] = (),
    ) -> None:
        """Replaces the egress policy; new connections see it at once. ``allow_out``
        opens CIDRs the defaults refuse (private ranges; the host itself as an exact
        ``/32``), ``deny_out`` refuses CIDRs; the longer matching prefix wins."""
        self._native.set_policy(internet, list(allow_out), list(deny_out))

    def expose(self, port: int, sandbox_port: Optional[int] = None) -> None:
        """Serves ``sandbox_port`` (default: ``port``) of the sandbox at ``port`` on
        the host's addresses (not 127.0.0.1), TCP."""
        self._native.expose(port, port if sandbox_port is None else sandbox_port)

    def unexpose(self, port: int) -> None:
        """Withdraws exposed host port ``port``."""
        self._native.unexpose(port)


class Sandbox:
    """One Cube sandbox.

    Create one with :meth:`Sandbox.create` (or ``with Sandbox.create() as sb:``, which
    kills it on leaving the block), or reattach with :meth:`Sandbox.connect`. A sandbox
    lives until :meth:`kill` (or its ``timeout``), also after this process ends.
    """

    def __init__(self, *, _native_sandbox: Any, _store: Optional[str] = None) -> None:
        self._native = _native_sandbox
        self._store = _store
        self.commands = Commands(_native_sandbox)
        self.files = Files(_native_sandbox)
        self.network = Network(_native_sandbox)

    # -- lifecycle ---------------------------------------------------------------

    @classmethod
    def create(
        cls,
        template: Optional[str] = None,
        *,
        snapshot: Union[Snapshot, str, None] = None,
        engine: str = "auto",
        timeout: Optional[float] = None,
        envs: Optional[Mapping[str, str]] = None,
        metadata: Optional[Mapping[str, str]] = None,
        store: StorePath = None,
        network: bool = False,
        internet: bool = True,
        allow_out: Sequence[str] = (),
        deny_out: Sequence[str] = (),
        expose: Sequence[PortSpec] = (),
        memory_mib: Optional[int] = None,
        cpu_millis: Optional[int] = None,
        pids_max: Optional[int] = None,
        disk_mib: Optional[int] = None,
    ) -> "Sandbox":
        """Starts a sandbox from ``template`` (default: the built-in ``host``
        template, the host's userland read-only with Python 3).

        ``snapshot`` (instead of ``template``) starts it from a snapshot in the store:
        one of a sandbox's, or one :func:`cubesandbox.import_snapshot` added; a full
        one brings its processes back as they were.

        ``engine`` is ``"auto"`` (the template's), ``"jail"`` or ``"vm"``; ``timeout``
        destroys the sandbox after that many seconds (``None``: it lives until killed);
        ``envs`` are environment variables of every process in it; ``metadata`` labels
        show up in :meth:`list`; ``store`` picks a store other than the default
        (``$CUBE_HOME``).

        ``network=True`` gives a jail sandbox a network (NAT through the host; private
        ranges and the host refused by default); without it the sandbox has loopback
        only. ``internet``, ``allow_out``, ``deny_out`` (CIDRs) and ``expose`` (ports:
        ``8080``, ``"8080:80"`` or ``(8080, 80)``) imply it.

        Limits of a jail sandbox, each ``None`` for the default the host can enforce:
        ``memory_mib`` (its whole memory, MiB, its /tmp and /dev/shm included;
        default 2048), ``cpu_millis`` (thousandths of a core; default 1000),
        ``pids_max`` (processes and threads at once; default 4096, so a fork bomb
        stops inside the sandbox) and ``disk_mib`` (what its files may take on disk,
        MiB, ENOSPC inside past it; default 4096 on a store with project quotas, where
        alone it can be asked for).
        """
        _check_limits(
            memory_mib=memory_mib, cpu_millis=cpu_millis, pids_max=pids_max, disk_mib=disk_mib
        )
        if snapshot is not None and template is not None:
            raise InvalidArgument("name a template or a snapshot to create from, not both")
        native = _native.create(
            template,
            engine,
            dict(envs) if envs else None,
            dict(metadata) if metadata else None,
            timeout,
            _store(store),
            network,
            internet,
            list(allow_out),
            list(deny_out),
            [_port(p) for p in expose],
            memory_mib,
            cpu_millis,
            pids_max,
            disk_mib,
            snapshot.id if isinstance(snapshot, Snapshot) else snapshot,
        )
        return cls(_native_sandbox=native, _store=_store(store))

    @classmethod
    def connect(cls, sandbox_id: str, *, store: StorePath = None) -> "Sandbox":
        """Attaches to a running sandbox; raises :class:`SandboxNotFound`."""
        native = _native.connect(sandbox_id, _store(store))
        return cls(_native_sandbox=native, _store=_store(store))

    @staticmethod
    def list(*, store: StorePath = None) -> List[SandboxInfo]:
        """The sandboxes in the store."""
        return [SandboxInfo._from_native(d) for d in _native.list_sandboxes(_store(store))]

    @property
    def sandbox_id(self) -> str:
        """The sandbox id."""
        return str(self._native.id)

    @property
    def id(self) -> str:
        """The sandbox id (same as :attr:`sandbox_id`)."""
        return self.sandbox_id

    @property
    def engine(self) -> str:
        """``"jail"`` or ``"vm"``."""
        return str(self._native.engine)

    def kill(self) -> bool:
        """Destroys the sandbox, its files and snapshots; false when this handle had
        already killed it."""
        return bool(self._native.kill())

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def __repr__(self) -> str:
        return f"Sandbox(id={self.sandbox_id!r}, engine={self.engine!r})"

    # -- state -------------------------------------------------------------------

    def create_snapshot(self) -> Snapshot:
        """Snapshots the sandbox; it keeps running. See :class:`Snapshot` for what a
        snapshot of each kind restores."""
        snap_id, kind = self._native.snapshot()
        return Snapshot(id=snap_id, kind=kind, sandbox_id=self.sandbox_id)

    def rollback(self, snapshot: Union[Snapshot, str]) -> None:
        """Puts the sandbox back to one of its own snapshots (same id afterwards)."""
        self._native.rollback(snapshot.id if isinstance(snapshot, Snapshot) else snapshot)

    def clone(self, n: int = 1) -> List["Sandbox"]:
        """Snapshots the sandbox and starts ``n`` new sandboxes from that snapshot."""
        if n < 0:
            raise InvalidArgument(f"cannot make {n} clones")
        return [
            Sandbox(_native_sandbox=c, _store=self._store) for c in self._native.clone(n)
        ]

    def set_limits(
        self,
        *,
        memory_mib: Optional[int] = None,
        cpu_millis: Optional[int] = None,
        pids_max: Optional[int] = None,
    ) -> None:
        """Changes a running jail sandbox's limits (as :meth:`create` takes them):
        each one given replaces the sandbox's, the others stay, and they hold across
        rollbacks, hibernation and wake. A VM's are fixed when it is created
        (:class:`cubesandbox.CubeError` says so)."""
        _check_limits(memory_mib=memory_mib, cpu_millis=cpu_millis, pids_max=pids_max)
        self._native.set_limits(memory_mib, cpu_millis, pids_max)

    def pause(self) -> None:
        """Freezes every process in the sandbox; memory stays."""
        self._native.pause()

    def resume(self) -> None:
        """Continues after :meth:`pause`."""
        self._native.resume()

    def hibernate(self) -> None:
        """Writes the sandbox's state out and frees its memory."""
        self._native.hibernate()

    def wake(self) -> None:
        """Restores after :meth:`hibernate`."""
        self._native.wake()

    # -- code --------------------------------------------------------------------

    def create_code_context(
        self, name: Optional[str] = None, language: str = "python", cwd: Optional[str] = None
    ) -> Context:
        """A fresh interpreter; pass it as ``context=`` to run cells in it."""
        name = name or f"ctx-{uuid.uuid4().hex[:12]}"
        self._native.create_context(name, language, cwd)
        return Context(id=name, language=language)

    def remove_code_context(self, context: Union[Context, str]) -> None:
        """Stops an interpreter created by :meth:`create_code_context`."""
        self._native.delete_context(context.id if isinstance(context, Context) else context)

    def run_code(
        self,
        code: str,
        language: Optional[str] = None,
        context: Union[Context, str, None] = None,
        on_stdout: Optional[OutputHandler] = None,
        on_stderr: Optional[OutputHandler] = None,
        on_result: Optional[Callable[[Result], Any]] = None,
        on_error: Optional[Callable[[ExecutionError], Any]] = None,
        timeout: Optional[float] = None,
    ) -> Execution:
        """Runs a cell; variables persist between cells of one context.

        Without ``context``, cells of a language share that language's default
        context. The value of the cell's last expression becomes the main result
        (with its rich forms: PNG, SVG, HTML); an exception it raised is
        ``execution.error`` (not raised here). ``timeout`` interrupts the cell (the
        context survives) and raises :class:`TimeoutError`. The agent sends a cell's
        output with its result, so ``on_stdout``/``on_stderr`` are called once the
        cell ends.
        """
        if isinstance(context, Context):
            if language is not None and language != context.language:
                raise InvalidArgument(
                    f"context {context.id} runs {context.language}, not {language}"
                )
            language = context.language
            ctx: Optional[str] = context.id
        else:
            ctx = context
        raw = self._native.run_code(code, language or "python", ctx, timeout)
        if raw["timed_out"]:
            raise TimeoutError(f"the cell ran past its timeout of {timeout} s and was interrupted")
        execution = Execution._from_native(raw)
        for text in execution.logs.stdout:
            if on_stdout:
                on_stdout(text)
        for text in execution.logs.stderr:
            if on_stderr:
                on_stderr(text)
        if on_result:
            for r in execution.results:
                on_result(r)
        if on_error and execution.error:
            on_error(execution.error)
        return execution


__all__ = ["CommandHandle", "Commands", "Files", "Sandbox"]
