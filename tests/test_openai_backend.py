"""The ``openai`` backend against a fake OpenAI-compatible upstream (no NATS, no GPU): what
the client sends reaches the upstream unchanged, what the upstream streams reaches the
client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from bus_schemas import errors as E
from engine_worker.backends.base import Delta, GenerationRequest
from engine_worker.backends.openai_upstream import OpenAIUpstreamBackend
from services.config import OpenAIUpstreamSettings, WorkerSettings

try:  # tests/ is a package when run from the repo root with rootdir on sys.path
    from tests.fakes.upstream import FakeUpstream
    from tests.support.waits import wait_for
except ImportError:  # pytest's default rootdir-less import puts tests/ itself on sys.path
    from fakes.upstream import FakeUpstream  # type: ignore[no-redef]
    from support.waits import wait_for  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parent.parent

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
IMAGE = (
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGNgYAAAAAMA"
    "ASsJTYQAAAAASUVORK5CYII="
)


@pytest.fixture
async def upstream() -> AsyncIterator[FakeUpstream]:
    up = FakeUpstream()
    await up.start()
    yield up
    await up.stop()


@pytest.fixture
async def backend(upstream: FakeUpstream) -> AsyncIterator[OpenAIUpstreamBackend]:
    cfg = WorkerSettings(
        backend="openai",
        model="tb-model",
        openai=OpenAIUpstreamSettings(
            upstream_url=upstream.url, upstream_model="upstream-model", api_key="sk-up"
        ),
    )
    b = OpenAIUpstreamBackend(cfg)
    await b.start()
    yield b
    await b.stop()


def chat(messages: list[dict[str, Any]], **kw: Any) -> GenerationRequest:
    kw.setdefault("max_tokens", 64)
    return GenerationRequest(
        request_id="r1", kind="chat", model="tb-model", messages=messages, **kw
    )


async def collect(b: OpenAIUpstreamBackend, req: GenerationRequest) -> list[Delta]:
    return [d async for d in b.generate(req)]


def assemble_calls(deltas: list[Delta]) -> dict[int, dict[str, Any]]:
    """Tool calls as a client reassembles them from streamed fragments."""
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        for frag in d.tool_calls or ():
            call = calls.setdefault(frag["index"], {"name": "", "arguments": ""})
            if frag.get("id"):
                call["id"] = frag["id"]
                call["type"] = frag.get("type")
            fn = frag.get("function") or {}
            call["name"] += fn.get("name") or ""
            call["arguments"] += fn.get("arguments") or ""
    return calls


@pytest.mark.unit
async def test_client_fields_reach_the_upstream_unchanged(
    backend: OpenAIUpstreamBackend, upstream: FakeUpstream
) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You answer briefly."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is in this picture?"},
                {"type": "image_url", "image_url": {"url": IMAGE, "detail": "low"}},
            ],
        },
    ]
    extra: dict[str, Any] = {
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.25,
        "logit_bias": {"50256": -100},
        "user": "u-42",
        "chat_template_kwargs": {"enable_thinking": False},
        "min_tokens": 2,
        "repetition_penalty": 1.1,
    }
    await collect(backend, chat(messages, extra=extra, seed=7, stop=["\n\n"]))
    sent = upstream.requests[-1]
    for key, value in extra.items():
        assert sent[key] == value, key
    assert sent["messages"] == messages
    assert sent["model"] == "upstream-model"
    assert sent["max_tokens"] == 64
    assert sent["stream"] is True
    assert sent["stream_options"] == {"include_usage": True}
    assert sent["seed"] == 7 and sent["stop"] == ["\n\n"]
    # Unset sampling parameters are left to the upstream's (the model's) defaults.
    assert "temperature" not in sent and "top_p" not in sent
    assert upstream.headers[-1]["Authorization"] == "Bearer sk-up"

    # The fake's record over HTTP is the same (what end-to-end tests read).
    async with (
        aiohttp.ClientSession() as s,
        s.get(upstream.url + "/last_request") as resp,
    ):
        assert await resp.json() == sent

    await collect(backend, chat([{"role": "user", "content": "hi"}], temperature=0.0, top_p=0.9))
    sent = upstream.requests[-1]
    assert sent["temperature"] == 0.0 and sent["top_p"] == 0.9
    assert "seed" not in sent and "stop" not in sent


@pytest.mark.unit
async def test_streamed_tool_call_and_second_turn(backend: OpenAIUpstreamBackend) -> None:
    user: dict[str, Any] = {"role": "user", "content": "Weather in Paris?"}
    deltas = await collect(backend, chat([user], extra={"tools": TOOLS, "tool_choice": "auto"}))
    final = deltas[-1]
    assert final.finish_reason == "tool_calls"
    assert all(d.finish_reason is None for d in deltas[:-1])
    fragments = [d for d in deltas if d.tool_calls]
    assert len(fragments) == 4  # the call's head, then 3 argument fragments
    assert all(d.text == "" and d.tokens == 1 for d in fragments)
    calls = assemble_calls(deltas)
    assert calls == {
        0: {
            "id": "call_up_1",
            "type": "function",
            "name": "get_weather",
            "arguments": '{"city": "Paris", "unit": "celsius"}',
        }
    }
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    assert final.completion_tokens == 4 and final.prompt_tokens > 0

    # The second turn: the assistant's call and the tool's answer go up as the client sent.
    turn2: list[dict[str, Any]] = [
        user,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_up_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": calls[0]["arguments"]},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_up_1", "content": '{"temp_c": 21}'},
    ]
    deltas = await collect(backend, chat(turn2, extra={"tools": TOOLS}))
    assert "".join(d.text for d in deltas) == "hello from upstream"
    assert deltas[-1].finish_reason == "stop"
    assert not any(d.tool_calls for d in deltas)


@pytest.mark.unit
async def test_logprobs_reasoning_and_usage_details(
    backend: OpenAIUpstreamBackend, upstream: FakeUpstream
) -> None:
    extra = {
        "logprobs": True,
        "top_logprobs": 2,
        "chat_template_kwargs": {"enable_thinking": True},
    }
    deltas = await collect(backend, chat([{"role": "user", "content": "hi"}], extra=extra))
    assert upstream.requests[-1]["top_logprobs"] == 2
    reasoning = [d for d in deltas if d.reasoning]
    assert [d.reasoning for d in reasoning] == ["thinking"]
    assert reasoning[0].text == "" and reasoning[0].tokens == 1
    words = [d for d in deltas if d.text]
    assert [d.text for d in words] == ["hello", " from", " upstream"]
    for d in words:
        assert d.logprobs is not None
        (entry,) = d.logprobs["content"]
        assert entry["token"] == d.text
        assert len(entry["top_logprobs"]) == 2
        assert d.tokens == 1
    final = deltas[-1]
    assert final.finish_reason == "stop"
    assert final.usage == {
        "prompt_tokens_details": {"cached_tokens": 3},
        "completion_tokens_details": {"reasoning_tokens": 1},
    }
    # The fake counts the prompt through a template: 3 tokens around "hi", 2 after.
    assert final.prompt_tokens == 6 and final.completion_tokens == 4


@pytest.mark.unit
async def test_length_and_text_completions(
    backend: OpenAIUpstreamBackend, upstream: FakeUpstream
) -> None:
    deltas = await collect(backend, chat([{"role": "user", "content": "hi"}], max_tokens=2))
    assert "".join(d.text for d in deltas) == "hello from"
    assert deltas[-1].finish_reason == "length"
    assert deltas[-1].completion_tokens == 2

    req = GenerationRequest(
        request_id="r2",
        kind="completions",
        model="tb-model",
        max_tokens=16,
        prompt="Say hello",
        extra={"logprobs": 1, "echo": False, "best_of": 1},
    )
    deltas = await collect(backend, req)
    sent = upstream.requests[-1]
    assert sent["prompt"] == "Say hello" and sent["echo"] is False and sent["logprobs"] == 1
    assert "messages" not in sent
    assert "".join(d.text for d in deltas) == "hello from upstream"
    assert all(d.logprobs is not None and d.logprobs["tokens"] == [d.text] for d in deltas[:-1])
    assert deltas[-1].finish_reason == "stop"


@pytest.mark.unit
async def test_the_stop_string_vllm_reports_reaches_the_last_delta(
    backend: OpenAIUpstreamBackend, upstream: FakeUpstream
) -> None:
    """vLLM names the stop string that ended an answer (``stop_reason`` on the finishing
    choice): it is the last delta's ``stop_sequence``; an answer that ended on its own, or an
    upstream that sends no ``stop_reason`` (OpenAI's own), names none."""
    hi = [{"role": "user", "content": "hi"}]
    deltas = await collect(backend, chat(hi, stop=["zz", " up", " from"]))
    assert "".join(d.text for d in deltas) == "hello"
    assert (deltas[-1].finish_reason, deltas[-1].stop_sequence) == ("stop", " from")
    assert all(d.stop_sequence is None for d in deltas[:-1])
    prompt = GenerationRequest(
        request_id="r2", kind="completions", model="tb-model", max_tokens=16, prompt="Say"
    )
    prompt.stop = ["om u"]
    deltas = await collect(backend, prompt)
    assert "".join(d.text for d in deltas) == "hello fr"
    assert (deltas[-1].finish_reason, deltas[-1].stop_sequence) == ("stop", "om u")
    deltas = await collect(backend, chat(hi, stop=["zz"]))
    assert "".join(d.text for d in deltas) == "hello from upstream"
    assert (deltas[-1].finish_reason, deltas[-1].stop_sequence) == ("stop", None)


@pytest.mark.unit
def test_a_stop_reason_that_is_no_string_names_no_stop_sequence() -> None:
    from engine_worker.backends.openai_shape import stop_string

    assert stop_string({"finish_reason": "stop", "stop_reason": "\n\n"}) == "\n\n"
    assert stop_string({"finish_reason": "stop", "stop_reason": 128009}) is None  # a token id
    assert stop_string({"finish_reason": "stop", "stop_reason": None}) is None
    assert stop_string({"finish_reason": "stop"}) is None


@pytest.mark.unit
async def test_upstream_errors(backend: OpenAIUpstreamBackend, upstream: FakeUpstream) -> None:
    hi = [{"role": "user", "content": "hi"}]
    with pytest.raises(E.InvalidRequest) as info:
        await collect(backend, chat(hi, extra={"fail_status": 400}))
    assert "fake upstream failure 400" in info.value.message
    assert upstream.requests[-1]["fail_status"] == 400  # an unknown field, carried
    with pytest.raises(E.InvalidRequest, match="fake upstream failure 422"):
        await collect(backend, chat(hi, extra={"fail_status": 422}))
    with pytest.raises(E.EngineError, match=r"503: fake upstream failure 503"):
        await collect(backend, chat(hi, extra={"fail_status": 503}))
    with pytest.raises(E.InvalidRequest, match="max_tokens"):
        backend.generate(chat(hi, max_tokens=0))


@pytest.mark.unit
async def test_max_tokens_beyond_the_upstreams_context_is_refused_before_it_is_asked() -> None:
    up = FakeUpstream(max_model_len=100)
    await up.start()
    cfg = WorkerSettings(
        backend="openai",
        model="tb-model",
        openai=OpenAIUpstreamSettings(upstream_url=up.url, upstream_model="upstream-model"),
    )
    b = OpenAIUpstreamBackend(cfg)
    await b.start()
    up.requests.clear()  # the capability probes (upstream_caps.py)
    try:
        assert b.max_model_len == 100  # read from the upstream's /v1/models
        hi = [{"role": "user", "content": "hi"}]
        for n in (100, 10**12):
            with pytest.raises(E.InvalidRequest, match="maximum context length is 100") as info:
                b.generate(chat(hi, max_tokens=n))
            assert info.value.param == "max_tokens"
        assert up.requests == []  # never sent on
        out = await collect(b, chat(hi, max_tokens=2))
        assert out[-1].finish_reason == "length"
    finally:
        await b.stop()
        await up.stop()


@pytest.mark.unit
async def test_unreachable_upstream() -> None:
    cfg = WorkerSettings(
        backend="openai",
        openai=OpenAIUpstreamSettings(upstream_url="http://127.0.0.1:9/v1"),
    )
    b = OpenAIUpstreamBackend(cfg)
    await b.start()
    try:
        with pytest.raises(E.EngineError, match="the upstream failed"):
            await collect(b, chat([{"role": "user", "content": "hi"}]))
        assert b.stats()["running"] == 0
    finally:
        await b.stop()


@pytest.mark.unit
async def test_embeddings(backend: OpenAIUpstreamBackend, upstream: FakeUpstream) -> None:
    req = GenerationRequest(
        request_id="e1",
        kind="embeddings",
        model="tb-model",
        max_tokens=1,
        input=["a cat", "a dog sat"],
        extra={"dimensions": 4, "encoding_format": "base64", "user": "u-1"},
    )
    out = await backend.embed(req)
    sent = upstream.requests[-1]
    assert sent == {
        "dimensions": 4,
        "encoding_format": "float",
        "user": "u-1",
        "model": "upstream-model",
        "input": ["a cat", "a dog sat"],
    }
    assert len(out.vectors) == 2 and all(len(v) == 4 for v in out.vectors)
    assert out.vectors[0] != out.vectors[1]
    assert out.prompt_tokens == 5
    again = await backend.embed(req)
    assert again.vectors == out.vectors  # deterministic

    req.extra = {}
    assert all(len(v) == 8 for v in (await backend.embed(req)).vectors)
    req.extra = {"fail_status": 400}
    with pytest.raises(E.InvalidRequest, match="fake upstream failure 400"):
        await backend.embed(req)
    assert backend.endpoints() == ["chat", "completions"]


@pytest.mark.unit
async def test_resume(backend: OpenAIUpstreamBackend, upstream: FakeUpstream) -> None:
    hi = [{"role": "user", "content": "hi"}]
    before = len(upstream.requests)
    spent = chat(hi, max_tokens=8, resume_text="already said", resume_tokens=8)
    deltas = await collect(backend, spent)
    assert [(d.text, d.finish_reason) for d in deltas] == [("", "length")]
    assert len(upstream.requests) == before  # the upstream was never called

    await collect(backend, chat(hi, max_tokens=8, resume_text="hello", resume_tokens=1))
    sent = upstream.requests[-1]
    assert sent["max_tokens"] == 7
    assert sent["messages"] == [*hi, {"role": "assistant", "content": "hello"}]
    assert sent["continue_final_message"] is True and sent["add_generation_prompt"] is False

    req = GenerationRequest(
        request_id="r3",
        kind="completions",
        model="tb-model",
        max_tokens=8,
        prompt="Say:",
        resume_text=" hello",
        resume_tokens=1,
    )
    await collect(backend, req)
    assert upstream.requests[-1]["prompt"] == "Say: hello"


@pytest.mark.unit
async def test_closing_the_stream_aborts_the_upstream(
    backend: OpenAIUpstreamBackend, upstream: FakeUpstream
) -> None:
    req = chat([{"role": "user", "content": "hi"}], extra={"fake_chunk_delay_s": 0.05})
    gen = backend.generate(req)
    first = await anext(gen)
    assert first.text == "hello"
    await gen.aclose()
    assert backend.stats()["running"] == 0
    for _ in range(100):
        if upstream.aborted:
            break
        await asyncio.sleep(0.02)
    assert upstream.aborted == 1


@pytest.mark.unit
async def test_on_a_kept_connection_the_request_is_written_before_it_is_relayed(
    backend: OpenAIUpstreamBackend, upstream: FakeUpstream
) -> None:
    # The first request opens the connection the second finds kept.
    await collect(backend, chat([{"role": "user", "content": "one"}]))
    n = len(upstream.requests)
    gen = backend.generate(chat([{"role": "user", "content": "two"}]))
    # Nobody reads the stream yet: the upstream has the request and answers it (the worker
    # acknowledges and sets up its relay meanwhile); what came is held for the reader.
    await wait_for(lambda: len(upstream.requests) == n + 1, what="the upstream got the request")
    assert upstream.requests[-1]["messages"] == [{"role": "user", "content": "two"}]
    assert backend.stats()["running"] == 1
    # Some of the answer arrives before anyone reads it: held, then handed over in order.
    await wait_for(lambda: gen._early is not None and gen._early.held, what="held deltas")
    got: list[Delta] = []
    async with contextlib.aclosing(gen):
        await gen.push(got.append)
    assert "".join(d.text for d in got) == "hello from upstream"
    assert got[-1].finish_reason == "stop" and got[-1].prompt_tokens > 0
    assert backend.stats()["running"] == 0
    # Read as any stream, the same.
    again = [d async for d in backend.generate(chat([{"role": "user", "content": "three"}]))]
    assert "".join(d.text for d in again) == "hello from upstream"


@pytest.mark.unit
async def test_a_request_written_early_and_never_relayed_is_aborted_at_the_upstream(
    backend: OpenAIUpstreamBackend, upstream: FakeUpstream
) -> None:
    await collect(backend, chat([{"role": "user", "content": "one"}]))
    req = chat([{"role": "user", "content": "hi"}], extra={"fake_chunk_delay_s": 0.05})
    n = len(upstream.requests)
    gen = backend.generate(req)
    await wait_for(lambda: len(upstream.requests) == n + 1, what="the upstream got the request")
    # The worker's acknowledgement failed, or its caller cancelled: the stream is closed.
    await gen.aclose()
    assert backend.stats()["running"] == 0
    await wait_for(lambda: upstream.aborted == 1, what="the upstream saw its client go")
    # The next request does not find the aborted connection kept.
    assert (
        "".join(d.text for d in await collect(backend, chat([{"role": "user", "content": "x"}])))
        == "hello from upstream"
    )


@pytest.mark.stack
def test_fake_upstream_runs_as_a_process() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.fakes.upstream", "--port", "0"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().split()
        assert line[0] == "READY"
        port = int(line[1])

        async def use() -> None:
            base = f"http://127.0.0.1:{port}/v1"
            async with aiohttp.ClientSession() as s:
                async with s.get(base + "/models") as resp:
                    assert (await resp.json())["data"][0]["id"] == "upstream-model"
                body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "foo": 1}
                async with s.post(base + "/chat/completions", json=body) as resp:
                    answer = await resp.json()
                assert answer["choices"][0]["message"]["content"] == "hello from upstream"
                async with s.get(base + "/last_request") as resp:
                    assert await resp.json() == body

        asyncio.run(use())
    finally:
        proc.terminate()
        assert proc.wait(10) == 0


