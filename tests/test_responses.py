"""The Responses API (``/v1/responses``) end to end: real processes on a real bus (the full
pipeline, keys checked), driven by the official ``openai`` SDK, the OpenAI Agents SDK and
the tokenbus NATS client.

One stack for the module: sim workers (exact, deterministic answers), an ``openai``-backend
worker in front of the fake upstream (to see what reached the engine, and reasoning), the
auth / ratelimit / filter / ingress / router services (the NATS path) and the bridge.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nats.js.api import DiscardPolicy
from openai.types.responses import (
    ResponseCompletedEvent,
    ResponseCustomToolCall,
    ResponseCustomToolCallInputDeltaEvent,
    ResponseCustomToolCallInputDoneEvent,
    ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent,
)
from pydantic import BaseModel

from auth.store import KeyStore
from bus_schemas import errors as E
from dialects.responses import ResponseBuilder, new_response_id, parse, translate, usage_of
from engine_worker.backends.base import GenerationRequest
from engine_worker.backends.sim import expected_structured, expected_text
from engine_worker.backends.sim_outputs import expected_tool_call
from filter.policy import FilterPolicy
from filter.scanner import Scanner
from jobs.response_store import ResponseStore, open_store
from services.caller import Chunk, Usage
from services.config import ResponsesSettings
from services.natsconf import role_login
from tests.lockedbus import LockedBus, serve_when_ready
from tests.support.busdata import key_store, new_model
from tests.support.natsserver import NatsServer, spawn_nats
from tests.support.ports import free_port
from tests.support.procs import Procs, ProcStack, start_stack, start_worker
from tests.support.upstreams import Upstream
from tests.support.waits import wait_for, wait_replicas
from tokenbus import Client
from tokenbus.client import _Stored

PIPELINE = {"TOKENBUS_INGRESS__PIPELINE": '["auth", "ratelimit", "filter", "route"]'}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
CHAT_WEATHER = {
    "type": "function",
    "function": {k: v for k, v in WEATHER.items() if k != "type"},
}


@dataclass
class Env:
    stack: ProcStack
    model: str
    up_model: str
    upstream: Upstream
    url: str
    key: str
    other: str


@pytest.fixture(scope="module")
async def env(
    nats_server: NatsServer, upstream: Upstream, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Env]:
    async with key_store(nats_server.url) as keys:
        key, _ = await keys.create("responses-a")
        other, _ = await keys.create("responses-b")
    with Procs(nats_server.url, tmp_path_factory.mktemp("responses")) as ps:
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
        yield Env(stack, stack.model, up_model, upstream, nats_server.url, key, other)


@pytest.fixture
async def oai(env: Env) -> AsyncIterator[openai.AsyncOpenAI]:
    async with env.stack.openai(env.key) as c:
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


# -- create, whole and streamed --------------------------------------------------------------
@pytest.mark.stack
async def test_create_whole_with_the_sdk(env: Env, oai: openai.AsyncOpenAI) -> None:
    out = await oai.responses.create(
        model=env.model, input="hello there", instructions="be brief", max_output_tokens=12
    )
    want = expected_text("<|system|>be brief\n<|user|>hello there\n", 12)[0]
    assert out.output_text == want
    assert out.status == "incomplete" and out.incomplete_details is not None
    assert out.incomplete_details.reason == "max_output_tokens"
    assert out.id.startswith("resp_") and out.object == "response" and out.model == env.model
    assert [i.type for i in out.output] == ["message"]
    assert out.usage is not None and out.usage.output_tokens == 12
    assert out.usage.total_tokens == out.usage.input_tokens + 12
    assert out.usage.input_tokens_details.cached_tokens == 0
    assert out.instructions == "be brief" and out.max_output_tokens == 12 and out.store


@pytest.mark.stack
async def test_create_streamed_with_the_sdk_stream_helper(
    env: Env, oai: openai.AsyncOpenAI
) -> None:
    full = expected_text("<|user|>tell me a story\n", 40)[0]
    stop = " " + full.split(" ")[6]
    want = full[: full.find(stop)]
    types: list[str] = []
    seqs: list[int] = []
    async with oai.responses.stream(
        model=env.model, input="tell me a story", max_output_tokens=40, extra_body={"stop": stop}
    ) as stream:
        deltas = ""
        async for ev in stream:
            types.append(ev.type)
            seqs.append(ev.sequence_number)
            if ev.type == "response.output_text.delta":
                deltas += ev.delta
        final = await stream.get_final_response()
    assert final.output_text == deltas == want
    assert final.status == "completed"
    assert seqs == list(range(len(seqs)))
    n = types.count("response.output_text.delta")
    assert n >= 5
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * n,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]


@pytest.mark.stack
async def test_raw_stream_ends_incomplete_at_max_output_tokens(
    env: Env, oai: openai.AsyncOpenAI
) -> None:
    stream = await oai.responses.create(
        model=env.model, input="hello there", max_output_tokens=6, stream=True
    )
    events = [ev async for ev in stream]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    last = events[-1]
    assert last.type == "response.incomplete"
    assert last.response.incomplete_details is not None
    assert last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.output_text == expected_text("<|user|>hello there\n", 6)[0]


@pytest.mark.stack
async def test_logprobs_come_back_on_the_output_text(env: Env, oai: openai.AsyncOpenAI) -> None:
    out = await oai.responses.create(
        model=env.model,
        input="hello there",
        max_output_tokens=5,
        include=["message.output_text.logprobs"],
        top_logprobs=2,
    )
    part = out.output[0].content[0]  # type: ignore[union-attr]
    assert part.type == "output_text" and part.logprobs is not None
    assert "".join(lp.token for lp in part.logprobs) == part.text
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in part.logprobs)


class City(BaseModel):
    name: str
    population: int


@pytest.mark.stack
async def test_parse_with_a_pydantic_text_format(env: Env, oai: openai.AsyncOpenAI) -> None:
    out = await oai.responses.parse(model=env.model, input="a city", text_format=City)
    assert isinstance(out.output_parsed, City)
    assert out.output_parsed == City.model_validate_json(out.output_text)
    assert out.status == "completed"
    # What the sim makes of the schema the SDK sent: its own instance of it, exactly.
    text = out.output_text
    schema = {**City.model_json_schema(), "additionalProperties": False}
    chat = [{"role": "user", "content": "a city"}]
    rf = {"type": "json_schema", "json_schema": {"name": "City", "schema": schema}}
    assert (
        json.loads(text).keys()
        == json.loads(expected_structured(_sim(env.model, chat, response_format=rf))).keys()
    )


# -- tools and state ------------------------------------------------------------------------
@pytest.mark.stack
async def test_function_tool_round_trip_with_previous_response_id(
    env: Env, oai: openai.AsyncOpenAI
) -> None:
    ask = [{"role": "user", "content": "weather in Paris?"}]
    first = await oai.responses.create(model=env.model, input="weather in Paris?", tools=[WEATHER])  # type: ignore[list-item]
    assert first.status == "completed"
    calls = [i for i in first.output if i.type == "function_call"]
    assert len(calls) == 1
    want = expected_tool_call(_sim(env.model, ask, tools=[CHAT_WEATHER]))
    assert want is not None
    call = calls[0]
    assert (call.call_id, call.name, call.arguments) == want
    second = await oai.responses.create(
        model=env.model,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        tools=[WEATHER],  # type: ignore[list-item]
        max_output_tokens=8,
    )
    # The engine saw the whole conversation: the question, its call, the call's result.
    prompt = (
        f"<|user|>weather in Paris?\n<|assistant|>{call.name}({call.arguments})\n<|tool|>sunny\n"
    )
    assert second.output_text == expected_text(prompt, 8)[0]
    assert second.previous_response_id == first.id


@pytest.mark.stack
async def test_streamed_tool_call_events(env: Env, oai: openai.AsyncOpenAI) -> None:
    stream = await oai.responses.create(
        model=env.model,
        input="weather?",
        tools=[WEATHER],
        tool_choice="required",
        stream=True,  # type: ignore[list-item]
    )
    events = [ev async for ev in stream]
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert types[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = events[-1].response.output[0]
    assert done.type == "function_call" and done.arguments == args
    assert json.loads(args)["city"]


@pytest.mark.stack
async def test_image_input_reaches_the_engine(env: Env, oai: openai.AsyncOpenAI) -> None:
    url = "data:image/png;base64,iVBORw0KGgo="
    content = [
        {"type": "input_text", "text": "what is this?"},
        {"type": "input_image", "image_url": url, "detail": "low"},
    ]
    out = await oai.responses.create(
        model=env.up_model,
        input=[{"role": "user", "content": content}],  # type: ignore[list-item, misc]
        max_output_tokens=4,
    )
    assert out.output_text
    got = await env.upstream.last_request()
    assert got["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what is this?"},
                {"type": "image_url", "image_url": {"url": url, "detail": "low"}},
            ],
        }
    ]
    assert got["max_tokens"] == 4


@pytest.mark.stack
async def test_reasoning_from_the_engine_is_a_reasoning_item(
    env: Env, oai: openai.AsyncOpenAI
) -> None:
    kw: dict[str, Any] = {
        "model": env.up_model,
        "input": "think first",
        "reasoning": {"effort": "low"},
        "extra_body": {"chat_template_kwargs": {"enable_thinking": True}},
    }
    out = await oai.responses.create(**kw)
    assert [i.type for i in out.output] == ["reasoning", "message"]
    assert out.output[0].content is not None  # type: ignore[union-attr]
    assert out.output[0].content[0].text == "thinking"  # type: ignore[union-attr]
    assert out.output_text == "hello from upstream"
    got = await env.upstream.last_request()
    assert got["reasoning_effort"] == "low"
    assert got["chat_template_kwargs"] == {"enable_thinking": True}
    stream = await oai.responses.create(**kw, stream=True)
    types = [e.type async for e in stream]
    # Under the output filter reasoning is held to the end and scanned whole, so its item
    # may come after the message's; its events are all there.
    assert {
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.output_text.delta",
    } <= set(types)


@pytest.mark.stack
async def test_stored_response_get_delete_and_another_keys_404(
    env: Env, oai: openai.AsyncOpenAI
) -> None:
    out = await oai.responses.create(
        model=env.model,
        input=[{"role": "user", "content": "remember me"}],
        max_output_tokens=3,
        metadata={"k": "v"},
    )
    got = await oai.responses.retrieve(out.id)
    assert got.id == out.id and got.output_text == out.output_text and got.metadata == {"k": "v"}
    items = await oai.responses.input_items.list(out.id)
    assert [(i.type, i.role) for i in items.data] == [("message", "user")]  # type: ignore[union-attr]
    async with env.stack.openai(env.other) as them:
        with pytest.raises(openai.NotFoundError):
            await them.responses.retrieve(out.id)
        with pytest.raises(openai.NotFoundError):
            await them.responses.delete(out.id)
        with pytest.raises(openai.NotFoundError):
            await them.responses.input_items.list(out.id)
        with pytest.raises(openai.NotFoundError):
            await them.responses.create(model=env.model, input="go on", previous_response_id=out.id)
    await oai.responses.delete(out.id)
    with pytest.raises(openai.NotFoundError):
        await oai.responses.retrieve(out.id)
    unstored = await oai.responses.create(
        model=env.model, input="forget me", max_output_tokens=2, store=False
    )
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        await oai.responses.retrieve(unstored.id)
    async with env.stack.openai("tb-000000000000_" + "A" * 43) as nobody:
        with pytest.raises(openai.AuthenticationError):
            await nobody.responses.retrieve(out.id)


@pytest.mark.stack
async def test_input_items_are_filtered_as_on_chat(env: Env, oai: openai.AsyncOpenAI) -> None:
    secret = "use the key AKIAIOSFODNN7EXAMPLE please"
    redacted = Scanner(FilterPolicy()).scan(secret).redacted_text
    assert "AKIA" not in redacted
    items: list[Any] = [
        {"role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": secret},
    ]
    out = await oai.responses.create(model=env.model, input=items, max_output_tokens=5)
    prompt = f"<|user|>weather?\n<|assistant|>get_weather({{}})\n<|tool|>{redacted}\n"
    assert out.output_text == expected_text(prompt, 5)[0]


# -- what OpenAI's document allows (tests/test_conformance_openapi.py found each) -----------
def _chat(body: dict[str, Any], previous: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    chat: dict[str, Any] = translate(parse(body), body, previous).chat
    return chat


CALLS = [
    {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
    {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{}"},
]


@pytest.mark.unit
def test_a_function_call_output_without_call_id_answers_the_first_call_without_one() -> None:
    outputs = [{"type": "function_call_output", "output": o} for o in ("sunny", "rain")]
    chat = _chat({"model": "m", "input": [*CALLS, *outputs]})
    tools = [m for m in chat["messages"] if m["role"] == "tool"]
    assert [(m["tool_call_id"], m["content"]) for m in tools] == [("c1", "sunny"), ("c2", "rain")]
    # The call may be in the conversation a previous_response_id continues.
    before = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c9", "type": "function"}]},
    ]
    chat = _chat({"model": "m", "input": outputs[:1]}, before)
    assert chat["messages"][-1] == {"role": "tool", "content": "sunny", "tool_call_id": "c9"}
    # Answering nothing known, it is a tool message of its own.
    chat = _chat({"model": "m", "input": [{"role": "user", "content": "x"}, outputs[0]]})
    assert chat["messages"][-1] == {"role": "tool", "content": "sunny"}


@pytest.mark.unit
def test_an_empty_call_id_is_an_id_like_any_other() -> None:
    # OpenAI's document makes call_id a string, with no minimum length (the fuzzer of
    # tests/test_conformance_openapi.py sends ""): a function_call takes it, so its output does.
    call = {**CALLS[0], "call_id": ""}
    for kind in ("function_call_output", "custom_tool_call_output"):
        out = {"type": kind, "call_id": "", "output": "sunny"}
        chat = _chat({"model": "m", "input": [call, out, out]})
        tools = [m for m in chat["messages"] if m["role"] == "tool"]
        assert [m["tool_call_id"] for m in tools] == ["", ""]
        assert chat["messages"][0]["tool_calls"][0]["id"] == ""


@pytest.mark.unit
def test_no_input_continues_the_previous_conversation_as_it_stands() -> None:
    before = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert _chat({"model": "m", "previous_response_id": "resp_x"}, before)["messages"] == before
    with pytest.raises(E.InvalidRequest, match="the conversation is empty"):
        _chat({"model": "m"})


@pytest.mark.unit
def test_allowed_tools_keep_the_request_s_tools_they_name() -> None:
    other = {**WEATHER, "name": "get_time"}
    allowed = [
        {"type": "function", "name": "get_time"},
        {"type": "mcp", "server_label": "deepwiki"},
        {"type": "function", "name": "not_in_tools"},
    ]
    body = {
        "model": "m",
        "input": "x",
        "tools": [WEATHER, other],
        "tool_choice": {"type": "allowed_tools", "mode": "required", "tools": allowed},
    }
    chat = _chat(body)
    assert chat["tool_choice"] == "required"
    assert [t["function"]["name"] for t in chat["tools"]] == ["get_time"]
    body["tool_choice"] = {"type": "allowed_tools", "mode": "auto", "tools": allowed[1:]}
    chat = _chat(body)
    assert chat["tool_choice"] == "none" and "tools" not in chat


@pytest.mark.unit
def test_prompt_null_top_p_0_and_integers_written_2_0_are_taken() -> None:
    body = {
        "model": "m",
        "input": "x",
        "prompt": None,
        "top_p": 0,
        "top_logprobs": 2.0,
        "max_output_tokens": 16.0,
    }
    chat = _chat(body)
    assert chat["top_p"] == 0 and "prompt" not in chat
    assert chat["top_logprobs"] == 2 and type(chat["top_logprobs"]) is int
    assert chat["max_completion_tokens"] == 16 and type(chat["max_completion_tokens"]) is int


@pytest.mark.unit
def test_usage_and_user_are_as_openai_s_document_has_them() -> None:
    u = usage_of(Usage(5, 2, 7, {"cached_tokens": 3}))
    assert u["input_tokens_details"] == {"cached_tokens": 3, "cache_write_tokens": 0}
    body = {"model": "m", "input": "x"}
    b = ResponseBuilder(translate(parse(body), body), events=True)
    created = b.opening()[0]["response"]
    # No usage yet, and no user: the document has no null for either.
    assert "usage" not in created and "user" not in created
    resp, _ = b.finish("stop", Usage(1, 1, 2))
    assert resp["usage"]["input_tokens_details"]["cache_write_tokens"] == 0


@pytest.mark.stack
async def test_requests_openai_documents_are_served(env: Env, oai: openai.AsyncOpenAI) -> None:
    first = await oai.responses.create(model=env.model, input="hi", max_output_tokens=4)
    auth = {"Authorization": f"Bearer {env.key}"}
    async with env.stack.http("/v1", headers=auth, timeout=30) as h:
        for body in (
            {"previous_response_id": first.id, "max_output_tokens": 3},
            {
                "input": "hi",
                "prompt": None,
                "top_p": 0,
                "top_logprobs": 2.0,
                "max_output_tokens": 3,
            },
            {"input": [*CALLS[:1], {"type": "function_call_output", "output": "sunny"}]},
        ):
            r = await h.post("/responses", json={"model": env.model, **body})
            assert r.status_code == 200, (body, r.text)
            assert r.json()["usage"]["input_tokens_details"]["cache_write_tokens"] == 0


# -- what Codex CLI sends ---------------------------------------------------------------------
SHELL = {
    "type": "function",
    "name": "shell",
    "description": "Runs a shell command.",
    "strict": False,
    "parameters": {
        "type": "object",
        "properties": {"command": {"type": "array", "items": {"type": "string"}}},
        "required": ["command"],
    },
}
# A namespace tool as Codex sends an MCP server's tools (mcp__<server>), first, so that the
# sim (which calls the first tool) calls a namespaced one.
DOCS = {
    "type": "namespace",
    "name": "mcp__docs",
    "description": "Tools of the docs MCP server.",
    "tools": [
        {
            "type": "function",
            "name": "search",
            "description": "Search the docs.",
            "strict": False,
            "defer_loading": False,
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}},
                "required": ["query"],
            },
        },
        {"type": "function", "name": "fetch", "parameters": {"type": "object", "properties": {}}},
    ],
}
# The namespace's tools as the engine sees them: flattened, the namespace's description first.
CHAT_DOCS = [
    {
        "type": "function",
        "function": {
            "name": "mcp__docs__search",
            "description": "Tools of the docs MCP server.\n\nSearch the docs.",
            "parameters": DOCS["tools"][0]["parameters"],  # type: ignore[index]
            "strict": False,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "mcp__docs__fetch",
            "description": "Tools of the docs MCP server.",
            "parameters": {"type": "object", "properties": {}},
        },
    },
]
CHAT_SHELL = {"type": "function", "function": {k: v for k, v in SHELL.items() if k != "type"}}


def codex_body(model: str, stream: bool) -> dict[str, Any]:
    """A first request as Codex CLI makes it to a custom provider (wire_api = "responses"):
    its instructions, the user's turn, function and namespace tools, and hosted web search,
    which Codex adds by default (``web_search = "cached"``)."""
    return {
        "model": model,
        "instructions": "You are Codex, a coding agent.",
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
        ],
        "tools": [DOCS, SHELL, {"type": "web_search", "external_web_access": False}],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "stream": stream,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0199a1b2-c3d4-7e5f-8a9b-codexsession",
        "client_metadata": {"x-codex-installation-id": "install-1"},
    }


async def _post(h: Any, body: dict[str, Any]) -> dict[str, Any]:
    """The final response object of ``body``, whole or read from its events."""
    if not body.get("stream"):
        r = await h.post("/responses", json=body)
        assert r.status_code == 200, r.text
        return dict(r.json())
    async with h.stream("POST", "/responses", json=body) as r:
        assert r.status_code == 200, await r.aread()
        events = [
            json.loads(line[6:]) async for line in r.aiter_lines() if line.startswith("data: ")
        ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    last = events[-1]
    assert last["type"] in ("response.completed", "response.incomplete"), last
    assert [i["type"] for i in added] == [i["type"] for i in last["response"]["output"]]
    assert done == last["response"]["output"]
    return dict(last["response"])


@pytest.mark.stack
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_codex_first_request_and_its_next_turn(env: Env, stream: bool) -> None:
    auth = {"Authorization": f"Bearer {env.key}"}
    body = codex_body(env.model, stream)
    async with env.stack.http("/v1", headers=auth, timeout=30) as h:
        first = await _post(h, body)
        # The engine called the namespaced tool by its flattened name; the client gets the
        # call under the name and namespace it gave.
        ask = [
            {"role": "system", "content": body["instructions"]},
            {"role": "user", "content": "hi"},
        ]
        want = expected_tool_call(
            _sim(env.model, ask, tools=[*CHAT_DOCS, CHAT_SHELL], tool_choice="auto")
        )
        assert want is not None and want[1] == "mcp__docs__search"
        assert first["status"] == "completed" and first["store"] is False
        [call] = first["output"]
        assert call["type"] == "function_call"
        assert (call["name"], call["namespace"]) == ("search", "mcp__docs")
        assert (call["call_id"], call["arguments"]) == (want[0], want[2])
        assert first["tools"] == body["tools"]  # the request's tools, as OpenAI repeats them
        # The next turn, as Codex sends it with store false: the history with the call (its
        # namespace) and the call's output; the engine sees the call by its flattened name.
        nxt = {
            **body,
            "input": [
                *body["input"],
                {k: call[k] for k in ("type", "call_id", "name", "namespace", "arguments")},
                {"type": "function_call_output", "call_id": call["call_id"], "output": "found"},
            ],
            "max_output_tokens": 8,
        }
        second = await _post(h, nxt)
    prompt = (
        f"<|system|>{body['instructions']}\n<|user|>hi\n"
        f"<|assistant|>mcp__docs__search({call['arguments']})\n<|tool|>found\n"
    )
    assert second["output"][-1]["type"] == "message"
    assert second["output"][-1]["content"][0]["text"] == expected_text(prompt, 8)[0]


@pytest.mark.stack
async def test_what_the_engine_gets_of_a_codex_request(env: Env) -> None:
    auth = {"Authorization": f"Bearer {env.key}"}
    body = codex_body(env.up_model, stream=False)
    body["input"] = [
        *body["input"],
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "fetch",
            "namespace": "mcp__docs",
            "arguments": "{}",
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "page"},
    ]
    body["tool_choice"] = {"type": "function", "name": "fetch", "namespace": "mcp__docs"}
    async with env.stack.http("/v1", headers=auth, timeout=30) as h:
        out = await _post(h, body)
    assert out["status"] == "completed"
    got = await env.upstream.last_request()
    # Flattened tools, web search left out (tokenbus cannot search), the choice mapped.
    assert got["tools"] == [*CHAT_DOCS, CHAT_SHELL]
    assert got["tool_choice"] == {"type": "function", "function": {"name": "mcp__docs__fetch"}}
    assert got["messages"][2]["tool_calls"][0]["function"]["name"] == "mcp__docs__fetch"
    assert got["prompt_cache_key"] == body["prompt_cache_key"]
    assert "client_metadata" not in got and "include" not in got


@pytest.mark.unit
def test_namespaced_names_are_a_table_not_a_parse() -> None:
    long_ns = "mcp__" + "x" * 70
    body = {
        "model": "m",
        "input": "hi",
        "tools": [
            {"type": "function", "name": "a__b", "parameters": {"type": "object"}},
            {
                "type": "namespace",
                "name": "a",
                "description": "",
                "tools": [{"type": "function", "name": "b"}],
            },
            {
                "type": "namespace",
                "name": long_ns,
                "description": "",
                "tools": [{"type": "function", "name": "go"}],
            },
            {
                "type": "namespace",
                "name": "my.ns",
                "description": "d",
                "tools": [{"type": "function", "name": "go"}],
            },
        ],
        "tool_choice": {"type": "function", "name": "b"},
    }
    turn = translate(parse(body), body)
    names = [t["function"]["name"] for t in turn.chat["tools"]]
    assert names[0] == "a__b" and names[1] != "a__b" and names[3] == "my_ns__go"
    assert all(re.fullmatch(r"[a-zA-Z0-9_-]{1,64}", n) for n in names)
    assert len(set(names)) == 4
    assert turn.names.to_client[names[1]] == ("a", "b")
    assert turn.names.to_client[names[2]] == (long_ns, "go")
    # A name alone that only one namespace has is that tool; a plain tool keeps its name.
    assert turn.chat["tool_choice"]["function"]["name"] == names[1]
    b = ResponseBuilder(turn, events=False)
    call = {"index": 0, "id": "c", "function": {"name": names[2], "arguments": "{}"}}
    b.add(Chunk("", 0, 0, tool_calls=[call]))
    resp, _ = b.finish("tool_calls", None)
    assert (resp["output"][0]["name"], resp["output"][0]["namespace"]) == ("go", long_ns)
    assert b.assistant_messages()[0]["tool_calls"][0]["function"]["name"] == names[2]
    assert turn.session is None
    assert translate(parse({**body, "prompt_cache_key": "s1"}), body).session == "s1"


# -- custom (free-form input) tools ---------------------------------------------------------
GRAMMAR = 'start: "*** Begin Patch" /(.|\\n)*/ "*** End Patch"'
PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files with a patch.",
    "format": {"type": "grammar", "syntax": "lark", "definition": GRAMMAR},
}
NOTE = {"type": "custom", "name": "note", "format": {"type": "text"}}
CUSTOM_INPUT = {
    "type": "object",
    "properties": {
        "input": {"type": "string", "description": "The tool's input: free-form text, not JSON."}
    },
    "required": ["input"],
    "additionalProperties": False,
}
# The custom tools as the engine sees them: a function with one string parameter, `input`;
# the grammar told in the description (the engine is not constrained by it).
CHAT_PATCH = {
    "type": "function",
    "function": {
        "name": "apply_patch",
        "description": "Edit files with a patch.\n\n"
        f"The input must follow this Lark grammar:\n```\n{GRAMMAR}\n```",
        "parameters": CUSTOM_INPUT,
    },
}
CHAT_NOTE = {"type": "function", "function": {"name": "note", "parameters": CUSTOM_INPUT}}
FIX = [{"role": "user", "content": "fix the bug"}]


def _patch_call(model: str, **extra: Any) -> tuple[str, str]:
    """(call_id, input) of the sim's call to the custom tool ``apply_patch``."""
    want = expected_tool_call(_sim(model, FIX, **extra))
    assert want is not None and want[1] == "apply_patch"
    return want[0], json.loads(want[2])["input"]


