"""The OpenAI API that real clients send, end to end on a real bus and real processes:
tools (whole, streamed, second turn), structured output through the SDK's ``parse``,
logprobs, content parts, carried fields, embeddings, and a clear 400 for each bad value.

Two models share one stack: ``sim`` workers (exact, deterministic answers) and an
``openai``-backend worker in front of a fake OpenAI-compatible upstream that records what it
received, so a test can assert that a field reached the engine unchanged.
"""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
from pydantic import BaseModel

from bus_schemas import errors as E
from bus_schemas.messages import token_ids_text
from engine_worker.backends.base import GenerationRequest
from engine_worker.backends.sim import count_tokens, expected_text
from engine_worker.backends.sim_outputs import expected_embedding, expected_tool_call
from tests.support.busdata import new_model
from tests.support.natsserver import NatsServer
from tests.support.procs import Procs, ProcStack, start_stack, start_worker
from tests.support.upstreams import Upstream
from tests.support.waits import wait_replicas
from tokenbus import Client

pytestmark = pytest.mark.stack

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "what is the weather in Paris?"}]


class Stacks:
    """The module's stack and the name of the upstream-backed model."""

    def __init__(self, stack: ProcStack, up_model: str, upstream: Upstream) -> None:
        self.stack = stack
        self.model = stack.model
        self.up_model = up_model
        self.upstream = upstream


@pytest.fixture(scope="module")
async def stacks(
    nats_server: NatsServer, upstream: Upstream, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Stacks]:
    with Procs(nats_server.url, tmp_path_factory.mktemp("api-stack")) as ps:
        up_model = new_model()
        start_worker(ps, up_model, "up", "--backend", "openai", "--upstream-url", upstream.url)
        stack = await start_stack(
            ps,
            new_model(),
            "ingress",
            "router",
            workers=1,
            worker_args=("--sim-prefill-ms", "2", "--sim-decode-ms", "1"),
        )
        await wait_replicas(nats_server.url, up_model, 1)
        yield Stacks(stack, up_model, upstream)


@pytest.fixture
async def oai(stacks: Stacks) -> AsyncIterator[openai.AsyncOpenAI]:
    async with stacks.stack.openai() as c:
        yield c


def _sim_request(model: str, messages: list[dict[str, Any]], **extra: Any) -> GenerationRequest:
    """What the sim worker sees for a request (to ask the sim what it will answer)."""
    max_tokens = extra.pop("max_tokens", 256)
    return GenerationRequest(
        request_id="x",
        kind="chat",
        model=model,
        max_tokens=max_tokens,
        messages=messages,
        extra=extra,
    )


# -- tools ----------------------------------------------------------------------------------
async def test_tool_call_whole_with_the_sdk(stacks: Stacks, oai: openai.AsyncOpenAI) -> None:
    out = await oai.chat.completions.create(model=stacks.model, messages=ASK, tools=[WEATHER])
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 1
    want = expected_tool_call(_sim_request(stacks.model, ASK, tools=[WEATHER]))
    assert want is not None
    assert (calls[0].id, calls[0].function.name, calls[0].function.arguments) == want
    args = json.loads(calls[0].function.arguments)
    assert args["unit"] in ("celsius", "fahrenheit") and isinstance(args["city"], str)
    assert out.usage is not None and out.usage.completion_tokens > 0


async def test_tool_call_streamed_reassembles_to_the_engines(
    stacks: Stacks, oai: openai.AsyncOpenAI
) -> None:
    stream = await oai.chat.completions.create(
        model=stacks.model, messages=ASK, tools=[WEATHER], tool_choice="required", stream=True
    )
    ids, names, args, finish, fragments = set(), set(), "", None, 0
    async for chunk in stream:
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or ():
                assert d.index == 0
                if d.id:
                    ids.add(d.id)
                if d.function and d.function.name:
                    names.add(d.function.name)
                if d.function and d.function.arguments:
                    args += d.function.arguments
                    fragments += 1
    want = expected_tool_call(
        _sim_request(stacks.model, ASK, tools=[WEATHER], tool_choice="required")
    )
    assert want is not None
    assert (ids, names, args) == ({want[0]}, {want[1]}, want[2])
    assert fragments > 1  # streamed in pieces, not whole
    assert finish == "tool_calls"


