"""The sim engine: deterministic text, stop sequences, batching limits, TP, cancel."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine_worker.backends.base import GenerationRequest
from engine_worker.backends.sim import SimEngine, expected_text
from services.config import SimSettings


def req(prompt: str = "hello", max_tokens: int = 8, **kw: object) -> GenerationRequest:
    return GenerationRequest(
        request_id="r", kind="completions", model="m", max_tokens=max_tokens, prompt=prompt, **kw
    )  # type: ignore[arg-type]


async def collect(engine: SimEngine, r: GenerationRequest) -> tuple[str, str, int, int]:
    text, tokens = "", 0
    async for d in engine.generate(r):
        text += d.text
        tokens += d.tokens
        if d.finish_reason:
            return text, d.finish_reason, d.completion_tokens, d.prompt_tokens
    raise AssertionError("no finish")


def fast(**kw: float) -> SimSettings:
    return SimSettings(**{"prefill_ms": 1.0, "decode_ms": 1.0, **kw})  # type: ignore[arg-type]


async def test_text_is_a_pure_function_of_prompt_and_seed() -> None:
    e = SimEngine(fast())
    a = await collect(e, req("hello", 12))
    b = await collect(e, req("hello", 12))
    c = await collect(e, req("hello", 12, seed=7))
    assert a == b
    assert a[0] != c[0]
    assert a[0] == expected_text("hello", 12)[0]
    assert a[1] == "length" and a[2] == 12


async def test_stop_sequence_ends_with_stop_and_never_leaks_it() -> None:
    e = SimEngine(fast())
    full, _ = expected_text("hello", 20)
    words = full.split(" ")
    stop = " " + words[5]
    text, reason, _, _ = await collect(e, req("hello", 20, stop=[stop]))
    assert reason == "stop"
    assert stop not in text
    assert text == full[: full.find(stop)]


async def test_prefill_and_decode_times_follow_the_model() -> None:
    e = SimEngine(SimSettings(prefill_ms=30, decode_ms=10))
    t0 = time.perf_counter()
    first = None
    async for d in e.generate(req("x", 5)):
        if first is None and d.text:
            first = time.perf_counter() - t0
    total = time.perf_counter() - t0
    assert first is not None and first >= 0.029
    assert total >= 0.029 + 4 * 0.0099


def test_tensor_parallel_speeds_steps_up_with_a_communication_cost() -> None:
    cfg = SimSettings(decode_ms=10, tp_comm_ms=0.5, tp_efficiency=0.5)
    tp1, tp4 = SimEngine(cfg, tp=1), SimEngine(cfg, tp=4)
    assert tp4.step_s(1) == pytest.approx(0.010 / 2.5 + 0.0005)
    assert tp1.step_s(1) == pytest.approx(0.010)
    grow = SimEngine(SimSettings(decode_ms=10, decode_ms_per_seq=0.1))
    assert grow.step_s(100) == pytest.approx(0.020)


async def test_max_running_queues_the_rest() -> None:
    e = SimEngine(fast(max_running=2))
    gens = [e.generate(req(f"p{i}", 50)) for i in range(5)]
    await asyncio.sleep(0.01)
    st = e.stats()
    assert st["running"] == 2 and st["waiting"] == 3
    for g in gens:
        await g.aclose()
    assert e.stats() == {"running": 0, "waiting": 0, "kv_usage": 0.0}


async def test_closing_a_stream_cancels_the_sequence() -> None:
    e = SimEngine(fast())
    g = e.generate(req("p", 10_000))
    async for d in g:
        assert d.text
        break
    await g.aclose()
    assert e.stats()["running"] == 0


async def test_slow_consumer_gets_coalesced_chunks_but_every_token() -> None:
    e = SimEngine(fast(decode_ms=1))
    g = e.generate(req("p", 40))
    chunks, text = 0, ""
    async for d in g:
        text += d.text
        chunks += 1 if d.text else 0
        await asyncio.sleep(0.01)  # ten steps per read
        if d.finish_reason:
            assert d.completion_tokens == 40
    assert chunks < 40
    assert text == expected_text("p", 40)[0]


async def test_many_sequences_share_steps() -> None:
    e = SimEngine(fast(decode_ms=5))
    outs = await asyncio.gather(*(collect(e, req(f"p{i}", 20)) for i in range(200)))
    assert all(o[2] == 20 for o in outs)
    # 200 sequences decode together: about 20 steps, not 4000.
    assert e.steps < 60