@pytest.mark.stack
async def test_a_custom_tool_call_whole(env: Env, oai: openai.AsyncOpenAI) -> None:
    out = await oai.responses.create(model=env.model, input="fix the bug", tools=[PATCH])  # type: ignore[list-item]
    assert out.status == "completed"
    [call] = out.output
    assert isinstance(call, ResponseCustomToolCall)
    assert (call.call_id, call.input) == _patch_call(env.model, tools=[CHAT_PATCH])
    assert call.name == "apply_patch" and call.namespace is None and call.id
    assert call.id.startswith("ctc_") and out.tools[0].type == "custom"


@pytest.mark.stack
async def test_a_custom_tool_call_streamed(env: Env, oai: openai.AsyncOpenAI) -> None:
    stream = await oai.responses.create(
        model=env.model,
        input="fix the bug",
        tools=[PATCH],  # type: ignore[list-item]
        stream=True,
    )
    events = [ev async for ev in stream]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if isinstance(e, ResponseCustomToolCallInputDeltaEvent)]
    assert deltas  # (the sim's fragments may come in one frame: one delta or more)
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        *["response.custom_tool_call_input.delta"] * len(deltas),
        "response.custom_tool_call_input.done",
        "response.output_item.done",
        "response.completed",
    ]
    added, done, item_done, completed = events[2], events[-3], events[-2], events[-1]
    assert isinstance(added, ResponseOutputItemAddedEvent)
    assert isinstance(done, ResponseCustomToolCallInputDoneEvent)
    assert isinstance(item_done, ResponseOutputItemDoneEvent)
    assert isinstance(completed, ResponseCompletedEvent)
    assert isinstance(added.item, ResponseCustomToolCall)
    assert (added.item.input, added.item.status) == ("", "in_progress")
    assert {(e.item_id, e.output_index) for e in [*deltas, done]} == {(added.item.id, 0)}
    [final] = completed.response.output
    assert isinstance(final, ResponseCustomToolCall) and final == item_done.item
    _, want = _patch_call(env.model, tools=[CHAT_PATCH])
    assert "".join(e.delta for e in deltas) == done.input == final.input == want