async def test_second_turn_with_the_tool_result_gets_text(
    stacks: Stacks, oai: openai.AsyncOpenAI
) -> None:
    first = await oai.chat.completions.create(model=stacks.model, messages=ASK, tools=[WEATHER])
    call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
    history: list[dict[str, Any]] = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'},
    ]
    out = await oai.chat.completions.create(
        model=stacks.model,
        messages=history,  # type: ignore[arg-type]
        tools=[WEATHER],
        max_tokens=6,
    )
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].message.tool_calls is None
    # The sim's text is a function of the prompt it saw: the tool call and result included.
    prompt = _sim_request(stacks.model, history).prompt_text()
    assert call.function.arguments in prompt and '{"temp_c": 21}' in prompt
    assert out.choices[0].message.content == expected_text(prompt, 6)[0]


async def test_tool_call_over_nats(stacks: Stacks, nats_server: NatsServer) -> None:
    async with await Client.connect(nats_server.url) as tb:
        whole = await tb.chat_completion(stacks.model, ASK, tools=[WEATHER])
        chunks = [c async for c in tb.chat(stacks.model, ASK, tools=[WEATHER])]
    want = expected_tool_call(_sim_request(stacks.model, ASK, tools=[WEATHER]))
    assert want is not None
    assert whole.finish_reason == "tool_calls"
    assert whole.tool_calls == [
        {"id": want[0], "type": "function", "function": {"name": want[1], "arguments": want[2]}}
    ]
    streamed = "".join(
        d["function"].get("arguments") or "" for c in chunks for d in c.tool_calls or ()
    )
    assert streamed == want[2]


# -- structured output and logprobs ---------------------------------------------------------
class City(BaseModel):
    name: str
    population: int


class Trip(BaseModel):
    destination: City
    days: int
    tags: list[str]
    budget_eur: float | None


async def test_parse_with_a_pydantic_model(stacks: Stacks, oai: openai.AsyncOpenAI) -> None:
    out = await oai.beta.chat.completions.parse(
        model=stacks.model,
        messages=[{"role": "user", "content": "plan a trip"}],
        response_format=Trip,
    )
    parsed = out.choices[0].message.parsed
    assert isinstance(parsed, Trip) and isinstance(parsed.destination, City)
    assert out.choices[0].finish_reason == "stop"


async def test_logprobs_streamed_and_whole(stacks: Stacks, oai: openai.AsyncOpenAI) -> None:
    whole = await oai.chat.completions.create(
        model=stacks.model, messages=ASK, max_tokens=5, logprobs=True, top_logprobs=2
    )
    lp = whole.choices[0].logprobs
    assert lp is not None and lp.content is not None and len(lp.content) == 5
    assert "".join(t.token for t in lp.content) == whole.choices[0].message.content
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in lp.content)
    stream = await oai.chat.completions.create(
        model=stacks.model, messages=ASK, max_tokens=5, logprobs=True, top_logprobs=2, stream=True
    )
    tokens = []
    async for chunk in stream:
        for ch in chunk.choices:
            if ch.logprobs and ch.logprobs.content:
                tokens += [t.token for t in ch.logprobs.content]
    assert tokens == [t.token for t in lp.content]


async def test_text_completion_logprobs(stacks: Stacks) -> None:
    async with stacks.stack.http("/v1") as c:
        r = await c.post(
            "/completions",
            json={"model": stacks.model, "prompt": "once", "max_tokens": 4, "logprobs": 2},
        )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
    assert "".join(lp["tokens"]) == choice["text"]


# -- content parts and carried fields -------------------------------------------------------
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}


# OpenAI's content parts allow more fields: a text part that also has an ``input_audio``
# list, an image part with a ``text`` number (found by the OpenAPI fuzz as a valid request
# refused) are served; only a part's own payload is checked and read as text.
ODD_PARTS = [
    {"type": "text", "text": "what is this?", "input_audio": [1, {}], "image_url": 5},
    {**IMAGE, "text": 7, "refusal": ["no"]},
]


