"""The kit's process supervisor: start children, restart the ones that die (or stall: the
watchdog reads each child's health file), stop them in order. ``tokenbus up`` (the launcher),
``tokenbus serve bridge --processes N``, the benchmark's spawned stacks, the nemesis' stack
and the tests' processes and nats-servers all start, signal and stop theirs through
:class:`Process`; the ones that must be restarted when they die run under :class:`Supervisor`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol


class Handle(Protocol):
    """What :class:`Process` needs of a started process: ``subprocess.Popen``'s part."""

    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...


def popen(p: Process) -> subprocess.Popen[bytes]:
    """``p`` started fresh: its ``argv`` with its ``env`` over this process's, its output (and
    errors) appended to its log file."""
    assert p.log is not None
    with open(p.log, "ab") as fh:
        return subprocess.Popen(
            p.argv,
            stdout=fh,
            stderr=subprocess.STDOUT,
            env={**os.environ, **p.env},
            cwd=p.cwd,
            start_new_session=p.new_session,
        )


Spawn = Callable[["Process"], Handle]


class Process:
    """One process with its output in a log file: started, signalled, awaited, stopped.
    ``spawn`` starts it (:func:`popen` unless another is given: the tests fork theirs from a
    process that has the project imported already)."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str] | None = None,
        *,
        log: Path | None = None,
        cwd: Path | None = None,
        new_session: bool = False,
        spawn: Spawn | None = None,
    ) -> None:
        self.name = name
        self.argv = argv
        self.env = dict(env or {})
        self.log = log
        self.cwd = cwd
        self.new_session = new_session  # its own process group (a Ctrl-C is not its)
        self.spawn = spawn or popen
        self.proc: Handle | None = None
        self.started_at = 0.0
        self._terminated = False

    def start(self) -> None:
        """Start it (again, if it ran before: its log grows)."""
        self.proc = self.spawn(self)
        self.started_at = time.monotonic()
        self._terminated = False

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        """Its exit status once it has ended (negative: the signal that ended it)."""
        return None if self.proc is None else self.proc.poll()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.alive():
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    # ``subprocess.Popen``'s names, for code that holds a started process either way.
    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Until it has ended (``subprocess.TimeoutExpired`` after ``timeout``)."""
        assert self.proc is not None
        return self.proc.wait(timeout)

    def send_signal(self, sig: int) -> None:
        self.signal(sig)

    def terminate(self) -> None:
        """SIGTERM, once (it drains and exits), and SIGCONT: a paused process must run to."""
        if self.alive() and not self._terminated:
            self._terminated = True
            self.signal(signal.SIGTERM)
            self.signal(signal.SIGCONT)

    def kill(self, wait: float = 5.0) -> None:
        """SIGKILL, then up to ``wait`` seconds for it to be gone."""
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(wait)

    def stop(self, timeout: float = 15.0) -> int | None:
        """:meth:`terminate`, then SIGKILL if it has not ended within ``timeout``; its exit
        status (None: never started)."""
        if self.proc is None:
            return None
        self.terminate()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGKILL)
            return self.proc.wait()

    async def exited(self) -> int:
        """Its exit status, once it has ended, awaited without blocking the loop: woken by
        the kernel (a pidfd) where it can, else by looking every 0.1 s."""
        proc = self.proc
        assert proc is not None
        if (rc := proc.poll()) is not None:
            return rc
        fd = -1
        with contextlib.suppress(AttributeError, OSError):
            fd = os.pidfd_open(proc.pid)  # Linux 5.3: readable once the process has ended
        if fd >= 0:
            loop = asyncio.get_running_loop()
            gone = asyncio.Event()
            try:
                loop.add_reader(fd, gone.set)
                await gone.wait()
            finally:
                loop.remove_reader(fd)
                os.close(fd)
        # Ended (its parent's reap may lag a moment), or no pidfd here: looked at in turn.
        while (rc := proc.poll()) is None:  # noqa: ASYNC110 - no event says "reaped"
            await asyncio.sleep(0.01 if fd >= 0 else 0.1)
        return rc

    async def stopped(self, timeout: float) -> int:
        """:meth:`terminate`, then SIGKILL if it has not ended within ``timeout``."""
        self.terminate()
        try:
            return await asyncio.wait_for(self.exited(), timeout)
        except TimeoutError:
            self.signal(signal.SIGKILL)
            return await self.exited()


