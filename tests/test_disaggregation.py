"""Prefill/decode disaggregation (issue 51, docs/disaggregation.md): replicas announce a role,
the router decides per request by the prompt's uncached tokens, a prefill replica computes the
prompt and hands its KV cache over (vLLM's ``kv_transfer_params``), a decode replica answers;
the sim models chunked prefill and the transfer. Real nats-server, real processes, the
official openai SDK."""

from __future__ import annotations

import asyncio
import json
import re
import signal
from typing import Any

import httpx
import nats
import openai
import pytest

from bus_schemas import subjects
from engine_worker.backends.base import GenerationRequest
from engine_worker.backends.sim import SimEngine, _Seq, count_tokens
from services.config import SimSettings
from tests.support.procs import Procs, start_stack, start_worker
from tests.support.waits import live_replicas, wait_for

pytestmark = pytest.mark.fault

LONG = "a long document to read " * 400  # about 2 400 tokens to the sim
SHORT = "hi"
# Prefill 0.2 ms a prompt token (a long prompt: about half a second), a token every 10 ms.
SIM = ("--sim-prefill-ms-per-token", "0.2", "--sim-decode-ms", "10")
ENV = {
    "TOKENBUS_INGRESS__PIPELINE": '["route"]',
    "TOKENBUS_ROUTER__PD_MIN_PROMPT_TOKENS": "512",
    "TOKENBUS_ROUTER__PD_PREFILL_TIMEOUT_S": "3",
    # An idle replica beats every second (four intervals), so the test hears each soon.
    "TOKENBUS_WORKER__HEARTBEAT_INTERVAL_S": "0.25",
}


def _req(text: str, n: int, **extra: Any) -> GenerationRequest:
    return GenerationRequest(
        request_id="r",
        kind="chat",
        model="m",
        max_tokens=n,
        messages=[{"role": "user", "content": text}],
        extra={"ignore_eos": True, **extra},
    )


async def test_the_sim_models_chunked_prefill_and_the_kv_hand_over() -> None:
    """With chunked prefill a long prompt in the batch stretches the running sequences'
    steps (what disaggregation takes away); a prefill's last delta hands its blocks over,
    and a decode engine given them reads the prompt instead of computing it. (The model's
    times are read from the engine's plan, not from a clock.)"""
    cfg = {"decode_ms": 5, "prefill_ms_per_token": 0.2, "answer_tokens_median": 0}
    chunked = SimEngine(SimSettings(**cfg, chunked_prefill_tokens=256))
    running, prompt = _Seq(1, 10, 40), _Seq(2, 2400, 1)
    running.emitted = 3
    prompt.left = 2400
    chunked.running, chunked.prefilling = [running], [prompt]
    chunked._plan_step(100.0)
    # The step beside the long prompt computes 255 of its tokens: 5 + 51 ms, not 5.
    assert chunked._step_end == pytest.approx(100.0 + (5 + 0.2 * 255) / 1000)
    assert prompt.left == 2400 - 255 and chunked._finishing == []
    chunked._step_end, chunked.prefilling = 0.0, []
    chunked._plan_step(100.0)
    assert chunked._step_end == pytest.approx(100.0 + 5 / 1000)  # decode alone
    # Its last chunk: the prompt gives its first token at that step's end.
    prompt.left = 100
    chunked._step_end, chunked.prefilling = 0.0, [prompt]
    chunked._plan_step(100.0)
    assert chunked._finishing == [prompt] and not chunked.prefilling

    prefill = SimEngine(SimSettings(**cfg))
    ask = {"do_remote_decode": True}
    out = [d async for d in prefill.generate(_req(LONG, 1, kv_transfer_params=ask))]
    kvt = out[-1].kv_transfer_params
    assert kvt is not None and kvt["do_remote_prefill"] is True
    assert kvt["remote_engine_id"] == prefill.engine_id
    assert len(kvt["remote_block_ids"]) == -(-out[-1].prompt_tokens // 16)
    # Without a hand-over asked, none is made.
    plain = [d async for d in prefill.generate(_req(SHORT, 1))]
    assert plain[-1].kv_transfer_params is None
    decode = SimEngine(SimSettings(**cfg, chunked_prefill_tokens=256))
    stream = decode.generate(_req(LONG, 3, kv_transfer_params=kvt))
    tokens = out[-1].prompt_tokens
    # Read over the link (2 400 tokens of 128 KiB at 25 GB/s: about 13 ms), not computed
    # (0.2 ms a token: about 480 ms).
    assert stream.seq.remote and stream.seq.prefill_s == pytest.approx(decode.transfer_s(tokens))
    assert decode.transfer_s(tokens) < decode.prefill_s(tokens) / 10
    handed = [d async for d in stream]
    whole = [d async for d in SimEngine(SimSettings(**cfg)).generate(_req(LONG, 3))]
    # The answer a whole run gives, and the prompt counted as the client's.
    assert "".join(d.text for d in handed) == "".join(d.text for d in whole)
    assert handed[-1].prompt_tokens == whole[-1].prompt_tokens


async def _decisions(base: str) -> dict[str, float]:
    async with httpx.AsyncClient() as h:
        text = (await h.get(f"{base}/metrics")).text
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(r'tokenbus_pd_decisions_total\{decision="(\w+)"\} ([0-9.]+)', text)
    }