@pytest.mark.parametrize(
    "parts",
    [[{"type": "text", "text": "what is this?"}, IMAGE], ODD_PARTS],
    ids=["image", "another-types-fields"],
)
async def test_image_part_is_served_and_reaches_the_engine(
    stacks: Stacks, oai: openai.AsyncOpenAI, parts: list[dict[str, Any]]
) -> None:
    messages = [{"role": "user", "content": parts}]
    out = await oai.chat.completions.create(
        model=stacks.model,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=4,
    )
    assert out.choices[0].message.content == expected_text("<|user|>what is this?\n", 4)[0]
    await oai.chat.completions.create(
        model=stacks.up_model,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=4,
    )
    got = await stacks.upstream.last_request()
    assert got["messages"] == messages  # every field as sent


async def test_a_file_named_by_id_reaches_the_engine_as_its_bytes(
    stacks: Stacks, oai: openai.AsyncOpenAI
) -> None:
    """A chat ``file`` part by ``file_id`` reaches the engine as ``file_data`` (a ``data:``
    URL of the file's bytes, its name as ``filename``); a Responses ``input_file`` by
    ``file_url`` is carried to the engine as it is (the bridge fetches nothing)."""
    f = await oai.files.create(file=("notes.txt", b"remember the milk"), purpose="user_data")
    part = {"type": "file", "file": {"file_id": f.id}}
    msgs: Any = [{"role": "user", "content": [part, {"type": "text", "text": "and?"}]}]
    await oai.chat.completions.create(model=stacks.up_model, messages=msgs, max_tokens=3)
    got = (await stacks.upstream.last_request())["messages"][0]["content"][0]
    data = base64.b64encode(b"remember the milk").decode()
    assert got == {
        "type": "file",
        "file": {"file_data": f"data:text/plain;base64,{data}", "filename": "notes.txt"},
    }
    url = "https://example.com/report.pdf"
    content: Any = [{"type": "input_file", "file_url": url}, {"type": "input_text", "text": "?"}]
    await oai.responses.create(
        model=stacks.up_model, input=[{"role": "user", "content": content}], max_output_tokens=3
    )
    got = (await stacks.upstream.last_request())["messages"][-1]["content"][0]
    assert got == {"type": "file", "file": {"file_url": url}}


async def test_every_field_reaches_the_upstream_unchanged(
    stacks: Stacks, oai: openai.AsyncOpenAI
) -> None:
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "cold"},
        {"role": "developer", "content": "be brief"},
    ]
    carried = {
        "tools": [WEATHER],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "response_format": {"type": "json_object"},
        "presence_penalty": 0.5,
        "frequency_penalty": -0.25,
        "logit_bias": {"1234": -100},
        "user": "u-7",
        "reasoning_effort": "low",
        "logprobs": True,
        "top_logprobs": 3,
    }
    vendor = {
        "chat_template_kwargs": {"enable_thinking": False},
        "min_tokens": 2,
        "repetition_penalty": 1.1,
        "guided_json": {"type": "object"},
    }
    await oai.chat.completions.create(
        model=stacks.up_model,
        messages=history,  # type: ignore[arg-type]
        max_completion_tokens=7,
        seed=3,
        stop=["\n\n"],
        extra_body=vendor,
        **carried,  # type: ignore[arg-type]
    )
    got = await stacks.upstream.last_request()
    assert got["messages"] == history
    for k, v in {**carried, **vendor}.items():
        assert got[k] == v, k
    assert got["max_tokens"] == 7 and got["seed"] == 3 and got["stop"] == ["\n\n"]
    # Not set by the client: the upstream's (the model's) defaults apply.
    assert "temperature" not in got and "top_p" not in got