@pytest.mark.stack
async def test_a_custom_tool_round_trip(env: Env, oai: openai.AsyncOpenAI) -> None:
    first = await oai.responses.create(model=env.model, input="fix the bug", tools=[PATCH])  # type: ignore[list-item]
    [call] = first.output
    assert isinstance(call, ResponseCustomToolCall)
    result = {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Done!"}
    second = await oai.responses.create(
        model=env.model,
        previous_response_id=first.id,
        input=[result],  # type: ignore[list-item]
        tools=[PATCH],  # type: ignore[list-item]
        max_output_tokens=8,
    )
    # The engine saw its call (the function `apply_patch`, the input as its argument) and
    # the call's output.
    args = json.dumps({"input": call.input})
    prompt = f"<|user|>fix the bug\n<|assistant|>apply_patch({args})\n<|tool|>Done!\n"
    assert second.output_text == expected_text(prompt, 8)[0]
    items = await oai.responses.input_items.list(second.id)
    assert [(i.type, getattr(i, "call_id", None)) for i in items.data] == [
        ("custom_tool_call_output", call.call_id)
    ]
    # The same conversation sent whole, as Codex does with store false.
    history = [
        *FIX,
        {
            "type": "custom_tool_call",
            "call_id": call.call_id,
            "name": call.name,
            "input": call.input,
        },
        result,
    ]
    third = await oai.responses.create(
        model=env.model,
        input=history,  # type: ignore[arg-type]
        tools=[PATCH],  # type: ignore[list-item]
        store=False,
        max_output_tokens=8,
    )
    assert third.output_text == second.output_text


@pytest.mark.stack
async def test_tool_choice_names_a_custom_tool(env: Env, oai: openai.AsyncOpenAI) -> None:
    tools = [WEATHER, PATCH]
    # Without a choice the sim calls the first tool, the function.
    out = await oai.responses.create(model=env.model, input="fix the bug", tools=tools)  # type: ignore[arg-type]
    assert [i.type for i in out.output] == ["function_call"]
    chat_tools = [CHAT_WEATHER, CHAT_PATCH]
    forced = {"type": "function", "function": {"name": "apply_patch"}}
    for choice in (
        {"type": "custom", "name": "apply_patch"},
        {
            "type": "allowed_tools",
            "mode": "required",
            "tools": [{"type": "custom", "name": "apply_patch"}],
        },
    ):
        out = await oai.responses.create(
            model=env.model,
            input="fix the bug",
            tools=tools,  # type: ignore[arg-type]
            tool_choice=choice,  # type: ignore[arg-type]
        )
        [call] = out.output
        assert isinstance(call, ResponseCustomToolCall) and call.name == "apply_patch"
        sent = {"tools": chat_tools, "tool_choice": forced}
        if choice["type"] == "allowed_tools":
            sent = {"tools": [CHAT_PATCH], "tool_choice": "required"}
        assert (call.call_id, call.input) == _patch_call(env.model, **sent)
        assert out.to_dict()["tool_choice"] == choice  # repeated as given


@pytest.mark.stack
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_what_the_engine_gets_of_custom_tools_and_a_call_that_is_not_json(
    env: Env, stream: bool
) -> None:
    auth = {"Authorization": f"Bearer {env.key}"}
    body: dict[str, Any] = {
        "model": env.up_model,
        "input": "fix the bug",
        "tools": [PATCH, NOTE, WEATHER],
        "tool_choice": {"type": "custom", "name": "apply_patch"},
        "store": False,
        "stream": stream,
    }
    async with env.stack.http("/v1", headers=auth, timeout=30) as h:
        if stream:
            async with h.stream("POST", "/responses", json=body) as r:
                assert r.status_code == 200, await r.aread()
                events = [
                    json.loads(line[6:])
                    async for line in r.aiter_lines()
                    if line.startswith("data: ")
                ]
            deltas = [e for e in events if e["type"] == "response.custom_tool_call_input.delta"]
            [done] = [e for e in events if e["type"] == "response.custom_tool_call_input.done"]
            assert "".join(e["delta"] for e in deltas) == done["input"]
            out = events[-1]["response"]
        else:
            out = await _post(h, body)
        got = await env.upstream.last_request()
        # Function tools for the engine, the choice of the custom tool a function choice.
        assert got["tools"] == [CHAT_PATCH, CHAT_NOTE, CHAT_WEATHER]
        assert got["tool_choice"] == {"type": "function", "function": {"name": "apply_patch"}}
        # The upstream's arguments are no {"input": ...}: the input is their raw text.
        [call] = out["output"]
        assert call["type"] == "custom_tool_call" and call["status"] == "completed"
        assert (call["call_id"], call["name"]) == ("call_up_1", "apply_patch")
        assert json.loads(call["input"]) == {"city": "Paris", "unit": "celsius"}
        # Its next turn: the call and its output reach the engine as a tool call and result.
        nxt = {
            **body,
            "input": [
                *FIX,
                call,
                {"type": "custom_tool_call_output", "call_id": "call_up_1", "output": "ok"},
            ],
            "tool_choice": "auto",
        }
        await _post(h, nxt)
    got = await env.upstream.last_request()
    assert got["messages"][1:] == [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_up_1",
                    "type": "function",
                    "function": {
                        "name": "apply_patch",
                        "arguments": json.dumps({"input": call["input"]}),
                    },
                }
            ],
        },
        {"role": "tool", "content": "ok", "tool_call_id": "call_up_1"},
    ]


