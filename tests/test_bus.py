"""The NATS path on a real nats-server: client, ingress, router, workers (in-process)."""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import time
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from bus_schemas import codec, frames, subjects
from bus_schemas import errors as E
from engine_worker.backends.sim import expected_text
from tests.support.inprocess import stack
from tests.support.natsserver import NatsServer
from tests.support.waits import wait_for
from tokenbus import Client, Completion

pytestmark = pytest.mark.bus

MSG = [{"role": "user", "content": "hello there"}]
PROMPT = "<|user|>hello there\n"


async def test_streaming_and_whole_chat_over_nats(
    nats_server: NatsServer, model: str, client: Client
) -> None:
    async with stack(nats_server.url, model):
        stream = client.chat(model, MSG, max_tokens=10, seed=3)
        chunks = [ch async for ch in stream]
        text = "".join(ch.text for ch in chunks)
        assert text == expected_text(PROMPT, 10, seed=3)[0]
        assert stream.finish_reason == "length"
        assert stream.usage is not None and stream.usage.completion_tokens == 10
        assert stream.replica and stream.replica.startswith(model)
        assert [ch.index for ch in chunks] == sorted(ch.index for ch in chunks)
        for mark in ("t0", "ingress", "route", "engine_start", "first_token", "engine_end"):
            assert mark in stream.timings
        assert stream.timings["t0"] <= stream.timings["ingress"] <= stream.timings["route"]
        assert stream.timings["route"] <= stream.timings["engine_start"]

        whole = await client.chat_completion(model, MSG, max_tokens=10, seed=3)
        assert whole.text == text and whole.finish_reason == "length"
        # A caller that takes the answer whole gets its text in one chunk, with the end.
        assert len(chunks) == 10
        one = client.chat(model, MSG, max_tokens=10, seed=3, whole=True)
        assert [ch.text async for ch in one] == [text]
        assert one.usage is not None and one.usage.completion_tokens == 10

        comp = await client.completion(model, "abc", max_tokens=4)
        assert comp.text == expected_text("abc", 4)[0]


async def test_stop_sequences_over_the_bus(
    nats_server: NatsServer, model: str, client: Client
) -> None:
    full = expected_text(PROMPT, 30)[0]
    stop = " " + full.split(" ")[4]
    async with stack(nats_server.url, model, workers=1):
        out = await client.chat_completion(model, MSG, max_tokens=30, stop=["zzzz", stop])
        missed = await client.chat_completion(model, MSG, max_tokens=30, stop=["zzzz"])
    assert out.finish_reason == "stop"
    assert out.text == full[: full.find(stop)]
    # The final frame names the stop sequence that ended the answer, and only that one.
    assert out.stop_sequence == stop
    assert missed.text == full and missed.stop_sequence is None


@pytest.mark.parametrize(
    ("body", "code", "status"),
    [
        ({"messages": MSG}, "invalid_request", 400),
        ({"model": "{model}", "messages": []}, "invalid_request", 400),
        ({"model": "{model}", "messages": "hi"}, "invalid_request", 400),
        ({"model": "{model}", "messages": MSG, "max_tokens": "many"}, "invalid_request", 400),
        ({"model": "{model}", "messages": MSG, "n": 3}, "invalid_request", 400),
        ({"model": "no-such-model", "messages": MSG}, "model_not_found", 404),
    ],
)
async def test_bad_requests_get_typed_errors_and_services_keep_serving(
    nats_server: NatsServer,
    model: str,
    body: dict[str, Any],
    code: str,
    status: int,
    client: Client,
) -> None:
    body = json.loads(json.dumps(body).replace("{model}", model))
    async with stack(nats_server.url, model, workers=1):
        with pytest.raises(E.TokenbusError) as ei:
            await client.submit("chat", body).collect()
        assert (ei.value.code, E.http_status(ei.value)) == (code, status)
        assert ei.value.message
        ok = await client.chat_completion(model, MSG, max_tokens=2)
        assert ok.usage.completion_tokens == 2