@pytest.fixture
async def pd_stack(procs: Procs, model: str) -> Any:
    """The bridge (routing in-process), one prefill replica and two decode replicas."""
    prefill = start_worker(procs, model, "p0", "--pd-role", "prefill", *SIM, env=ENV)
    decode = [
        start_worker(procs, model, f"d{i}", "--pd-role", "decode", *SIM, env=ENV) for i in range(2)
    ]
    stack = await start_stack(procs, model, workers=0, env=ENV)

    async def all_heard() -> bool:
        # Beats heard after the bridge was ready: its router heard them too.
        beats = await live_replicas(procs.url, model, wait=1.5)
        return sorted(hb.get("pd_role") for hb in beats.values()) == ["decode"] * 2 + ["prefill"]

    await wait_for(all_heard, timeout=60, what="both pools heard")
    yield stack, prefill, decode


async def _answer(oai: openai.AsyncOpenAI, model: str, prompt: str, n: int = 12) -> tuple[str, Any]:
    out = await oai.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=n,
        extra_body={"ignore_eos": True},
    )
    return out.choices[0].message.content or "", out.usage


async def test_a_long_prompt_is_prefilled_on_one_replica_and_decoded_on_another(
    pd_stack: Any, model: str
) -> None:
    stack, prefill, decode = pd_stack
    async with stack.openai() as oai:
        out = await oai.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": LONG}],
            max_tokens=12,
            extra_body={"ignore_eos": True},
        )
        text, usage = out.choices[0].message.content or "", out.usage
        assert usage is not None
        assert usage.completion_tokens == 12 and usage.prompt_tokens > 2000
        got = await _decisions(stack.base)
        assert got.get("disaggregated") == 1, got
        # The prefill ran under an id of its own (its telemetry record is not the answer's),
        # the decode under the request's.
        rid = out.id.removeprefix("chatcmpl-")

        def served(w: Any) -> set[str]:
            return {
                e.get("request_id", "")
                for e in map(json.loads, w.output().splitlines())
                if e.get("event") == "request"
            }

        await wait_for(lambda: f"{rid}.prefill" in served(prefill), what="the prefill's log")
        assert any(rid in served(w) for w in decode)
        # Streamed: one stream to the client, its first token from the decode replica.
        chunks = [
            c.choices[0].delta.content or ""
            async for c in await oai.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": LONG}],
                max_tokens=12,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            if c.choices
        ]
        assert "".join(chunks) == text  # the answer a whole run would give, whole
        short, _ = await _answer(oai, model, SHORT)
        assert short
        got = await _decisions(stack.base)
        assert got.get("disaggregated") == 2 and got.get("aggregated_short") == 1, got