@pytest.mark.unit
def test_custom_tools_named_as_a_function_or_in_a_namespace_come_back_as_themselves() -> None:
    body: dict[str, Any] = {
        "model": "m",
        "input": "hi",
        "tools": [
            PATCH,
            {"type": "function", "name": "apply_patch", "parameters": {"type": "object"}},
            {"type": "namespace", "name": "ed", "description": "Editor.", "tools": [NOTE]},
        ],
        "tool_choice": {"type": "custom", "name": "apply_patch"},
    }
    turn = translate(parse(body), body)
    names = [t["function"]["name"] for t in turn.chat["tools"]]
    # The function keeps its name; the custom tool is renamed, so its calls are told apart.
    assert names[1] == "apply_patch" and names[2] == "ed__note" and len(set(names)) == 3
    assert turn.chat["tool_choice"]["function"]["name"] == names[0]
    assert turn.chat["tools"][2]["function"]["description"] == "Editor."
    # Arguments cut inside escapes and a surrogate pair: the input streams decoded.
    text = 'é "q" \\ 😀\n*** End Patch'
    args = json.dumps({"input": text})
    calls = [
        *[{"index": 0, "function": {"arguments": args[i : i + 3]}} for i in range(0, len(args), 3)],
        {"index": 1, "id": "c1", "function": {"name": "ed__note", "arguments": '{"input": "n"}'}},
        {"index": 2, "id": "c2", "function": {"name": "apply_patch", "arguments": "{}"}},
    ]
    calls[0] = {**calls[0], "id": "c0", "function": {"name": names[0], **calls[0]["function"]}}
    b = ResponseBuilder(turn, events=True)
    events = [e for c in calls for e in b.add(Chunk("", 0, 0, tool_calls=[c]))]
    resp, closing = b.finish("tool_calls", None)
    events += closing
    deltas = [e for e in events if e["type"] == "response.custom_tool_call_input.delta"]
    dones = [e for e in events if e["type"] == "response.custom_tool_call_input.done"]
    assert len([d for d in deltas if d["output_index"] == 0]) > 3
    assert "".join(d["delta"] for d in deltas if d["output_index"] == 0) == text
    assert [d["input"] for d in dones] == [text, "n"]
    out = [(i["type"], i["name"], i.get("namespace")) for i in resp["output"]]
    assert out == [
        ("custom_tool_call", "apply_patch", None),
        ("custom_tool_call", "note", "ed"),
        ("function_call", "apply_patch", None),
    ]
    assert resp["output"][0]["input"] == text
    # The stored conversation keeps the engine's names and arguments.
    sent = [c["function"] for c in b.assistant_messages()[0]["tool_calls"]]
    assert sent == [
        {"name": names[0], "arguments": args},
        {"name": "ed__note", "arguments": '{"input": "n"}'},
        {"name": "apply_patch", "arguments": "{}"},
    ]
    # A custom_tool_call in the history goes to the engine under the same names.
    history = [
        {"type": "custom_tool_call", "call_id": "c0", "name": "apply_patch", "input": "x"},
        {
            "type": "custom_tool_call",
            "call_id": "c1",
            "name": "note",
            "namespace": "ed",
            "input": "é",
        },
    ]
    chat = _chat({**body, "input": history})
    assert [c["function"] for c in chat["messages"][0]["tool_calls"]] == [
        {"name": names[0], "arguments": '{"input": "x"}'},
        {"name": "ed__note", "arguments": '{"input": "é"}'},
    ]


