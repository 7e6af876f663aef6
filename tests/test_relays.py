"""The floors ``tokenbus bench`` measures beside vllm-router: the bare Python byte relay
(``--peer pyrelay``) and the bare byte tunnel through nats-server (``--peer busrelay``).
Real processes: the engine server, the relays, a real nats-server, the official SDK."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import httpx
import nats
import openai
import pytest
from nats.aio.msg import Msg

from engine_worker.backends.sim import expected_text
from tests.support.natsserver import NatsServer
from tests.support.pids import stop_process
from tests.support.ports import free_port, wait_port
from tests.support.procs import Procs
from tests.support.repo import ROOT
from tests.support.waits import wait_for, wait_http
from tokenbus.evaluation.busrelay import BACK_READY
from tokenbus.launcher import port_open

pytestmark = pytest.mark.stack

MSG = [{"role": "user", "content": "hello there"}]
PROMPT = "<|user|>hello there\n"
FAST = ("--sim-prefill-ms", "2", "--sim-decode-ms", "1")
PYRELAY = (sys.executable, "-m", "tokenbus.evaluation.pyrelay")
BUSRELAY = (sys.executable, "-m", "tokenbus.evaluation.busrelay")


class Relay:
    """A relay's processes, the last of them listening on ``port`` for clients."""

    def __init__(self, log_dir: Path) -> None:
        self.port = free_port()
        self._log_dir = log_dir
        self.procs: list[subprocess.Popen[bytes]] = []
        self._logs: list[IO[bytes]] = []

    def start(self, name: str, *argv: str) -> subprocess.Popen[bytes]:
        log = open(self._log_dir / f"{name}.log", "wb")  # noqa: SIM115 - closed in stop()
        self._logs.append(log)
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        self.procs.append(proc)
        return proc

    def running(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def stop(self) -> None:
        for p in reversed(self.procs):
            stop_process(p)
        for log in self._logs:
            log.close()


class Relays:
    """The relays a test starts: ``start(kind, upstream, fronts)`` starts a relay of
    ``kind`` (``pyrelay``, or ``busrelay`` on the test's own nats-server) and returns the
    processes clients connect to; every one is stopped after the test."""

    def __init__(self, log_dir: Path, bus: str) -> None:
        self._log_dir = log_dir
        self._bus = bus
        self.all: list[Relay] = []

    def start(self, kind: str, upstream: str, fronts: int = 1) -> list[Relay]:
        out = []
        if kind == "pyrelay":
            r = Relay(self._log_dir)
            r.start("pyrelay", *PYRELAY, "--port", str(r.port), "--upstream", upstream)
            out.append(r)
        else:
            back = Relay(self._log_dir)
            back.start("back", *BUSRELAY, "back", "--nats", self._bus, "--upstream", upstream)
            self.all.append(back)
            for i in range(fronts):
                r = Relay(self._log_dir)
                argv = ("front", "--nats", self._bus, "--port", str(r.port))
                r.start(f"front{i}", *BUSRELAY, *argv)
                out.append(r)
        self.all.extend(out)
        for r in out:
            wait_port(r.port, 20)
        return out

    def running(self) -> bool:
        return all(r.running() for r in self.all)


@pytest.fixture
def relays(tmp_path: Path, private_nats: NatsServer) -> Iterator[Relays]:
    rs = Relays(tmp_path, private_nats.url)
    yield rs
    for r in rs.all:
        r.stop()


async def _engine(procs: Procs) -> str:
    port = free_port()
    procs.start("engine", "serve", "openai-http", "--port", str(port), "--model", "m", *FAST)
    await wait_http(f"http://127.0.0.1:{port}/ready")
    return f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("kind", ["pyrelay", "busrelay"])
async def test_streams_pass_through_the_relay_as_the_engine_wrote_them(
    procs: Procs, relays: Relays, kind: str
) -> None:
    (relay,) = relays.start(kind, await _engine(procs))
    # One client, several requests: its keep-alive connection stays paired with its own
    # upstream connection; streamed and whole answers, as the engine wrote them.
    async with openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{relay.port}/v1", api_key="none", max_retries=0
    ) as c:
        for n in (5, 17):
            s = await c.chat.completions.create(model="m", messages=MSG, max_tokens=n, stream=True)
            text = "".join([ch.choices[0].delta.content or "" async for ch in s if ch.choices])
            assert text == expected_text(PROMPT, n)[0]
        out = await c.chat.completions.create(model="m", messages=MSG, max_tokens=3)
        assert out.choices[0].message.content == expected_text(PROMPT, 3)[0]
        # An error answer is relayed too, status and body.
        with pytest.raises(openai.NotFoundError):
            await c.chat.completions.create(model="not-served", messages=MSG, max_tokens=3)
    assert relays.running()


