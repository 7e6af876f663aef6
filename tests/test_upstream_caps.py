"""The ``openai`` backend in front of servers that are not vLLM: what each upstream can do is
probed (usage on streams, continuing a message, a tokenize endpoint, logprobs), usage never
counts zero input, and a stream cut off by a lost replica resumes only where the upstream
continues the message exactly: never a spliced answer. Fake upstreams of three flavors
(tests/fakes/upstream.py: vLLM, llama.cpp, a bare server); real processes and a real bus
where a worker is killed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from bus_schemas import codec
from bus_schemas import errors as E
from engine_worker.backends.base import Delta, GenerationRequest
from engine_worker.backends.openai_upstream import OpenAIUpstreamBackend
from engine_worker.backends.upstream_caps import (
    USAGE_ESTIMATE,
    USAGE_TOKENIZED,
    USAGE_UPSTREAM,
)
from services.config import OpenAIUpstreamSettings, WorkerSettings
from telemetry import records
from telemetry.store import RecordStore
from tests.fakes.upstream import FakeUpstream, template_tokens
from tests.support.ports import free_port
from tests.support.procs import Procs, ProcStack, start_stack
from tests.support.repo import run_cli
from tests.support.upstreams import Upstream
from tests.support.waits import live_replicas
from tokenbus import Client

HB = {"TOKENBUS_WORKER__HEARTBEAT_INTERVAL_S": "0.25"}
STORY = [{"role": "user", "content": "tell me a long story"}]
CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "What is the capital of France?"},
    ],
    [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
        {"role": "user", "content": "Name three colours of the rainbow."},
    ],
]


def words(n: int) -> str:
    return " ".join(f"word{i}" for i in range(1, n + 1))


@pytest.fixture
async def fake(request: pytest.FixtureRequest) -> AsyncIterator[FakeUpstream]:
    up = FakeUpstream(flavor=getattr(request, "param", "vllm"))
    await up.start()
    yield up
    await up.stop()


def settings(url: str, **over: Any) -> WorkerSettings:
    return WorkerSettings(
        backend="openai",
        model="tb-model",
        openai=OpenAIUpstreamSettings(upstream_url=url, upstream_model="upstream-model", **over),
    )


async def started(url: str, **over: Any) -> OpenAIUpstreamBackend:
    b = OpenAIUpstreamBackend(settings(url, **over))
    await b.start()
    return b


def chat(messages: list[dict[str, Any]], **kw: Any) -> GenerationRequest:
    kw.setdefault("max_tokens", 64)
    return GenerationRequest("r1", "chat", "tb-model", messages=messages, **kw)


async def last(b: OpenAIUpstreamBackend, req: GenerationRequest) -> Delta:
    deltas = [d async for d in b.generate(req)]
    assert deltas and deltas[-1].finish_reason is not None
    return deltas[-1]


@pytest.mark.stack
@pytest.mark.parametrize(
    ("fake", "expected"),
    [
        ("vllm", (True, True, "vllm", True)),
        ("llamacpp", (False, False, "llama.cpp", True)),
        ("bare", (False, False, None, True)),
        # Closes a final assistant message instead of continuing it, though it leaves the
        # generation prompt out when asked: its count grows by the closing token too.
        ("closer", (True, False, "vllm", True)),
        # Counts the messages' words alone: whatever it does with a final assistant message,
        # its count cannot tell, so no resume.
        ("textcount", (True, False, "vllm", True)),
    ],
    indirect=["fake"],
)
async def test_the_probe_finds_what_each_upstream_does(
    fake: FakeUpstream, expected: tuple[Any, ...]
) -> None:
    b = await started(fake.url)
    try:
        caps = b.capabilities()
        assert caps["probed"] is True
        got = (caps["stream_usage"], caps["continue_message"], caps["tokenize"], caps["logprobs"])
        assert got == expected
        # Probes are tiny: one token each.
        assert fake.requests and all(r.get("max_tokens") == 1 for r in fake.requests)
        resumed = chat(STORY, resume_text="word1 word2", resume_tokens=2)
        assert b.can_resume(resumed) is expected[1]
    finally:
        await b.stop()


@pytest.mark.stack
@pytest.mark.parametrize("fake", ["llamacpp"], indirect=True)
async def test_usage_without_usage_on_streams_is_the_upstreams_own_count(
    fake: FakeUpstream,
) -> None:
    b = await started(fake.url)
    try:
        for messages in CHATS:
            d = await last(b, chat(messages))
            assert (d.prompt_tokens, d.usage_source) == (
                template_tokens(messages),
                USAGE_TOKENIZED,
            )
            assert d.completion_tokens == 3
        # A sequence of roles not measured at start: its first count is an estimate from the
        # measured ones (within 5 % here), then it is measured and exact.
        five = [
            *CHATS[2],
            {"role": "assistant", "content": "Red"},
            {"role": "user", "content": "Two more"},
        ]
        d = await last(b, chat(five))
        assert d.usage_source == USAGE_ESTIMATE
        assert abs(d.prompt_tokens - template_tokens(five)) <= 0.05 * template_tokens(five)
        assert b.counter is not None
        await asyncio.wait_for(b.counter.settled(), 10)  # measured once nothing is in flight
        d = await last(b, chat(five))
        assert (d.prompt_tokens, d.usage_source) == (template_tokens(five), USAGE_TOKENIZED)
        # Text completions: the prompt's own tokens.
        req = GenerationRequest("r2", "completions", "tb-model", 8, prompt="Once upon a time")
        d = await last(b, req)
        assert (d.prompt_tokens, d.usage_source) == (4, USAGE_TOKENIZED)
        # Parts the tokenizer cannot count (tools the template renders): marked an estimate,
        # never zero.
        tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
        d = await last(b, chat(CHATS[0], extra={"tools": [tool], "tool_choice": "none"}))
        assert d.usage_source == USAGE_ESTIMATE and d.prompt_tokens > template_tokens(CHATS[0])
    finally:
        await b.stop()


@pytest.mark.stack
@pytest.mark.parametrize("fake", ["bare"], indirect=True)
async def test_with_no_tokenizer_to_ask_usage_is_marked_estimated(fake: FakeUpstream) -> None:
    b = await started(fake.url)
    try:
        for messages in CHATS:
            d = await last(b, chat(messages))
            assert d.usage_source == USAGE_ESTIMATE
            # Characters per token measured against the upstream's count of an English
            # sentence: near its count, never zero.
            assert abs(d.prompt_tokens - template_tokens(messages)) <= 0.25 * template_tokens(
                messages
            )
    finally:
        await b.stop()


@pytest.mark.stack
@pytest.mark.parametrize("fake", ["vllm"], indirect=True)
async def test_usage_the_upstream_sends_is_used_as_it_is(fake: FakeUpstream) -> None:
    b = await started(fake.url)
    try:
        d = await last(b, chat(CHATS[1]))
        own = template_tokens(CHATS[1], flavor="vllm")
        assert (d.prompt_tokens, d.usage_source) == (own, USAGE_UPSTREAM)
        # The operator says it sends none: counted with its /tokenize (vLLM's dialect).
        await b.stop()
        b = await started(fake.url, stream_usage=False, continue_message=False)
        caps = b.capabilities()
        assert caps["overridden"] == ["continue_message", "stream_usage"]
        assert (caps["stream_usage"], caps["continue_message"]) == (False, False)
        d = await last(b, chat(CHATS[1]))
        assert d.prompt_tokens == own  # what it said, when it says after all
        # Counted here with vLLM's /tokenize when it does not say.
        counted = await b.count_prompt("/chat/completions", {"messages": CHATS[1]})
        assert counted == (own, USAGE_TOKENIZED)
        assert not b.can_resume(chat(STORY, resume_text="word1", resume_tokens=1))
    finally:
        await b.stop()


@pytest.mark.stack
@pytest.mark.parametrize("fake", ["llamacpp"], indirect=True)
async def test_a_chat_resume_is_refused_where_the_upstream_would_start_over(
    fake: FakeUpstream,
) -> None:
    b = await started(fake.url)
    try:
        before = len(fake.requests)
        req = chat(STORY, resume_text="word1 word2", resume_tokens=2, extra={"fake_words": 9})
        with pytest.raises(E.ReplicaLost, match="cannot continue") as ei:
            await last(b, req)
        assert ei.value.retryable and ei.value.status == 503
        assert len(fake.requests) == before  # never asked: it would have started over
        # A text completion continues exactly anywhere: the prompt and the text so far.
        req = GenerationRequest(
            "r3", "completions", "tb-model", 8, prompt="Say:", resume_text=" hello", resume_tokens=1
        )
        assert (await last(b, req)).finish_reason is not None
        assert fake.requests[-1]["prompt"] == "Say: hello"
    finally:
        await b.stop()


@pytest.mark.stack
@pytest.mark.parametrize("fake", ["llamacpp"], indirect=True)
async def test_an_answer_cut_short_without_a_finish_reason_is_an_error(
    fake: FakeUpstream,
) -> None:
    # llama-cpp-python's server ends the answer it is writing with [DONE] and no finish
    # reason when another request arrives: a truncated answer, never a "stop".
    b = await started(fake.url)
    try:
        with pytest.raises(E.EngineError, match="without a finish reason"):
            await last(b, chat(STORY, extra={"fake_no_finish": True}))
    finally:
        await b.stop()


@pytest.mark.stack
async def test_an_upstream_unreachable_at_start_is_probed_once_it_answers() -> None:
    port = free_port()
    b = await started(f"http://127.0.0.1:{port}/v1")
    b.refresh.base_s = b.refresh.every_s = 0.0  # the timer under test, small
    up = FakeUpstream(flavor="llamacpp")
    try:
        assert b.capabilities()["probed"] is False
        assert not b.can_resume(chat(STORY, resume_text="word1", resume_tokens=1))
        with pytest.raises(E.EngineError):
            await last(b, chat(CHATS[0]))
        await up.start(port)

        async def probed() -> None:
            while not b.capabilities()["probed"]:
                task = b._probe_task
                if task is not None and not task.done():
                    await task  # a probe at work (it may have begun while the port was shut)
                else:
                    # A request lets it probe again (it may fail while the upstream comes up).
                    with contextlib.suppress(E.TokenbusError):
                        await last(b, chat(CHATS[0]))

        await asyncio.wait_for(probed(), 10)
        assert b.capabilities()["tokenize"] == "llama.cpp"
        d = await last(b, chat(CHATS[0]))
        assert (d.prompt_tokens, d.usage_source) == (template_tokens(CHATS[0]), USAGE_TOKENIZED)
    finally:
        await b.stop()
        await up.stop()


# -- through the bus: kill -9 mid-stream ------------------------------------------------------


class Records:
    """Telemetry records heard on the bus from the moment :meth:`listen` returns."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.sub: Any = None

    @classmethod
    async def listen(cls, client: Client) -> Records:
        heard = cls()

        async def on_records(msg: Any) -> None:
            for r in records.batch(codec.decode_map(msg.data)):
                heard.queue.put_nowait(r)

        heard.sub = await client.nc.subscribe(records.subject(), cb=on_records)
        return heard

    async def of(self, request_id: str, source: str) -> dict[str, Any]:
        """The record ``source`` (``worker``, ``http``) published of ``request_id`` (within
        10 s); stops listening."""

        async def record() -> dict[str, Any]:
            while True:
                r = await self.queue.get()
                if (r.get("request_id"), r.get("source")) == (request_id, source):
                    return r

        try:
            return await asyncio.wait_for(record(), 10)
        finally:
            await self.sub.unsubscribe()


