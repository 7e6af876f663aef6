"""Request migration: a stream whose replica dies goes on on another replica, without a
duplicate or a gap; real processes, a real bus, kill -9."""

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
from engine_worker.backends.base import GenerationRequest
from engine_worker.backends.sim import _start, expected_text, resume_point, token_text
from filter.policy import FilterPolicy
from filter.scanner import Scanner
from tests.support.busdata import key_store
from tests.support.inprocess import stack
from tests.support.natsserver import NatsServer
from tests.support.procs import Procs, start_stack
from tests.support.upstreams import Upstream
from tests.support.waits import fresh_window, live_replicas, wait_for
from tokenbus import Client

MSG = [{"role": "user", "content": "tell me a long story"}]
PROMPT = "<|user|>tell me a long story\n"
SLOW = ("--sim-prefill-ms", "5", "--sim-decode-ms", "20")
HB = {"TOKENBUS_WORKER__HEARTBEAT_INTERVAL_S": "0.25"}


def _req(text: str, tokens: int, max_tokens: int = 50) -> GenerationRequest:
    return GenerationRequest(
        "r", "chat", "m", max_tokens, messages=MSG, resume_text=text, resume_tokens=tokens
    )


@pytest.mark.unit
def test_resume_point_takes_the_callers_count_where_its_text_agrees() -> None:
    start = _start(PROMPT, None)
    full = "".join(token_text(start, i) for i in range(10))
    five = "".join(token_text(start, i) for i in range(5))
    assert resume_point(start, _req("", 0), 50) == (0, "")
    assert resume_point(start, _req(five, 5), 50) == (5, five)
    six = "".join(token_text(start, i) for i in range(6))
    eight = "".join(token_text(start, i) for i in range(8))
    # The count says 6 (an output filter held back text of a counted token) and the text
    # holds 5 and a bit: 6 are done, not produced again; the text they make is returned
    # (the caller's missing part is sent first). Held back whole, the same.
    partial = five + token_text(start, 5)[:2]
    assert full.startswith(partial)
    assert resume_point(start, _req(partial, 6), 50) == (6, six)
    assert resume_point(start, _req(five, 8), 50) == (8, eight)
    three = "".join(token_text(start, i) for i in range(3))
    assert resume_point(start, _req("", 3), 50) == (3, three)
    assert resume_point(start, _req(five, 8), 6) == (6, six)  # never past the answer's end
    # Counted as 5 with a bit more: the cut token is produced again.
    assert resume_point(start, _req(partial, 5), 50) == (5, five)
    # Text that is not the sequence's (redacted by a filter): the count is trusted.
    assert resume_point(start, _req("[REDACTED:pii.card] and", 4), 50) == (
        4,
        "[REDACTED:pii.card] and",
    )


def _victim(ws: list[Any], replica: str | None) -> Any:
    """The worker process serving ``replica`` (``<model>-<i>`` runs as ``worker-<i>``)."""
    assert replica is not None
    return ws[int(replica.rsplit("-", 1)[1])]


async def _first_words(s: Any, n: int = 15) -> str:
    """The text of a stream read until it holds ``n`` words (the stream left open)."""
    text = ""
    async for ch in s:
        text += ch.text
        if len(text.split(" ")) >= n:
            break
    return text


@pytest.mark.fault
async def test_a_worker_killed_mid_stream_is_migrated_over_nats(
    procs: Procs, model: str, client: Client
) -> None:
    stack = await start_stack(
        procs, model, "ingress", "router", workers=2, worker_args=SLOW, env=HB, settle=0.6
    )
    s = client.chat(model, MSG, max_tokens=120, request_id="my-label-7")
    text = await _first_words(s)
    first = s.replica
    victim = _victim(stack.workers, first)
    victim.signal(signal.SIGKILL)
    t_kill = time.monotonic()
    gap = 0.0
    async for ch in s:
        if not gap:
            gap = time.monotonic() - t_kill
        text += ch.text
    expected = expected_text(PROMPT, 120)[0]
    assert text == expected  # no duplicate, no gap
    assert s.migrations == 1 and s.replica != first
    assert s.finish_reason == "length"
    assert s.usage is not None and s.usage.completion_tokens == 120
    # Detected by the heartbeats (0.25 s), then re-issued: seconds, where nothing else would
    # end the stream before the request's own timeout (a generous bound: a loaded machine).
    assert gap < 10.0, gap
    # The attempt that finished is logged (and recorded) under the client's own id as its
    # label, as the first was: a migration names the gateway's id, not the client's.
    survivor = _victim(stack.workers, s.replica)
    await wait_for(
        lambda: '"client_request_id": "my-label-7"' in survivor.output(),
        timeout=10,
        what="the migrated attempt's log line without the client's label",
    )


