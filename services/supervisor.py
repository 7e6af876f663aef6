"""The kit's process supervisor: start children, restart the ones that die (or stall: the
watchdog reads each child's health file), stop them in order. ``tokenbus up`` (the launcher),
``tokenbus serve bridge --processes N``, the benchmark's spawned stacks and the tests' stall
checks run their processes under it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Child:
    """One supervised process."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    proc: asyncio.subprocess.Process | None = None
    restarts: int = 0
    stalls: int = 0  # times the watchdog killed it
    started_at: float = 0.0


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
        log = open(self.log_dir / f"{child.name}.log", "ab")  # noqa: SIM115 - owned by the child
        env = {**os.environ, **child.env}
        if self.watchdog_s > 0:
            health = self.health_file(child)
            health.unlink(missing_ok=True)  # the last run's: this one's is awaited afresh
            env["TOKENBUS_HEALTH_FILE"] = str(health)
        child.proc = await asyncio.create_subprocess_exec(
            *child.argv, stdout=log, stderr=log, env=env, start_new_session=True
        )
        log.close()
        child.started_at = time.monotonic()

    async def add(self, child: Child) -> None:
        self.children.append(child)
        await self.spawn(child)

    async def watch(self) -> None:
        """Restart children that exit while not stopping."""
        while not self.stopping:
            # Woken by a child's exit (or once a second, for children added meanwhile),
            # not by polling: an idle stack's supervisor sleeps.
            exits = [asyncio.ensure_future(c.proc.wait()) for c in self.children if c.proc]
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
                if c.proc is not None and c.proc.returncode is not None:
                    rc = c.proc.returncode
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
            if c.proc is None or c.proc.returncode is not None:
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
                with contextlib.suppress(ProcessLookupError):
                    c.proc.kill()

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
            live = [c for c in g if c.proc is not None and c.proc.returncode is None]
            for c in live:
                with contextlib.suppress(ProcessLookupError):
                    c.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
            # One span for the group, not one per child in turn: children that do not stop
            # (a drain against a bus that is gone) took ``timeout`` each, one after another.
            await asyncio.gather(*(self._stopped(c, timeout) for c in live))

    @staticmethod
    async def _stopped(c: Child, timeout: float) -> None:
        """Until ``c`` (sent SIGTERM) exits, SIGKILL after ``timeout``."""
        proc = c.proc
        assert proc is not None
        try:
            await asyncio.wait_for(proc.wait(), timeout)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
