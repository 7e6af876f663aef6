"""Processes by id: a test's children (from /proc) and stopping one it started."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any


def children_of(pid: int) -> dict[int, str]:
    """The live processes whose parent is ``pid``, with their command lines (from /proc):
    a test ends only the processes it started, never a match of a pattern across the
    machine, which on a shared host may be another stack's."""
    out: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except OSError:
            continue
        # The parent is the second field after the command name, which may hold spaces.
        if int(stat.rpartition(")")[2].split()[1]) == pid and cmd:
            out[int(entry.name)] = cmd
    return out


def child_matching(pid: int, needle: str) -> int | None:
    """The child of ``pid`` whose command line holds ``needle``, if one is alive."""
    return next((c for c, cmd in children_of(pid).items() if needle in cmd), None)


def stop_process(proc: subprocess.Popen[Any], timeout: float = 10) -> None:
    """SIGTERM, then SIGKILL if ``proc`` has not ended within ``timeout`` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