@pytest.mark.fault
async def test_a_stream_migrated_while_the_output_filter_holds_text_is_whole_and_counted_once(
    procs: Procs, model: str, client: Client
) -> None:
    """An output filter holds back the text of a word until the word has ended, while the
    chunk of each token already carries its count: a replica lost then leaves the caller
    with more tokens counted than it holds text of. The next replica sends the missing
    text and does not produce the counted tokens again: the answer is whole and its usage
    the answer's (a rolling upgrade in CI once counted 31 of 30)."""
    full = expected_text(PROMPT, 120)[0]
    policy = {"blocklist": [full.split(" ")[80]], "actions": {"blocklist": "redact"}}
    env = {
        **HB,
        "TOKENBUS_INGRESS__PIPELINE": '["filter", "route"]',
        "TOKENBUS_FILTER__DEFAULT_POLICY": "t",
        "TOKENBUS_FILTER__POLICIES": json.dumps({"t": policy}),
    }
    stack = await start_stack(
        procs, model, "ingress", "filter", "router", workers=2, worker_args=SLOW, env=env,
        settle=0.6,
    )  # fmt: skip
    start = _start(PROMPT, None)
    ends = {len("".join(token_text(start, i) for i in range(n))) for n in range(121)}
    s = client.chat(model, MSG, max_tokens=120)
    text, counted = "", 0
    async for ch in s:  # up to a chunk whose text ends inside a token it counts
        text, counted = text + ch.text, counted + ch.tokens
        if counted > 5 and len(text) not in ends:
            break
    assert len(text) not in ends and counted < 100, (counted, text)
    first = s.replica
    _victim(stack.workers, first).signal(signal.SIGKILL)
    async for ch in s:
        text += ch.text
    assert text == Scanner(FilterPolicy.from_dict(policy)).scan(full).redacted_text
    assert s.migrations == 1 and s.replica != first
    assert s.usage is not None and s.usage.completion_tokens == 120


@pytest.mark.fault
async def test_a_stop_sequence_hit_after_a_migration_is_named(
    procs: Procs, model: str, client: Client
) -> None:
    """The stop sequence that ends a migrated answer is the one the last replica names (the
    final frame's), as for an answer served by one replica."""
    stack = await start_stack(
        procs, model, "ingress", "router", workers=2, worker_args=SLOW, env=HB, settle=0.6
    )
    full = expected_text(PROMPT, 120)[0]
    words = full.split(" ")
    stop = " " + " ".join(words[40:42])
    assert full.find(stop) > len(" ".join(words[:30]))
    s = client.chat(model, MSG, max_tokens=120, stop=["zzzz", stop])
    text = await _first_words(s)
    first = s.replica
    _victim(stack.workers, first).signal(signal.SIGKILL)
    async for ch in s:
        text += ch.text
    assert text == full[: full.find(stop)]
    assert s.migrations == 1 and s.replica != first
    assert (s.finish_reason, s.stop_sequence) == ("stop", stop)


