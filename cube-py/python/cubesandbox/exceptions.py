"""The exceptions `cubesandbox` raises.

Every one derives from :class:`CubeError`; where a built-in exception means the same
thing (a missing file, a timeout, a bad argument) it derives from that too, so
``except FileNotFoundError`` works on a sandbox's files as it does on local ones.
"""

from __future__ import annotations

import builtins
from typing import Optional


class CubeError(Exception):
    """Base class of every error Cube raises.

    A failed sandbox operation also carries ``kind``, the failure's kind as Cube
    reports it whether it failed in this process or in the sandbox's supervisor
    (``"not_found"``, ``"bad_state"``, ``"snapshot_failed"``, ``"host_cannot"``,
    ``"timeout"``...); the exception's class follows it.
    """

    kind: Optional[str] = None

    def __init__(self, message: str = "") -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class NotFound(CubeError, LookupError):
    """Something the operation names does not exist."""


class SandboxNotFound(NotFound):
    """No sandbox with this id is running (or it was killed)."""


class TemplateNotFound(NotFound):
    """No template with this name exists in the store."""


class SnapshotNotFound(NotFound):
    """No snapshot with this id exists."""


class AlreadyExists(CubeError):
    """Something of that name exists already (a template)."""


class InUse(CubeError):
    """What the operation would change is in use (a template sandboxes run on)."""


class InvalidArgument(CubeError, ValueError):
    """An argument was rejected (unknown engine or language, bad path, ...)."""


class ArchiveError(InvalidArgument):
    """A snapshot archive was refused on import: damaged, truncated, tampered with, or
    not a Cube snapshot this build reads. Nothing was added to the store."""


class EngineUnavailable(CubeError):
    """The engine cannot run here (missing helper binary, missing privileges, no KVM)."""


class SandboxError(CubeError):
    """A sandbox operation failed in the engine."""


class InvalidState(SandboxError):
    """The sandbox is not in a state that allows the operation (it is hibernated, not
    hibernated, or has no running machine)."""


class SnapshotError(SandboxError):
    """A snapshot could not be taken, or restored from (rollback, clone, wake)."""


class ConnectionLost(SandboxError):
    """The connection to the sandbox's agent broke (the sandbox stopped or restarted)."""


class AgentError(CubeError):
    """The agent inside the sandbox refused a request; ``code`` says why."""

    code: Optional[str] = None


class ContextError(AgentError):
    """The code context does not exist or its interpreter died."""


class FileNotFound(AgentError, builtins.FileNotFoundError):
    """A path in the sandbox does not exist."""


class FileExists(AgentError, builtins.FileExistsError):
    """A path in the sandbox already exists."""


class PermissionDenied(AgentError, builtins.PermissionError):
    """The sandbox does not allow the operation (e.g. a read-only path)."""


class NotADirectory(AgentError, builtins.NotADirectoryError):
    """A path component in the sandbox is not a directory."""


class IsADirectory(AgentError, builtins.IsADirectoryError):
    """A directory was given where a file is needed."""


class DirectoryNotEmpty(AgentError, builtins.OSError):
    """The directory is not empty."""


class TimeoutError(CubeError, builtins.TimeoutError):
    """An operation did not finish in time (a cell, a command, a wait)."""


class CommandError(CubeError):
    """A command in the sandbox failed."""


class CommandExitError(CommandError):
    """A command exited with a non-zero status (or was killed by a signal).

    Carries what the command printed, like the result of a successful run.
    """

    def __init__(
        self,
        message: str = "",
        stdout: str = "",
        stderr: str = "",
        exit_code: int = -1,
        error: Optional[str] = None,
    ) -> None:
        super().__init__(message)
        self.stdout = stdout
        self.stderr = stderr
        self.exit_code = exit_code
        self.error = error


__all__ = [
    "AgentError",
    "AlreadyExists",
    "ArchiveError",
    "CommandError",
    "CommandExitError",
    "ConnectionLost",
    "ContextError",
    "CubeError",
    "DirectoryNotEmpty",
    "EngineUnavailable",
    "FileExists",
    "FileNotFound",
    "InUse",
    "InvalidArgument",
    "InvalidState",
    "IsADirectory",
    "NotADirectory",
    "NotFound",
    "PermissionDenied",
    "SandboxError",
    "SandboxNotFound",
    "SnapshotError",
    "SnapshotNotFound",
    "TemplateNotFound",
    "TimeoutError",
]
