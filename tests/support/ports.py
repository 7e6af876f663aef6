"""Ports on 127.0.0.1: a free one for a server a test starts, a taken one, a wait for a listener."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

from tokenbus.launcher import free_port as launcher_free_port
from tokenbus.launcher import port_open


@contextlib.contextmanager
def taken_port() -> Iterator[int]:
    """A port on 127.0.0.1 that something else listens on, for as long as the block runs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def free_port() -> int:
    """A port for a server a test starts (:func:`tokenbus.launcher.free_port`: outside the
    ephemeral range, so no client's connection takes it before the server binds it)."""
    return launcher_free_port()


def wait_port(
    port: int,
    timeout: float = 10,
    host: str = "127.0.0.1",
    proc: Any = None,
) -> bool:
    """Until something listens on ``port`` (a server just started): True; False as soon as
    ``proc`` (the server: a ``Popen`` or the kit's ``Process``) exited. Raises when
    ``timeout`` passes first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if port_open(host, port):
            return True
        if proc is not None and proc.poll() is not None:
            return False
        time.sleep(0.02)
    raise RuntimeError(f"nothing listens on port {port}")


def listened_by(pid: int, port: int) -> bool:
    """Whether ``pid`` or a process it started listens on TCP ``port`` (Linux's /proc: the
    listening sockets' inodes among the processes' open files). Tells a server's own port
    from the same port taken by another test's server a moment before it tried to bind."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.read().splitlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{cols[9]}]")
    if not inodes:
        return False
    todo, seen = [pid], set()
    while todo:
        p = todo.pop()
        seen.add(p)
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{p}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{p}/fd/{fd}") in inodes:
                        return True
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo.extend(int(c) for c in f.read().split() if int(c) not in seen)
    return False