async def _kill_stack(procs: Procs, model: str, up: Upstream) -> ProcStack:
    """Ingress, router and two openai-backend workers in front of ``up``, fast heartbeats:
    the stack the kill tests stop a worker of."""
    args = ("--backend", "openai", "--upstream-url", up.url)
    return await start_stack(
        procs, model, "ingress", "router", workers=2, worker_args=args, env=HB, settle=0.6
    )


async def _stream_then_kill(
    client: Client, model: str, stack: Any, after: int
) -> tuple[str, Any, E.TokenbusError | None]:
    """Stream a 100-word answer (5 s), kill -9 the worker serving it after ``after`` words:
    the text received, the stream, and the error that ended it (None: it finished)."""
    s = client.chat(model, STORY, max_tokens=120, fake_words=100, fake_chunk_delay_s=0.05)
    text, n = "", 0
    try:
        async for ch in s:
            text += ch.text
            n += 1
            if n == after:
                victim = stack.workers[int(str(s.replica).rsplit("-", 1)[1])]
                victim.signal(signal.SIGKILL)
    except E.TokenbusError as err:
        return text, s, err
    return text, s, None


@pytest.mark.fault
@pytest.mark.parametrize("flavor", ["llamacpp", "bare"])
async def test_kill_9_mid_stream_never_splices_an_answer(
    procs: Procs, model: str, client: Client, tmp_path: Path, flavor: str
) -> None:
    full = words(100)
    # An upstream that starts over: the stream ends with one retryable error, its text a
    # true prefix of the answer.
    up = Upstream(tmp_path, flavor=flavor)
    try:
        stack = await _kill_stack(procs, model, up)
        text, s, err = await _stream_then_kill(client, model, stack, after=10)
        assert isinstance(err, E.ReplicaLost), err
        assert err.retryable and err.status == 503
        assert s.migrations == 0
        assert text and full.startswith(text) and text.count("word1 ") == 1
        # Its replicas say so, and `tokenbus status` shows it.
        st = run_cli("--nats-url", procs.url, "status", "--json", "--wait", "3", timeout=60)
        rows = json.loads(st.stdout)["replicas"]
        alive = [r for r in rows if r["model"] == model]
        assert alive and all(r["upstream"]["continue_message"] is False for r in alive)
        st = run_cli("--nats-url", procs.url, "status", "--wait", "3", timeout=60)
        tokenize = "llama.cpp" if flavor == "llamacpp" else "none"
        assert f"usage-on-streams=no resume=no tokenize={tokenize}" in st.stdout
        if flavor == "bare":
            return
        # Usage over NATS is the upstream's own count, and says how it was had; so does the
        # worker's telemetry record (what limits, budgets and reports are built on).
        heard = await Records.listen(client)
        out = client.chat(model, CHATS[1], max_tokens=8)
        async for _ in out:
            pass
        assert out.usage is not None
        assert out.usage.prompt_tokens == template_tokens(CHATS[1])
        assert out.usage_source == USAGE_TOKENIZED

        rec = await heard.of(out.request_id, "worker")
        assert (rec["prompt_tokens"], rec["usage_source"]) == (
            template_tokens(CHATS[1]),
            USAGE_TOKENIZED,
        )
    finally:
        up.stop()


