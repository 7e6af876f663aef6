"""The bare Python byte relay (``--peer pyrelay``): the floor ``tokenbus bench`` measures
beside vllm-router. Real processes: the engine server, the relay, the official SDK."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from engine_worker.backends.sim import expected_text
from tests.conftest import ROOT, Procs, free_port, stop_process, wait_http, wait_port

MSG = [{"role": "user", "content": "hello there"}]
PROMPT = "<|user|>hello there\n"
FAST = ("--sim-prefill-ms", "2", "--sim-decode-ms", "1")
RELAY = (sys.executable, "-m", "tokenbus.evaluation.pyrelay")


class Relay:
    """``python -m tokenbus.evaluation.pyrelay`` on a free port, in front of ``upstream``."""

    def __init__(self, upstream: str, log: Path) -> None:
        self.port = free_port()
        self._log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [*RELAY, "--port", str(self.port), "--upstream", upstream],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
        wait_port(self.port, 20)

    def stop(self) -> None:
        stop_process(self.proc)
        self._log.close()


@pytest.fixture
def relay_to() -> Iterator[list[Relay]]:
    """Relays a test starts; each stopped after it."""
    started: list[Relay] = []
    yield started
    for r in started:
        r.stop()


async def test_streams_pass_through_the_relay_as_the_engine_wrote_them(
    procs: Procs, relay_to: list[Relay], tmp_path: Path
) -> None:
    port = free_port()
    procs.start("engine", "serve", "openai-http", "--port", str(port), "--model", "m", *FAST)
    await wait_http(f"http://127.0.0.1:{port}/ready")
    relay = Relay(f"http://127.0.0.1:{port}", tmp_path / "relay.log")
    relay_to.append(relay)
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
    assert relay.proc.poll() is None


async def test_an_unreachable_upstream_closes_the_client_connection_at_once(
    relay_to: list[Relay], tmp_path: Path
) -> None:
    relay = Relay(f"http://127.0.0.1:{free_port()}", tmp_path / "relay.log")
    relay_to.append(relay)
    async with httpx.AsyncClient(timeout=10) as c:
        for _ in range(3):  # and it keeps accepting
            with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
                await c.get(f"http://127.0.0.1:{relay.port}/ready")
    assert relay.proc.poll() is None


def test_an_upstream_it_cannot_relay_to_is_refused_at_start() -> None:
    r = subprocess.run(
        [*RELAY, "--port", str(free_port()), "--upstream", "https://example.invalid"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=30,
    )
    assert r.returncode != 0
    assert "--upstream wants http://HOST:PORT" in r.stderr
