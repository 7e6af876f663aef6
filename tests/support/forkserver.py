"""Service processes forked from one interpreter that has imported the project already
(tests/support/zygote.py), instead of a fresh ``python -m tokenbus.cli`` each.

The suite starts about a thousand service processes; each fresh one spent about 0.3 s of
CPU on the interpreter's start and the imports before it did anything (docs/testing.md), on
a 2-core machine where the suite is short of CPU. A child forked from the zygote runs the
same command, as the main module, in a process of its own with its own environment,
directory, output file and pid: signals (SIGSTOP, SIGKILL), exit codes and drains are the
ones under test. What it does not repeat is the import of the project, which
``tests/test_install.py`` and CI's newcomer stage check in fresh processes.

:class:`Forked` has the part of ``subprocess.Popen`` the tests use (``pid``, ``poll``,
``wait``, ``returncode``, ``send_signal``, ``terminate``, ``kill``). The zygote is the
children's parent: it reaps them and says how each ended. ``TOKENBUS_TEST_FORKSERVER=0``
starts every process fresh instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# Where ``tests.support.zygote`` imports from: the checkout's root.
_HOME = Path(__file__).resolve().parents[2]


def enabled() -> bool:
    return os.environ.get("TOKENBUS_TEST_FORKSERVER", "1") != "0" and sys.platform == "linux"


class _Zygote:
    """The one fork server of this test process, started on first use."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=_HOME,
        )
        self.lock = threading.Lock()
        self.changed = threading.Condition()
        self.pids: dict[int, int] = {}  # request id -> pid
        self.exits: dict[int, int] = {}  # pid -> returncode
        self.gone = False
        self.next_id = 0
        threading.Thread(target=self._read, name="zygote-reader", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self.changed:
                if "exit" in msg:
                    self.exits[int(msg["exit"])] = int(msg["code"])
                else:
                    self.pids[int(msg["id"])] = int(msg["pid"])
                self.changed.notify_all()
        with self.changed:
            self.gone = True
            self.changed.notify_all()

    def fork(
        self, args: list[str], env: dict[str, str], log: Path, err: Path | None, cwd: Path
    ) -> int:
        with self.lock:
            self.next_id += 1
            rid = self.next_id
            job = {"id": rid, "args": args, "env": env, "cwd": str(cwd), "log": str(log)}
            if err is not None:
                job["err"] = str(err)
            assert self.proc.stdin is not None
            self.proc.stdin.write((json.dumps(job) + "\n").encode())
            self.proc.stdin.flush()
        with self.changed:
            if not self.changed.wait_for(lambda: rid in self.pids or self.gone, timeout=30):
                raise RuntimeError("the fork server did not answer in 30 s")
            if rid not in self.pids:
                raise RuntimeError("the fork server is gone")
            return self.pids.pop(rid)


_zygote: _Zygote | None = None
_start_lock = threading.Lock()


def _server() -> _Zygote:
    global _zygote
    with _start_lock:
        if _zygote is None or _zygote.gone or _zygote.proc.poll() is not None:
            _zygote = _Zygote()
        return _zygote


class Forked:
    """A child of the fork server, as ``subprocess.Popen`` would show it."""

    def __init__(
        self,
        args: list[str],
        env: dict[str, str],
        log: Path,
        *,
        cwd: Path,
        err: Path | None = None,
    ) -> None:
        """``log``: its output (and its standard error, unless ``err``); ``cwd``: its
        directory."""
        self.args = ["tokenbus", *args]
        for f in (log, err):
            if f is not None:
                f.touch()  # there once it has a pid, as a Popen's output file is
        self._z = _server()
        self.pid = self._z.fork(args, env, log, err, cwd)
        self.returncode: int | None = None

    def _ended(self) -> bool:
        if self.returncode is not None:
            return True
        z = self._z
        if self.pid in z.exits:
            self.returncode = z.exits.pop(self.pid)
            return True
        if z.gone:  # no parent to say: it is an orphan now, alive or not
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                self.returncode = -signal.SIGKILL
                return True
        return False

    def poll(self) -> int | None:
        with self._z.changed:
            self._ended()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._z.changed:
            # Looked at again every second at least: a fork server that died says no more.
            while True:
                left = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
                if self._z.changed.wait_for(self._ended, timeout=max(0.0, left)):
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    raise subprocess.TimeoutExpired(self.args, timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def run(
    args: list[str],
    env: dict[str, str] | None,
    cwd: Path,
    timeout: float,
    check: bool,
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([python, -m, tokenbus.cli, *args], capture_output=True, text=True)``
    through the fork server (``env`` None: this process's)."""
    env = dict(os.environ if env is None else env)
    with tempfile.TemporaryDirectory(prefix="tb-cli-") as tmp:
        out, err = Path(tmp) / "out", Path(tmp) / "err"
        p = Forked(args, env, out, err=err, cwd=cwd)
        try:
            code = p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            raise
        done = subprocess.CompletedProcess(
            p.args, code, out.read_text(errors="replace"), err.read_text(errors="replace")
        )
    if check:
        done.check_returncode()
    return done