async def test_a_hand_over_never_crosses_a_site(procs: Procs, model: str) -> None:
    """A prefill replica at site x and a decode replica only at site y: the KV cache would
    cross the sites' link, so the request runs whole at y (router.pd_cross_site is off).
    With a decode replica at x too, requests are disaggregated and decoded at x, never y."""
    start_worker(procs, model, "p0", "--pd-role", "prefill", *SIM, env=ENV | {"TOKENBUS_SITE": "x"})
    far = start_worker(
        procs, model, "d0", "--pd-role", "decode", *SIM, env=ENV | {"TOKENBUS_SITE": "y"}
    )
    stack = await start_stack(procs, model, workers=0, env=ENV)

    async def heard(roles: list[str]) -> bool:
        beats = await live_replicas(procs.url, model, wait=1.5)
        return sorted(hb.get("pd_role") for hb in beats.values()) == roles

    await wait_for(lambda: heard(["decode", "prefill"]), timeout=60, what="both sites heard")

    def decoded(w: Any) -> int:
        return sum(
            1
            for e in map(json.loads, w.output().splitlines())
            if e.get("event") == "request" and not e.get("request_id", "").endswith(".prefill")
        )

    async with stack.openai() as oai:
        whole, _ = await _answer(oai, model, LONG)
        got = await _decisions(stack.base)
        assert got.get("aggregated_other_site") == 1 and not got.get("disaggregated"), got
        await wait_for(lambda: decoded(far) >= 1, what="site y's replica's whole answer")
        far_before = decoded(far)
        near = start_worker(
            procs, model, "d1", "--pd-role", "decode", *SIM, env=ENV | {"TOKENBUS_SITE": "x"}
        )
        await wait_for(
            lambda: heard(["decode", "decode", "prefill"]), timeout=60, what="site x's decode"
        )
        for n in range(1, 5):
            text, _ = await _answer(oai, model, LONG)
            assert text == whole
            got = await _decisions(stack.base)
            assert got.get("disaggregated") == n, got
    await wait_for(lambda: decoded(near) == 4, what="site x's decode replica's four answers")
    assert decoded(far) == far_before  # no hand-over decoded across the sites


async def test_a_stalled_or_lost_prefill_replica_leaves_the_request_whole(
    pd_stack: Any, model: str
) -> None:
    """Paused (SIGSTOP), the prefill replica acknowledges nothing: the request runs whole on
    a decode replica after the dispatch's wait; killed (-9), its requests find no responder
    and the same happens at once. The caller only sees its answer."""
    stack, prefill, _decode = pd_stack
    async with stack.openai() as oai:
        want, _ = await _answer(oai, model, LONG)
        prefill.signal(signal.SIGSTOP)
        try:
            got, usage = await _answer(oai, model, LONG)
        finally:
            prefill.signal(signal.SIGCONT)
        assert got == want and usage.completion_tokens == 12
        decided = await _decisions(stack.base)
        assert decided.get("aggregated_after_failure") == 1, decided
        prefill.signal(signal.SIGKILL)
        got, _ = await _answer(oai, model, LONG)
        assert got == want


async def test_a_decode_replica_lost_mid_answer_moves_it_as_any_other(
    pd_stack: Any, model: str
) -> None:
    """A decode replica killed mid-stream: the answer goes on elsewhere (migration), whole
    and without a repeat."""
    stack, _prefill, decode = pd_stack
    async with stack.openai() as oai:
        want, _ = await _answer(oai, model, LONG, 150)
        parts: list[str] = []
        stream = await oai.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": LONG}],
            max_tokens=150,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        by_replica = {f"{model}-d{i}": w for i, w in enumerate(decode)}
        async for c in stream:
            if c.choices:
                parts.append(c.choices[0].delta.content or "")
            if len(parts) == 20:
                # The decode replica that holds it says so in its heartbeats (in flight).
                holder: list[str] = []

                async def held(holder: list[str] = holder) -> bool:
                    beats = await live_replicas(stack.procs.url, model)
                    holder[:] = [
                        r for r, hb in beats.items() if hb.get("in_flight") and r in by_replica
                    ]
                    return bool(holder)

                await wait_for(held, what="the decode replica holding it")
                by_replica[holder[0]].signal(signal.SIGKILL)
        assert "".join(parts) == want