async def test_malformed_msgpack_is_refused(nats_server: NatsServer, model: str, nc: NATS) -> None:
    async with stack(nats_server.url, model, workers=1):
        reply = await nc.request(subjects.request("chat"), b"\xc1\xc1", timeout=5)
        frame = codec.decode_map(reply.data)
        assert frame["t"] == "e" and frame["error"]["code"] == "invalid_request"
        assert frame["error"]["status"] == 400


async def test_oversized_prompt_is_413(nats_server: NatsServer, model: str, client: Client) -> None:
    async with stack(nats_server.url, model, workers=1, ingress={"max_prompt_chars": 100}):
        with pytest.raises(E.PayloadTooLarge):
            await client.chat_completion(model, [{"role": "user", "content": "x" * 101}])


async def test_several_workers_share_the_load(
    nats_server: NatsServer, model: str, client: Client
) -> None:
    async with stack(nats_server.url, model, workers=3):
        outs = await asyncio.gather(
            *(client.chat_completion(model, MSG, max_tokens=20) for _ in range(30))
        )
    served = [o.replica for o in outs]
    assert len(set(served)) == 3
    assert max(served.count(r) for r in set(served)) <= 15


async def test_no_replica_is_503_and_unknown_model_404(
    private_nats: NatsServer, model: str
) -> None:
    url = private_nats.url
    async with stack(url, model, workers=1) as svcs, await Client.connect(url) as c:
        w = svcs["workers"][0]
        await w.drain(timeout=2)
        await wait_for(lambda: not svcs["router"].registry.live(model))
        with pytest.raises(E.NoReplica) as ei:
            await c.chat_completion(model, MSG)
        assert ei.value.retryable and ei.value.status == 503
        for task in list(w._active.values()):
            task.cancel()  # the "dead" replica's generation, so teardown does not wait on it
        with pytest.raises(E.ModelNotFound):
            await c.chat_completion("never-served", MSG)


async def test_no_ingress_is_a_clear_503(private_nats: NatsServer) -> None:
    async with await Client.connect(private_nats.url) as c:
        with pytest.raises(E.ServiceUnavailable) as ei:
            await c.chat_completion("m", MSG, timeout=5)
    assert "ingress" in ei.value.message


async def test_no_router_is_a_clear_503(private_nats: NatsServer, model: str) -> None:
    async with (
        stack(private_nats.url, model, workers=0, with_router=False),
        await Client.connect(private_nats.url) as c,
    ):
        with pytest.raises(E.ServiceUnavailable):
            await c.chat_completion(model, MSG, timeout=5)


async def test_dead_replica_before_accept_is_routed_around(
    nats_server: NatsServer, model: str, client: Client
) -> None:
    async with stack(nats_server.url, model, workers=2) as svcs:
        dead = svcs["workers"][0]
        # The replica stops answering but the router still believes in it (heartbeats not
        # yet expired): exactly a process killed between two heartbeats.
        for sub in dead._subs:
            await sub.unsubscribe()
        dead._subs.clear()
        dead._hb_task.cancel()
        outs = await asyncio.gather(
            *(client.chat_completion(model, MSG, max_tokens=3) for _ in range(10))
        )
        assert {o.replica for o in outs} == {svcs["workers"][1].replica}


async def test_closing_the_stream_cancels_generation_on_the_worker(
    nats_server: NatsServer, model: str, client: Client
) -> None:
    async with stack(nats_server.url, model, workers=1) as svcs:
        w = svcs["workers"][0]
        stream = client.chat(model, MSG, max_tokens=100_000)
        async for _ in stream:
            break
        assert w.in_flight == 1
        await stream.aclose()
        await wait_for(lambda: w.in_flight == 0 and w.backend.stats()["running"] == 0)


async def test_cancel_before_accept_still_reaches_the_worker(
    nats_server: NatsServer, model: str, client: Client
) -> None:
    async with stack(nats_server.url, model, workers=1) as svcs:
        w = svcs["workers"][0]
        stream = client.chat(model, MSG, max_tokens=100_000)
        await stream.start()
        await stream.aclose()  # before any frame arrived
        # The request still reaches the worker, is accepted and then cancelled: its handler
        # has ended (counted) and nothing runs any more.
        await wait_for(
            lambda: (
                w.discovery.endpoints[0].num_requests >= 1
                and w.in_flight == 0
                and w.backend.stats()["running"] == 0
            ),
            timeout=20,
            what="the worker never received and ended the cancelled request",
        )


