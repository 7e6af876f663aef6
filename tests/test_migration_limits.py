"""What a migration must not do, and requests it must not run or count twice: answers that
cannot be resumed (a tool call, reasoning) end with one retryable error, a request held by
a stopped member is sent again once, an overloaded router queues then refuses, three
routers never overload a replica, and a migrated request counts once toward its key's
limits (streams that move whole: tests/test_migration.py); real processes, a real bus."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path
from typing import Any

import nats
import pytest

from auth.ratelimit import estimate_tokens
from bus_schemas import codec, subjects
from bus_schemas import errors as E
from engine_worker.backends.sim import expected_text
from services.runtime import servers
from tests.support.busdata import key_store
from tests.support.inprocess import stack
from tests.support.natsserver import NatsServer
from tests.support.procs import Procs, start_stack
from tests.support.upstreams import Upstream
from tests.support.waits import fresh_window, live_replicas, wait_for
from tests.test_migration import HB, MSG, PROMPT, SLOW, _victim
from tokenbus import Client

_GROUP = {"router": subjects.STAGE_ROUTE, "ingress": subjects.QUEUE_INGRESS, "filter": "filter"}


@pytest.mark.fault
@pytest.mark.parametrize("role", ["router", "ingress", "filter"])
async def test_a_request_held_by_a_stopped_member_is_sent_again(
    procs: Procs, model: str, client: Client, role: str
) -> None:
    # Two of the role's queue group, one frozen: a request the queue group hands to the
    # frozen one is sent again once nobody accepted it in ACCEPT_TIMEOUT_S, and the resend
    # goes to the member that still beats (services/members.py), not at random: one resend
    # at most, each. (Of 24 requests sent at once, the queue group hands the frozen one
    # some: all 24 miss it 1 run in 2**24.) A sender that reaches the group only after the
    # frozen member missed its beats (a loaded machine: over 1.2 s) rightly passes it over:
    # then nothing is sent again, the round proves nothing, and another is tried once the
    # member beats again.
    roles = ["ingress", "router", *(["filter"] if role == "filter" else []), role]
    env = {"TOKENBUS_INGRESS__PIPELINE": '["filter", "route"]'} if role == "filter" else None
    stack = await start_stack(procs, model, *roles, workers=2, bridge=False, settle=0.6, env=env)
    stopped = stack.roles[role][0]
    beats: dict[str, float] = {}
    watch = await nats.connect(servers(procs.url))

    async def on_beat(msg: Any) -> None:
        beats[codec.decode_map(msg.data)["id"]] = time.monotonic()

    await watch.subscribe(subjects.members(_GROUP[role]), cb=on_beat)
    try:
        for _ in range(3):
            stopped.signal(signal.SIGSTOP)  # holds what it is given, answers nothing
            try:
                streams = [client.chat(model, MSG, max_tokens=3) for _ in range(24)]
                t0 = time.monotonic()
                outs = await asyncio.gather(*(s.collect() for s in streams))
                took = time.monotonic() - t0
                assert all(o.text == expected_text(PROMPT, 3)[0] for o in outs)
                resends = sorted(s.resends for s in streams)
                assert resends[-1] <= 1, resends
            finally:
                stopped.signal(signal.SIGCONT)
            if resends[-1] == 1:
                sent_again = resends.count(1)
                print(f"\n{role} paused: {sent_again} of 24 sent again, served in {took:.2f} s")
                return
            # Passed over from the start: again once both members have beaten since.
            since = time.monotonic()
            await wait_for(
                lambda since=since: sum(at > since for at in beats.values()) >= 2,
                what="the resumed member never beat again",
            )
        raise AssertionError("in three rounds the queue group never handed the frozen member one")
    finally:
        await watch.drain()


@pytest.mark.bus
async def test_overload_queues_up_to_a_bound_then_answers_503(
    nats_server: NatsServer, model: str, client: Client
) -> None:
    over = {"router": {"queue_timeout_s": 30.0, "max_queued": 1}}
    async with stack(
        nats_server.url, model, workers=1, worker={"max_concurrency": 2}, **over
    ) as svcs:
        queue = svcs["router"].dispatcher.queued
        a = client.chat(model, MSG, max_tokens=100_000)
        b = client.chat(model, MSG, max_tokens=100_000)
        await a.__anext__()
        await b.__anext__()
        # Both slots taken: the next request waits in the router's queue ...
        queued = asyncio.create_task(client.chat_completion(model, MSG, max_tokens=2))
        await wait_for(lambda: queue.get(model, 0) == 1, what="the request was not queued")
        assert not queued.done()
        # ... which holds one: another is refused at once, retryable, with Retry-After.
        t0 = time.monotonic()
        with pytest.raises(E.Overloaded) as ei:
            await client.chat_completion(model, MSG, max_tokens=2)
        assert time.monotonic() - t0 < 10.0  # at once, not after the queue's 30 s
        assert ei.value.status == 503 and ei.value.retryable
        assert ei.value.headers["Retry-After"] == "1"
        # A slot frees up: the queued request is served.
        await a.aclose()
        out = await asyncio.wait_for(queued, 30)
        assert out.usage.completion_tokens == 2
        await b.aclose()


@pytest.mark.stack
async def test_three_routers_never_overload_a_replica(
    procs: Procs, model: str, client: Client
) -> None:
    await start_stack(
        procs,
        model,
        "ingress",
        *["router"] * 3,
        workers=2,
        worker_args=("--max-concurrency", "6", *SLOW),
        bridge=False,
        env=HB,
        settle=0.6,
    )
    # Twelve long streams at once, spread by three routers that each see only their own
    # dispatches and the heartbeats: exactly the capacity of the two replicas.
    streams = [client.chat(model, MSG, max_tokens=10_000) for _ in range(12)]
    await asyncio.gather(*(s.__anext__() for s in streams))
    load = await live_replicas(procs.url, model)
    assert sorted(hb["in_flight"] for hb in load.values()) == [6, 6], load
    # One more waits for room instead of overloading a replica (a router says it holds it
    # in its queue), and gets it. Every router holds nothing until then: the twelve were
    # placed.
    reports: list[dict[str, Any]] = []

    async def on_report(msg: Any) -> None:
        reports.append(codec.decode_map(msg.data))

    nc = await nats.connect(procs.url)
    try:
        await nc.subscribe(subjects.telemetry(subjects.TELEMETRY_QUEUE), cb=on_report)
        await nc.flush()
        extra = asyncio.create_task(client.chat_completion(model, MSG, max_tokens=2))
        await wait_for(
            lambda: any(sum(r["waiting"].get(model, {}).values()) for r in reports),
            what="no router held the request",
        )
    finally:
        await nc.close()
    assert not extra.done()
    await streams[0].aclose()
    out = await asyncio.wait_for(extra, 5)
    assert out.usage.completion_tokens == 2
    for s in streams[1:]:
        await s.aclose()


@pytest.mark.fault
async def test_a_tool_call_cut_mid_way_ends_with_a_retryable_error(
    procs: Procs, model: str, client: Client
) -> None:
    # Arguments cannot be resumed like text: once a fragment reached the caller, the stream
    # ends with one retryable error instead of a call pieced together from two replicas.
    stack = await start_stack(
        procs, model, "ingress", "router", workers=2, worker_args=SLOW, env=HB, settle=0.6
    )
    long_args = {
        "type": "object",
        "properties": {"story": {"type": "string", "minLength": 400}},
        "required": ["story"],
    }
    tool = {"type": "function", "function": {"name": "write", "parameters": long_args}}
    s = client.chat(model, MSG, tools=[tool], max_tokens=400)
    fragments = 0
    with pytest.raises(E.ReplicaLost) as ei:
        async for ch in s:
            fragments += len(ch.tool_calls or ())
            if fragments == 3:
                _victim(stack.workers, s.replica).signal(signal.SIGKILL)
    assert ei.value.retryable and ei.value.status == 503
    assert s.migrations == 0
    # A request with tools whose answer had not started moves on as before.
    out = await client.chat_completion(model, MSG, tools=[tool], max_tokens=400)
    assert out.finish_reason == "tool_calls" and out.tool_calls is not None


@pytest.mark.fault
async def test_reasoning_already_sent_is_not_resumed(
    procs: Procs, model: str, client: Client, tmp_path: Path
) -> None:
    # Reasoning cannot be resumed like answer text either: the stream ends with one
    # retryable error rather than reasoning sent twice.
    up = Upstream(tmp_path)
    try:
        args = ("--backend", "openai", "--upstream-url", up.url)
        stack = await start_stack(
            procs, model, "ingress", "router", workers=2, worker_args=args, env=HB, settle=0.6
        )
        s = client.chat(
            model,
            MSG,
            chat_template_kwargs={"enable_thinking": True},
            fake_chunk_delay_s=0.5,
        )
        with pytest.raises(E.ReplicaLost):
            async for ch in s:
                if ch.reasoning:
                    _victim(stack.workers, s.replica).signal(signal.SIGKILL)
        assert s.migrations == 0
    finally:
        up.stop()


TPM = 100_000


def _charged_before(remaining_tokens: str, max_tokens: int) -> int:
    """What a key's window was charged before a request that saw ``remaining_tokens`` (the
    request's own reservation, prompt estimate + max_tokens, is taken off too)."""
    own = estimate_tokens({"messages": MSG, "params": {"max_tokens": max_tokens}})
    return TPM - int(remaining_tokens) - own


