"""A rolling upgrade of every role under streaming load fails no request (docs/deploy.md,
"Zero-downtime upgrade"): two copies of each stage, two workers and two bridges on real
processes; 16 HTTP clients stream through the bridges, picking one that says it is ready
as a load balancer's health check would, and 16 NATS clients stream through every stage;
meanwhile each copy of each role in turn gets SIGTERM (it drains), exits, and a new copy
starts and is ready before the next. Every answer must be whole."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import time
from typing import Any

import httpx
import nats
import pytest

from tests.support.busdata import key_store
from tests.support.ports import free_port
from tests.support.procs import Proc, Procs, start_worker
from tests.support.waits import wait_for, wait_http, wait_replicas, wait_started
from tokenbus import Client

pytestmark = pytest.mark.stack

STAGES = ("ingress", "auth", "ratelimit", "filter", "router")
ENV = {
    "TOKENBUS_INGRESS__PIPELINE": '["auth", "ratelimit", "filter", "route"]',
    "TOKENBUS_BRIDGE__UNREADY_S": "1.5",  # the balancer below checks every 0.2 s
    "TOKENBUS_WORKER__SIM__DECODE_MS": "20",
}
TOKENS = 30  # 0.6 s of decoding a stream: many are open at each restart
MSG = [{"role": "user", "content": "rolling"}]


class Balancer:
    """What a load balancer in front of the bridges does: health checks on /ready every
    :data:`CHECK_EVERY_S`, requests only to bridges that passed the last one, round robin."""

    CHECK_EVERY_S = 0.2  # its health-check period: the timer this test runs against, small

    def __init__(self, ports: list[int]) -> None:
        self.ports = ports
        self.ready: dict[int, bool] = dict.fromkeys(ports, False)
        self._turn = 0
        self._task: asyncio.Task[None] | None = None

    async def _check(self) -> None:
        async with httpx.AsyncClient(timeout=1) as h:
            while True:
                for port in list(self.ports):
                    try:
                        r = await h.get(f"http://127.0.0.1:{port}/ready")
                        self.ready[port] = r.status_code == 200
                    except httpx.HTTPError:
                        self.ready[port] = False
                await asyncio.sleep(self.CHECK_EVERY_S)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._check())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def _up(self) -> list[int]:
        return [p for p in self.ports if self.ready.get(p)]

    async def pick(self) -> int:
        await wait_for(lambda: self._up(), timeout=30, what="a bridge that passed its check")
        up = self._up()
        self._turn += 1
        return up[self._turn % len(up)]


async def test_a_rolling_upgrade_of_every_role_under_streaming_load_fails_no_request(
    procs: Procs, model: str
) -> None:
    async with key_store(procs.url) as keys:
        key, _ = await keys.create("rolling", models=[model])
    started: dict[str, list[Proc]] = {}
    commands: dict[str, tuple[str, ...]] = {}

    def start(role: str, i: int, *args: str) -> Proc:
        name = f"{role}-{i}"
        commands[name] = args
        p = procs.start(f"{name}-{len(started.get(name, []))}", *args, env=ENV)
        started.setdefault(name, []).append(p)
        return p

    for role in STAGES:
        for i in range(2):
            start(role, i, "serve", role)
    for i in range(2):
        commands[f"worker-{i}"] = ()
        started[f"worker-{i}"] = [start_worker(procs, model, i, env=ENV)]
    ports = [free_port(), free_port()]
    for i, port in enumerate(ports):
        start("bridge", i, "serve", "bridge", "--port", str(port))
    nc = await nats.connect(procs.url)
    try:
        await wait_replicas(procs.url, model, 2)
        await wait_started(nc, dict.fromkeys(STAGES, 2), timeout=60)
        for port in ports:
            await wait_http(f"http://127.0.0.1:{port}/ready")
    finally:
        await nc.close()

    lb = Balancer(ports)
    lb.start()
    done = asyncio.Event()
    served = {"http": 0, "nats": 0}
    failures: list[str] = []

    async def over_http() -> None:
        async with httpx.AsyncClient(timeout=60) as h:
            while not done.is_set():
                port = await lb.pick()
                body = {"model": model, "messages": MSG, "max_tokens": TOKENS, "stream": True,
                        "stream_options": {"include_usage": True}, "ignore_eos": True}  # fmt: skip
                try:
                    usage: dict[str, Any] = {}
                    async with h.stream(
                        "POST",
                        f"http://127.0.0.1:{port}/v1/chat/completions",
                        json=body,
                        headers={"Authorization": f"Bearer {key}"},
                    ) as r:
                        if r.status_code != 200:
                            failures.append(f"http {r.status_code}: {(await r.aread())[:200]!r}")
                            continue
                        async for line in r.aiter_lines():
                            if line.startswith('data: {"error"'):
                                failures.append(f"http stream: {line[:200]}")
                            elif '"usage"' in line and '"completion_tokens"' in line:
                                usage = httpx.Response(200, content=line[6:]).json()["usage"]
                    if usage.get("completion_tokens") != TOKENS:
                        failures.append(f"http: usage {usage}")
                    else:
                        served["http"] += 1
                except httpx.HTTPError as exc:
                    failures.append(f"http {port}: {exc!r}")

    async def over_nats(client: Client) -> None:
        while not done.is_set():
            try:
                out = await client.chat(
                    model, MSG, max_tokens=TOKENS, api_key=key, ignore_eos=True
                ).collect()  # streamed, frame by frame
                assert out.usage.completion_tokens == TOKENS, out.usage
                served["nats"] += 1
            except Exception as exc:
                failures.append(f"nats: {exc!r}")

    client = await Client.connect(procs.url)
    tasks = [asyncio.create_task(over_http()) for _ in range(16)]
    tasks += [asyncio.create_task(over_nats(client)) for _ in range(16)]
    restarted: list[str] = []
    t0 = time.monotonic()
    try:
        for name in ["worker-0", "worker-1", *(f"{r}-{i}" for r in STAGES for i in range(2)),
                     "bridge-0", "bridge-1"]:  # fmt: skip
            old = started[name][-1]
            before = dict(served)
            old.signal(signal.SIGTERM)
            try:
                rc = await asyncio.to_thread(old.proc.wait, 60)
            except subprocess.TimeoutExpired:
                # Where it waits (SIGUSR1: every task's awaits, in its log).
                old.signal(signal.SIGUSR1)
                with contextlib.suppress(AssertionError):
                    await wait_for(lambda o=old: '"task_stack"' in o.output(), timeout=10)
                stacks = [x for x in old.output().splitlines() if '"task_stack"' in x]
                raise AssertionError(
                    f"{name} did not exit within 60 s of SIGTERM; its tasks:\n"
                    + "\n".join(stacks)[-8000:]
                ) from None
            assert rc == 0, (name, old.output()[-2000:])
            role, _, idx = name.rpartition("-")
            if role == "worker":
                started[name].append(start_worker(procs, model, int(idx), env=ENV))
                await wait_replicas(procs.url, model, 2)
            else:
                new = start(role, int(idx), *commands[name])
                if role == "bridge":
                    await wait_http(f"http://127.0.0.1:{ports[int(idx)]}/ready")
                else:
                    nc = await nats.connect(procs.url)
                    try:
                        await wait_started(nc, {role: 2}, timeout=60)
                    finally:
                        await nc.close()
                assert new.alive(), new.output()[-2000:]
            # Traffic went on meanwhile.
            await wait_for(
                lambda b=before: served["http"] > b["http"] and served["nats"] > b["nats"],
                timeout=20,
                what=f"streams served after {name}'s restart ({served}, {failures[:3]})",
            )
            restarted.append(name)
    finally:
        done.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await lb.stop()
        await client.close()
    assert len(restarted) == 14, restarted  # 2 workers, 2 of each of 5 stages, 2 bridges
    assert not failures, (len(failures), failures[:5])
    assert served["http"] > 100 and served["nats"] > 100, served
    print(f"rolling upgrade: {served} in {time.monotonic() - t0:.0f} s, 0 failed")