async def test_request_timeout_is_a_typed_error(
    nats_server: NatsServer, model: str, client: Client
) -> None:
    async with stack(nats_server.url, model, workers=1) as svcs:
        with pytest.raises(E.Timeout):
            await client.chat_completion(model, MSG, max_tokens=100_000, timeout=0.3)
        await wait_for(lambda: svcs["workers"][0].in_flight == 0)


async def test_expired_requests_are_dropped_not_served(
    nats_server: NatsServer, model: str, nc: NATS
) -> None:
    async with stack(nats_server.url, model, workers=1) as svcs:
        reply = await nc.request(
            subjects.request("chat"),
            codec.encode({"model": model, "messages": MSG}),
            headers={"Tb-Deadline": "1000"},
            timeout=5,
        )
        frame = codec.decode_map(reply.data)
        assert frame["error"]["code"] == "timeout"
        assert svcs["workers"][0].discovery.endpoints[0].num_requests == 0


async def test_drain_finishes_in_flight_streams(
    nats_server: NatsServer, model: str, client: Client
) -> None:
    async with stack(nats_server.url, model, workers=2) as svcs:
        stream = client.chat(model, MSG, max_tokens=60)
        first = await stream.__anext__()
        serving = next(w for w in svcs["workers"] if w.replica == stream.replica)
        other = next(w for w in svcs["workers"] if w is not serving)
        drain = asyncio.create_task(serving.drain(timeout=10))
        rest = [ch async for ch in stream]
        await drain
        assert stream.finish_reason == "length"
        assert sum(ch.tokens for ch in [first, *rest]) == 60
        out = await client.chat_completion(model, MSG, max_tokens=2)
        assert out.replica == other.replica


async def test_services_answer_nats_micro_discovery(
    nats_server: NatsServer, model: str, nc: NATS
) -> None:
    async with stack(nats_server.url, model, workers=1):
        inbox = nc.new_inbox()
        got: list[dict[str, Any]] = []

        async def cb(msg: Any) -> None:
            got.append(json.loads(msg.data))

        await nc.subscribe(inbox, cb=cb)
        await nc.publish("$SRV.INFO", b"", reply=inbox)
        wanted = {"tokenbus-ingress", "tokenbus-router", "tokenbus-worker"}
        await wait_for(
            lambda: wanted <= {g["name"] for g in got},
            timeout=10,
            what="not every service answered $SRV.INFO",
        )
        got.clear()
        await nc.publish("$SRV.STATS.tokenbus-worker", b"", reply=inbox)
        await wait_for(lambda: bool(got), timeout=10, what="the worker never answered $SRV.STATS")
        assert got and all(g["type"] == "io.nats.micro.v1.stats_response" for g in got)
        assert all("num_requests" in e for g in got for e in g["endpoints"])


async def test_replica_dying_mid_stream_ends_in_a_retryable_error(
    nats_server: NatsServer, model: str, client: Client
) -> None:
    async with stack(nats_server.url, model, workers=1) as svcs:
        w = svcs["workers"][0]
        stream = client.chat(model, MSG, max_tokens=100_000)
        await stream.__anext__()
        # What a kill -9 looks like from the bus: no more frames, no more heartbeats.
        w._hb_task.cancel()
        w.outbox.send = lambda reply, frame: None  # type: ignore[method-assign]
        # The client tries to move the stream to another replica; there is none.
        with pytest.raises(E.TokenbusError) as ei:
            async for _ in stream:
                pass
        assert ei.value.retryable and ei.value.status == 503
        assert ei.value.code in ("replica_lost", "no_replica", "service_unavailable")
        for task in list(w._active.values()):
            task.cancel()  # the "dead" replica's generation, so teardown does not wait on it


