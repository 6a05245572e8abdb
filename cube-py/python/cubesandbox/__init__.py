"""Cube sandboxes from Python.

>>> from cubesandbox import Sandbox
>>> with Sandbox.create() as sb:
...     sb.run_code("x = 41")
...     print(sb.run_code("x + 1").text)
42

See :class:`Sandbox` for everything a sandbox can do.
"""

from __future__ import annotations

from . import _binaries

# Before the native module starts any supervisor: point it at the bundled helpers.
_binaries.configure()

from . import _native  # noqa: E402
from .exceptions import (  # noqa: E402
    AgentError,
    AlreadyExists,
    ArchiveError,
    CommandError,
    CommandExitError,
    ConnectionLost,
    ContextError,
    CubeError,
    DirectoryNotEmpty,
    EngineUnavailable,
    FileExists,
    FileNotFound,
    InUse,
    InvalidArgument,
    InvalidState,
    IsADirectory,
    NotADirectory,
    NotFound,
    PermissionDenied,
    SandboxError,
    SandboxNotFound,
    SnapshotError,
    SnapshotNotFound,
    TemplateNotFound,
    TimeoutError,
)
from .models import (  # noqa: E402
    CommandResult,
    Context,
    EntryInfo,
    Execution,
    ExecutionError,
    Logs,
    NetworkCounters,
    NetworkInfo,
    Result,
    SandboxInfo,
    Snapshot,
    SnapshotArchive,
    WriteInfo,
)
from .sandbox import CommandHandle, Commands, Files, Network, Sandbox  # noqa: E402
from .snapshots import export_snapshot, import_snapshot  # noqa: E402

#: The template :meth:`Sandbox.create` uses when none is named.
DEFAULT_TEMPLATE: str = _native.default_template()

try:
    from importlib.metadata import version as _version

    __version__ = _version("cubesandbox")
except Exception:  # not installed as a distribution (e.g. a source checkout)
    __version__ = "0+unknown"

__all__ = [
    "DEFAULT_TEMPLATE",
    "AgentError",
    "AlreadyExists",
    "ArchiveError",
    "CommandError",
    "CommandExitError",
    "CommandHandle",
    "CommandResult",
    "Commands",
    "ConnectionLost",
    "Context",
    "ContextError",
    "CubeError",
    "DirectoryNotEmpty",
    "EngineUnavailable",
    "EntryInfo",
    "Execution",
    "ExecutionError",
    "FileExists",
    "FileNotFound",
    "Files",
    "InUse",
    "InvalidArgument",
    "InvalidState",
    "IsADirectory",
    "Logs",
    "Network",
    "NetworkCounters",
    "NetworkInfo",
    "NotADirectory",
    "NotFound",
    "PermissionDenied",
    "Result",
    "Sandbox",
    "SandboxError",
    "SandboxInfo",
    "SandboxNotFound",
    "Snapshot",
    "SnapshotArchive",
    "SnapshotError",
    "SnapshotNotFound",
    "TemplateNotFound",
    "TimeoutError",
    "WriteInfo",
    "export_snapshot",
    "import_snapshot",
]