BAD_CUSTOM: list[tuple[dict[str, Any], str]] = [
    ({"tools": [{"type": "custom", "description": "no name"}]}, "tools.0.name"),
    (
        {"tools": [WEATHER, {"type": "custom", "name": "p", "format": {"type": "json"}}]},
        "tools.1.format.type",
    ),
    ({"tools": [{"type": "custom", "name": "p", "format": "text"}]}, "tools.0.format"),
    (
        {
            "tools": [
                {
                    "type": "custom",
                    "name": "p",
                    "format": {"type": "grammar", "syntax": "ebnf", "definition": "x"},
                }
            ]
        },
        "tools.0.format.syntax",
    ),
    (
        {
            "tools": [
                {"type": "custom", "name": "p", "format": {"type": "grammar", "syntax": "lark"}}
            ]
        },
        "tools.0.format.definition",
    ),
    ({"tools": [{"type": "custom", "name": "p", "description": 5}]}, "tools.0.description"),
    (
        {
            "tools": [
                {
                    "type": "namespace",
                    "name": "ns",
                    "description": "",
                    "tools": [{"type": "custom"}],
                }
            ]
        },
        "tools.0.tools.0.name",
    ),
    (
        {"tools": [WEATHER, PATCH], "tool_choice": {"type": "custom", "name": "get_weather"}},
        "tool_choice.name",
    ),
    (
        {"tools": [WEATHER, PATCH], "tool_choice": {"type": "function", "name": "apply_patch"}},
        "tool_choice.name",
    ),
    ({"input": [{"type": "custom_tool_call", "call_id": "c", "name": "p"}]}, "input.0.input"),
    ({"input": [{"type": "custom_tool_call", "name": "p", "input": "x"}]}, "input.0.call_id"),
    (
        {"input": [{"type": "custom_tool_call_output", "call_id": 5, "output": "x"}]},
        "input.0.call_id",
    ),
]