async def test_draining_ingress_answers_what_it_already_received(
    nats_server: NatsServer, model: str, client: Client
) -> None:
    # Heartbeats each second (not the suite's 0.2 s): the stack shares this test's event loop
    # with its 80 requests, and in a loaded CI run (nn) the router missed three 0.2 s beats
    # and answered the first 40 "no live replica". Liveness is not what is tested here.
    beats = {"heartbeat_interval_s": 1.0}
    async with stack(nats_server.url, model, workers=1, worker=beats) as svcs:
        await client.chat_completion(model, MSG, max_tokens=1)  # the path is live end to end
        before = [client.chat(model, MSG, max_tokens=3, timeout=60) for _ in range(40)]
        for s in before:
            await s.start()
        await client.flush()  # the server has them all, so the only ingress has them
        ingress = svcs["ingress"]
        # More requests race the drain: each is either taken (and served) or refused.
        racing = [client.chat(model, MSG, max_tokens=3, timeout=60) for _ in range(40)]

        async def publish_racing() -> None:
            for s in racing:
                await s.start()
                await asyncio.sleep(0)

        await asyncio.gather(ingress.drain(timeout=60), publish_racing())
        outs = await asyncio.gather(*(s.collect() for s in before + racing), return_exceptions=True)
    # Every request the ingress received before draining was served, not dropped; every
    # request after it was told so (a retryable 503, after the client's few resends). None
    # was lost on the way: the client would find that out only when no one accepted it in
    # ACCEPT_TIMEOUT_S, and resend it (counted in ``resends``).
    served = [o for o in outs if isinstance(o, Completion)]
    refused = [o for o in outs if isinstance(o, E.ServiceUnavailable)]
    assert all(isinstance(o, Completion) for o in outs[:40]), [
        o for o in outs[:40] if not isinstance(o, Completion)
    ]
    assert len(served) + len(refused) == 80, [o for o in outs if isinstance(o, Exception)]
    assert all(o.usage.completion_tokens == 3 for o in served)
    assert all(e.retryable and e.status == 503 for e in refused)
    assert [s.resends for s in before + racing] == [0] * 80
    stats = ingress.discovery.endpoints[0]
    assert stats.num_requests >= len(served) and stats.num_errors == 0, (len(served), stats)


async def test_same_request_id_twice_does_not_cross_streams(
    nats_server: NatsServer, model: str, client: Client
) -> None:
    async with stack(nats_server.url, model, workers=1) as svcs:
        a = client.chat(model, MSG, max_tokens=40, request_id="same-id")
        b = client.chat(model, MSG, max_tokens=40, request_id="same-id")
        await a.__anext__()
        await b.__anext__()
        await a.aclose()
        rest = [ch async for ch in b]
        assert b.finish_reason == "length" and rest
        await wait_for(lambda: svcs["workers"][0].in_flight == 0)


async def test_a_request_too_large_for_the_bus_is_413_and_the_client_survives(
    nats_server: NatsServer, model: str, client: Client
) -> None:
    async with stack(nats_server.url, model, workers=1):
        # Messages that large go by claim check (docs/large-requests.md); other fields do not.
        fn = {"name": "f", "description": "x" * (client.nc.max_payload + 10)}
        with pytest.raises(E.PayloadTooLarge):
            await client.chat_completion(model, MSG, tools=[{"type": "function", "function": fn}])
        ok = await client.chat_completion(model, MSG, max_tokens=2)
        assert ok.usage.completion_tokens == 2


async def test_ingress_ignores_stage_headers_from_clients(
    nats_server: NatsServer, model: str, nc: NATS
) -> None:
    async with stack(nats_server.url, model, workers=1):
        spy = nc.new_inbox()
        got: list[Any] = []

        async def cb(msg: Any) -> None:
            got.append(msg)

        await nc.subscribe(spy, cb=cb)
        reply = await nc.request(
            subjects.request("chat"),
            codec.encode({"model": "", "messages": MSG}),
            headers={"Tb-Reply-To": spy, "Tb-Principal": "admin"},
            timeout=5,
        )
        assert codec.decode_map(reply.data)["error"]["code"] == "invalid_request"
        await asyncio.sleep(0.2)  # a negative check: nothing arrives on the spy meanwhile
        assert got == []  # errors go to the real reply subject, nowhere else


