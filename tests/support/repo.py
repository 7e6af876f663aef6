"""The checkout the tests run in: its root, and its ``tokenbus`` command run as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support import forkserver

ROOT = Path(__file__).resolve().parent.parent.parent


def run_cli(
    *args: str,
    env: dict[str, str] | None = None,
    timeout: float = 60,
    check: bool = False,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``tokenbus <args>`` (as ``python -m tokenbus.cli``) the way a user would: forked
    from the project already imported (tests/support/forkserver.py) where it may."""
    if forkserver.enabled():
        return forkserver.run(list(args), env, cwd or ROOT, timeout, check)
    return subprocess.run(
        [sys.executable, "-m", "tokenbus.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd or ROOT,
        env=env,
        timeout=timeout,
        check=check,
    )
