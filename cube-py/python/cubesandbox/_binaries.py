"""Points Cube at the helper programs shipped inside the wheel.

A sandbox is held by a ``cube-supervisor`` process and runs ``cube-agent`` inside it.
The wheel carries both in ``cubesandbox/bin``; the engine finds them through the
``CUBE_SUPERVISOR`` and ``CUBE_AGENT`` environment variables, which are set here (before
the first sandbox starts) unless the caller set them already.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Dict

BIN_DIR = Path(__file__).resolve().parent / "bin"

HELPERS: Dict[str, str] = {
    "CUBE_SUPERVISOR": "cube-supervisor",
    "CUBE_AGENT": "cube-agent",
}


def _ensure_executable(path: Path) -> None:
    mode = path.stat().st_mode
    if mode & stat.S_IXUSR:
        return
    # An installer that dropped the execute bits (some do for package data).
    try:
        path.chmod(mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    except OSError:
        pass


def configure() -> Dict[str, str]:
    """Sets the helper variables that are unset; returns the paths in effect."""
    for var, name in HELPERS.items():
        bundled = BIN_DIR / name
        if bundled.is_file():
            _ensure_executable(bundled)
            os.environ.setdefault(var, str(bundled))
    return {var: os.environ.get(var, "") for var in HELPERS}