@pytest.mark.stack
async def test_a_bad_custom_tool_gets_a_400_naming_it(env: Env) -> None:
    auth = {"Authorization": f"Bearer {env.key}"}
    async with env.stack.http("/v1", headers=auth, timeout=30) as h:
        for change, param in BAD_CUSTOM:
            r = await h.post("/responses", json={"model": env.model, "input": "hi", **change})
            assert r.status_code == 400, (change, r.text)
            err = r.json()["error"]
            assert err["param"] == param, (change, err)
            assert err["type"] == "invalid_request_error" and err["message"], err


# -- bad fields -----------------------------------------------------------------------------
BAD: list[tuple[dict[str, Any], str]] = [
    ({"input": 5}, "input"),
    ({"input": [{"type": "message", "role": "robot", "content": "x"}]}, "input.0.role"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0.call_id"),
    ({"input": [{"type": "computer_call"}]}, "input.0.type"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
        "input.0.content.0.image_url",
    ),
    (
        {"input": [{"role": "user", "content": [{"type": "input_file", "filename": "f"}]}]},
        "input.0.content.0.file_data",
    ),
    (  # an id of no file of this key: a 404 naming it
        {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
        "input.0.content.0.file_id",
    ),
    ({"background": True, "store": False}, "background"),
    (
        {"tool_choice": {"type": "web_search"}, "tools": [{"type": "web_search"}]},
        "tool_choice.type",
    ),
    (
        {"tools": [{"type": "namespace", "name": "ns", "description": "", "tools": []}]},
        "tools.0.tools",
    ),
    ({"tools": [{"type": "namespace", "description": "", "tools": [WEATHER]}]}, "tools.0.name"),
    (
        {"tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "file_search"}]}]},
        "tools.0.tools.0.type",
    ),
    (
        {
            "input": [
                {
                    "type": "function_call",
                    "call_id": "c",
                    "name": "f",
                    "arguments": "{}",
                    "namespace": 5,
                }
            ]
        },
        "input.0.namespace",
    ),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools.0.type"),
    ({"tools": [{"type": "computer_use_preview"}]}, "tools.0.type"),
    ({"tools": [{"type": "function"}]}, "tools.0.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice.type"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": "10"}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"stream": "yes"}, "stream"),
    ({"store": "no"}, "store"),
    ({"truncation": "auto"}, "truncation"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"max_tokens": 5}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}]}, "messages"),
    ({"previous_response_id": "resp_nope"}, "previous_response_id"),
    ({"input": []}, "input"),
]