async def test_the_tunnel_brings_each_front_its_own_streams(procs: Procs, relays: Relays) -> None:
    """Two front processes share one back: every batch the back sends goes to the front
    whose clients it belongs to, many streams at once, each answer whole and in order."""
    fronts = relays.start("busrelay", await _engine(procs), fronts=2)

    async def one(port: int, n: int) -> str:
        async with openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0
        ) as c:
            s = await c.chat.completions.create(model="m", messages=MSG, max_tokens=n, stream=True)
            return "".join([ch.choices[0].delta.content or "" async for ch in s if ch.choices])

    lengths = [3 + i % 20 for i in range(24)]
    got = await asyncio.gather(*(one(fronts[i % 2].port, n) for i, n in enumerate(lengths)))
    assert got == [expected_text(PROMPT, n)[0] for n in lengths]


async def test_a_front_listens_only_once_a_back_answers(
    procs: Procs, tmp_path: Path, private_nats: NatsServer
) -> None:
    """Before a back process is on the bus, what a client sent would reach nobody and the
    client would hang: the front does not listen until one answers."""
    engine = await _engine(procs)
    front, back = Relay(tmp_path), Relay(tmp_path)
    # The front's calls for a back, heard (and left unanswered) by the test.
    asks: list[Msg] = []

    async def heard(msg: Msg) -> None:
        asks.append(msg)

    nc = await nats.connect(private_nats.url)
    try:
        await nc.subscribe(BACK_READY, cb=heard)
        await nc.flush()
        bus = ("--nats", private_nats.url)
        front.start("front", *BUSRELAY, "front", *bus, "--port", str(front.port))
        # Until the front has called for a back, found none and called again.
        await wait_for(
            lambda: len(asks) >= 2 or not front.running(), timeout=30, what="no call for a back"
        )
        await nc.close()
        assert front.running() and not port_open("127.0.0.1", front.port)
        back.start("back", *BUSRELAY, "back", *bus, "--upstream", engine)
        wait_port(front.port, 20)
        async with httpx.AsyncClient(timeout=10) as c:
            r = await c.get(f"http://127.0.0.1:{front.port}/ready")
        assert r.status_code == 200
    finally:
        await nc.close()
        front.stop()
        back.stop()


@pytest.mark.parametrize("kind", ["pyrelay", "busrelay"])
async def test_an_unreachable_upstream_closes_the_client_connection_at_once(
    relays: Relays, kind: str
) -> None:
    (relay,) = relays.start(kind, f"http://127.0.0.1:{free_port()}")
    async with httpx.AsyncClient(timeout=10) as c:
        for _ in range(3):  # and it keeps accepting
            with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
                await c.get(f"http://127.0.0.1:{relay.port}/ready")
    assert relays.running()


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (
            [*PYRELAY, "--port", "1", "--upstream", "https://example.invalid"],
            "--upstream wants http://HOST:PORT",
        ),
        (
            [*BUSRELAY, "back", "--nats", "nats://127.0.0.1:1", "--upstream", "ftp://x"],
            "--upstream wants http://HOST:PORT",
        ),
        ([*BUSRELAY, "front", "--nats", "nats://127.0.0.1:1"], "front needs --port"),
    ],
)
def test_a_relay_it_cannot_start_is_refused_at_start(argv: list[str], says: str) -> None:
    r = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=30)
    assert r.returncode == 2
    assert says in r.stderr
