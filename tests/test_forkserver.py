"""The suite's fork server (tests/support/forkserver.py): a process forked from the project
already imported is a process of its own, as a fresh ``python -m tokenbus.cli`` is: its
own environment, output file, exit code, signals and pid."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.support import forkserver
from tests.support.ports import free_port
from tests.support.repo import ROOT
from tests.support.waits import wait_for

pytestmark = [
    pytest.mark.stack,
    pytest.mark.skipif(not forkserver.enabled(), reason="TOKENBUS_TEST_FORKSERVER=0"),
]


def _forked(tmp_path: Path, name: str, *args: str, **env: str) -> forkserver.Forked:
    return forkserver.Forked(list(args), {**os.environ, **env}, tmp_path / f"{name}.log", cwd=ROOT)


def test_a_forked_command_exits_with_its_code_and_writes_its_output(tmp_path: Path) -> None:
    # Its own environment: the setting read from it is refused, with its name.
    env = {"TOKENBUS_WORKER__MAX_CONCURRENCY": "abc"}
    refused = _forked(tmp_path, "refused", "serve", "worker", "--model", "forked", **env)
    assert refused.wait(30) != 0
    assert "worker.max_concurrency" in (tmp_path / "refused.log").read_text()
    bad = _forked(tmp_path, "bad", "serve", "nosuch")
    assert bad.wait(30) == 2  # argparse's exit code for a bad argument
    assert "invalid choice: 'nosuch'" in (tmp_path / "bad.log").read_text()
    ok = _forked(tmp_path, "help", "serve", "--help")
    assert ok.wait(30) == 0 and ok.poll() == 0
    assert "usage:" in (tmp_path / "help.log").read_text()


async def test_a_forked_service_has_its_own_environment_pid_and_signals(tmp_path: Path) -> None:
    """A worker told to reach a NATS port where nothing listens keeps trying: it is
    stopped and continued, then killed, by its own pid."""
    port = free_port()
    log = tmp_path / "worker.log"
    w = _forked(
        tmp_path,
        "worker",
        *("serve", "worker", "--model", "forked"),
        TOKENBUS_NATS_URL=f"nats://127.0.0.1:{port}",
        TOKENBUS_LOG_LEVEL="debug",
    )
    try:
        assert w.pid not in (os.getpid(), os.getppid())
        await wait_for(lambda: "Connection refused" in log.read_text(), what="the worker's tries")
        with pytest.raises(subprocess.TimeoutExpired):
            w.wait(0.2)
        w.send_signal(signal.SIGSTOP)
        await wait_for(lambda: _state(w.pid) == "T", what="the worker stopped")
        w.send_signal(signal.SIGCONT)
        await wait_for(lambda: _state(w.pid) != "T", what="the worker continued")
        w.kill()
        assert w.wait(10) == -signal.SIGKILL
        w.kill()  # ended: nothing is sent to a pid that may be another process's by now
    finally:
        w.kill()  # a failed check leaves no worker behind


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0]