async def test_a_prefill_replica_lost_mid_prefill_leaves_the_request_whole(
    pd_stack: Any, procs: Procs, model: str
) -> None:
    """The prefill replica dies (-9) while it computes the prompt (after it took it): its
    heartbeats stop, the router stops waiting for its hand-over and the request runs whole
    on a decode replica."""
    stack, first, _decode = pd_stack
    first.signal(signal.SIGKILL)
    # A slow one in its place: 5 ms a prompt token, about 12 s for the long prompt.
    slow = start_worker(
        procs, model, "p1", "--pd-role", "prefill", "--sim-prefill-ms-per-token", "5", env=ENV
    )

    async def only_the_slow_one() -> bool:
        beats = await live_replicas(procs.url, model, wait=1.5)
        return [r for r, hb in beats.items() if hb.get("pd_role") == "prefill"] == [f"{model}-p1"]

    await wait_for(only_the_slow_one, timeout=60, what="the slow prefill replica alone")
    async with stack.openai() as oai:
        answer = asyncio.create_task(_answer(oai, model, LONG))

        async def computing() -> bool:
            beats = await live_replicas(procs.url, model)
            return bool((beats.get(f"{model}-p1") or {}).get("in_flight"))

        await wait_for(computing, what="the prefill under way")
        slow.signal(signal.SIGKILL)
        text, usage = await answer
        assert usage.completion_tokens == 12 and text
        decided = await _decisions(stack.base)
        assert decided.get("aggregated_after_failure") == 1, decided


@pytest.mark.parametrize("pulled", [True, False], ids=["pulled", "stored"])
async def test_a_large_prompt_reaches_its_prefill_and_its_decode_replica(
    procs: Procs, model: str, pulled: bool
) -> None:
    """A body past one bus message (docs/large-requests.md). Pulled (the default): the
    prefill replica asks the router in the bridge for it, the decode replica asks the
    caller, and nothing goes into the store. Stored first (``bridge.pull_bodies`` off, as a
    NATS client's body is): each replica reads the one object. Either way both get it whole
    (the answer counts every prompt token)."""
    env = ENV | {
        "TOKENBUS_WORKER__SIM__MAX_MODEL_LEN": "50000000",
        "TOKENBUS_BRIDGE__PULL_BODIES": "true" if pulled else "false",
    }
    fast = ("--sim-prefill-ms-per-token", "0.001", "--sim-decode-ms", "5")
    start_worker(procs, model, "p0", "--pd-role", "prefill", *fast, env=env)
    start_worker(procs, model, "d0", "--pd-role", "decode", *fast, env=env)
    stack = await start_stack(procs, model, workers=0, env=env)

    async def both_heard() -> bool:
        beats = await live_replicas(procs.url, model, wait=1.5)
        return sorted(hb.get("pd_role") for hb in beats.values()) == ["decode", "prefill"]

    await wait_for(both_heard, timeout=60, what="both pools heard")
    big = "a long document to read " * 30_000  # 720 KB: past half of max_payload
    nc = await nats.connect(procs.url)
    try:
        js = nc.jetstream()
        before = (await js.stream_info(subjects.BODIES_STREAM)).state.last_seq
        async with stack.openai() as oai:
            _, usage = await _answer(oai, model, big, 6)
        assert usage is not None and usage.completion_tokens == 6
        assert usage.prompt_tokens == count_tokens(f"<|user|>{big}\n")
        assert (await _decisions(stack.base)).get("disaggregated") == 1
        stored = (await js.stream_info(subjects.BODIES_STREAM)).state.last_seq - before
        assert stored == 0 if pulled else stored > 0
    finally:
        await nc.drain()
