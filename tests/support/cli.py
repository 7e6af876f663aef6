"""The ``tokenbus`` CLI as a user runs it: an environment without the caller's own
``TOKENBUS_`` settings, and a line a running command prints."""

from __future__ import annotations

import os
import subprocess
import time


def cli_env(**extra: str) -> dict[str, str]:
    """This process's environment without its ``TOKENBUS_`` settings, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENBUS_")}
    return {**env, **extra}


def wait_line(
    proc: subprocess.Popen[str], needle: str, lines: list[str], timeout: float = 40
) -> str:
    """The first line ``proc`` prints that holds ``needle`` (every line read is appended to
    ``lines``), within ``timeout`` seconds or before it exits."""
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                break
            continue
        lines.append(line)
        if needle in line:
            return line
    raise AssertionError(f"{needle!r} not printed; got {lines}")
