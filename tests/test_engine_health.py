"""A worker whose engine dies or hangs (docs/deploy.md, "Engine health"): it says so in its
heartbeats and leaves routing, its streams move to another replica and end whole, and the
process exits with 75 for its supervisor to start again. The sim's engine is made to die
(SIGUSR1) or hang (SIGUSR2); real processes, a real nats-server, the openai SDK."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path
from typing import Any

import nats
import pytest

from bus_schemas import codec, subjects
from engine_worker.health import ENGINE_FAILED_EXIT
from services.runtime import check_health
from tests.support.procs import Procs, ProcStack, start_stack
from tests.support.waits import wait_for

pytestmark = pytest.mark.stack

ENV = {
    "TOKENBUS_WORKER__SIM__FAULT_SIGNALS": "true",
    "TOKENBUS_WORKER__SIM__DECODE_MS": "20",
    "TOKENBUS_WORKER__ENGINE_STUCK_S": "1.5",
    "TOKENBUS_WORKER__HEARTBEAT_INTERVAL_S": "0.2",
}
TOKENS = 60  # 1.2 s of decoding: long enough to be cut in the middle


async def stream(stack: ProcStack, i: int) -> tuple[str, int]:
    """One streamed answer through the bridge: its text and completion tokens."""
    async with stack.openai() as oai:
        parts: list[str] = []
        tokens = 0
        s = await oai.chat.completions.create(
            model=stack.model,
            messages=[{"role": "user", "content": f"engine health {i}"}],
            max_tokens=TOKENS,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for ch in s:
            for c in ch.choices:
                parts.append(c.delta.content or "")
            if ch.usage is not None:
                tokens = ch.usage.completion_tokens
        return "".join(parts), tokens


@pytest.mark.parametrize(("sig", "why"), [(signal.SIGUSR1, "died"), (signal.SIGUSR2, "made no")])
async def test_a_dead_or_hung_engine_leaves_routing_and_its_streams_move(
    procs: Procs, sig: signal.Signals, why: str
) -> None:
    model = f"health-{sig.name.lower()}"
    stack = await start_stack(procs, model, "ingress", "router", workers=2, env=ENV)
    sick = stack.workers[0]
    beats: list[dict[str, Any]] = []
    nc = await nats.connect(procs.url)
    try:

        async def on_beat(msg: Any) -> None:
            beats.append(codec.decode_map(msg.data))

        await nc.subscribe(subjects.heartbeat(model, f"{model}-0"), cb=on_beat)
        # Undisturbed answers first, to compare the moved ones with.
        want = await asyncio.gather(*(stream(stack, i) for i in range(8)))
        answers = asyncio.gather(*(stream(stack, i) for i in range(8)))
        await wait_for(
            lambda: any(b["in_flight"] > 0 for b in beats[-2:]),
            timeout=10,
            what="requests in flight on the first worker",
        )
        t0 = time.monotonic()
        sick.signal(sig)
        got = await answers
        # Every stream ended whole and as it would have: moved, not cut or repeated.
        assert got == want
        failed = [b for b in beats if b.get("health") == "failed"]
        assert failed and why in failed[0]["health_reason"], beats[-3:]
        assert failed[0]["draining"] is True
        await wait_for(lambda: not sick.alive(), timeout=30, what="the sick worker's exit")
        assert sick.proc.returncode == ENGINE_FAILED_EXIT, sick.output()[-2000:]
        assert time.monotonic() - t0 < 30
        log = [json.loads(x) for x in sick.output().splitlines() if x.startswith("{")]
        assert any(e.get("event") == "engine_failed" for e in log)
        # The other replica serves everything now.
        assert await stream(stack, 0) == want[0]
    finally:
        await nc.close()


def test_the_health_probe_fails_for_a_worker_whose_engine_failed(tmp_path: Path) -> None:
    path = tmp_path / "health.json"
    state = {"service": "worker", "ts": time.time(), "connected": True, "unhealthy": None}
    path.write_text(json.dumps(state))
    assert check_health(str(path), 30) is None
    state["unhealthy"] = "the engine died (vLLM's engine core; AsyncLLM.errored)"
    path.write_text(json.dumps(state))
    assert check_health(str(path), 30) == state["unhealthy"]