@pytest.mark.unit
async def test_raw_event_stream_parsing() -> None:
    """Events split anywhere, CRLF line ends, comments, multi-line data, vendor fields, an
    unknown finish reason and a last event without its blank line all parse."""

    def event(obj: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(obj).encode() + b"\r\n\r\n"

    def choice(**kw: Any) -> dict[str, Any]:
        return {"choices": [{"index": 0, "finish_reason": None, **kw}]}

    stream = b"".join(
        [
            b": keep-alive comment\n\n",
            event(choice(delta={"role": "assistant"})),
            event(choice(delta={"reasoning": "hmm"})),
            b'data: {"choices": [{"index": 0,\ndata: "delta": {"content": "Hi"}}]}\n\n',
            event(choice(delta={"refusal": "no"})),
            event(choice(delta={"content": "x"}, index=1)),  # another choice: not served
            event(choice(delta={}, finish_reason="abort")),
            b'data: {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}',
        ]
    )

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(0, len(stream), 7):
            await resp.write(stream[i : i + 7])
        await resp.write_eof()
        return resp

    async def failing(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(event(choice(delta={"content": "a"})))
        await resp.write(event({"error": {"message": "bad guided_json", "code": 400}}))
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    app.router.add_post("/v2/chat/completions", failing)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        for version in ("v1", "v2"):
            cfg = WorkerSettings(
                backend="openai",
                openai=OpenAIUpstreamSettings(upstream_url=f"http://127.0.0.1:{port}/{version}"),
            )
            b = OpenAIUpstreamBackend(cfg)
            await b.start()
            try:
                if version == "v1":
                    deltas = await collect(b, chat([{"role": "user", "content": "hi"}]))
                    got = [(d.text, d.reasoning, d.refusal, d.tokens) for d in deltas[:-1]]
                    assert got == [("", "hmm", None, 1), ("Hi", None, None, 1), ("", None, "no", 1)]
                    final = deltas[-1]
                    assert final.finish_reason == "stop"
                    assert (final.prompt_tokens, final.completion_tokens) == (5, 2)
                    assert final.usage is None
                else:
                    with pytest.raises(E.InvalidRequest, match="bad guided_json"):
                        await collect(b, chat([{"role": "user", "content": "hi"}]))
            finally:
                await b.stop()
    finally:
        await runner.cleanup()