@pytest.mark.fault
async def test_kill_9_mid_stream_resumes_where_the_upstream_continues(
    procs: Procs, model: str, client: Client, tmp_path: Path
) -> None:
    up = Upstream(tmp_path, flavor="vllm")
    try:
        stack = await _kill_stack(procs, model, up)
        text, s, err = await _stream_then_kill(client, model, stack, after=10)
        assert err is None
        assert text == words(100)  # no duplicate, no gap
        assert s.migrations == 1
        assert s.usage is not None and s.usage.completion_tokens == 100
    finally:
        up.stop()


@pytest.mark.stack
async def test_usage_over_http_is_the_upstreams_count(
    procs: Procs, model: str, tmp_path: Path
) -> None:
    up = Upstream(tmp_path, flavor="llamacpp")
    try:
        args = ("--backend", "openai", "--upstream-url", up.url)
        stack = await start_stack(procs, model, "ingress", "router", workers=1, worker_args=args)
        async with stack.openai() as api:
            whole = await api.chat.completions.create(model=model, messages=CHATS[2], max_tokens=8)  # type: ignore[arg-type]
            assert whole.usage is not None
            assert whole.usage.prompt_tokens == template_tokens(CHATS[2])
            stream = await api.chat.completions.create(
                model=model,
                messages=CHATS[2],  # type: ignore[arg-type]
                max_tokens=8,
                stream=True,
                stream_options={"include_usage": True},
            )
            usage = [ch.usage async for ch in stream if ch.usage is not None]
            assert usage and usage[-1].prompt_tokens == template_tokens(CHATS[2])
            assert usage[-1].completion_tokens == 3
    finally:
        up.stop()


