"""The objects `cubesandbox` returns: executions, command results, file entries,
snapshots and sandbox listings."""

from __future__ import annotations

import base64
import datetime
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple


@dataclass
class Result:
    """One result of a cell: the value of its last expression (``is_main_result``) or a
    figure it left open, in every form it has.

    ``text`` is the ``repr`` of the value; ``png``, ``svg``, ``html`` hold the rich forms
    (``png`` base64-encoded, as E2B and Jupyter hand it out).
    """

    text: Optional[str] = None
    html: Optional[str] = None
    svg: Optional[str] = None
    png: Optional[str] = None
    is_main_result: bool = False
    raw: Dict[str, bytes] = field(default_factory=dict)

    def formats(self) -> List[str]:
        """The forms this result has, besides ``text``."""
        return [k for k in ("html", "svg", "png") if getattr(self, k) is not None]

    def png_bytes(self) -> Optional[bytes]:
        """The PNG form, decoded."""
        return self.raw.get("image/png")

    def __str__(self) -> str:
        return self.text or ""


@dataclass
class Logs:
    """What a cell printed."""

    stdout: List[str] = field(default_factory=list)
    stderr: List[str] = field(default_factory=list)


@dataclass
class ExecutionError:
    """The exception a cell raised."""

    name: str
    value: str
    traceback: str

    def __str__(self) -> str:
        return f"{self.name}: {self.value}"


@dataclass
class Execution:
    """The outcome of :meth:`cubesandbox.Sandbox.run_code`."""

    results: List[Result] = field(default_factory=list)
    logs: Logs = field(default_factory=Logs)
    error: Optional[ExecutionError] = None
    exit_status: Optional[int] = None
    """Status of the cell's last command (bash cells)."""

    @property
    def text(self) -> Optional[str]:
        """The text of the main result (the value of the cell's last expression)."""
        for r in self.results:
            if r.is_main_result:
                return r.text
        return None

    @classmethod
    def _from_native(cls, raw: Dict[str, Any]) -> "Execution":
        results: List[Result] = []
        main = Result(text=raw["value"], is_main_result=True)
        figures: List[Result] = []
        for mime, data in raw["rich"]:
            target = main if mime not in main.raw else None
            if target is None:
                # A second form of one kind: a figure left open, its own result.
                target = Result()
                figures.append(target)
            target.raw[mime] = data
            if mime == "image/png":
                target.png = base64.b64encode(data).decode("ascii")
            elif mime == "image/svg+xml":
                target.svg = data.decode("utf-8", "replace")
            elif mime == "text/html":
                target.html = data.decode("utf-8", "replace")
        if main.text is not None or main.raw:
            results.append(main)
        results.extend(figures)
        error = None
        if raw["error"] is not None:
            name, value, tb = raw["error"]
            error = ExecutionError(name=name, value=value, traceback=tb)
        logs = Logs(
            stdout=[raw["stdout"]] if raw["stdout"] else [],
            stderr=[raw["stderr"]] if raw["stderr"] else [],
        )
        return cls(results=results, logs=logs, error=error, exit_status=raw["exit_status"])


@dataclass
class CommandResult:
    """How a command ended and what it printed."""

    stdout: str
    stderr: str
    exit_code: int
    error: Optional[str] = None
    """Why it ended abnormally (a signal), when it did."""


@dataclass
class EntryInfo:
    """A file, directory or link in the sandbox."""

    name: str
    path: str
    type: str
    """``file``, ``dir``, ``symlink`` or ``other``."""
    size: int
    mode: int
    uid: int
    gid: int
    modified_time: datetime.datetime
    symlink_target: Optional[str] = None

    @classmethod
    def _from_native(cls, raw: Dict[str, Any]) -> "EntryInfo":
        return cls(
            name=raw["name"],
            path=raw["path"],
            type=raw["type"],
            size=raw["size"],
            mode=raw["mode"],
            uid=raw["uid"],
            gid=raw["gid"],
            modified_time=datetime.datetime.fromtimestamp(
                raw["modified_ns"] / 1e9, tz=datetime.timezone.utc
            ),
            symlink_target=raw["symlink_target"],
        )


@dataclass
class WriteInfo:
    """A file written into the sandbox."""

    path: str
    size: int
    name: str = ""

    def __post_init__(self) -> None:
        if not self.name:
            self.name = self.path.rstrip("/").rsplit("/", 1)[-1]


@dataclass(frozen=True)
class Snapshot:
    """A snapshot of a sandbox.

    ``kind`` is ``"full"`` when it holds the processes' memory too (a rollback puts
    running interpreters back as they were), ``"filesystem"`` when it holds only the
    files (a rollback restarts the sandbox's processes, so variables are lost).
    """

    id: str
    kind: str
    sandbox_id: str

    @property
    def is_full(self) -> bool:
        """Whether a rollback to it also restores memory and processes."""
        return self.kind == "full"

    def __str__(self) -> str:
        return self.id


@dataclass
class SnapshotArchive:
    """What :func:`cubesandbox.export_snapshot` wrote.

    ``required_template`` is the template a store must hold to import it (``None``
    for a snapshot over the built-in ``host`` template, which every store has).
    ``rootfs`` is the directory the snapshot lies over instead of a template, when
    its sandbox was created on one (a container's root filesystem): the archive does
    not hold it, and a sandbox created from the imported snapshot needs a tree like it.
    """

    snapshot_id: str
    path: str
    archive_bytes: int
    file_bytes: int
    data_bytes: int
    template: Optional[str]
    required_template: Optional[str]
    rootfs: Optional[str] = None


@dataclass
class SandboxInfo:
    """A sandbox as :meth:`cubesandbox.Sandbox.list` reports it."""

    sandbox_id: str
    engine: str
    template: str
    """The template (or snapshot) it was created from."""
    started_at: datetime.datetime
    metadata: Dict[str, str] = field(default_factory=dict)

    @classmethod
    def _from_native(cls, raw: Dict[str, Any]) -> "SandboxInfo":
        return cls(
            sandbox_id=raw["id"],
            engine=raw["engine"],
            template=raw["origin"],
            started_at=datetime.datetime.fromtimestamp(
                raw["created_unix"], tz=datetime.timezone.utc
            ),
            metadata=dict(raw["metadata"]),
        )


@dataclass(frozen=True)
class Context:
    """A named interpreter context: cells run in it share their variables."""

    id: str
    language: str


@dataclass(frozen=True)
class NetworkCounters:
    """A sandbox's traffic as its datapath counted it."""

    tx_packets: int
    tx_bytes: int
    rx_packets: int
    rx_bytes: int
    dropped: int
    """Packets refused (policy, no flow, malformed)."""


@dataclass(frozen=True)
class NetworkInfo:
    """A sandbox's network: device, egress policy, exposed ports, counters."""

    device: str
    """The host side of its device (empty while hibernated)."""
    address: str
    gateway: str
    internet: bool
    allow_out: List[str]
    deny_out: List[str]
    exposed: List[Tuple[int, int]]
    """``(host_port, sandbox_port)`` pairs."""
    counters: NetworkCounters

    @classmethod
    def _from_native(cls, raw: Dict[str, Any]) -> "NetworkInfo":
        return cls(
            device=raw["device"],
            address=raw["address"],
            gateway=raw["gateway"],
            internet=bool(raw["internet"]),
            allow_out=list(raw["allow_out"]),
            deny_out=list(raw["deny_out"]),
            exposed=[(int(h), int(s)) for h, s in raw["exposed"]],
            counters=NetworkCounters(**raw["counters"]),
        )