@pytest.mark.stack
async def test_each_bad_field_gets_a_clear_400(env: Env) -> None:
    auth = {"Authorization": f"Bearer {env.key}"}
    async with env.stack.http("/v1", headers=auth, timeout=30) as h:
        for change, param in BAD:
            body = {"model": env.model, "input": "hi", **change}
            r = await h.post("/responses", json=body)
            want = 404 if param in ("previous_response_id", "input.0.content.0.file_id") else 400
            assert r.status_code == want, (change, r.text)
            err = r.json()["error"]
            assert err["param"] == param, (change, err)
            assert err["type"] == "invalid_request_error" and err["message"], err
        r = await h.post("/responses", json={"input": "hi"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"
        r = await h.post("/responses", json={"model": "no-such-model", "input": "hi"})
        assert r.status_code in (403, 404)
        r = await h.put("/responses/resp_" + "0" * 32)
        assert r.status_code == 405
        r = await h.post("/responses/resp_" + "0" * 32 + "/cancel")
        assert r.status_code == 404
        r = await h.get("/responses/resp_x/input_items", params={"limit": 0})
        assert r.status_code in (400, 404)
    assert env.stack.all_alive()


# -- the OpenAI Agents SDK -------------------------------------------------------------------
@pytest.mark.stack
async def test_an_agent_with_a_function_tool_runs_to_a_final_answer(env: Env) -> None:
    from agents import (
        Agent,
        ModelSettings,
        Runner,
        function_tool,
        set_default_openai_api,
        set_default_openai_client,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    set_default_openai_api("responses")
    asked: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return f"sunny in {city}"

    async with env.stack.openai(env.key) as c:
        set_default_openai_client(c, use_for_tracing=False)
        agent = Agent(
            name="weather",
            instructions="Answer with the weather.",
            model=env.model,
            tools=[get_weather],
            # The sim writes until max_tokens, which the SDK takes for a failed run
            # (response.incomplete): a stop sequence ends its answer after the first word.
            model_settings=ModelSettings(max_tokens=16, extra_body={"stop": [" "]}),
        )
        result = await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
    assert len(asked) == 1
    assert isinstance(result.final_output, str) and result.final_output
    assert [type(i).__name__ for i in result.new_items] == [
        "ToolCallItem",
        "ToolCallOutputItem",
        "MessageOutputItem",
    ]


# -- the NATS client --------------------------------------------------------------------------
@pytest.mark.stack
async def test_the_nats_client_serves_the_same_operation(env: Env, oai: openai.AsyncOpenAI) -> None:
    async with await Client.connect(env.url, api_key=env.key) as tb:
        out = await tb.response(env.model, "hello there", max_output_tokens=12)
        assert (
            out["output"][0]["content"][0]["text"] == expected_text("<|user|>hello there\n", 12)[0]
        )
        assert out["usage"]["output_tokens"] == 12 and out["store"] is True
        events = tb.responses(env.model, "weather?", tools=[WEATHER], tool_choice="required")
        seen = [ev async for ev in events]
        assert [e["sequence_number"] for e in seen] == list(range(len(seen)))
        assert seen[-1]["type"] == "response.completed"
        call = seen[-1]["response"]["output"][0]
        assert call["type"] == "function_call" and call["name"] == "get_weather"
        # Stored by ingress under the key: the conversation goes on over NATS or HTTP.
        answer = {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}
        second = await tb.response(
            env.model, [answer], previous_response_id=events.id, max_output_tokens=6
        )
        prompt = f"<|user|>weather?\n<|assistant|>get_weather({call['arguments']})\n<|tool|>sunny\n"
        text = expected_text(prompt, 6)[0]
        assert second["output"][0]["content"][0]["text"] == text
        over_http = await oai.responses.retrieve(second["id"])
        assert over_http.output_text == text
        items = await tb.response_input_items(second["id"])
        assert [i["type"] for i in items] == ["function_call_output"]
        assert (await tb.get_response(out["id"]))["id"] == out["id"]
        # Another key sees none of it.
        # (On a connection of its own: a request is answered only in its key's inboxes.)
        async with await Client.connect(env.url, api_key=env.other) as them:
            with pytest.raises(E.NotFound):
                await them.get_response(out["id"])
            with pytest.raises(E.NotFound):
                await them.response(env.model, "go on", previous_response_id=out["id"])
        await tb.delete_response(out["id"])
        with pytest.raises(E.NotFound):
            await tb.get_response(out["id"])
        with pytest.raises(E.InvalidRequest) as ei:
            tb.responses(env.model, "hi", background=True)
        assert ei.value.param == "background"


# -- migration -------------------------------------------------------------------------------
SLOW = ("--sim-prefill-ms", "5", "--sim-decode-ms", "20")
HB = {"TOKENBUS_WORKER__HEARTBEAT_INTERVAL_S": "0.25"}
STORY = "tell me a long story"


def _victim(stack: ProcStack, replica: str | None) -> Any:
    """The worker process serving ``replica`` (``<model>-<i>`` runs as ``worker-<i>``)."""
    assert replica is not None
    return stack.workers[int(replica.rsplit("-", 1)[1])]


@pytest.mark.fault
async def test_a_stream_moved_to_another_replica_keeps_a_valid_event_sequence(
    procs: Procs,
) -> None:
    stack = await start_stack(procs, new_model(), workers=3, worker_args=SLOW, env=HB, settle=0.6)
    async with stack.openai() as api:
        # Text is resumed on another replica: one sequence, nothing twice, nothing missing.
        # (150 tokens at 20 ms: the kill lands mid-stream even on a busy machine.)
        s = await api.responses.create(
            model=stack.model, input=STORY, max_output_tokens=150, stream=True
        )
        victim = _victim(stack, s.response.headers.get("x-tokenbus-replica"))
        events: list[Any] = []
        async for ev in s:
            events.append(ev)
            if ev.type == "response.output_text.delta" and victim.alive():
                victim.signal(signal.SIGKILL)
        assert not victim.alive()
        assert [e.sequence_number for e in events] == list(range(len(events)))
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert text == expected_text(f"<|user|>{STORY}\n", 150)[0]
        assert events[-1].type == "response.incomplete"
        assert events[-1].response.output_text == text
        # A function call's arguments cannot be pieced together from two replicas: once a
        # fragment went out, the stream ends with response.failed and a retryable error.
        long_args = {
            "type": "object",
            "properties": {"story": {"type": "string", "minLength": 400}},
            "required": ["story"],
        }
        tool = {"type": "function", "name": "write", "parameters": long_args}
        s = await api.responses.create(
            model=stack.model,
            input=STORY,
            tools=[tool],  # type: ignore[list-item]
            max_output_tokens=400,
            stream=True,
        )
        victim = _victim(stack, s.response.headers.get("x-tokenbus-replica"))
        events = []
        async for ev in s:
            events.append(ev)
            if ev.type == "response.function_call_arguments.delta" and victim.alive():
                victim.signal(signal.SIGKILL)
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert [e.type for e in events[-2:]] == ["error", "response.failed"]
        failed = events[-1].response
        assert failed.status == "failed" and failed.error is not None
        assert failed.error.code == "replica_lost" and "retryable" in failed.error.message
        # Kept as it failed, as OpenAI keeps a failed response.
        got = await api.responses.retrieve(failed.id)
        assert got.status == "failed" and got.error is not None
        assert got.error.code == "replica_lost"
    assert "request_migrated" in stack.bridge.output()


# -- the store -------------------------------------------------------------------------------
@pytest.mark.bus
async def test_the_store_has_a_ttl_and_a_size_bound_and_owners(nc: Any) -> None:
    bucket = f"test_responses_{uuid.uuid4().hex[:8]}"
    cfg = ResponsesSettings(ttl_s=3600, max_bytes=2 << 20)
    store = await ResponseStore(nc, cfg, bucket=bucket).open()
    try:
        info = await nc.jetstream().stream_info(f"KV_{bucket}")
        assert info.config.max_age == 3600 and info.config.max_bytes == 2 << 20
        # A cache of conversations: when full, the oldest go, new ones are still kept.
        assert info.config.discard == DiscardPolicy.OLD
        assert info.config.num_replicas == 1 and info.config.max_msgs_per_subject == 1
        rid = new_response_id()
        assert await store.put(rid, {"owner": "k1", "response": {"id": rid}})
        assert (await store.get(rid, "k1"))["response"] == {"id": rid}
        for owner, response_id in (("k2", rid), ("k1", new_response_id()), ("k1", "../x")):
            with pytest.raises(E.NotFound):
                await store.get(response_id, owner)
        with pytest.raises(E.NotFound):
            await store.delete(rid, "k2")
        await store.delete(rid, "k1")
        with pytest.raises(E.NotFound):
            await store.get(rid, "k1")
        # Larger than the bus carries: not kept, and the caller is told so.
        assert not await store.put(new_response_id(), {"owner": "k1", "blob": "x" * (2 << 20)})
    finally:
        await nc.jetstream().delete_stream(f"KV_{bucket}")


@pytest.mark.bus
async def test_a_write_over_a_record_waits_through_a_stream_that_does_not_answer(
    nc: Any,
) -> None:
    """A background response's end is written over its record; a bucket's stream without a
    leader answers a write with "no response from stream" (nats-py's NoStreamResponseError),
    which is waited through as a stall, not taken for a write that failed: one that failed
    left the response ``in_progress``, and its run was made again (charged twice: the
    nemesis run, seed 21)."""
    bucket = f"test_responses_{uuid.uuid4().hex[:8]}"
    cfg = ResponsesSettings(ttl_s=3600, max_bytes=2 << 20)
    store = await ResponseStore(nc, cfg, bucket=bucket).open()
    js = nc.jetstream()
    info = await js.stream_info(f"KV_{bucket}")
    rid = new_response_id()
    try:
        assert await store.put(rid, {"owner": "k1", "response": {"id": rid, "status": "queued"}})
        await js.delete_stream(f"KV_{bucket}")  # as a stream without a leader
        tries: list[str] = []  # each write tried (the real one, counted)
        kv = await store.opened()
        put = kv.put

        async def counted(key: str, value: bytes) -> Any:
            tries.append(key)
            return await put(key, value)

        kv.put = counted  # type: ignore[method-assign]
        end = {"owner": "k1", "response": {"id": rid, "status": "completed"}}
        writing = asyncio.ensure_future(store.replace(rid, end))
        # Refused while no stream answers, and tried again.
        await wait_for(lambda: len(tries) >= 2, timeout=30, what="the write tried again")
        assert not writing.done()
        await js.add_stream(info.config)
        assert await asyncio.wait_for(writing, 30)
        assert (await store.get(rid, "k1"))["response"]["status"] == "completed"
    finally:
        await js.delete_stream(f"KV_{bucket}")


@pytest.mark.fault
async def test_a_store_that_could_not_open_at_start_opens_when_jetstream_answers(
    tmp_path: Path,
) -> None:
    # A process that starts while JetStream does not answer (here: a server without it,
    # then one with it on the same port, as a node comes back) is not left without stored
    # responses: the store opens at a use after, and until then says so.
    port = free_port()
    bare = spawn_nats(port, "-a", "127.0.0.1", "-p", str(port))
    nc = await nats.connect(
        f"nats://127.0.0.1:{port}", max_reconnect_attempts=-1, reconnect_time_wait=0.1
    )
    srv: NatsServer | None = None
    try:
        store = await open_store(nc, ResponsesSettings())
        assert store.kv is None
        rid = new_response_id()
        assert not await store.put(rid, {"owner": "k1", "response": {"id": rid}})
        with pytest.raises(E.ServiceUnavailable) as err:
            await store.get(rid, "k1")
        assert err.value.retryable
        bare.terminate()
        bare.wait(10)
        srv = NatsServer(tmp_path / "js", port=port).start()
        await wait_for(lambda: nc.is_connected, what="reconnected")
        await wait_for(
            lambda: store.put(rid, {"owner": "k1", "response": {"id": rid}}),
            timeout=30,
            interval=0.2,
            what="the store opened and kept the response",
        )
        assert (await store.get(rid, "k1"))["response"] == {"id": rid}
    finally:
        await nc.close()
        if bare.poll() is None:
            bare.kill()
        if srv is not None:
            srv.stop()


# -- the locked bus ---------------------------------------------------------------------------
@pytest.mark.stack
async def test_stored_responses_over_nats_on_the_locked_bus(tmp_path: Path) -> None:
    # Ingress keeps them with its own role's permissions; a key's connection reaches them by
    # request-reply under its own inbox root only.
    bus = LockedBus(tmp_path / "locked").start()
    try:
        with Procs(bus.url, tmp_path) as procs:
            model = "locked-responses"
            await start_stack(
                procs,
                model,
                "ingress",
                "auth",
                "router",
                bridge=False,
                env={"TOKENBUS_INGRESS__PIPELINE": '["auth", "route"]'},
                env_for=lambda role, _: bus.env(role),
                login=role_login(bus.users, "admin"),
            )
            admin = await bus.admin()
            store = await KeyStore(admin).open(watch=False)
            a, _ = await store.create("responses-a")
            b, _ = await store.create("responses-b")
            await serve_when_ready(bus.url, a, model)
            async with await Client.connect(bus.url, api_key=a) as tb:
                first = await tb.response(model, "hello", max_output_tokens=3)
                assert first["store"] is True
                second = await tb.response(
                    model, "again", previous_response_id=first["id"], max_output_tokens=3
                )
                prompt = f"<|user|>hello\n<|assistant|>{first['output'][0]['content'][0]['text']}\n"
                want = expected_text(prompt + "<|user|>again\n", 3)[0]
                assert second["output"][0]["content"][0]["text"] == want
                # A record a client stores is never a background response's: the flag it
                # claims is dropped, so it is not cancelled (nor listed) as one.
                forged = new_response_id()
                claim = {"response": {"id": forged, "status": "in_progress"}, "background": True}
                assert await _Stored(tb, a).put(forged, claim)
                assert "background" not in await _Stored(tb, a).get(forged)
                with pytest.raises(E.InvalidRequest, match="only background responses"):
                    await tb.response_cancel(forged)
            async with await Client.connect(bus.url, api_key=b) as them:
                with pytest.raises(E.NotFound):
                    await them.get_response(first["id"])
            await admin.drain()
    finally:
        bus.stop()


# -- the translation alone --------------------------------------------------------------------
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=12,
)
FIELDS = st.sampled_from(
    ["input", "tools", "tool_choice", "text", "reasoning", "include", "instructions", "metadata"]
)
ITEM_KEYS = st.sampled_from(["type", "role", "content", "call_id", "name", "arguments", "output"])


@pytest.mark.unit
@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(FIELDS, JSON, max_size=4),
    st.lists(st.dictionaries(ITEM_KEYS, JSON, max_size=5), max_size=3),
)
def test_any_body_is_translated_or_refused_with_a_400(body: dict[str, Any], items: Any) -> None:
    body = {"model": "m", "input": items, **body}
    try:
        turn = translate(parse(body), body)
    except E.InvalidRequest as exc:
        assert exc.status == 400 and exc.param
        return
    assert turn.chat["messages"] and turn.chat["model"] == "m"