async def test_an_idle_replica_beats_slower_and_at_full_rate_once_it_takes_a_request(
    nats_server: NatsServer, model: str, client: Client, nc: NATS
) -> None:
    async with stack(nats_server.url, model, workers=1) as svcs:
        w = svcs["workers"][0]
        fast = w.cfg.heartbeat_interval_s
        beats: list[tuple[float, dict[str, Any]]] = []

        async def on_beat(msg: Any) -> None:
            beats.append((time.monotonic(), codec.decode(msg.data)))

        await nc.subscribe(subjects.heartbeat(model, w.replica), cb=on_beat)
        await wait_for(lambda: len(beats) >= 2, timeout=10)
        # Idle: it says it beats less often, and does.
        assert beats[-1][1]["interval_s"] == fast * w.cfg.idle_heartbeat_factor
        assert beats[-1][0] - beats[-2][0] > 2 * fast
        stream = client.chat(model, MSG, max_tokens=10_000)
        t0 = time.monotonic()
        await stream.__anext__()
        # Busy: a full-rate beat at once (the caller's watchdog expects one per `fast`).
        await wait_for(
            lambda: any(b[1]["interval_s"] == fast and b[1]["in_flight"] for b in beats),
            timeout=fast,
        )
        assert next(t for t, b in beats if b["in_flight"]) - t0 < fast
        # At least four busy beats (three gaps) have come.
        await wait_for(
            lambda: sum(1 for _, b in beats if b["in_flight"]) >= 4,
            timeout=max(10, 20 * fast),
            what="the busy replica did not beat four times",
        )
        busy = [t for t, b in beats if b["in_flight"]]
        gaps = [b - a for a, b in itertools.pairwise(busy)]
        # At the full rate, not the idle one: the middle gap near `fast`, none as long as an
        # idle beat's (a loaded machine once stretched one gap to 1.6 x fast in CI).
        idle = fast * w.cfg.idle_heartbeat_factor
        assert len(gaps) >= 3 and statistics.median(gaps) < 1.5 * fast, gaps
        assert max(gaps) < idle, gaps
        await stream.aclose()


async def test_a_request_that_cannot_fit_the_context_is_refused_as_vllm_does(
    nats_server: NatsServer, model: str, client: Client, nc: NATS
) -> None:
    async with stack(nats_server.url, model, workers=1, worker={"max_model_len": 100}) as svcs:
        w = svcs["workers"][0]
        beat = await nc.subscribe(subjects.heartbeat(model, w.replica))
        assert codec.decode((await beat.next_msg(timeout=5)).data)["max_model_len"] == 100
        await beat.unsubscribe()
        # Unbounded: refused at once with vLLM's wording, naming max_tokens.
        with pytest.raises(E.InvalidRequest) as ei:
            await client.chat_completion(model, MSG, max_tokens=10**12)
        assert ei.value.param == "max_tokens"
        assert "maximum context length is 100 tokens" in str(ei.value)
        # No max_tokens: the gateway's default (512) is lowered to what fits.
        out = await client.chat_completion(model, MSG)
        assert out.usage.prompt_tokens + out.usage.completion_tokens == 100
        assert out.finish_reason == "length"
        # A prompt longer than the context: refused, naming the messages.
        with pytest.raises(E.InvalidRequest) as ei:
            await client.chat_completion(model, [{"role": "user", "content": "x" * 1000}])
        assert ei.value.param == "messages"
        # What fits is served as asked.
        ok = await client.chat_completion(model, MSG, max_tokens=5)
        assert ok.usage.completion_tokens == 5