class Child(Process):
    """One supervised process: restarted when it dies (``restarts``) or stalls (``stalls``:
    times the watchdog killed it)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        super().__init__(name, argv, env, new_session=True)
        self.restarts = 0
        self.stalls = 0


class Supervisor:
    """Starts children, restarts the ones that die, stops them in order on request."""

    def __init__(
        self,
        log_dir: Path,
        *,
        backoff_s: float = 1.0,
        echo: bool = True,
        fatal_codes: frozenset[int] | set[int] = frozenset(),
        watchdog_s: float = 0.0,
    ) -> None:
        self.log_dir = log_dir
        self.backoff_s = backoff_s
        # A child whose health file (written by its event loop every 2 s: services.runtime.
        # write_health) is older than this is stalled (paused, its loop stuck) and is killed,
        # then restarted like a crashed one. 0: off.
        self.watchdog_s = watchdog_s
        self.children: list[Child] = []
        self.stopping = False
        self.echo = echo
        # A child that exits with one of these (2: a usage error, such as a port it cannot
        # bind) is not restarted: the supervisor stops and reports it in ``failed``.
        self.fatal_codes = frozenset(fatal_codes)
        self.failed: tuple[Child, int] | None = None
        log_dir.mkdir(parents=True, exist_ok=True)

    def say(self, text: str) -> None:
        if self.echo:
            print(text, flush=True)

    def health_file(self, child: Child) -> Path:
        return self.log_dir / f"{child.name}.health"

    async def spawn(self, child: Child) -> None:
        child.log = self.log_dir / f"{child.name}.log"
        if self.watchdog_s > 0:
            health = self.health_file(child)
            health.unlink(missing_ok=True)  # the last run's: this one's is awaited afresh
            child.env["TOKENBUS_HEALTH_FILE"] = str(health)
        child.start()

    async def add(self, child: Child) -> None:
        self.children.append(child)
        await self.spawn(child)

    async def watch(self) -> None:
        """Restart children that exit while not stopping."""
        while not self.stopping:
            # Woken by a child's exit (or once a second, for children added meanwhile),
            # not by polling: an idle stack's supervisor sleeps.
            exits = [asyncio.ensure_future(c.exited()) for c in self.children if c.proc]
            if exits:
                _, pending = await asyncio.wait(
                    exits, timeout=1.0, return_when=asyncio.FIRST_COMPLETED
                )
                for t in pending:
                    t.cancel()
            else:
                await asyncio.sleep(1.0)
            self.kill_stalled()
            for c in self.children:
                if self.stopping:
                    return
                if (rc := c.returncode) is not None:
                    if rc in self.fatal_codes:
                        self.failed = (c, rc)
                        self.say(
                            f"  {c.name} exited (code {rc}) and is not restarted: "
                            f"{self.last_error(c)}"
                        )
                        return
                    c.restarts += 1
                    self.say(
                        f"  {c.name} exited (code {rc}); restarting "
                        f"(logs: {self.log_dir / (c.name + '.log')})"
                    )
                    await asyncio.sleep(
                        self.backoff_s if time.monotonic() - c.started_at < 5 else 0
                    )
                    if not self.stopping:
                        await self.spawn(c)

    def kill_stalled(self) -> None:
        """SIGKILL each child whose health file has not been written for ``watchdog_s``
        (a child that has not written one yet is still starting: left alone); the restart
        follows as for a crash. SIGKILL ends a paused process too."""
        if self.watchdog_s <= 0 or self.stopping:
            return
        now = time.time()
        for c in self.children:
            if not c.alive():
                continue
            try:
                age = now - self.health_file(c).stat().st_mtime
            except OSError:
                continue
            if age > self.watchdog_s:
                self.say(
                    f"  {c.name} stalled (its loop silent for {age:.0f} s, watchdog "
                    f"{self.watchdog_s:g} s); killing it to restart it"
                )
                c.stalls += 1
                c.signal(signal.SIGKILL)

    def last_error(self, child: Child) -> str:
        """The last line of ``child``'s log that starts with ``error:`` (what a service that
        refuses to start says), or where its log is."""
        path = self.log_dir / f"{child.name}.log"
        with contextlib.suppress(OSError):
            for line in reversed(path.read_text(errors="replace").splitlines()[-50:]):
                if line.startswith("error: "):
                    return line.removeprefix("error: ")
        return f"see {path}"

    async def stop(self, timeout: float, order: list[str] | None = None) -> None:
        """SIGTERM children (in ``order`` of name prefixes first), wait, then SIGKILL."""
        self.stopping = True
        groups: list[list[Child]] = []
        rest = list(self.children)
        for prefix in order or []:
            g = [c for c in rest if c.name.startswith(prefix)]
            rest = [c for c in rest if c not in g]
            groups.append(g)
        groups.append(rest)
        for g in groups:
            live = [c for c in g if c.alive()]
            # One span for the group, not one per child in turn: children that do not stop
            # (a drain against a bus that is gone) took ``timeout`` each, one after another.
            await asyncio.gather(*(c.stopped(timeout) for c in live))
