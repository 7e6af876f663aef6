"""Ports on 127.0.0.1: a free one for a server a test starts, a taken one, a wait for a listener."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from collections.abc import Iterator

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
    proc: subprocess.Popen[bytes] | None = None,
) -> bool:
    """Until something listens on ``port`` (a server just started): True; False as soon as
    ``proc`` (the server) exited. Raises when ``timeout`` passes first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if port_open(host, port):
            return True
        if proc is not None and proc.poll() is not None:
            return False
        time.sleep(0.02)
    raise RuntimeError(f"nothing listens on port {port}")