async def test_upstream_tool_calls_reasoning_and_usage_details_come_back(
    stacks: Stacks, oai: openai.AsyncOpenAI
) -> None:
    out = await oai.chat.completions.create(model=stacks.up_model, messages=ASK, tools=[WEATHER])
    call = out.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert (call.id, call.function.name) == ("call_up_1", "get_weather")
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
    assert out.choices[0].finish_reason == "tool_calls"
    stream = await oai.chat.completions.create(
        model=stacks.up_model,
        messages=ASK,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    reasoning, text, usage = "", "", None
    async for chunk in stream:
        usage = chunk.usage or usage
        for ch in chunk.choices:
            reasoning += getattr(ch.delta, "reasoning_content", None) or ""
            text += ch.delta.content or ""
    assert reasoning == "thinking" and text == "hello from upstream"
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 3


async def test_upstream_refusal_of_a_carried_field_is_a_clear_400(
    stacks: Stacks, oai: openai.AsyncOpenAI
) -> None:
    with pytest.raises(openai.BadRequestError) as ei:
        await oai.chat.completions.create(
            model=stacks.up_model, messages=ASK, extra_body={"fail_status": 400}
        )
    assert "fake upstream failure 400" in str(ei.value)


# -- embeddings -----------------------------------------------------------------------------
async def test_embeddings_with_the_sdk(stacks: Stacks, oai: openai.AsyncOpenAI) -> None:
    # The SDK asks for base64 and decodes it; the bridge encodes little-endian float32.
    out = await oai.embeddings.create(model=stacks.model, input=["alpha", "beta"])
    assert [d.index for d in out.data] == [0, 1]
    for d, text in zip(out.data, ["alpha", "beta"], strict=True):
        want = expected_embedding(text, 64)
        assert d.embedding == pytest.approx(want, abs=1e-6)
    assert out.usage.prompt_tokens > 0
    small = await oai.embeddings.create(
        model=stacks.model, input="alpha", dimensions=8, encoding_format="float"
    )
    assert small.data[0].embedding == pytest.approx(expected_embedding("alpha", 8))


async def test_embeddings_base64_over_http_and_over_nats(
    stacks: Stacks, nats_server: NatsServer
) -> None:
    async with stacks.stack.http("/v1") as c:
        r = await c.post(
            "/embeddings",
            json={"model": stacks.model, "input": "gamma", "encoding_format": "base64"},
        )
    assert r.status_code == 200, r.text
    raw = base64.b64decode(r.json()["data"][0]["embedding"])
    vec = list(struct.unpack(f"<{len(raw) // 4}f", raw))
    assert vec == pytest.approx(expected_embedding("gamma", 64), abs=1e-6)
    async with await Client.connect(nats_server.url) as tb:
        res = await tb.embeddings(stacks.model, ["gamma", "delta"], dimensions=16)
    assert len(res.embeddings) == 2
    assert res.embeddings[1] == pytest.approx(expected_embedding("delta", 16))


async def test_embeddings_go_only_to_replicas_that_serve_them(
    stacks: Stacks, oai: openai.AsyncOpenAI
) -> None:
    # The upstream-backed worker serves chat and completions (its default).
    with pytest.raises(openai.BadRequestError) as ei:
        await oai.embeddings.create(model=stacks.up_model, input="x")
    assert "does not serve embeddings" in str(ei.value)
    async with stacks.stack.http("/v1") as c:
        models = (await c.get("/models")).json()["data"]
    assert {stacks.model, stacks.up_model} <= {m["id"] for m in models}


# -- what OpenAI's document allows (tests/test_conformance_openapi.py found each) -----------
CUSTOM_CALL = [
    *ASK,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "custom", "custom": {"name": "shell", "input": "ls -la"}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "nothing here"},
]
ALLOWED = {
    "type": "allowed_tools",
    "allowed_tools": {"mode": "auto", "tools": [{"type": "function", "function": {"name": "w"}}]},
}
# (what the body adds, what the engine must get of it)
VALID_CHAT: list[tuple[dict[str, Any], dict[str, Any]]] = [
    ({"top_p": 0}, {"top_p": 0.0}),
    ({"stop": ""}, {}),
    ({"stop": ["", "zz"]}, {"stop": ["zz"]}),
    ({"logprobs": True, "top_logprobs": 2.0}, {"top_logprobs": 2}),
    ({"n": 1.0}, {}),
    ({"messages": CUSTOM_CALL}, {"messages": CUSTOM_CALL}),
    ({"tools": [WEATHER], "tool_choice": ALLOWED}, {"tool_choice": ALLOWED}),
    (
        {
            "tools": [{"type": "custom", "custom": {"name": "shell"}}],
            "tool_choice": {"type": "custom", "custom": {"name": "shell"}},
        },
        {"tool_choice": {"type": "custom", "custom": {"name": "shell"}}},
    ),
]