@pytest.mark.fault
async def test_a_worker_killed_mid_stream_is_migrated_over_http(procs: Procs, model: str) -> None:
    stack = await start_stack(
        procs, model, "ingress", "router", workers=3, worker_args=SLOW, env=HB, settle=0.6
    )
    async with stack.openai() as api:
        raws = [
            await api.chat.completions.with_raw_response.create(
                model=model, messages=MSG, max_tokens=100, stream=True
            )  # type: ignore[call-overload]
            for _ in range(6)
        ]
        streams = [r.parse() for r in raws]
        texts = ["" for _ in streams]
        for i, s in enumerate(streams):
            for _ in range(5):
                ch = await s.__anext__()
                if ch.choices:
                    texts[i] += ch.choices[0].delta.content or ""
        # The worker serving the first stream (the bridge may not have heard every worker's
        # first heartbeat yet, so the streams need not be spread over all three).
        _victim(stack.workers, raws[0].headers.get("x-tokenbus-replica")).signal(signal.SIGKILL)
        for i, s in enumerate(streams):
            async for ch in s:
                if ch.choices:
                    texts[i] += ch.choices[0].delta.content or ""
    expected = expected_text(PROMPT, 100)[0]
    assert texts == [expected] * 6
    assert "request_migrated" in stack.bridge.output()


@pytest.mark.stack
async def test_a_draining_worker_past_its_timeout_hands_streams_over(
    procs: Procs, model: str, client: Client
) -> None:
    stack = await start_stack(
        procs,
        model,
        "ingress",
        "router",
        workers=2,
        worker_args=SLOW,
        bridge=False,
        env_for=lambda role, _: {"TOKENBUS_DRAIN_TIMEOUT_S": "0.5"} if role == "worker" else {},
        settle=0.6,
    )
    streams = [client.chat(model, MSG, max_tokens=80) for _ in range(4)]
    texts = [(await s.__anext__()).text for s in streams]
    victim = _victim(stack.workers, streams[0].replica)
    victim.signal(signal.SIGTERM)
    for i, s in enumerate(streams):
        async for ch in s:
            texts[i] += ch.text
    assert victim.proc.wait(10) == 0
    assert texts == [expected_text(PROMPT, 80)[0]] * 4
    assert any(s.migrations == 1 for s in streams)


@pytest.mark.fault
async def test_when_no_replica_is_left_the_stream_ends_with_one_retryable_error(
    procs: Procs, model: str, client: Client
) -> None:
    stack = await start_stack(
        procs, model, "ingress", "router", worker_args=SLOW, env=HB, settle=0.6
    )
    s = client.chat(model, MSG, max_tokens=200)
    await s.__anext__()
    stack.workers[0].signal(signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(E.TokenbusError) as ei:
        async for _ in s:
            pass
    assert ei.value.retryable and ei.value.status == 503
    assert time.monotonic() - t0 < 10  # an answer, not a hang


@pytest.mark.fault
@pytest.mark.parametrize("role", ["router", "ingress", "filter"])
async def test_a_request_held_by_a_stopped_member_is_sent_again(
    procs: Procs, model: str, client: Client, role: str
) -> None:
    # Two of the role's queue group, one frozen: a request the queue group hands to the
    # frozen one is sent again once nobody accepted it in ACCEPT_TIMEOUT_S, and the resend
    # goes to the member that still beats (services/members.py), not at random: one resend
    # at most, each. (Of 24 requests sent at once, the queue group hands the frozen one
    # some: all 24 miss it 1 run in 2**24.)
    roles = ["ingress", "router", *(["filter"] if role == "filter" else []), role]
    env = {"TOKENBUS_INGRESS__PIPELINE": '["filter", "route"]'} if role == "filter" else None
    stack = await start_stack(procs, model, *roles, workers=2, bridge=False, settle=0.6, env=env)
    stopped = stack.roles[role][0]
    stopped.signal(signal.SIGSTOP)  # holds what it is given, answers nothing
    try:
        streams = [client.chat(model, MSG, max_tokens=3) for _ in range(24)]
        t0 = time.monotonic()
        outs = await asyncio.gather(*(s.collect() for s in streams))
        took = time.monotonic() - t0
        assert all(o.text == expected_text(PROMPT, 3)[0] for o in outs)
        resends = sorted(s.resends for s in streams)
        assert resends[-1] == 1, resends
        print(f"\n{role} paused: {resends.count(1)} of 24 sent again, all served in {took:.2f} s")
    finally:
        stopped.signal(signal.SIGCONT)


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
