"""``tokenbus bench --spawn`` stopped while its stack starts, as a user does with Ctrl-C
during a slow start (a vLLM engine server, a peer that never answers), or as ``timeout`` and
CI runners do with SIGTERM: every process it started ends with it, its nats-server included
(real processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.pids import children_of
from tests.support.repo import ROOT
from tests.support.waits import wait_until

pytestmark = pytest.mark.stack


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_run_stopped_while_its_stack_starts_leaves_no_process_behind(
    tmp_path: Path, sig: signal.Signals
) -> None:
    # A peer that never becomes ready holds the run in its start (bench waits up to 120 s
    # for a peer's health) while every other process runs already.
    peer = tmp_path / "vllm-router"
    peer.write_text("#!/bin/sh\nexec sleep 600\n")
    peer.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENBUS_")}
    argv = ["bench", "--spawn", "--no-progress", "--peer", f"vllm-router={peer}"]
    argv += ["--concurrency", "1", "--requests-per-client", "1", "--out", str(tmp_path / "o")]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenbus.cli", *argv],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    started: dict[int, str] = {}

    def peer_started() -> bool:
        started.update(children_of(proc.pid))
        return proc.poll() is not None or any("sleep 600" in c for c in started.values())

    try:
        wait_until(peer_started, timeout=120, interval=0.1, what="the peer started")
        assert any("sleep 600" in c for c in started.values()), started
        assert any("nats-server" in c for c in started.values()), started
        started.update(children_of(proc.pid))
    finally:
        proc.send_signal(sig)
        try:
            out, _ = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate(timeout=30)
            raise AssertionError(f"still running 90 s after {sig.name}: {out[-3000:]}") from None

    def left() -> dict[int, str]:
        return {p: c for p, c in started.items() if Path(f"/proc/{p}").exists()}

    wait_until(
        lambda: not left(), timeout=30, interval=0.1, what=f"no process left ({out[-1500:]})"
    )
    assert not (tmp_path / "o").exists()  # stopped before any level ran
    assert proc.returncode != 0
