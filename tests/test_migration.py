"""Request migration: a stream whose replica dies goes on on another replica, without a
duplicate or a gap; real processes, a real bus, kill -9 (what is not moved, sent again or
counted twice: tests/test_migration_limits.py)."""

from __future__ import annotations

import json
import signal
import time
from typing import Any

import pytest

from bus_schemas import errors as E
from engine_worker.backends.base import GenerationRequest
from engine_worker.backends.sim import _start, expected_text, resume_point, token_text
from filter.policy import FilterPolicy
from filter.scanner import Scanner
from tests.support.procs import Procs, start_stack
from tests.support.waits import wait_for
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
async def test_a_worker_killed_while_it_holds_text_for_coalescing_is_migrated_whole(
    procs: Procs, model: str, client: Client
) -> None:
    """With every stream's text held for coalescing (``stream_coalesce_streams`` 1, a hold of
    five steps), a worker killed mid-stream takes the text it held with it: the caller has
    fewer tokens than the worker made, and the next replica goes on from the caller's count,
    so the answer is whole, without a duplicate or a gap, and counted once."""
    env = {
        **HB,
        "TOKENBUS_WORKER__STREAM_COALESCE_STREAMS": "1",
        "TOKENBUS_WORKER__STREAM_COALESCE_MS": "100",
    }
    stack = await start_stack(
        procs, model, "ingress", "router", workers=2, worker_args=SLOW, env=env, settle=0.6
    )
    s = client.chat(model, MSG, max_tokens=120)
    text, sizes = "", []
    async for ch in s:
        text, sizes = text + ch.text, [*sizes, ch.tokens]
        if len(sizes) >= 3:
            break
    assert sizes[0] == 1 and max(sizes[1:]) > 1, sizes  # the first alone, then held
    first = s.replica
    _victim(stack.workers, first).signal(signal.SIGKILL)
    async for ch in s:
        text += ch.text
    assert text == expected_text(PROMPT, 120)[0]
    assert s.migrations == 1 and s.replica != first
    assert s.usage is not None and s.usage.completion_tokens == 120


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
