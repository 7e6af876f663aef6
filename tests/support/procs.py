"""Real tokenbus processes (``python -m tokenbus.cli serve ...``): one, a set, a stack."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import nats
import openai

from services.runtime import servers
from services.supervisor import Process
from tests.support import forkserver
from tests.support.ports import free_port, listened_by
from tests.support.repo import ROOT
from tests.support.waits import wait_for, wait_http, wait_replicas, wait_started


def _forked(p: Process) -> forkserver.Forked:
    """``p`` (``python -m tokenbus.cli <args>``) forked from the project already imported
    (tests/support/forkserver.py)."""
    assert p.log is not None and p.cwd is not None
    return forkserver.Forked(p.argv[3:], {**os.environ, **p.env}, p.log, cwd=p.cwd)


class Proc(Process):
    """A real tokenbus process (``python -m tokenbus.cli ...``) with its output in a file,
    started at once: the kit's :class:`~services.supervisor.Process`, forked when it can be."""

    def __init__(
        self,
        name: str,
        args: list[str],
        env: dict[str, str],
        log_dir: Path,
        prefix: Sequence[str] = (),
    ) -> None:
        # ``prefix``: what runs it elsewhere (``ip netns exec <host>``, which execs it: the
        # pid is still the process's own), a fresh process; so is every process when the
        # fork server is off.
        fresh = bool(prefix) or not forkserver.enabled()
        super().__init__(
            name,
            [*prefix, sys.executable, "-m", "tokenbus.cli", *args],
            env,
            log=log_dir / f"{name}.log",
            cwd=ROOT,
            spawn=None if fresh else _forked,
        )
        self.log: Path = log_dir / f"{name}.log"
        self.log.write_bytes(b"")  # this test's run only
        self.start()

    def output(self) -> str:
        return self.log.read_text(errors="replace")


class Procs:
    """Starts and always stops the processes of one test (``with Procs(...) as procs``)."""

    def __init__(self, url: str, log_dir: Path) -> None:
        self.url = url
        self.log_dir = log_dir
        self.env = {
            "TOKENBUS_NATS_URL": url,
            "TOKENBUS_LOG_LEVEL": "info",
            "TOKENBUS_DRAIN_TIMEOUT_S": "15",
            "TOKENBUS_WORKER__HEARTBEAT_INTERVAL_S": "0.2",
            # The safety stages are tested where a test starts them.
            "TOKENBUS_INGRESS__PIPELINE": '["route"]',
        }
        self.procs: list[Proc] = []

    def start(
        self,
        name: str,
        *args: str,
        env: dict[str, str] | None = None,
        prefix: Sequence[str] = (),
    ) -> Proc:
        p = Proc(name, list(args), {**self.env, **(env or {})}, self.log_dir, prefix)
        self.procs.append(p)
        return p

    def stop_all(self) -> None:
        """SIGTERM to every process, the last started first, then each waited for: their
        drains overlap. One after the other they added up: a worker on the locked bus gives
        its usage records 2 s to be acknowledged by a stream it may not reach (six seconds
        of every chaos test's thirteen processes), and a process may take seconds more to
        exit after it has drained."""
        for p in reversed(self.procs):
            p.terminate()
        for p in reversed(self.procs):
            p.stop()

    def all_alive(self) -> bool:
        return all(p.alive() for p in self.procs)

    def __enter__(self) -> Procs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()


def start_worker(
    procs: Procs, model: str, i: int | str, *args: str, env: dict[str, str] | None = None
) -> Proc:
    """A worker process ``worker-<i>`` serving ``model`` as replica ``<model>-<i>``."""
    cmd = ("serve", "worker", "--model", model, "--replica", f"{model}-{i}", *args)
    return procs.start(f"worker-{i}", *cmd, env=env)


class ProcStack:
    """The processes :func:`start_stack` started, by role, and the bridge's address."""

    def __init__(
        self, procs: Procs, model: str, roles: dict[str, list[Proc]], port: int | None
    ) -> None:
        self.procs = procs
        self.model = model
        self.roles = roles
        self.port = port

    @property
    def workers(self) -> list[Proc]:
        return self.roles.get("worker", [])

    @property
    def bridge(self) -> Proc:
        return self.roles["bridge"][0]

    @property
    def base(self) -> str:
        """The bridge's HTTP root."""
        return f"http://127.0.0.1:{self.port}"

    def openai(self, api_key: str = "unused") -> openai.AsyncOpenAI:
        """The openai SDK pointed at the bridge, without retries (they would hide errors)."""
        return openai.AsyncOpenAI(base_url=f"{self.base}/v1", api_key=api_key, max_retries=0)

    def http(self, path: str = "", **kw: Any) -> httpx.AsyncClient:
        """An httpx client for the bridge, rooted at ``path`` (``"/v1"``: the OpenAI API)."""
        return httpx.AsyncClient(base_url=self.base + path, **kw)

    def all_alive(self) -> bool:
        return self.procs.all_alive()