@pytest.mark.unit
def test_the_usage_source_is_stored_with_the_request(tmp_path: Path) -> None:
    # The worker's record says how prompt_tokens were had; the bridge's record of the same
    # request (which does not know) leaves it as it is.
    store = RecordStore(tmp_path / "records.db")
    try:
        t = {"t0": 1, "engine_start": 2, "first_token": 3, "engine_end": 4}
        store.write(
            [
                records.build(
                    request_id="r1",
                    source="worker",
                    model="m",
                    timings=t,
                    outcome="stop",
                    prompt_tokens=31,
                    usage_source=USAGE_TOKENIZED,
                )
            ]
        )
        bridge = records.build(
            request_id="r1", source="http", model="m", timings=t, outcome="stop", prompt_tokens=31
        )
        store.write([bridge])
        (row,) = store.rows()
        assert (row["prompt_tokens"], row["usage_source"]) == (31, USAGE_TOKENIZED)
    finally:
        store.close()


@pytest.mark.fault
async def test_a_cut_stream_over_http_ends_with_one_error_and_its_record_says_so(
    procs: Procs, model: str, client: Client, tmp_path: Path
) -> None:
    # Over HTTP the headers are gone when the replica dies: the SSE stream ends with one
    # replica_lost error event (no spliced text), and the bridge's record names that
    # outcome and counts the tokens the client got, not "ok" and 0.
    up = Upstream(tmp_path, flavor="llamacpp")
    try:
        stack = await _kill_stack(procs, model, up)
        heard = await Records.listen(client)
        async with stack.http("/v1", timeout=30) as http:
            body = {
                "model": model,
                "messages": STORY,
                "max_tokens": 120,
                "stream": True,
                "fake_words": 100,
                "fake_chunk_delay_s": 0.05,
            }
            text, n, errors = "", 0, []
            async with http.stream("POST", "/chat/completions", json=body) as r:
                assert r.status_code == 200
                rid, replica = r.headers["x-request-id"], r.headers["x-tokenbus-replica"]
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        errors.append(ev["error"])
                        continue
                    for ch in ev.get("choices") or ():
                        piece = (ch.get("delta") or {}).get("content")
                        if piece:
                            text += piece
                            n += 1
                            if n == 10:
                                victim = stack.workers[int(replica.rsplit("-", 1)[1])]
                                victim.signal(signal.SIGKILL)
        assert len(errors) == 1 and errors[0]["code"] == "replica_lost", errors
        assert words(100).startswith(text) and text.count("word1 ") == 1

        rec = await heard.of(rid, "http")
        assert (rec["outcome"], rec["status"]) == ("replica_lost", 200)
        assert rec["completion_tokens"] == n
    finally:
        up.stop()


