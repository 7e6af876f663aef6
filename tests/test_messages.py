"""Anthropic's Messages API (``/v1/messages``) end to end: real processes on a real bus (the
full pipeline, keys checked), driven by the official ``anthropic`` SDK and the tokenbus NATS
client; and the translation (:mod:`dialects.anthropic`) on its own.

One stack for the module: a sim worker (exact, deterministic answers), an ``openai``-backend
worker in front of the fake upstream (to see what reached the engine, and reasoning), the
auth / ratelimit / filter / ingress / router services (the NATS path) and the bridge.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anthropic
import pytest

from bus_schemas import errors as E
from dialects import anthropic as M
from engine_worker.backends.base import GenerationRequest
from engine_worker.backends.sim import count_tokens, expected_text
from engine_worker.backends.sim_outputs import expected_tool_call
from filter.policy import FilterPolicy
from filter.scanner import Scanner
from services.caller import Chunk, Usage
from tests.support.busdata import key_store, new_model
from tests.support.natsserver import NatsServer
from tests.support.procs import Procs, ProcStack, start_stack, start_worker
from tests.support.upstreams import Upstream
from tests.support.waits import wait_replicas
from tokenbus import Client

PIPELINE = {"TOKENBUS_INGRESS__PIPELINE": '["auth", "ratelimit", "filter", "route"]'}
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {"name": "get_weather", "description": "The weather in a city.", "input_schema": SCHEMA}
CHAT_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": SCHEMA,
    },
}


@dataclass
class Env:
    stack: ProcStack
    model: str
    up_model: str
    upstream: Upstream
    url: str
    key: str

    def sdk(self, **kw: Any) -> anthropic.AsyncAnthropic:
        """The anthropic SDK pointed at the bridge (x-api-key unless told), no retries."""
        kw.setdefault("api_key", self.key)
        return anthropic.AsyncAnthropic(base_url=self.stack.base, max_retries=0, **kw)


@pytest.fixture(scope="module")
async def env(
    nats_server: NatsServer, upstream: Upstream, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Env]:
    async with key_store(nats_server.url) as keys:
        key, _ = await keys.create("messages-a")
    with Procs(nats_server.url, tmp_path_factory.mktemp("messages")) as ps:
        up_model = new_model()
        start_worker(
            ps, up_model, "up", "--backend", "openai", "--upstream-url", upstream.url, env=PIPELINE
        )
        stack = await start_stack(
            ps,
            new_model(),
            "auth",
            "ratelimit",
            "filter",
            "ingress",
            "router",
            workers=1,
            worker_args=("--sim-prefill-ms", "2", "--sim-decode-ms", "1"),
            env=PIPELINE,
        )
        await wait_replicas(nats_server.url, up_model, 1)
        yield Env(stack, stack.model, up_model, upstream, nats_server.url, key)


@pytest.fixture
async def sdk(env: Env) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with env.sdk() as c:
        yield c


def _sim(model: str, messages: list[dict[str, Any]], **extra: Any) -> GenerationRequest:
    """What the sim worker sees for a chat request (to ask the sim what it will answer)."""
    return GenerationRequest(
        request_id="x",
        kind="chat",
        model=model,
        max_tokens=extra.pop("max_tokens", 256),
        messages=messages,
        extra=extra,
    )


# -- create, whole; keys and errors ------------------------------------------------------------
@pytest.mark.stack
async def test_create_whole_with_the_sdk(env: Env, sdk: anthropic.AsyncAnthropic) -> None:
    out = await sdk.messages.create(
        model=env.model,
        max_tokens=12,
        system="be brief",
        messages=[{"role": "user", "content": "hello there"}],
        metadata={"user_id": "u-1"},
        extra_body={"temperature": 0.5, "top_k": 5},
    )
    want = expected_text("<|system|>be brief\n<|user|>hello there\n", 12)[0]
    assert [b.type for b in out.content] == ["text"]
    assert out.content[0].text == want  # type: ignore[union-attr]
    assert out.stop_reason == "max_tokens" and out.stop_sequence is None
    assert out.id.startswith("msg_") and out.type == "message" and out.role == "assistant"
    assert out.model == env.model
    assert out.usage.output_tokens == 12
    assert out.usage.input_tokens == count_tokens("<|system|>be brief\n<|user|>hello there\n")
    assert out.usage.cache_read_input_tokens == 0


@pytest.mark.stack
async def test_bearer_auth_as_claude_code_sends_it(env: Env) -> None:
    # ANTHROPIC_AUTH_TOKEN: `Authorization: Bearer`, no x-api-key; the version and beta
    # headers Claude Code sends are taken.
    async with env.sdk(
        api_key=None,
        auth_token=env.key,
        default_headers={"anthropic-beta": "interleaved-thinking-2025-05-14"},
    ) as c:
        out = await c.messages.create(
            model=env.model,
            max_tokens=4,
            system=[{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}],
            messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        )
    assert out.content[0].text == expected_text("<|system|>be brief\n<|user|>hi\n", 4)[0]  # type: ignore[union-attr]


@pytest.mark.stack
async def test_a_wrong_key_is_refused_in_anthropic_s_shape(env: Env) -> None:
    for kw in ({"api_key": "tb-wrong"}, {"api_key": None, "auth_token": "tb-wrong"}):
        async with env.sdk(**kw) as c:
            with pytest.raises(anthropic.AuthenticationError) as ei:
                await c.messages.create(
                    model=env.model, max_tokens=4, messages=[{"role": "user", "content": "hi"}]
                )
        assert ei.value.status_code == 401
        body: Any = ei.value.body
        assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
        assert body["error"]["message"]


@pytest.mark.stack
async def test_another_tenants_key_is_refused_the_model_in_anthropic_s_shape(env: Env) -> None:
    # A key of another tenant, allowed only the other model: this one is refused with 403
    # permission_error, and its own model is served to it.
    async with key_store(env.url) as keys:
        other, _ = await keys.create("messages-b", models=[env.up_model])
    msgs: Any = [{"role": "user", "content": "hi"}]
    async with env.sdk(api_key=other) as c:
        for _ in range(50):  # the auth service learns the new key from its watched bucket
            try:
                await c.messages.create(model=env.up_model, max_tokens=2, messages=msgs)
                break
            except anthropic.AuthenticationError:
                await asyncio.sleep(0.1)
        with pytest.raises(anthropic.PermissionDeniedError) as ei:
            await c.messages.create(model=env.model, max_tokens=2, messages=msgs)
    body: Any = ei.value.body
    assert ei.value.status_code == 403
    assert body["type"] == "error" and body["error"]["type"] == "permission_error"


@pytest.mark.stack
async def test_bad_fields_get_anthropic_s_errors_with_their_status(
    env: Env, sdk: anthropic.AsyncAnthropic
) -> None:
    hi = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.BadRequestError) as ei:
        await sdk.messages.create(
            model=env.model,
            max_tokens=4,
            messages=hi,  # type: ignore[arg-type]
            extra_body={"temperature": 1.5},
        )
    assert ei.value.status_code == 400
    body: Any = ei.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith("temperature:")
    with pytest.raises(anthropic.NotFoundError) as nf:
        await sdk.messages.create(model="no-such-model", max_tokens=4, messages=hi)  # type: ignore[arg-type]
    assert nf.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    # Raw HTTP: what the SDK would not send.
    hdrs = {"x-api-key": env.key, "anthropic-version": "2023-06-01"}
    cases: list[tuple[Any, str]] = [
        ({"model": env.model, "messages": hi}, "max_tokens:"),
        ({"model": env.model, "max_tokens": 4, "messages": []}, "messages:"),
        (
            {"model": env.model, "max_tokens": 4, "messages": [{"role": "tool", "content": "x"}]},
            "messages.0.role:",
        ),
        (
            {
                "model": env.model,
                "max_tokens": 4,
                "messages": [
                    {"role": "user", "content": [{"type": "image", "source": {"type": "file"}}]}
                ],
            },
            "messages.0.content.0.source.file_id:",  # a file source names a file
        ),
        (
            {
                "model": env.model,
                "max_tokens": 4,
                "messages": [
                    {"role": "user", "content": [{"type": "image", "source": {"type": "s3"}}]}
                ],
            },
            "messages.0.content.0.source.type:",
        ),
        (
            {
                "model": env.model,
                "max_tokens": 4,
                "messages": hi,
                "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            },
            "tools.0.type:",
        ),
        (
            {
                "model": env.model,
                "max_tokens": 4,
                "messages": hi,
                "tools": [WEATHER],
                "tool_choice": {"type": "tool", "name": "nope"},
            },
            "tool_choice.name:",
        ),
        ({"model": env.model, "max_tokens": 4, "messages": hi, "stop": ["x"]}, "stop:"),
    ]
    async with env.stack.http(headers=hdrs) as h:
        for body, starts in cases:
            r = await h.post("/v1/messages", json=body)
            assert r.status_code == 400, (body, r.text)
            got = r.json()
            assert got["type"] == "error" and got["error"]["type"] == "invalid_request_error"
            assert got["error"]["message"].startswith(starts), got
        r = await h.post("/v1/messages", content=b"{not json")
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        r = await h.get("/v1/messages")
        assert r.status_code == 405 and r.json()["type"] == "error"
        r = await h.post("/v1/messages/batches", json={})
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


# -- streamed ----------------------------------------------------------------------------------
@pytest.mark.stack
async def test_create_streamed_with_the_sdk_stream_helper(
    env: Env, sdk: anthropic.AsyncAnthropic
) -> None:
    full = expected_text("<|user|>tell me a story\n", 40)[0]
    stop = " " + full.split(" ")[6]
    want = full[: full.find(stop)]
    types: list[str] = []
    async with sdk.messages.stream(
        model=env.model,
        max_tokens=40,
        messages=[{"role": "user", "content": "tell me a story"}],
        stop_sequences=[stop],
    ) as stream:
        text = ""
        async for ev in stream:
            types.append(ev.type)
            if ev.type == "text":
                text += ev.text
        final = await stream.get_final_message()
    assert text == want
    assert final.content[0].text == want  # type: ignore[union-attr]
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    assert final.usage.output_tokens >= 5
    assert final.usage.input_tokens == count_tokens("<|user|>tell me a story\n")
    # The raw events (the helper adds its own `text` events beside them).
    raw = [t for t in types if t != "text"]
    n = raw.count("content_block_delta")
    assert n >= 5
    assert raw == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * n,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]


@pytest.mark.stack
async def test_raw_stream_events_as_anthropic_sends_them(env: Env) -> None:
    hdrs = {"x-api-key": env.key, "anthropic-version": "2023-06-01"}
    body = {
        "model": env.model,
        "max_tokens": 6,
        "stream": True,
        "messages": [{"role": "user", "content": "hello there"}],
    }
    async with env.stack.http(headers=hdrs) as h, h.stream("POST", "/v1/messages", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = "".join([t async for t in r.aiter_text()])
    events = []
    for block in raw.strip().split("\n\n"):
        name, data = block.split("\n")
        ev = json.loads(data.removeprefix("data: "))
        assert name == f"event: {ev['type']}"
        events.append(ev)
    assert [e["type"] for e in events[:3]] == ["message_start", "ping", "content_block_start"]
    start = events[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["role"] == "assistant"
    assert events[2] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert all(d["type"] == "text_delta" for d in deltas)
    assert "".join(d["text"] for d in deltas) == expected_text("<|user|>hello there\n", 6)[0]
    assert events[-3] == {"type": "content_block_stop", "index": 0}
    delta = events[-2]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 6
    assert events[-1] == {"type": "message_stop"}


@pytest.mark.stack
async def test_an_error_before_the_first_token_keeps_its_status_when_streamed(
    env: Env, sdk: anthropic.AsyncAnthropic
) -> None:
    with pytest.raises(anthropic.NotFoundError):
        async with sdk.messages.stream(
            model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        ) as stream:
            await stream.get_final_message()


# -- tools, images, thinking, count_tokens ---------------------------------------------------
@pytest.mark.stack
async def test_tool_round_trip(env: Env, sdk: anthropic.AsyncAnthropic) -> None:
    ask = [{"role": "user", "content": "weather in Paris?"}]
    first = await sdk.messages.create(
        model=env.model,
        max_tokens=64,
        messages=ask,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "any"},
    )
    assert first.stop_reason == "tool_use"
    assert [b.type for b in first.content] == ["tool_use"]
    use = first.content[0]
    assert use.type == "tool_use"
    want = expected_tool_call(_sim(env.model, ask, tools=[CHAT_WEATHER]))
    assert want is not None
    assert (use.id, use.name, use.input) == (want[0], want[1], json.loads(want[2]))
    second = await sdk.messages.create(
        model=env.model,
        max_tokens=8,
        tools=[WEATHER],  # type: ignore[list-item]
        messages=[
            *ask,  # type: ignore[list-item]
            {"role": "assistant", "content": first.content},  # type: ignore[list-item]
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}],
            },
        ],
    )
    # The engine saw the whole conversation: the question, its call, the call's result.
    prompt = f"<|user|>weather in Paris?\n<|assistant|>get_weather({want[2]})\n<|tool|>sunny\n"
    assert second.content[0].text == expected_text(prompt, 8)[0]  # type: ignore[union-attr]
    assert second.stop_reason == "max_tokens"


@pytest.mark.stack
async def test_streamed_tool_use(env: Env, sdk: anthropic.AsyncAnthropic) -> None:
    ask = [{"role": "user", "content": "weather?"}]
    partial = ""
    async with sdk.messages.stream(
        model=env.model,
        max_tokens=64,
        messages=ask,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "tool", "name": "get_weather"},
    ) as stream:
        async for ev in stream:
            if ev.type == "content_block_delta" and ev.delta.type == "input_json_delta":
                partial += ev.delta.partial_json
        final = await stream.get_final_message()
    want = expected_tool_call(_sim(env.model, ask, tools=[CHAT_WEATHER]))
    assert want is not None and partial == want[2]
    assert final.stop_reason == "tool_use"
    use = final.content[0]
    assert use.type == "tool_use" and use.input == json.loads(want[2]) and use.id == want[0]


@pytest.mark.stack
async def test_an_image_block_reaches_the_engine_as_an_image_url(
    env: Env, sdk: anthropic.AsyncAnthropic
) -> None:
    data = "iVBORw0KGgo="
    out = await sdk.messages.create(
        model=env.up_model,
        max_tokens=4,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is this?"},
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": data},
                    },
                    {"type": "image", "source": {"type": "url", "url": "https://x.test/a.png"}},
                ],
            }
        ],
        stop_sequences=["zzz"],
        metadata={"user_id": "u-7"},
        extra_body={"top_k": 3, "temperature": 0.2},
    )
    assert out.content[0].text  # type: ignore[union-attr]
    got = await env.upstream.last_request()
    assert got["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what is this?"},
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
                {"type": "image_url", "image_url": {"url": "https://x.test/a.png"}},
            ],
        }
    ]
    assert got["max_tokens"] == 4 and got["stop"] == ["zzz"] and got["user"] == "u-7"
    assert got["top_k"] == 3 and got["temperature"] == 0.2


@pytest.mark.stack
async def test_thinking_comes_from_the_engine_s_reasoning(
    env: Env, sdk: anthropic.AsyncAnthropic
) -> None:
    kw: dict[str, Any] = {
        "model": env.up_model,
        "max_tokens": 2048,
        "messages": [{"role": "user", "content": "think first"}],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
    }
    out = await sdk.messages.create(**kw)
    assert [b.type for b in out.content] == ["thinking", "text"]
    assert out.content[0].thinking == "thinking"  # type: ignore[union-attr]
    assert out.content[1].text == "hello from upstream"  # type: ignore[union-attr]
    got = await env.upstream.last_request()
    assert got["chat_template_kwargs"]["enable_thinking"] is True
    async with sdk.messages.stream(**kw) as stream:
        deltas = {ev.delta.type async for ev in stream if ev.type == "content_block_delta"}
        final = await stream.get_final_message()
    assert {"thinking_delta", "text_delta"} <= deltas
    assert {b.type for b in final.content} == {"thinking", "text"}
    # The thinking goes back with the next turn as the assistant's reasoning.
    await sdk.messages.create(
        **{
            **kw,
            "messages": [
                *kw["messages"],
                {"role": "assistant", "content": out.content},
                {"role": "user", "content": "and then?"},
            ],
        }
    )
    got = await env.upstream.last_request()
    assert got["messages"][1] == {
        "role": "assistant",
        "content": "hello from upstream",
        "reasoning_content": "thinking",
    }


@pytest.mark.stack
async def test_count_tokens(env: Env, sdk: anthropic.AsyncAnthropic) -> None:
    out = await sdk.messages.count_tokens(
        model=env.model,
        system="be brief",
        messages=[{"role": "user", "content": "count me, please"}],
    )
    assert out.input_tokens == count_tokens("<|system|>be brief\n<|user|>count me, please\n")
    with pytest.raises(anthropic.BadRequestError):
        await sdk.messages.count_tokens(model=env.model, messages=[])


# -- stop_reason: which stop sequence ended it --------------------------------------------------
def _ends_on_its_own(max_tokens: int) -> tuple[str, str]:
    """(a user message whose sim answer ends on its own before ``max_tokens``, the answer)."""
    for i in range(500):
        text, finish = expected_text(f"<|user|>question {i}\n", max_tokens)
        if finish == "stop":
            return f"question {i}", text
    raise AssertionError("no answer ends on its own")


@pytest.mark.stack
async def test_an_answer_that_ends_on_its_own_is_end_turn_despite_stop_sequences(
    env: Env, sdk: anthropic.AsyncAnthropic
) -> None:
    """Stop sequences asked, none hit: the model stopped on its own, ``end_turn`` with no
    ``stop_sequence`` (whole, streamed, and from the NATS client); one that hits is named."""
    content, want = _ends_on_its_own(400)
    assert "zzzz" not in want and "qqqq" not in want
    kw: dict[str, Any] = {
        "model": env.model,
        "max_tokens": 400,
        "messages": [{"role": "user", "content": content}],
        "stop_sequences": ["zzzz", "qqqq"],
    }
    out = await sdk.messages.create(**kw)
    assert out.content[0].text == want  # type: ignore[union-attr]
    assert (out.stop_reason, out.stop_sequence) == ("end_turn", None)
    async with sdk.messages.stream(**kw) as stream:
        final = await stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("end_turn", None)
    # The second of two stop sequences is the one that hits.
    stop = " " + want.split(" ")[3]
    hit = {**kw, "stop_sequences": ["zzzz", stop]}
    out = await sdk.messages.create(**hit)
    assert out.content[0].text == want[: want.find(stop)]  # type: ignore[union-attr]
    assert (out.stop_reason, out.stop_sequence) == ("stop_sequence", stop)
    async with await Client.connect(env.url, api_key=env.key) as tb:
        body = {k: v for k, v in kw.items() if k not in ("model", "messages")}
        msg = await tb.message(env.model, kw["messages"], **body)
        assert (msg["stop_reason"], msg["stop_sequence"]) == ("end_turn", None)
        events = tb.messages(env.model, kw["messages"], **{**body, "stop_sequences": [stop]})
        seen = [ev async for ev in events]
        delta = next(ev for ev in seen if ev["type"] == "message_delta")
        assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}


# -- the NATS client ---------------------------------------------------------------------------
@pytest.mark.stack
async def test_the_nats_client_serves_the_same_operation(env: Env) -> None:
    hello = [{"role": "user", "content": "hello there"}]
    async with await Client.connect(env.url, api_key=env.key) as tb:
        out = await tb.message(env.model, hello, max_tokens=12, system="be brief")
        assert out["content"] == [
            {
                "type": "text",
                "text": expected_text("<|system|>be brief\n<|user|>hello there\n", 12)[0],
            }
        ]
        assert out["stop_reason"] == "max_tokens" and out["usage"]["output_tokens"] == 12
        events = tb.messages(
            env.model,
            [{"role": "user", "content": "weather?"}],
            max_tokens=64,
            tools=[WEATHER],
            tool_choice={"type": "any"},
        )
        seen = [ev async for ev in events]
        assert seen[0]["type"] == "message_start" and seen[-1]["type"] == "message_stop"
        assert events.message is not None and events.message["stop_reason"] == "tool_use"
        assert events.message["content"][0]["name"] == "get_weather"
        n = await tb.count_tokens(env.model, hello)
        assert n == count_tokens("<|user|>hello there\n")
        with pytest.raises(E.InvalidRequest) as ei:
            tb.messages(env.model, hello, max_tokens=4, tool_choice={"type": "any"})
        assert ei.value.param == "tool_choice"
        with pytest.raises(E.ModelNotFound):
            await tb.message("no-such-model", hello, max_tokens=4)


@pytest.mark.stack
async def test_tool_results_are_filtered_as_on_chat(
    env: Env, sdk: anthropic.AsyncAnthropic
) -> None:
    secret = "use the key AKIAIOSFODNN7EXAMPLE please"
    redacted = Scanner(FilterPolicy()).scan(secret).redacted_text
    assert "AKIA" not in redacted
    out = await sdk.messages.create(
        model=env.model,
        max_tokens=5,
        messages=[
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "c1", "name": "get_weather", "input": {}}],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "c1", "content": secret}],
            },
        ],
    )
    prompt = f"<|user|>weather?\n<|assistant|>get_weather({{}})\n<|tool|>{redacted}\n"
    assert out.content[0].text == expected_text(prompt, 5)[0]  # type: ignore[union-attr]


# -- the translation on its own --------------------------------------------------------------
def _chat(body: dict[str, Any]) -> dict[str, Any]:
    return M.translate(M.parse(body), body)


@pytest.mark.unit
def test_blocks_become_chat_messages() -> None:
    chat = _chat(
        {
            "model": "m",
            "max_tokens": 100,
            "system": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}],
                },
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hmm", "signature": "s"},
                        {"type": "redacted_thinking", "data": "opaque"},
                        {"type": "text", "text": "calling"},
                        {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}},
                        {"type": "tool_use", "id": "t2", "name": "g", "input": {}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t1",
                            "content": [{"type": "text", "text": "one"}],
                        },
                        {
                            "type": "tool_result",
                            "tool_use_id": "t2",
                            "content": "boom",
                            "is_error": True,
                        },
                        {"type": "text", "text": "go on"},
                        {
                            "type": "document",
                            "source": {"type": "text", "media_type": "text/plain", "data": "doc"},
                        },
                    ],
                },
            ],
            "tools": [
                {"name": "f", "input_schema": {"type": "object"}},
                {"name": "g", "input_schema": {}},
            ],
            "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
            "thinking": {"type": "disabled"},
            "output_config": {"effort": "max"},
            "cache_control": {"type": "ephemeral"},
            "chat_template_kwargs": {"thinking": True},
            "min_tokens": 2,
        }
    )
    assert chat["messages"] == [
        {"role": "system", "content": "a\nb"},
        {"role": "user", "content": "x\ny"},
        {
            "role": "assistant",
            "content": "calling",
            "reasoning_content": "hmm",
            "tool_calls": [
                {
                    "id": "t1",
                    "type": "function",
                    "function": {"name": "f", "arguments": '{"a": 1}'},
                },
                {"id": "t2", "type": "function", "function": {"name": "g", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "one"},
        {"role": "tool", "tool_call_id": "t2", "content": "Error:\nboom"},
        {"role": "user", "content": "go on\ndoc"},
    ]
    assert chat["tools"][0] == {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object"}},
    }
    assert chat["tool_choice"] == "auto" and chat["parallel_tool_calls"] is False
    # The request's own template switches win over the ones thinking sets.
    assert chat["chat_template_kwargs"] == {"enable_thinking": False, "thinking": True}
    assert chat["reasoning_effort"] == "high"
    assert chat["min_tokens"] == 2 and "cache_control" not in chat
    assert "continue_final_message" not in chat


@pytest.mark.unit
def test_a_last_assistant_turn_is_a_prefill_and_choices_map() -> None:
    body: dict[str, Any] = {
        "model": "m",
        "max_tokens": 5,
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure,"}],
        "tools": [{"name": "f", "input_schema": {}}],
    }
    chat = _chat(body)
    assert chat["continue_final_message"] is True and chat["add_generation_prompt"] is False
    for choice, want in [
        ({"type": "any"}, "required"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "f"}, {"type": "function", "function": {"name": "f"}}),
    ]:
        assert _chat({**body, "tool_choice": choice})["tool_choice"] == want
    counted = M.count_request(_chat({**body, "stop_sequences": ["x"]}))
    assert counted["max_tokens"] == 1 and "stop" not in counted


@pytest.mark.unit
@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "5"}, "max_tokens"),
        ({"stream": "yes"}, "stream"),
        ({"top_k": -1}, "top_k"),
        ({"system": [{"type": "image"}]}, "system.0"),
        ({"metadata": {"user_id": 5}}, "metadata.user_id"),
        ({"metadata": {"other": "x"}}, "metadata.other"),
        ({"thinking": {"type": "enabled", "budget_tokens": 99}}, "thinking.budget_tokens"),
        ({"thinking": {"type": "sometimes"}}, "thinking.type"),
        ({"tools": [{"name": "f"}]}, "tools.0.input_schema"),
        ({"tools": [{"name": "bad name", "input_schema": {}}]}, "tools.0.name"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
        ({"mcp_servers": [{}]}, "mcp_servers"),
        ({"max_completion_tokens": 5}, "max_completion_tokens"),
        ({"output_config": {"effort": "huge"}}, "output_config.effort"),
        ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format.schema"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_use"}]}]},
            "messages.0.content.0.type",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "t", "name": "f", "input": []}],
                    }
                ]
            },
            "messages.0.content.0.input",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
            "messages.0.content.0.tool_use_id",
        ),
    ],
)
def test_each_bad_field_is_a_400_naming_it(change: dict[str, Any], param: str) -> None:
    body = {
        "model": "m",
        "max_tokens": 5,
        "messages": [{"role": "user", "content": "hi"}],
        **change,
    }
    with pytest.raises(E.InvalidRequest) as ei:
        _chat(body)
    assert ei.value.param == param
    assert ei.value.message.startswith(f"{param}:")


@pytest.mark.unit
def test_the_builder_puts_thinking_first_and_maps_the_end() -> None:
    b = M.MessageBuilder("m", events=False, message_id="msg_1")
    b.add(Chunk("Hel", 1, 0))
    b.add(Chunk("lo", 1, 0))
    b.add(Chunk("", 0, 0, reasoning="why"))
    call = {
        "index": 0,
        "id": "c",
        "type": "function",
        "function": {"name": "f", "arguments": '{"a"'},
    }
    b.add(Chunk("", 0, 0, tool_calls=[call]))
    b.add(Chunk("", 0, 0, tool_calls=[{"index": 0, "function": {"arguments": ": 1}"}}]))
    usage = Usage(10, 4, 14, prompt_tokens_details={"cached_tokens": 3})
    msg, events = b.finish("tool_calls", usage)
    assert events == []
    assert msg == {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "m",
        "content": [
            {"type": "thinking", "thinking": "why", "signature": ""},
            {"type": "text", "text": "Hello"},
            {"type": "tool_use", "id": "c", "name": "f", "input": {"a": 1}},
        ],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {
            "input_tokens": 7,
            "output_tokens": 4,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 3,
        },
    }
    assert M.stop_reason("stop", None) == ("end_turn", None)
    # Stop sequences asked, none matched: the model stopped on its own.
    assert M.stop_reason("stop", None, ["a", "b"]) == ("end_turn", None)
    assert M.stop_reason("stop", "b", ["a", "b"]) == ("stop_sequence", "b")
    # A stop string the engine names that the request did not ask for is no stop sequence.
    assert M.stop_reason("stop", "c", ["a", "b"]) == ("end_turn", None)
    assert M.stop_reason("length", None, ["a"]) == ("max_tokens", None)
    assert M.stop_reason("content_filter", None) == ("refusal", None)


@pytest.mark.unit
def test_a_stream_that_fails_after_it_started_ends_with_an_error_event() -> None:
    b = M.MessageBuilder("m", events=True)
    assert [e["type"] for e in b.opening()] == ["message_start", "ping"]
    started = b.add(Chunk("hi", 1, 0))
    assert [e["type"] for e in started] == ["content_block_start", "content_block_delta"]
    (ev,) = b.fail(E.ReplicaLost("the replica went away"))
    assert ev["type"] == "error" and ev["error"]["type"] == "overloaded_error"
    assert "retryable" in ev["error"]["message"]
    assert M.sse(ev).startswith("event: error\ndata: {")
    # The statuses keep Anthropic's types.
    assert M.error_body(429, "slow down")["error"]["type"] == "rate_limit_error"
    assert M.error_body(413, "big")["error"]["type"] == "request_too_large"
    assert M.error_body(500, "oops")["error"]["type"] == "api_error"
    assert M.error_body(403, "no")["error"]["type"] == "permission_error"