@pytest.mark.parametrize(
    ("extra", "sent"), VALID_CHAT, ids=[str(i) for i in range(len(VALID_CHAT))]
)
async def test_values_openai_documents_reach_the_engine(
    stacks: Stacks, extra: dict[str, Any], sent: dict[str, Any]
) -> None:
    async with stacks.stack.http("/v1") as c:
        r = await c.post(
            "/chat/completions",
            json={"model": stacks.up_model, "messages": ASK, "max_tokens": 3, **extra},
        )
    assert r.status_code == 200, r.text
    got = await stacks.upstream.last_request()
    for k, v in sent.items():
        assert got[k] == v and type(got[k]) is type(v), (k, got.get(k))
    assert "" not in (got.get("stop") or [])


async def test_a_list_of_prompts_gets_one_choice_per_prompt(
    stacks: Stacks, oai: openai.AsyncOpenAI
) -> None:
    prompts = ["one two", "three", "four five six seven"]
    want = [expected_text(p, 5)[0] for p in prompts]
    out = await oai.completions.create(model=stacks.model, prompt=prompts, max_tokens=5)
    assert [(c.index, c.text, c.finish_reason) for c in out.choices] == [
        (i, w, "length") for i, w in enumerate(want)
    ]
    assert out.usage is not None and out.usage.completion_tokens == 15
    assert out.usage.prompt_tokens == sum(count_tokens(p) for p in prompts)
    stream = await oai.completions.create(
        model=stacks.model,
        prompt=prompts,
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, ends, usage = ["", "", ""], {}, None
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                ends[c.index] = c.finish_reason
        usage = chunk.usage or usage
    assert texts == want and ends == {0: "length", 1: "length", 2: "length"}
    assert usage is not None and usage.total_tokens == out.usage.total_tokens


async def test_token_id_prompts_are_served_and_checked(
    stacks: Stacks, oai: openai.AsyncOpenAI
) -> None:
    """A completions prompt of token ids (a list of integers, or a list of such lists): the
    simulator reads id ``t`` as its four hex digits (one token each, its vocabulary 65 536
    ids), so its answer and ``prompt_tokens`` are known; an id past the vocabulary is a 400
    naming ``prompt``; an upstream gets the ids as sent and counts them as they are."""
    ids, more = [17, 4242, 9], [[1, 2], [3, 4, 5]]
    out = await oai.completions.create(model=stacks.model, prompt=ids, max_tokens=5)
    assert out.choices[0].text == expected_text(token_ids_text(ids), 5)[0]
    assert out.usage is not None and out.usage.prompt_tokens == 3
    out = await oai.completions.create(model=stacks.model, prompt=more, max_tokens=4)
    assert [c.text for c in out.choices] == [expected_text(token_ids_text(p), 4)[0] for p in more]
    assert out.usage is not None and out.usage.prompt_tokens == 5
    await oai.completions.create(model=stacks.up_model, prompt=ids, max_tokens=2)
    assert (await stacks.upstream.last_request())["prompt"] == ids
    async with stacks.stack.http("/v1") as c:
        for prompt, param in (
            ([70_000], "prompt"),  # past the sim's vocabulary: the engine's check
            ([1, "a"], "prompt"),
            ([[1], []], "prompt"),
            ([-1, 2], "prompt"),
            ([True], "prompt"),
        ):
            r = await c.post(
                "/completions", json={"model": stacks.model, "prompt": prompt, "max_tokens": 2}
            )
            assert r.status_code == 400, (prompt, r.text)
            assert r.json()["error"]["param"] == param, (prompt, r.json())
        r = await c.post(  # the bridge would have to write the prompt as text itself
            "/completions",
            json={"model": stacks.model, "prompt": ids, "max_tokens": 0, "echo": True},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "echo", r.text


async def test_n_choices_whole_and_streamed_on_chat(
    stacks: Stacks, oai: openai.AsyncOpenAI
) -> None:
    """``n``: one request per choice on the bus; with a ``seed`` choice ``j`` is sampled with
    ``seed + j`` (choices differ, reproducibly); the usage counts the prompt once (as
    OpenAI's) and every choice's answer."""
    prompt = "<|user|>tell me\n"
    msgs: Any = [{"role": "user", "content": "tell me"}]
    want = [expected_text(prompt, 6, 7 + j)[0] for j in range(3)]
    assert len(set(want)) == 3  # the sim's answers differ by seed
    out = await oai.chat.completions.create(
        model=stacks.model, messages=msgs, max_tokens=6, n=3, seed=7
    )
    assert [(c.index, c.message.content, c.message.role) for c in out.choices] == [
        (j, w, "assistant") for j, w in enumerate(want)
    ]
    assert out.usage is not None and out.usage.completion_tokens == 18
    assert out.usage.prompt_tokens == count_tokens(prompt)
    assert out.usage.total_tokens == out.usage.prompt_tokens + 18
    stream = await oai.chat.completions.create(
        model=stacks.model,
        messages=msgs,
        max_tokens=6,
        n=3,
        seed=7,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, roles, ends, usage = ["", "", ""], set(), {}, None
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.delta.role:
                roles.add((c.index, c.delta.role))
            if c.finish_reason:
                ends[c.index] = c.finish_reason
        usage = chunk.usage or usage
    assert texts == want and ends == {0: "length", 1: "length", 2: "length"}
    assert roles == {(0, "assistant"), (1, "assistant"), (2, "assistant")}
    assert usage is not None and usage.total_tokens == out.usage.total_tokens


async def test_n_choices_of_a_list_of_prompts_in_openais_order(
    stacks: Stacks, oai: openai.AsyncOpenAI
) -> None:
    """Prompt ``i``'s choice ``j`` is choice ``i * n + j``."""
    prompts = ["one two", "three"]
    out = await oai.completions.create(
        model=stacks.model, prompt=prompts, max_tokens=4, n=2, seed=1
    )
    want = [expected_text(p, 4, 1 + j)[0] for p in prompts for j in range(2)]
    assert [(c.index, c.text) for c in out.choices] == list(enumerate(want))
    assert out.usage is not None and out.usage.completion_tokens == 16
    assert out.usage.prompt_tokens == sum(count_tokens(p) for p in prompts)


@pytest.mark.parametrize(
    "body",
    [
        {"n": 0},
        {"n": 129},
        {"n": -1},
        {"n": "2"},
        {"n": 2.5},
    ],
)
async def test_a_bad_n_is_a_400_naming_it(stacks: Stacks, body: dict[str, Any]) -> None:
    async with stacks.stack.http("/v1") as c:
        r = await c.post("/chat/completions", json={"model": stacks.model, "messages": ASK, **body})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "n", r.json()
        # Choices times prompts past 128 answers: named too.
        r = await c.post(
            "/completions",
            json={"model": stacks.model, "prompt": ["a"] * 3, "n": 50, "max_tokens": 1},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        r = await c.get("/models")  # and the bridge still serves
        assert r.status_code == 200


async def test_max_tokens_0_answers_the_prompt_or_nothing(
    stacks: Stacks, oai: openai.AsyncOpenAI
) -> None:
    for echo, text in ((True, "say it"), (False, "")):
        out = await oai.completions.create(
            model=stacks.model, prompt="say it", max_tokens=0, echo=echo
        )
        assert [(c.text, c.finish_reason) for c in out.choices] == [(text, "length")]
        assert out.usage is not None and out.usage.completion_tokens == 0
        assert out.usage.prompt_tokens == count_tokens("say it")
        stream = await oai.completions.create(
            model=stacks.model, prompt=["say it", "again"], max_tokens=0, echo=echo, stream=True
        )
        got = {c.index: c.text async for chunk in stream for c in chunk.choices if c.text}
        assert got == ({0: "say it", 1: "again"} if echo else {})


async def test_completions_default_to_16_tokens_and_take_a_null_prompt(stacks: Stacks) -> None:
    async with stacks.stack.http("/v1") as c:
        for prompt in ("hello", None):
            r = await c.post("/completions", json={"model": stacks.model, "prompt": prompt})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 16
            assert r.json()["choices"][0]["text"] == expected_text(prompt or "", 16)[0]
        # Integers written 2.0, as JSON Schema's `integer` allows: taken, and carried as 2.
        r = await c.post(
            "/completions",
            json={"model": stacks.up_model, "prompt": "x", "max_tokens": 2, "logprobs": 2.0},
        )
        assert r.status_code == 200, r.text
        got = await stacks.upstream.last_request()
        assert got["logprobs"] == 2 and type(got["logprobs"]) is int
        r = await c.post(
            "/embeddings", json={"model": stacks.model, "input": "x", "dimensions": 3.0}
        )
        assert r.status_code == 200, r.text
        assert len(r.json()["data"][0]["embedding"]) == 3


async def test_over_nats_a_request_holds_one_prompt_and_makes_a_token(
    stacks: Stacks, nats_server: NatsServer
) -> None:
    async with await Client.connect(nats_server.url) as tb:
        with pytest.raises(E.InvalidRequest, match="one request per prompt"):
            await tb.completion(stacks.model, ["a", "b"], max_tokens=2)  # type: ignore[arg-type]
        with pytest.raises(E.InvalidRequest, match="at least one token"):
            await tb.completion(stacks.model, "a", max_tokens=0)
        out = await tb.completion(stacks.model, "a")
    assert out.usage.completion_tokens == 16


# -- bad values -----------------------------------------------------------------------------
BAD_CHAT: list[tuple[str, dict[str, Any]]] = [
    ("tools", {"tools": {"type": "function"}}),
    ("tools", {"tools": [{"type": "function"}]}),
    ("tools", {"tools": [{"type": "function", "function": {"name": "bad name!"}}]}),
    ("tool_choice", {"tools": [WEATHER], "tool_choice": "sometimes"}),
    ("tool_choice", {"tools": [WEATHER], "tool_choice": {"function": {"name": "other"}}}),
    ("tool_choice", {"tool_choice": "required"}),
    ("response_format", {"response_format": {"type": "yaml"}}),
    ("response_format", {"response_format": {"type": "json_schema"}}),
    ("top_logprobs", {"logprobs": True, "top_logprobs": 21}),
    ("top_logprobs", {"top_logprobs": 2}),
    ("logprobs", {"logprobs": "many"}),
    ("presence_penalty", {"presence_penalty": 2.5}),
    ("frequency_penalty", {"frequency_penalty": -3}),
    ("logit_bias", {"logit_bias": {"the": 5}}),
    ("logit_bias", {"logit_bias": {"12": 101}}),
    ("parallel_tool_calls", {"parallel_tool_calls": "yes please"}),
    ("stream", {"stream": "yes"}),
    ("logprobs", {"logprobs": "false"}),
    ("presence_penalty", {"presence_penalty": "0.5"}),
    ("logit_bias", {"logit_bias": {"\u00b2": 1}}),
    ("messages", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
    ("messages", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}),
    (
        "messages.0.content.0",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
    ),
    (
        "messages.0.content.0",
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": ""}}]}
            ]
        },
    ),
    ("messages", {"messages": [{"role": "robot", "content": "hi"}]}),
    (
        "messages",
        {"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {}}]}]},
    ),
]


@pytest.mark.parametrize(
    ("param", "extra"), BAD_CHAT, ids=[f"{p}-{i}" for i, (p, _) in enumerate(BAD_CHAT)]
)
async def test_bad_values_get_a_clear_400(
    stacks: Stacks, param: str, extra: dict[str, Any]
) -> None:
    body = {"model": stacks.model, "messages": ASK, **extra}
    async with stacks.stack.http("/v1") as c:
        r = await c.post("/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert str(err["param"]).startswith(param), err


BAD_EMBEDDINGS: list[dict[str, Any]] = [
    {"input": ""},
    {"input": []},
    {"input": ["a", ""]},
    {"input": "a", "encoding_format": "hex"},
    {"input": "a", "dimensions": 0},
    {"input": [{"text": "a"}]},
]


@pytest.mark.parametrize("extra", BAD_EMBEDDINGS)
async def test_bad_embedding_requests_get_a_clear_400(
    stacks: Stacks, extra: dict[str, Any]
) -> None:
    async with stacks.stack.http("/v1") as c:
        r = await c.post("/embeddings", json={"model": stacks.model, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


async def test_bad_values_over_nats_are_invalid_request(
    stacks: Stacks, nats_server: NatsServer
) -> None:
    async with await Client.connect(nats_server.url) as tb:
        with pytest.raises(E.InvalidRequest) as ei:
            await tb.chat_completion(stacks.model, ASK, tool_choice="required")
    assert ei.value.status == 400


async def test_carried_fields_reach_the_upstream_over_nats(
    stacks: Stacks, nats_server: NatsServer
) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "look"}, IMAGE]}]
    async with await Client.connect(nats_server.url) as tb:
        out = await tb.chat_completion(
            stacks.up_model,
            messages,
            presence_penalty=1.0,
            logit_bias={"7": 3},
            min_tokens=1,
            chat_template_kwargs={"enable_thinking": True},
            logprobs=True,
        )
    got = await stacks.upstream.last_request()
    assert got["messages"] == messages
    assert (got["presence_penalty"], got["logit_bias"], got["min_tokens"]) == (1.0, {"7": 3}, 1)
    assert out.text == "hello from upstream" and out.reasoning == "thinking"
    assert out.logprobs is not None
    assert "".join(t["token"] for t in out.logprobs["content"]) == out.text


def _tool_with_params(params: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f", "parameters": params}}


# What the engine cannot do with a schema is the client's to fix: a 400, never a 5xx, and
# never a worker busy without bound.
BAD_SCHEMAS: list[dict[str, Any]] = [
    {"type": "array", "minItems": "x"},
    {"type": "array", "items": {"type": "string"}, "minItems": 1_000_000_000},
    {"type": "integer", "minimum": 2**64},  # beyond what the bus carries
    {"$ref": "#/$defs/missing"},
]


@pytest.mark.parametrize("params", BAD_SCHEMAS)
async def test_unusable_tool_schemas_are_a_400(
    stacks: Stacks, oai: openai.AsyncOpenAI, params: dict[str, Any]
) -> None:
    with pytest.raises(openai.BadRequestError):
        await oai.chat.completions.create(
            model=stacks.model,
            messages=ASK,
            tools=[_tool_with_params(params)],  # type: ignore[list-item]
            tool_choice="required",
        )
    out = await oai.chat.completions.create(model=stacks.model, messages=ASK, max_tokens=2)
    assert out.choices[0].finish_reason == "length"  # the worker is still serving


async def test_binary_text_over_nats_is_refused(stacks: Stacks, nats_server: NatsServer) -> None:
    # msgpack can carry bytes where JSON has only strings: text the filter could not read.
    async with await Client.connect(nats_server.url) as tb:
        for messages in (
            [{"role": "user", "content": b"hello"}],
            [{"role": "user", "content": [{"type": "text", "text": b"hello"}]}],
        ):
            with pytest.raises(E.InvalidRequest):
                await tb.chat_completion(stacks.model, messages)
        with pytest.raises(E.InvalidRequest):
            await tb.chat_completion(
                stacks.model, ASK, tools=[_tool_with_params({"maximum": 2**64})]
            )