@pytest.mark.fault
async def test_a_migrated_request_counts_once_toward_rpm_and_tpm_over_nats(
    procs: Procs, model: str, client: Client
) -> None:
    async with key_store(procs.url, watch=False) as keys:
        key, _ = await keys.create("migrating", rpm=2, tpm=TPM)
    stack = await start_stack(
        procs,
        model,
        "ingress",
        "auth",
        "ratelimit",
        "router",
        workers=2,
        worker_args=SLOW,
        env={**HB, "TOKENBUS_INGRESS__PIPELINE": '["auth", "ratelimit", "route"]'},
        settle=1.0,
    )
    await fresh_window(12)
    s = client.chat(model, MSG, max_tokens=60, api_key=key)
    got = 0
    async for ch in s:
        got += ch.tokens
        if got == 15:
            _victim(stack.workers, s.replica).signal(signal.SIGKILL)
    assert s.migrations == 1 and s.usage is not None and s.usage.completion_tokens == 60
    # The usage report and the superseded attempt's settle, in the ratelimit process: a
    # fixed wait, as nothing outside that process shows them settled (the lease is local).
    await asyncio.sleep(0.5)
    # The key's second request of the minute is admitted (the migration was not a third),
    # and the window was charged the first request's tokens once.
    s2 = client.chat(model, MSG, max_tokens=1, api_key=key)
    async for _ in s2:
        pass
    assert s2.rate_limits["x-ratelimit-remaining-requests"] == "0"
    charged = _charged_before(s2.rate_limits["x-ratelimit-remaining-tokens"], 1)
    assert charged == s.usage.total_tokens, (charged, s.usage)