@pytest.mark.fault
async def test_a_cut_chat_stream_moves_to_a_replica_that_continues_it(
    procs: Procs, model: str, client: Client, tmp_path: Path
) -> None:
    # A mixed fleet: replicas 0 and 2 in front of an upstream that continues a message,
    # replica 1 in front of one that starts over. A stream cut on 0 or 2 after text reached
    # the caller goes to the other of them (Tb-Resume), never to 1, and ends whole.
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    cont, over = (
        Upstream(tmp_path / "a", flavor="vllm"),
        Upstream(tmp_path / "b", flavor="llamacpp"),
    )
    try:
        urls = [cont.url, over.url, cont.url]

        def env_for(role: str, i: int) -> dict[str, str]:
            return {"TOKENBUS_WORKER__OPENAI__UPSTREAM_URL": urls[i]} if role == "worker" else {}

        stack = await start_stack(
            procs,
            model,
            "ingress",
            "router",
            workers=3,
            worker_args=("--backend", "openai"),
            env=HB,
            env_for=env_for,
            settle=0.6,
        )

        # Every replica heard with what its upstream does before the first request.
        async def probed() -> None:
            while True:
                beats = await live_replicas(procs.url, model, wait=1.5)
                if len(beats) == 3 and all(hb["upstream"]["probed"] for hb in beats.values()):
                    return

        await asyncio.wait_for(probed(), 30)
        for _ in range(20):  # a stream that starts on replica 0 or 2
            s = client.chat(model, STORY, max_tokens=120, fake_words=100, fake_chunk_delay_s=0.05)
            first = await anext(s)
            if not str(s.replica).endswith("-1"):
                break
            await s.aclose()
        first_replica = str(s.replica)
        assert not first_replica.endswith("-1")
        text, n = first.text, 1
        async for ch in s:
            text += ch.text
            n += 1
            if n == 10:
                stack.workers[int(first_replica.rsplit("-", 1)[1])].signal(signal.SIGKILL)
        assert text == words(100)  # no duplicate, no gap
        assert s.migrations == 1 and s.replica not in (first_replica, f"{model}-1")
    finally:
        cont.stop()
        over.stop()
