"""The sim engine: deterministic text, stop sequences, batching limits, TP, cancel."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine_worker.backends.base import GenerationRequest
from engine_worker.backends.sim import SimEngine, expected_text
from services.config import SimSettings
from tests.support.waits import wait_for


def req(prompt: str = "hello", max_tokens: int = 8, **kw: object) -> GenerationRequest:
    return GenerationRequest(
        request_id="r", kind="completions", model="m", max_tokens=max_tokens, prompt=prompt, **kw
    )  # type: ignore[arg-type]


async def collect(engine: SimEngine, r: GenerationRequest) -> tuple[str, str, int, int]:
    text, tokens = "", 0
    async for d in engine.generate(r):
        text += d.text
        tokens += d.tokens
        if d.finish_reason:
            return text, d.finish_reason, d.completion_tokens, d.prompt_tokens
    raise AssertionError("no finish")


def fast(**kw: float) -> SimSettings:
    return SimSettings(**{"prefill_ms": 1.0, "decode_ms": 1.0, **kw})  # type: ignore[arg-type]


async def test_text_is_a_pure_function_of_prompt_and_seed() -> None:
    e = SimEngine(fast())
    a = await collect(e, req("hello", 12))
    b = await collect(e, req("hello", 12))
    c = await collect(e, req("hello", 12, seed=7))
    assert a == b
    assert a[0] != c[0]
    assert a[0] == expected_text("hello", 12)[0]
    assert a[1] == "length" and a[2] == 12


async def test_answers_end_on_their_own_at_a_length_drawn_per_prompt() -> None:
    from engine_worker.backends.sim import _start, answer_tokens

    cfg = SimSettings()
    lengths = [answer_tokens(_start(f"prompt {i}", None), cfg) for i in range(2000)]
    assert all(n is not None and n >= cfg.answer_tokens_min for n in lengths)
    ordered = sorted(n for n in lengths if n is not None)
    # Log-normal around the configured median, with a long tail of long answers.
    assert 0.85 * cfg.answer_tokens_median <= ordered[1000] <= 1.15 * cfg.answer_tokens_median
    assert ordered[1900] > 3 * ordered[1000] and ordered[100] < ordered[1000] / 3
    # The same prompt and seed, the same length; through the engine it ends with `stop`.
    e = SimEngine(fast())
    prompt = next(f"prompt {i}" for i in range(2000) if lengths[i] == ordered[0])
    n = ordered[0]
    text, reason, completion, _ = await collect(e, req(prompt, n + 50))
    assert (reason, completion) == ("stop", n)
    assert (text, reason) == expected_text(prompt, n + 50)
    # The budget first: `length`. ignore_eos (vLLM's) runs to the budget; median 0 never stops.
    assert (await collect(e, req(prompt, n)))[1:3] == ("length", n)
    forced = await collect(e, req(prompt, n + 50, extra={"ignore_eos": True}))
    assert forced[1:3] == ("length", n + 50)
    assert forced[0] == expected_text(prompt, n + 50, ignore_eos=True)[0]
    endless = SimEngine(fast(answer_tokens_median=0))
    assert (await collect(endless, req(prompt, n + 50)))[1:3] == ("length", n + 50)


async def test_stop_sequence_ends_with_stop_and_never_leaks_it() -> None:
    e = SimEngine(fast())
    full, _ = expected_text("hello", 20)
    words = full.split(" ")
    stop = " " + words[5]
    text, reason, _, _ = await collect(e, req("hello", 20, stop=[stop]))
    assert reason == "stop"
    assert stop not in text
    assert text == full[: full.find(stop)]


async def test_prefill_and_decode_times_follow_the_model() -> None:
    e = SimEngine(SimSettings(prefill_ms=30, decode_ms=10))
    t0 = time.perf_counter()
    first = None
    async for d in e.generate(req("x", 5)):
        if first is None and d.text:
            first = time.perf_counter() - t0
    total = time.perf_counter() - t0
    assert first is not None and first >= 0.029
    assert total >= 0.029 + 4 * 0.0099


def test_tensor_parallel_speeds_steps_up_with_a_communication_cost() -> None:
    cfg = SimSettings(decode_ms=10, tp_comm_ms=0.5, tp_efficiency=0.5)
    tp1, tp4 = SimEngine(cfg, tp=1), SimEngine(cfg, tp=4)
    assert tp4.step_s(1) == pytest.approx(0.010 / 2.5 + 0.0005)
    assert tp1.step_s(1) == pytest.approx(0.010)
    grow = SimEngine(SimSettings(decode_ms=10, decode_ms_per_seq=0.1))
    assert grow.step_s(100) == pytest.approx(0.020)


async def test_max_running_queues_the_rest() -> None:
    e = SimEngine(fast(max_running=2))
    gens = [e.generate(req(f"p{i}", 50)) for i in range(5)]
    await wait_for(
        lambda: e.stats()["running"] == 2,
        timeout=10,
        what="the engine never ran two of the five sequences",
    )
    st = e.stats()
    assert st["running"] == 2 and st["waiting"] == 3
    for g in gens:
        await g.aclose()
    assert e.stats() == {"running": 0, "waiting": 0, "kv_usage": 0.0}


async def test_closing_a_stream_cancels_the_sequence() -> None:
    e = SimEngine(fast())
    g = e.generate(req("p", 10_000))
    async for d in g:
        assert d.text
        break
    await g.aclose()
    assert e.stats()["running"] == 0


async def test_slow_consumer_gets_coalesced_chunks_but_every_token() -> None:
    e = SimEngine(fast(decode_ms=1))
    g = e.generate(req("p", 40))
    chunks, text = 0, ""
    async for d in g:
        text += d.text
        chunks += 1 if d.text else 0
        await asyncio.sleep(0.01)  # ten steps per read
        if d.finish_reason:
            assert d.completion_tokens == 40
    assert chunks < 40
    assert text == expected_text("p", 40)[0]


async def test_many_sequences_share_steps() -> None:
    e = SimEngine(fast(decode_ms=5))
    # Every answer runs its 20 tokens (ignore_eos): a few would end on their own before.
    outs = await asyncio.gather(
        *(collect(e, req(f"p{i}", 20, extra={"ignore_eos": True})) for i in range(200))
    )
    assert all(o[2] == 20 for o in outs)
    # 200 sequences decode together: about 20 steps, not 4000.
    assert e.steps < 60


async def pushed(engine: SimEngine, r: GenerationRequest, stop_after: int = 0) -> list[Any]:
    """The deltas a pushing stream hands its sink (``stop_after``: the sink ends it then)."""
    got: list[Any] = []

    def sink(d: Any) -> bool:
        got.append(d)
        return bool(stop_after) and len(got) >= stop_after

    stream = engine.generate(r)
    assert isinstance(stream, SimStream)
    await stream.push(sink)
    return got


async def test_a_pushing_stream_gives_what_iteration_gives_one_token_at_a_time() -> None:
    """``push`` (the worker's path: deltas from the engine's step, no task per token):
    the same text, finish and usage as iterating, while a stop sequence ends a stream in
    the middle of a step whose other sequences still get every token."""
    e = SimEngine(fast())
    full, _ = expected_text("hello", 20)
    stop = " " + full.split(" ")[5]
    plain, stopped, *others = await asyncio.gather(
        pushed(e, req("hello", 20)),
        pushed(e, req("hello", 20, stop=[stop])),
        *(pushed(e, req(f"p{i}", 12)) for i in range(5)),
    )
    assert "".join(d.text for d in plain) == full
    assert [d.tokens for d in plain[:-1]] == [1] * 20 and plain[-1].tokens == 0
    assert plain[-1].finish_reason == "length" and plain[-1].completion_tokens == 20
    assert all(d.finish_reason is None for d in plain[:-1])
    assert stopped[-1].finish_reason == "stop"
    assert "".join(d.text for d in stopped) == full[: full.find(stop)]
    for i, got in enumerate(others):
        assert "".join(d.text for d in got) == expected_text(f"p{i}", 12)[0]
    await asyncio.sleep(0)
    assert e.stats() == {"running": 0, "waiting": 0, "kv_usage": 0.0}


async def test_a_sink_that_ends_or_fails_stops_only_its_own_sequence() -> None:
    e = SimEngine(fast())
    other = asyncio.ensure_future(collect(e, req("other", 30)))
    got = await pushed(e, req("p", 10_000), stop_after=3)
    assert len(got) == 3
    await asyncio.sleep(0)
    assert e.stats()["running"] == 1  # the other one

    def broken(d: Any) -> bool:
        raise RuntimeError("a sink bug")

    stream = e.generate(req("q", 10_000))
    assert isinstance(stream, SimStream)
    with pytest.raises(RuntimeError, match="a sink bug"):
        await stream.push(broken)
    assert (await other)[0] == expected_text("other", 30)[0]
    await asyncio.sleep(0)
    assert e.stats()["running"] == 0


# -- outputs beside plain text: tool calls, structured output, logprobs, embeddings ---------

import json  # noqa: E402
import math  # noqa: E402
from typing import Any  # noqa: E402

from bus_schemas import errors as E  # noqa: E402
from engine_worker.backends.base import Delta  # noqa: E402
from engine_worker.backends.sim import (  # noqa: E402
    JSON_OBJECT_TOKENS,
    SimBackend,
    SimExtraStream,
    SimStream,
    count_tokens,
    expected_structured,
)
from engine_worker.backends.sim_outputs import (  # noqa: E402
    expected_embedding,
    expected_tool_call,
    instance,
    json_tokens,
)
from services.config import WorkerSettings  # noqa: E402

pytestmark = pytest.mark.unit

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "when": {"type": "string", "format": "date"},
            },
            "required": ["city", "unit", "days", "when"],
            "additionalProperties": False,
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "filters": {"type": "array", "items": {"$ref": "#/$defs/Filter"}, "minItems": 2},
                "limit": {"type": ["integer", "null"], "exclusiveMinimum": 0, "multipleOf": 5},
            },
            "required": ["query"],
            "$defs": {
                "Filter": {
                    "type": "object",
                    "properties": {
                        "field": {"type": "string", "enum": ["title", "body", "author"]},
                        "value": {"anyOf": [{"type": "null"}, {"type": "string"}]},
                        "since": {"type": "string", "format": "date-time"},
                    },
                    "required": ["field", "value"],
                }
            },
        },
    },
}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def chat(
    messages: list[dict[str, Any]] | None = None, max_tokens: int = 200, **extra: Any
) -> GenerationRequest:
    return GenerationRequest(
        request_id="r",
        kind="chat",
        model="m",
        max_tokens=max_tokens,
        messages=USER if messages is None else messages,
        extra=extra,
    )


def validate(value: Any, schema: Any, root: Any = None) -> None:
    """A JSON Schema check for the keywords the tests use (jsonschema is not installed)."""
    try:
        import jsonschema
    except ImportError:
        pass
    else:
        jsonschema.validate(value, schema)
    _check(value, schema, schema if root is None else root)


def _check(v: Any, s: Any, root: Any) -> None:
    if s is True or s == {}:
        return
    if "$ref" in s:
        node = root
        for part in s["$ref"][2:].split("/"):
            node = node[part]
        _check(v, node, root)
    for sub in s.get("allOf", ()):
        _check(v, sub, root)
    for key in ("anyOf", "oneOf"):
        if key in s:
            ok = 0
            for sub in s[key]:
                try:
                    _check(v, sub, root)
                    ok += 1
                except AssertionError:
                    pass
            assert ok == 1 if key == "oneOf" else ok >= 1, (v, s)
    if "const" in s:
        assert v == s["const"]
    if "enum" in s:
        assert v in s["enum"]
    t = s.get("type")
    if t is not None:
        types = t if isinstance(t, list) else [t]
        py = {
            "object": dict,
            "array": list,
            "string": str,
            "boolean": bool,
            "null": type(None),
        }
        assert any(
            isinstance(v, py[x])
            if x in py
            else (
                isinstance(v, int) and not isinstance(v, bool)
                if x == "integer"
                else isinstance(v, (int, float)) and not isinstance(v, bool)
            )
            for x in types
        ), (v, t)
    if isinstance(v, dict):
        props = s.get("properties", {})
        for k in s.get("required", ()):
            assert k in v, (k, v)
        for k, x in v.items():
            if k in props:
                _check(x, props[k], root)
            elif s.get("additionalProperties") is False:
                raise AssertionError(f"extra property {k}")
            elif isinstance(s.get("additionalProperties"), dict):
                _check(x, s["additionalProperties"], root)
    if isinstance(v, list):
        assert len(v) >= s.get("minItems", 0)
        assert len(v) <= s.get("maxItems", len(v))
        prefix = s.get("prefixItems", [])
        for i, x in enumerate(v):
            _check(x, prefix[i] if i < len(prefix) else s.get("items", {}), root)
    if isinstance(v, str):
        assert s.get("minLength", 0) <= len(v) <= s.get("maxLength", len(v))
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        assert v >= s.get("minimum", v) and v <= s.get("maximum", v)
        if "exclusiveMinimum" in s:
            assert v > s["exclusiveMinimum"]
        if "exclusiveMaximum" in s:
            assert v < s["exclusiveMaximum"]
        if "multipleOf" in s:
            assert (v / s["multipleOf"]).is_integer()


async def deltas(engine: SimEngine, r: GenerationRequest, pause: float = 0.0) -> list[Delta]:
    out: list[Delta] = []
    async for d in engine.generate(r):
        out.append(d)
        if pause:
            await asyncio.sleep(pause)
    assert out[-1].finish_reason is not None
    assert all(d.finish_reason is None for d in out[:-1])
    return out


def arguments(ds: list[Delta]) -> str:
    return "".join(
        c["function"].get("arguments", "")
        for d in ds
        for c in d.tool_calls or ()
        if "function" in c
    )


def test_the_sim_serves_chat_completions_and_embeddings() -> None:
    assert SimBackend(WorkerSettings()).endpoints() == ["chat", "completions", "embeddings"]


async def test_embeddings_are_deterministic_unit_vectors() -> None:
    b = SimBackend(WorkerSettings())
    inputs: list[Any] = ["hello world", [1, 2, 3], "hello world", "other"]
    r = GenerationRequest(request_id="r", kind="embeddings", model="m", max_tokens=1, input=inputs)
    t0 = time.perf_counter()
    out = await b.embed(r)
    assert time.perf_counter() - t0 >= b.engine.prefill_s(out.prompt_tokens) - 0.002
    assert out.prompt_tokens == count_tokens("hello world") * 2 + 3 + count_tokens("other")
    assert len(out.vectors) == 4
    for vec, item in zip(out.vectors, inputs, strict=True):
        assert len(vec) == 64  # SimSettings.embedding_dim
        assert math.isclose(math.fsum(x * x for x in vec), 1.0, rel_tol=1e-9)
        assert vec == expected_embedding(item, 64)
    assert out.vectors[0] == out.vectors[2]
    assert out.vectors[0] != out.vectors[3]
    assert expected_embedding([1, 2, 3], 64) != expected_embedding("1,2,3", 64)
    again = await b.embed(r)
    assert again.vectors == out.vectors

    r.extra = {"dimensions": 8}
    short = await b.embed(r)
    assert [len(v) for v in short.vectors] == [8] * 4
    assert math.isclose(math.fsum(x * x for x in short.vectors[0]), 1.0, rel_tol=1e-9)
    # A shorter vector is the longer one's start, normalised again.
    head = out.vectors[0][:8]
    norm = math.sqrt(math.fsum(x * x for x in head))
    assert short.vectors[0] == pytest.approx([x / norm for x in head])


@pytest.mark.parametrize(
    ("inputs", "extra"),
    [
        ([], {}),
        (None, {}),
        ([""], {}),
        ([[]], {}),
        ([1.5], {}),
        (["a"], {"dimensions": 0}),
        (["a"], {"dimensions": "8"}),
    ],
)
async def test_bad_embedding_inputs_are_invalid_requests(inputs: Any, extra: Any) -> None:
    b = SimBackend(WorkerSettings())
    r = GenerationRequest(
        request_id="r", kind="embeddings", model="m", max_tokens=1, input=inputs, extra=extra
    )
    with pytest.raises(E.InvalidRequest):
        await b.embed(r)


async def test_tool_call_streams_like_openai() -> None:
    e = SimEngine(SimSettings(prefill_ms=5, decode_ms=2))
    r = chat(tools=[WEATHER, SEARCH])
    expected = expected_tool_call(r)
    assert expected is not None
    call_id, name, args = expected
    assert name == "get_weather"
    assert call_id.startswith("call_") and len(call_id) == 29
    assert expected_tool_call(chat(tools=[WEATHER, SEARCH])) == expected
    t0 = time.perf_counter()
    ds = await deltas(e, r)
    took = time.perf_counter() - t0
    toks = json_tokens(args)
    # The header: id, type, name and empty arguments, no tokens.
    assert ds[0] == Delta(
        "",
        0,
        tool_calls=[
            {
                "index": 0,
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": ""},
            }
        ],
    )
    # Then one fragment of about four characters per decode step.
    frags = ds[1:-1]
    assert [d.tool_calls for d in frags] == [
        [{"index": 0, "function": {"arguments": t}}] for t in toks
    ]
    assert all(d.text == "" and d.tokens == 1 and d.logprobs is None for d in frags)
    last = ds[-1]
    assert last.finish_reason == "tool_calls"
    assert last.completion_tokens == len(toks) == count_tokens(args)
    assert last.prompt_tokens == count_tokens(r.prompt_text())
    assert took >= 0.005 + (len(toks) - 1) * 0.002 - 0.001
    assert arguments(ds) == args
    value = json.loads(args)
    validate(value, WEATHER["function"]["parameters"])  # type: ignore[index]
    assert value["unit"] == "celsius" and value["when"] == "2024-01-15"


async def test_tool_call_arguments_follow_refs_and_nested_schemas() -> None:
    e = SimEngine(fast())
    choice = {"type": "function", "function": {"name": "search"}}
    r = chat(tools=[WEATHER, SEARCH], tool_choice=choice)
    expected = expected_tool_call(r)
    assert expected is not None and expected[1] == "search"
    ds = await deltas(e, r, pause=0.004)  # a slow reader: fragments coalesce
    assert ds[0].tool_calls and ds[0].tool_calls[0]["function"]["name"] == "search"
    assert ds[0].tool_calls[0]["id"] == expected[0]
    assert arguments(ds) == expected[2]
    assert sum(d.tokens for d in ds) == ds[-1].completion_tokens == len(json_tokens(expected[2]))
    assert len(ds) - 2 < len(json_tokens(expected[2]))
    value = json.loads(expected[2])
    params = SEARCH["function"]["parameters"]  # type: ignore[index]
    validate(value, params)
    assert len(value["filters"]) == 2 and value["limit"] == 5
    assert value["filters"][0]["field"] != value["filters"][1]["field"]


async def test_a_turn_carrying_the_tool_result_gets_text() -> None:
    e = SimEngine(fast())
    first = chat(tools=[WEATHER])
    call = expected_tool_call(first)
    assert call is not None
    turn: list[dict[str, Any]] = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call[0],
                    "type": "function",
                    "function": {"name": call[1], "arguments": call[2]},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call[0], "content": '{"temp": 21}'},
    ]
    r = chat(turn, 12, tools=[WEATHER])
    assert expected_tool_call(r) is None
    ds = await deltas(e, r)
    assert all(d.tool_calls is None for d in ds)
    assert "".join(d.text for d in ds) == expected_text(r.prompt_text(), 12)[0]
    assert ds[-1].finish_reason == "length"
    # "required" calls a tool even then.
    forced = chat(turn, 200, tools=[WEATHER], tool_choice="required")
    assert expected_tool_call(forced) is not None
    assert (await deltas(e, forced))[-1].finish_reason == "tool_calls"


async def test_tool_choice_none_gives_text() -> None:
    e = SimEngine(fast())
    r = chat(max_tokens=10, tools=[WEATHER], tool_choice="none")
    assert expected_tool_call(r) is None
    assert isinstance(e.generate(r), SimStream)  # nothing extra: the plain path
    text, reason, n, _ = await collect(e, r)
    assert (text, reason, n) == (*expected_text(r.prompt_text(), 10), 10)


def test_a_named_tool_that_is_not_offered_is_an_invalid_request() -> None:
    e = SimEngine(fast())
    r = chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(E.InvalidRequest):
        e.generate(r)


async def test_max_tokens_cuts_a_tool_call_with_length() -> None:
    e = SimEngine(fast())
    r = chat(max_tokens=3, tools=[WEATHER])
    expected = expected_tool_call(r)
    assert expected is not None
    ds = await deltas(e, r)
    assert ds[-1].finish_reason == "length" and ds[-1].completion_tokens == 3
    assert arguments(ds) == "".join(json_tokens(expected[2])[:3])
    assert ds[0].tool_calls and ds[0].tool_calls[0]["id"] == expected[0]


async def test_a_resumed_tool_call_is_made_again() -> None:
    e = SimEngine(fast())
    r = chat(tools=[WEATHER])
    expected = expected_tool_call(r)
    assert expected is not None
    r.resume_text, r.resume_tokens = "whatever", 2
    ds = await deltas(e, r)
    assert arguments(ds) == expected[2] and ds[-1].finish_reason == "tool_calls"


async def test_structured_output_parses_into_the_pydantic_model() -> None:
    from pydantic import BaseModel, Field

    class Address(BaseModel):
        street: str
        city: str = Field(min_length=2, max_length=5)
        zip_code: int = Field(ge=10000, le=99999)

    class Person(BaseModel):
        name: str
        age: int = Field(gt=0, lt=150)
        score: float = Field(ge=0, le=1)
        nickname: str | None
        home: Address
        previous: list[Address]
        tags: list[str] = Field(min_length=2)

    try:
        from openai.lib._pydantic import to_strict_json_schema

        schema = to_strict_json_schema(Person)
    except ImportError:  # pragma: no cover - an older openai
        schema = Person.model_json_schema()
    assert "$defs" in schema
    rf = {
        "type": "json_schema",
        "json_schema": {"name": "Person", "schema": schema, "strict": True},
    }
    e = SimEngine(fast())
    r = chat(response_format=rf)
    ds = await deltas(e, r)
    text = "".join(d.text for d in ds)
    assert text == expected_structured(r) == json.dumps(instance(schema))
    assert ds[-1].finish_reason == "stop"
    assert ds[-1].completion_tokens == len(json_tokens(text)) == count_tokens(text)
    assert all(d.tokens == 1 for d in ds[:-1])
    person = Person.model_validate_json(text)
    assert person.home.zip_code == 10000 and len(person.tags) == 2
    validate(json.loads(text), schema)


async def test_json_object_answers_with_the_prompts_text() -> None:
    e = SimEngine(fast())
    r = chat(response_format={"type": "json_object"})
    text, reason, n, _ = await collect(e, r)
    answer = expected_text(r.prompt_text(), JSON_OBJECT_TOKENS)[0]
    assert json.loads(text) == {"answer": answer}
    assert text == expected_structured(r)
    assert reason == "stop" and n == count_tokens(text)
    # A text completion may ask for it too.
    c = req("abc", 100, extra={"response_format": {"type": "json_object"}})
    text, reason, _, _ = await collect(e, c)
    assert json.loads(text) == {"answer": expected_text("abc", JSON_OBJECT_TOKENS)[0]}


async def test_max_tokens_cuts_structured_output_with_length() -> None:
    e = SimEngine(fast())
    r = chat(max_tokens=5, response_format={"type": "json_object"})
    text, reason, n, _ = await collect(e, r)
    assert (text, reason, n) == ("".join(json_tokens(expected_structured(r))[:5]), "length", 5)


async def test_structured_output_resumes_after_the_delivered_text() -> None:
    e = SimEngine(fast())
    full = expected_structured(chat(response_format={"type": "json_object"}))
    for cut in (8, 10, 0):  # whole tokens, a token in part, nothing yet
        r = chat(response_format={"type": "json_object"})
        r.resume_text, r.resume_tokens = full[:cut], cut // 4
        ds = await deltas(e, r)
        rest = "".join(d.text for d in ds)
        assert full[:cut] + rest == full
        assert ds[-1].finish_reason == "stop"
        assert ds[-1].completion_tokens == len(json_tokens(full)) - cut // 4
    r = chat(max_tokens=6, response_format={"type": "json_object"})
    r.resume_text, r.resume_tokens = full[:8], 2
    ds = await deltas(e, r)
    assert ds[-1].finish_reason == "length" and ds[-1].completion_tokens == 4
    assert full[:8] + "".join(d.text for d in ds) == full[:24]


async def test_a_resumed_answer_never_produces_a_counted_token_again() -> None:
    """An output filter held back the text of tokens the caller counted (their frames carry
    the count first) when its replica was lost: the next replica sends the missing text and
    goes on after them, so the counts of both attempts add up to the answer's, never more
    (a rolling upgrade in CI saw 31 of 30), and the text is whole."""
    e = SimEngine(fast())
    for r in (
        req("hello", 12),
        req("hello", 12, extra={"ignore_eos": True}),
        chat(max_tokens=12),
        chat(max_tokens=12, logprobs=True),
        chat(max_tokens=12, response_format={"type": "json_object"}),
    ):
        first = await deltas(e, r)
        full, reason, total = (
            "".join(d.text for d in first),
            first[-1].finish_reason,
            len(first) - 1,
        )
        assert first[-1].completion_tokens == total >= 8 and all(d.tokens == 1 for d in first[:-1])
        toks = [d.text for d in first[:-1]]  # one token a delta
        for counted, held in ((6, 1), (6, 3), (total, 2), (3, 3), (6, 0)):
            have = "".join(toks[: counted - held])
            if held:
                have += toks[counted - held][:2]  # in part
            r.resume_text, r.resume_tokens = have, counted
            ds = await deltas(e, r)
            assert have + "".join(d.text for d in ds) == full, (r.extra, counted, held)
            assert sum(d.tokens for d in ds) == ds[-1].completion_tokens == total - counted
            assert ds[-1].finish_reason == reason


def _check_chat_logprobs(d: Delta, top: int) -> list[str]:
    assert d.logprobs is not None and set(d.logprobs) == {"content"}
    content = d.logprobs["content"]
    assert len(content) == d.tokens
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["bytes"] == list(entry["token"].encode())
        assert entry["logprob"] <= 0
        tops = entry["top_logprobs"]
        assert len(tops) == top
        if top:
            assert tops[0] == {k: entry[k] for k in ("token", "logprob", "bytes")}
            assert all(t["logprob"] < entry["logprob"] for t in tops[1:])
            assert len({t["token"] for t in tops}) == top
    return [entry["token"] for entry in content]


async def test_chat_logprobs_cover_every_token() -> None:
    e = SimEngine(fast())
    r = chat(max_tokens=12, logprobs=True, top_logprobs=3)
    assert isinstance(e.generate(r), SimExtraStream)
    fast_ds = await deltas(e, r)
    slow_ds = await deltas(e, r, pause=0.004)
    for ds in (fast_ds, slow_ds):
        tokens: list[str] = []
        for d in ds:
            if d.tokens:
                got = _check_chat_logprobs(d, 3)
                assert "".join(got) == d.text
                tokens += got
            else:
                assert d.logprobs is None
        assert "".join(tokens) == expected_text(r.prompt_text(), 12)[0]
        assert len(tokens) == 12 and ds[-1].finish_reason == "length"

    def flat(ds: list[Delta]) -> list[Any]:
        return [x for d in ds if d.logprobs for x in d.logprobs["content"]]

    assert flat(fast_ds) == flat(slow_ds)  # values depend on the position, not the chunking
    # Without top_logprobs the lists are empty.
    plain = await deltas(e, chat(max_tokens=3, logprobs=True))
    assert [_check_chat_logprobs(d, 0) for d in plain if d.tokens]


async def test_chat_logprobs_cover_tool_calls_and_structured_output() -> None:
    e = SimEngine(fast())
    r = chat(tools=[WEATHER], logprobs=True, top_logprobs=2)
    ds = await deltas(e, r)
    tokens = [t for d in ds if d.tokens for t in _check_chat_logprobs(d, 2)]
    call = expected_tool_call(r)
    assert call is not None and tokens == json_tokens(call[2])
    r = chat(response_format={"type": "json_object"}, logprobs=True, top_logprobs=1)
    ds = await deltas(e, r, pause=0.003)
    tokens = [t for d in ds if d.tokens for t in _check_chat_logprobs(d, 1)]
    assert "".join(tokens) == expected_structured(r)


async def test_completion_logprobs_have_tokens_offsets_and_top_k() -> None:
    e = SimEngine(fast())
    r = req("abc", 10, extra={"logprobs": 2})
    for pause in (0.0, 0.004):
        ds = await deltas(e, r, pause=pause)
        tokens: list[str] = []
        offsets: list[int] = []
        for d in ds:
            if not d.tokens:
                assert d.logprobs is None
                continue
            lp = d.logprobs
            assert lp is not None
            assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
            assert len(lp["tokens"]) == len(lp["token_logprobs"]) == d.tokens
            assert len(lp["top_logprobs"]) == len(lp["text_offset"]) == d.tokens
            assert "".join(lp["tokens"]) == d.text
            for t, v, top in zip(
                lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True
            ):
                assert v <= 0 and len(top) == 2
                assert next(iter(top.items())) == (t, v) and max(top.values()) == v
            tokens += lp["tokens"]
            offsets += lp["text_offset"]
        full = expected_text("abc", 10)[0]
        assert "".join(tokens) == full
        assert offsets == [len("".join(tokens[:i])) for i in range(len(tokens))]


async def test_logprobs_stay_aligned_when_a_stop_sequence_holds_text_back() -> None:
    e = SimEngine(fast())
    full, _ = expected_text("hello", 20)
    stop = " " + full.split(" ")[5]
    r = req("hello", 20, stop=[stop], extra={"logprobs": 0})
    ds = await deltas(e, r)
    assert "".join(d.text for d in ds) == full[: full.find(stop)]
    assert ds[-1].finish_reason == "stop"
    lps = [d.logprobs for d in ds if d.tokens]
    assert sum(d.tokens for d in ds) == ds[-1].completion_tokens
    assert all(
        lp is not None and len(lp["tokens"]) == d.tokens
        for lp, d in zip(lps, [d for d in ds if d.tokens], strict=True)
    )
    assert full.startswith("".join(t for lp in lps if lp for t in lp["tokens"]))


async def test_the_last_delta_names_the_stop_sequence_that_ended_the_answer() -> None:
    """Only a stop sequence that hit is named (the earliest in the text), on the last delta,
    iterated, pushed, and with logprobs (the other stream); an answer that ends on its own
    or at max_tokens names none."""
    e = SimEngine(fast())
    full, _ = expected_text("hello", 20)
    words = full.split(" ")
    early, late = " " + words[3], " " + words[6]
    assert full.find(early) < full.find(late)
    natural = next(p for p in (f"p{i}" for i in range(500)) if expected_text(p, 400)[1] == "stop")
    for extra in ({}, {"logprobs": 0}):
        ds = await deltas(e, req("hello", 20, stop=[late, "zzzz", early], extra=extra))
        assert "".join(d.text for d in ds) == full[: full.find(early)]
        assert (ds[-1].finish_reason, ds[-1].stop_sequence) == ("stop", early)
        assert all(d.stop_sequence is None for d in ds[:-1])
        ds = await deltas(e, req(natural, 400, stop=["zzzz"], extra=extra))
        assert (ds[-1].finish_reason, ds[-1].stop_sequence) == ("stop", None)
        ds = await deltas(e, req("hello", 4, stop=["zzzz"], extra=extra))
        assert (ds[-1].finish_reason, ds[-1].stop_sequence) == ("length", None)
    got = await pushed(e, req("hello", 20, stop=[late, early]))
    assert (got[-1].finish_reason, got[-1].stop_sequence) == ("stop", early)
    got = await pushed(e, req(natural, 400, stop=["zzzz"]))
    assert (got[-1].finish_reason, got[-1].stop_sequence) == ("stop", None)


async def test_temperature_and_top_p_may_be_none_and_unrelated_extras_keep_the_plain_path() -> None:
    e = SimEngine(fast())
    r = req("hello", 6, temperature=None, top_p=None, extra={"user": "u", "logit_bias": {}})
    assert isinstance(e.generate(r), SimStream)
    assert (await collect(e, r))[:2] == expected_text("hello", 6)
    assert isinstance(e.generate(req("hello", 6)), SimStream)


def test_instance_satisfies_common_schema_keywords() -> None:
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {
            "when": {"type": "string", "format": "date-time"},
            "day": {"type": "string", "format": "date"},
            "mail": {"type": "string", "format": "email"},
            "site": {"type": "string", "format": "uri"},
            "short": {"type": "string", "maxLength": 3},
            "long": {"type": "string", "minLength": 40},
            "big": {"type": "integer", "minimum": 100, "multipleOf": 7},
            "neg": {"type": "integer", "maximum": -3},
            "ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 0.5},
            "flag": {"type": "boolean"},
            "nothing": {"type": "null"},
            "either": {"type": ["null", "integer"]},
            "fixed": {"const": "k"},
            "ids": {"type": "array", "items": {"type": "integer"}, "minItems": 3, "maxItems": 3},
            "none": {"type": "array", "maxItems": 0},
            "pair": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "number"}]},
            "map": {"type": "object", "additionalProperties": {"type": "integer"}},
            "merged": {"allOf": [{"$ref": "#/definitions/A"}, {"$ref": "#/definitions/B"}]},
            "maybe": {"oneOf": [{"type": "null"}, {"$ref": "#/definitions/A"}]},
        },
        "required": ["when"],
        "additionalProperties": False,
        "definitions": {
            "A": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            "B": {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]},
        },
    }
    value = instance(schema)
    assert value == instance(schema)
    validate(value, schema)
    assert value["day"] == "2024-01-15" and value["mail"] == "user0@example.com"
    assert value["big"] == 105 and value["neg"] == -3 and value["either"] == 1
    assert value["merged"].keys() == {"a", "b"} and value["maybe"].keys() == {"a"}
    assert len(value["ids"]) == 3 and value["none"] == [] and len(value["map"]) == 1
    assert instance({}) is None and instance({"anyOf": [{"type": "null"}]}) is None


def test_instance_ends_recursive_schemas() -> None:
    schema = {
        "$defs": {
            "Node": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}},
                    "parent": {"anyOf": [{"$ref": "#/$defs/Node"}, {"type": "null"}]},
                },
                "required": ["name", "children", "parent"],
                "additionalProperties": False,
            }
        },
        "$ref": "#/$defs/Node",
    }
    value = instance(schema)
    validate(value, schema)


def test_a_role_that_is_not_a_string_does_not_break_the_prompt() -> None:
    # Found by the NATS fuzz (tests/test_fuzz_nats.py, 300 examples): an envelope published
    # straight to the router whose role was a list nested 1000 deep made the sim's prompt
    # rendering recurse until it failed, logged as an engine fault.
    deep: Any = []
    for _ in range(1000):
        deep = [deep]
    req = GenerationRequest(
        request_id="r",
        kind="chat",
        model="m",
        messages=[{"role": deep, "content": "hi"}, {"role": 5, "content": "there"}],
        max_tokens=2,
    )
    assert req.prompt_text() == "<||>hi\n<||>there\n"


def test_an_envelope_whose_stop_is_not_text_is_malformed() -> None:
    # msgpack carries bytes beside text: a NATS client's stop of bytes (found by the bus
    # fuzz) failed inside the sim's engine with a TypeError instead of a clear refusal.
    base = {"request_id": "r", "kind": "completions", "model": "m", "prompt": "p"}
    for stop in ([b"x"], "x", [1], {"a": "b"}):
        with pytest.raises(TypeError, match=r"params\.stop"):
            GenerationRequest.from_envelope({**base, "params": {"stop": stop}})
    assert GenerationRequest.from_envelope({**base, "params": {"stop": ["x"]}}).stop == ["x"]