@pytest.mark.fault
async def test_a_migrated_request_counts_once_toward_rpm_and_tpm_over_http(
    procs: Procs, model: str
) -> None:
    async with key_store(procs.url, watch=False) as keys:
        key, _ = await keys.create("migrating-http", rpm=2, tpm=TPM)
    # The bridge runs auth and ratelimit in-process and routes itself.
    stack = await start_stack(
        procs,
        model,
        workers=2,
        worker_args=SLOW,
        env={**HB, "TOKENBUS_INGRESS__PIPELINE": '["auth", "ratelimit", "route"]'},
        settle=1.0,
    )
    await fresh_window(12)
    auth = {"Authorization": f"Bearer {key}"}
    body = {"model": model, "messages": MSG, "max_tokens": 60, "stream": True}
    body["stream_options"] = {"include_usage": True}
    usage: dict[str, Any] = {}
    async with stack.http() as http:
        async with http.stream("POST", "/v1/chat/completions", json=body, headers=auth) as r:
            assert r.status_code == 200
            n = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                n += 1
                if n == 15:
                    live = await live_replicas(procs.url, model)
                    busy = [rid for rid, hb in live.items() if hb.get("in_flight")]
                    assert len(busy) == 1, live
                    _victim(stack.workers, busy[0]).signal(signal.SIGKILL)
        assert usage["completion_tokens"] == 60
        # As over NATS: the settle, in the bridge's own limiter, shows nowhere outside it.
        await asyncio.sleep(0.5)
        r = await http.post(
            "/v1/chat/completions",
            json={"model": model, "messages": MSG, "max_tokens": 1},
            headers=auth,
        )
    assert r.status_code == 200, r.text
    assert r.headers["x-ratelimit-remaining-requests"] == "0"
    charged = _charged_before(r.headers["x-ratelimit-remaining-tokens"], 1)
    assert charged == usage["total_tokens"], (charged, usage)
    assert "request_migrated" in stack.bridge.output()
