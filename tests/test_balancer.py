"""The `gateways` profile's load balancer (compose/haproxy.cfg) as it is shipped, run by a real
HAProxy in front of two real bridges (no Docker: only its addresses are rewritten to these
processes'), with streaming clients through it while one bridge is killed (a crashed host):
requests that start after the crash are all served by the other bridge, none refused.
The same with the nemesis' own balancer, which stands in for HAProxy in its runs. The HAProxy
tests skip where no ``haproxy`` is installed (Debian's package; `.ci/run` installs it)."""

from __future__ import annotations

import asyncio
import re
import shutil
import signal
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.ports import free_port
from tests.support.procs import Procs, start_stack
from tests.support.repo import ROOT
from tests.support.waits import wait_for, wait_http
from tokenbus.evaluation.balancer import Balancer

pytestmark = pytest.mark.fault

HAPROXY = shutil.which("haproxy") or (
    "/usr/sbin/haproxy" if Path("/usr/sbin/haproxy").exists() else None
)
NO_HAPROXY = pytest.mark.skipif(HAPROXY is None, reason="no haproxy (Debian's haproxy package)")
CONFIG = ROOT / "compose" / "haproxy.cfg"
MSG = [{"role": "user", "content": "balanced"}]


def local_config(text: str, port: int, bridges: dict[str, int]) -> str:
    """The shipped config with this host's addresses: the bridges' ports for the compose
    services' names, the listening port, and no Docker DNS (the names are addresses here)."""
    text = re.sub(r"(?ms)^resolvers docker\n.*?\n\n", "", text)
    text = text.replace(" resolvers docker init-addr last,libc,none", "")
    text = text.replace("bind :8080", f"bind 127.0.0.1:{port}")
    for name, p in bridges.items():
        text, n = re.subn(rf"(server {name}) {name}:8000\b", rf"\1 127.0.0.1:{p}", text)
        assert n == 1, name
    return text


@NO_HAPROXY
def test_the_shipped_config_is_valid_and_checks_both_bridges_ready() -> None:
    text = CONFIG.read_text()
    assert "option httpchk GET /ready" in text and "http-check expect status 200" in text
    assert re.search(r"server bridge bridge:8000\b", text)
    assert re.search(r"server bridge-b bridge-b:8000\b", text)
    # A POST is never sent twice: only a failed connection is tried again.
    assert re.search(r"(?m)^\s*retry-on conn-failure\s*$", text)
    assert HAPROXY is not None
    r = subprocess.run([HAPROXY, "-c", "-f", str(CONFIG)], capture_output=True, text=True)
    # Valid; the compose services' names do not resolve here (a warning, not an error).
    assert r.returncode == 0 and "Configuration file is valid" in r.stdout, r.stderr


def _haproxy(cfg: Path, log: Path) -> subprocess.Popen[bytes]:
    """HAProxy run with ``cfg``, its output to ``log``."""
    assert HAPROXY is not None
    with open(log, "wb") as out:
        return subprocess.Popen([HAPROXY, "-f", str(cfg)], stdout=out, stderr=out)


@pytest.fixture
def haproxy_proc(tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    held: list[subprocess.Popen[bytes]] = []
    yield held
    for p in held:
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


@pytest.mark.parametrize(
    "front",
    [pytest.param("haproxy", marks=NO_HAPROXY), "harness"],
)
async def test_a_crashed_bridge_takes_no_new_request_with_it(
    procs: Procs,
    model: str,
    tmp_path: Path,
    haproxy_proc: list[subprocess.Popen[bytes]],
    front: str,
) -> None:
    """``haproxy``: compose/haproxy.cfg in a real HAProxy; ``harness``: the nemesis' own
    balancer (tokenbus/evaluation/balancer.py), which stands in for it there."""
    stack = await start_stack(
        procs,
        model,
        "ingress",
        "router",
        workers=2,
        worker_args=("--sim-decode-ms", "10"),
    )
    assert stack.port is not None
    second = free_port()
    other = procs.start("bridge-b", "serve", "bridge", "--port", str(second))
    await wait_http(f"http://127.0.0.1:{second}/ready")
    lb: Balancer | None = None
    if front == "haproxy":
        port = free_port()
        cfg = tmp_path / "haproxy.cfg"
        bridges = {"bridge": stack.port, "bridge-b": second}
        cfg.write_text(local_config(CONFIG.read_text(), port, bridges))
        haproxy_proc.append(_haproxy(cfg, tmp_path / "haproxy.log"))
    else:
        lb = Balancer.of([stack.port, second], check_every_s=0.2)
        port = await lb.start()
    await wait_http(f"http://127.0.0.1:{port}/ready")

    outcomes: Counter[str] = Counter()
    after: Counter[str] = Counter()  # requests that started after the crash
    errors: list[str] = []
    crashed = asyncio.Event()
    stop = asyncio.Event()

    async def client() -> None:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}/v1", timeout=30) as h:
            while not stop.is_set():
                late = crashed.is_set()
                body: dict[str, Any] = {
                    "model": model,
                    "messages": MSG,
                    "max_tokens": 12,
                    "stream": True,
                }
                try:
                    async with h.stream("POST", "/chat/completions", json=body) as r:
                        text = (await r.aread()).decode()
                    ok = r.status_code == 200 and text.rstrip().endswith("data: [DONE]")
                    what = "ok" if ok else f"http_{r.status_code}"
                except httpx.HTTPError as exc:
                    what = type(exc).__name__
                (after if late else outcomes)[what] += 1
                if what != "ok":
                    errors.append(f"{'after' if late else 'before'}: {what}")

    tasks = [asyncio.create_task(client()) for _ in range(4)]
    try:
        await wait_for(lambda: outcomes["ok"] >= 8, timeout=60, what="no load through it")
        stack.bridge.signal(signal.SIGKILL)  # a crashed host: refused from now on
        # Requests sent before it was gone may be cut with it (their bytes were with it):
        # "after" counts those sent once nothing of it is left.
        await wait_for(lambda: not stack.bridge.alive(), timeout=10, what="the bridge lived")
        crashed.set()
        await wait_for(lambda: after["ok"] >= 24, timeout=60, what="not served after the crash")
        stop.set()
        await asyncio.gather(*tasks)
    finally:
        stop.set()
        for t in tasks:
            t.cancel()
        if lb is not None:
            await lb.stop()
    print(f"\nthrough the balancer: before the crash {dict(outcomes)}, after {dict(after)}")
    # Streams open on the killed bridge may be cut (their bytes were with it); every request
    # that started after the crash was served by the other bridge.
    assert set(after) == {"ok"}, errors[:5]
    assert other.alive()