async def start_stack(
    procs: Procs,
    model: str,
    *services: str,
    workers: int = 1,
    worker_args: Sequence[str] = (),
    bridge: bool = True,
    bridge_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    env_for: Callable[[str, int], dict[str, str]] | None = None,
    heartbeats: bool = True,
    settle: float = 0.0,
    login: dict[str, Any] | None = None,
) -> ProcStack:
    """Real processes: ``services`` (``"ingress"``, ``"router"``, a stage; a name given twice
    runs twice), ``workers`` workers of ``model`` (:func:`start_worker`, ``worker_args``
    added), then the HTTP bridge on a free port. Each gets ``env`` and, over it,
    ``env_for(role, index)``. Returns once every replica heartbeats on the bus (unless
    ``heartbeats`` is off), every queue-group member has started and heard the others, the
    bridge is ready, and ``settle`` seconds more have passed (for what the test's services
    learn next). ``login``: nats-py's connect options for those waits (the admin role on a
    locked bus, whose anonymous client may listen to nothing)."""

    def env_of(role: str, i: int) -> dict[str, str]:
        return {**(env or {}), **(env_for(role, i) if env_for else {})}

    roles: dict[str, list[Proc]] = {}
    for role in services:
        i = len(roles.setdefault(role, []))
        name = f"{role}-{i}" if services.count(role) > 1 else role
        roles[role].append(procs.start(name, "serve", role, env=env_of(role, i)))
    roles["worker"] = [
        start_worker(procs, model, i, *worker_args, env=env_of("worker", i)) for i in range(workers)
    ]
    port = None
    if bridge:
        bridge_proc, port = start_bridge(procs, bridge_args, env_of("bridge", 0))
        roles["bridge"] = [bridge_proc]
    stack = ProcStack(procs, model, roles, port)
    if heartbeats and workers:
        await wait_replicas(procs.url, model, workers, **(login or {}))
    # Every queue-group member started (ingress, router, the stages) answers discovery once
    # its setup is done, then beats: until each has, not a guess at how long a start takes
    # on a loaded machine (a router slower than a 2 s settle once made "no route service").
    members: dict[str, int] = {}
    for role in services:
        if role in MEMBER_ROLES:
            members[role] = members.get(role, 0) + 1
    if heartbeats and members:
        nc = await nats.connect(servers(procs.url), dont_randomize=True, **(login or {}))
        # A router routes only to replicas it heard beat after it started (an idle one
        # beats every 2 s): until each has beaten once more, not a guess either.
        routed = workers if heartbeats and "router" in members else 0
        try:
            await wait_started(nc, members, model=model, replicas=routed, timeout=60)
        finally:
            await nc.drain()
    if bridge:
        await _wait_own_bridge(stack, procs, bridge_args, env_of("bridge", 0))
    await asyncio.sleep(settle)
    return stack


def start_bridge(procs: Procs, args: Sequence[str], env: dict[str, str]) -> tuple[Proc, int]:
    """An HTTP bridge on a free port: the process and its port."""
    port = free_port()
    return procs.start("bridge", "serve", "bridge", "--port", str(port), *args, env=env), port


async def _wait_own_bridge(
    stack: ProcStack, procs: Procs, args: Sequence[str], env: dict[str, str]
) -> None:
    """Until the stack's own bridge listens (the port's socket is its own) and is ready.
    Another test's server (parallel workers draw ports from one range) may take the free
    port between its draw and the bridge's bind: this bridge then exits, and the port
    answers for the other one, whose keys and models are not this test's (a CI run's test
    got 401 for its own key). It is started again on another port, a few times at most."""
    for _ in range(4):
        bridge = stack.roles["bridge"][0]
        port = stack.port or 0
        await wait_for(
            lambda b=bridge, p=port: not b.alive() or listened_by(b.pid, p),
            timeout=60,
            interval=0.05,
            what=f"the bridge listening on {port}",
        )
        if bridge.alive():
            await wait_http(f"{stack.base}/ready")
            return
        if "Address already in use" not in bridge.output():
            raise AssertionError(f"the bridge exited: {bridge.output()[-2000:]}")
        bridge.stop()
        procs.procs.remove(bridge)
        # Its log kept beside the next bridge's (which is written to ``bridge.log``).
        bridge.log = bridge.log.rename(bridge.log.with_name("bridge-port-taken.log"))
        stack.roles["bridge"][0], stack.port = start_bridge(procs, args, env)
    raise AssertionError("no free port for the bridge in four tries")


# The services whose instances are members of a queue group (services/members.py): they
# answer discovery as ``tokenbus-<role>`` and beat on the members' subjects.
MEMBER_ROLES = frozenset(("ingress", "router", "auth", "ratelimit", "filter"))