async def test_no_request_outlives_the_ingress_limit_whatever_deadline_the_client_sets(
    nats_server: NatsServer, model: str, client: Client
) -> None:
    async with stack(
        nats_server.url, model, workers=1, ingress={"pipeline": ["route"], "max_request_s": 1.0}
    ) as svcs:
        t0 = time.monotonic()
        stream = client.chat(model, MSG, max_tokens=10**6, timeout=3600)
        with pytest.raises(E.Timeout):
            async for _ in stream:
                pass
        # Ended at the ingress' limit (1 s), not the client's hour; the engine work with it.
        assert time.monotonic() - t0 < 5
        await wait_for(lambda: svcs["workers"][0].in_flight == 0, timeout=5)


async def _cancels_to(nc: NATS, replica: str) -> tuple[asyncio.Queue[dict[str, Any]], Any]:
    """The cancels sent to ``replica``, as they come, and the subscription (to end)."""
    cancels: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def on_cancel(m: Any) -> None:
        cancels.put_nowait(codec.decode_map(m.data))

    sub = await nc.subscribe(subjects.worker_cancel(replica), cb=on_cancel)
    await nc.flush()
    return cancels, sub


async def test_a_resend_cancels_the_copy_nobody_accepted_as_a_duplicate(
    client: Client, nc: NATS, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request no replica accepted in time is sent again; the copy it was first sent to (an
    in-process sender names its replica at once) is cancelled as a duplicate, so if it ran
    after all its usage report leaves the spend to the copy that is read (both share one
    hold; nemesis seed 4805: the first copy's report settled it, the answer was charged
    nothing)."""
    from services import caller

    monkeypatch.setattr(caller, "ACCEPT_TIMEOUT_S", 0.3)
    sent: asyncio.Queue[str] = asyncio.Queue()

    async def sender(data: bytes, hdrs: dict[str, str], reply: str) -> str:
        sent.put_nowait(reply)
        return "r-slow" if sent.qsize() == 1 else "r-next"

    cancels, sub = await _cancels_to(nc, "r-slow")
    stream = client.submit("chat", {"model": "m", "messages": MSG}, sender=sender, timeout=20)
    first = asyncio.ensure_future(anext(stream))
    await asyncio.wait_for(sent.get(), 10)  # to r-slow, which never answers
    reply2 = await asyncio.wait_for(sent.get(), 20)  # sent again
    cancel = await asyncio.wait_for(cancels.get(), 10)
    # (Sent again as a resend, or a move: a replica named at once counts as accepted.)
    assert cancel.get("dup") is True and stream.resends + stream.migrations == 1
    await nc.publish(reply2, frames.chunk("a", 1, 0))
    await nc.publish(reply2, frames.final("stop", 3, 1, {}))
    assert (await asyncio.wait_for(first, 10)).text == "a"
    await stream.aclose()
    await sub.unsubscribe()


async def test_a_late_copy_is_cancelled_only_once_the_resend_is_admitted(
    client: Client, nc: NATS, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bridge's resend shares one hold with the copy it left (the same request id): the
    copy's report leaves that hold to the resend only once the resend's admission wrote it.
    A copy accepted late while the resend is still being admitted (its stages wait on the
    spend book) is cancelled as a duplicate only after that admission; cancelled at once, its
    report came first, settled the hold as its own, and the request paid twice (the nemesis
    run's overcharge by about one prompt, docs/nemesis.md finding 14)."""
    from services import caller

    monkeypatch.setattr(caller, "ACCEPT_TIMEOUT_S", 0.3)
    monkeypatch.setattr(caller, "DUPLICATE_CANCEL_WAIT_S", 60.0)  # only the admission ends it
    sent: asyncio.Queue[str] = asyncio.Queue()
    admitted = asyncio.Event()  # the resend's admission (its stages) is held until set

    async def sender(data: bytes, hdrs: dict[str, str], reply: str) -> str | None:
        sent.put_nowait(reply)
        if sent.qsize() == 1:
            return None  # to the router: a replica's accept frame would name it
        await admitted.wait()
        return "r-next"

    cancels, sub = await _cancels_to(nc, "r-late")
    stream = client.submit("chat", {"model": "m", "messages": MSG}, sender=sender, timeout=20)
    first = asyncio.ensure_future(anext(stream))
    reply1 = await asyncio.wait_for(sent.get(), 10)
    await asyncio.wait_for(sent.get(), 20)  # sent again: its admission now waits
    late = reply1.rpartition(".")[2]
    callers = stream._client
    await nc.publish(reply1, frames.accept("r-late", stream.request_id, 5.0))
    await wait_for(lambda: late not in callers._tombstones)  # the late accept was read
    # Round trips, not a timer: whatever that read started runs while the client's PING
    # waits for its PONG, and a cancel it published is through to this subscriber after the
    # next round trip of each connection.
    for _ in range(3):
        await callers.nc.flush()
        await nc.flush()
    assert cancels.empty(), "the copy was cancelled before the resend was admitted"
    admitted.set()
    cancel = await asyncio.wait_for(cancels.get(), 10)
    assert cancel.get("dup") is True and cancel["request_id"] == stream.request_id
    await stream.aclose()
    first.cancel()
    await sub.unsubscribe()


async def test_an_attempt_moved_on_from_unread_is_cancelled_as_a_duplicate(
    client: Client, nc: NATS
) -> None:
    """A request moved to another replica (frames lost): the attempt it left is cancelled
    plainly (its replica answered, its tokens were read); a replica that accepts the abandoned
    attempt only after (its copy never read) is cancelled as a duplicate, so its usage report
    leaves the request's spend to the attempt that is read (docs/flow.md, spend budgets)."""
    sent: asyncio.Queue[tuple[dict[str, Any], str]] = asyncio.Queue()
    cancels: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def sender(data: bytes, hdrs: dict[str, str], reply: str) -> str:
        sent.put_nowait((codec.decode_map(data), reply))
        return "r-first" if sent.qsize() == 1 else "r-next"

    async def on_cancel(m: Any) -> None:
        cancels.put_nowait({**codec.decode_map(m.data), "to": m.subject})

    subs = [
        await nc.subscribe(subjects.worker_cancel(r), cb=on_cancel) for r in ("r-first", "r-late")
    ]
    await nc.flush()
    stream = client.submit("chat", {"model": "m", "messages": MSG}, sender=sender, timeout=20)
    first = asyncio.ensure_future(anext(stream))
    _, reply = await sent.get()
    await nc.publish(reply, frames.chunk("a", 1, 0))
    assert (await first).text == "a"
    more = asyncio.ensure_future(anext(stream))
    await nc.publish(reply, frames.chunk("c", 1, 2))  # frame 1 lost: moved on
    _, reply2 = await asyncio.wait_for(sent.get(), 10)
    plain = await asyncio.wait_for(cancels.get(), 10)
    assert plain["to"] == subjects.worker_cancel("r-first") and not plain.get("dup")
    # The abandoned attempt accepted late by another replica: a duplicate's cancel.
    await nc.publish(reply, frames.accept("r-late", stream.request_id, 5.0))
    dup = await asyncio.wait_for(cancels.get(), 10)
    assert dup["to"] == subjects.worker_cancel("r-late") and dup.get("dup") is True
    await nc.publish(reply2, frames.chunk("b", 1, 0))
    await nc.publish(reply2, frames.final("stop", 3, 1, {}))
    assert (await asyncio.wait_for(more, 10)).text == "b"
    await stream.aclose()
    for sub in subs:
        await sub.unsubscribe()


async def test_a_sink_takes_plain_chunks_in_order_and_the_stream_still_resumes(
    client: Client, nc: NATS
) -> None:
    """``Stream.push_to`` (the bridge's SSE writer): plain text chunks that arrive while the
    consumer waits go to the sink; one the sink refuses, side output, a gap and the end go
    to the consumer, in order. A migration after sink-taken text resumes after all of it."""
    sent: asyncio.Queue[tuple[dict[str, Any], str]] = asyncio.Queue()

    async def sender(data: bytes, hdrs: dict[str, str], reply: str) -> str:
        sent.put_nowait((codec.decode_map(data), reply))
        return "r-test"

    stream = client.submit("chat", {"model": "m", "messages": MSG}, sender=sender, timeout=20)
    first = asyncio.ensure_future(anext(stream))
    _, reply = await sent.get()
    await nc.publish(reply, frames.accept("r-test", stream.request_id, 5.0))
    await nc.publish(reply, frames.chunk("a", 1, 0))
    assert (await first).text == "a"

    sunk: list[str] = []
    stream.push_to(lambda text: text != "slow" and not sunk.append(text))
    received: list[str] = []

    async def consume() -> None:
        async for c in stream:
            received.append(c.text)

    consumer = asyncio.ensure_future(consume())

    async def deliver(frame: bytes, to: str, seen: int) -> None:
        await nc.publish(to, frame)
        await wait_for(lambda: len(sunk) + len(received) == seen, timeout=10)

    await deliver(frames.chunk("b", 1, 1), reply, 1)
    await deliver(frames.chunk("c", 2, 2), reply, 2)
    await deliver(frames.chunk("slow", 1, 3), reply, 3)  # refused by the sink
    await deliver(frames.chunk("d", 1, 4), reply, 4)
    await deliver(frames.chunk("e", 1, 5, {"lp": {"content": []}}), reply, 5)  # side output
    assert sunk == ["b", "c", "d"] and received == ["slow", "e"]

    # Frame 7 without 6: lost frames, so the stream moves to another replica and resumes
    # after everything delivered so far, the sink's text included.
    await nc.publish(reply, frames.chunk("x", 1, 7))
    body, reply2 = await asyncio.wait_for(sent.get(), 10)
    assert body["resume"] == {"text": "abcslowde", "tokens": 7, "since": 0}
    # (The sender named the replica: that attempt is accepted, and the consumer waits.)
    await deliver(frames.chunk("f", 1, 0), reply2, 6)
    # Moved again: ``since`` says what that attempt began with (its limiter charges the
    # tokens it delivered itself, one).
    await nc.publish(reply2, frames.chunk("y", 1, 2))
    body, reply3 = await asyncio.wait_for(sent.get(), 10)
    assert body["resume"] == {"text": "abcslowdef", "tokens": 8, "since": 7}
    await nc.publish(reply3, frames.final("stop", 3, 1, {}))
    await asyncio.wait_for(consumer, 10)
    assert sunk == ["b", "c", "d", "f"] and received == ["slow", "e"]
    assert stream.finish_reason == "stop"
    assert (
        stream.usage is not None and stream.usage.completion_tokens == 1 + 8
    )  # the last attempt's one, after the 8 it resumed from


async def test_a_first_token_goes_out_before_the_plain_tokens_read_with_it(
    client: Client, nc: NATS
) -> None:
    """Held plain chunks reach their sinks after the consumers their read woke have run: a
    first token that came in the same batch is taken first."""
    sent: asyncio.Queue[str] = asyncio.Queue()

    async def sender(data: bytes, hdrs: dict[str, str], reply: str) -> str:
        sent.put_nowait(reply)
        return "r-test"

    a = client.submit("chat", {"model": "m", "messages": MSG}, sender=sender, timeout=20)
    b = client.submit("chat", {"model": "m", "messages": MSG}, sender=sender, timeout=20)
    a_first = asyncio.ensure_future(anext(a))
    reply_a = await sent.get()
    await nc.publish(reply_a, frames.chunk("a0", 1, 0))
    assert (await a_first).text == "a0"
    order: list[str] = []
    a.push_to(lambda text: not order.append(text))
    a_rest = asyncio.ensure_future(anext(a))  # waits; its plain chunks go to the sink

    async def take_b() -> None:  # as the bridge's writer does: in the consumer's own turn
        order.append((await anext(b)).text)

    b_first = asyncio.ensure_future(take_b())
    await sent.get()
    prefix = reply_a.rpartition(".")[0]
    items = [(a.token, frames.chunk("a1", 1, 1)), (b.token, frames.chunk("b0", 1, 0))]
    await nc.publish(subjects.inbox_batch(prefix), frames.batch(items))
    await wait_for(lambda: len(order) == 2, timeout=10)
    assert order == ["b0", "a1"]
    await b_first
    a_rest.cancel()
    await a.aclose()
    await b.aclose()
