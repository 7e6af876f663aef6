"""Files of a folder owned by running processes (each holds an ``flock`` on its own while it
runs), and taking over those of processes that are gone: the telemetry spool's
(telemetry/spool.py) and a cut-off limiter's state (auth/cut_off_state.py)."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path


def hold(path: Path, flags: int = os.O_WRONLY | os.O_CREAT) -> int:
    """Open ``path`` (mode 0600) and lock it for this process's life: its descriptor."""
    fd = os.open(path, flags, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def gone(directory: Path, pattern: str, own: Path) -> Iterator[tuple[Path, int]]:
    """Each file of ``directory`` matching ``pattern`` but ``own`` that no live process holds:
    (its path, a descriptor of it locked here, closed once the caller's step is done)."""
    for other in sorted(directory.glob(pattern)):
        if other == own:
            continue
        try:
            fd = os.open(other, os.O_RDONLY)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live process's
            yield other, fd
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)
