"""The vllm backend against a fake of vLLM 0.33's serve front end and engine (no GPU needed),
a check of the real vLLM names and signatures (when vLLM is installed), and one GPU test that
runs a real model when vLLM, a GPU and a model path are available.

``python -m tests.test_vllm_backend`` measures the adapter's own cost per request and chunk.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import threading
import time
import types
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import pytest

from bus_schemas import errors as E
from engine_worker import backends
from engine_worker.backends import vllm_serving as vs
from engine_worker.backends.base import Delta, GenerationRequest
from engine_worker.backends.vllm_backend import (
    MULTIPROC_ENV,
    OTLP_PROTOCOL_ENV,
    VLLMBackend,
    pin_gpus,
)
from services.config import VLLMSettings, WorkerSettings

try:  # tests/ is a package when run from the repo root with rootdir on sys.path
    from tests.fakes import fake_vllm as fv
except ImportError:  # pytest's default rootdir-less import puts tests/ itself on sys.path
    from fakes import fake_vllm as fv  # type: ignore[no-redef]


def make_cfg(
    model: str = "tiny-model",
    tp: int = 1,
    gpus: str = "",
    opts: dict[str, Any] | None = None,
    **more: Any,
) -> WorkerSettings:
    """Worker settings; ``opts`` and ``more`` are ``worker.vllm.engine_args``."""
    engine_args = {**(opts or {}), **more}
    return WorkerSettings(
        backend="vllm", model=model, tp=tp, vllm=VLLMSettings(gpus=gpus, engine_args=engine_args)
    )


async def started(
    cfg: WorkerSettings | None = None, **engine_options: Any
) -> tuple[VLLMBackend, fv.FakeVLLM]:
    fake = fv.FakeVLLM(**engine_options)
    b = VLLMBackend(cfg or make_cfg(), vllm=fake)
    await b.start()
    return b, fake


def completion(
    rid: str = "r1",
    prompt: str = "tell me a story",
    extra: dict[str, Any] | None = None,
    resume: dict[str, Any] | None = None,
    **p: Any,
) -> GenerationRequest:
    return GenerationRequest.from_envelope(
        {
            "request_id": rid,
            "kind": "completions",
            "model": "tiny-model",
            "prompt": prompt,
            "params": {"max_tokens": 12, "temperature": 0.0, "seed": 7, **p},
            "extra": extra or {},
            "resume": resume,
        }
    )


MESSAGES = [
    {"role": "system", "content": "be brief"},
    {
        "role": "user",
        "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}],
    },
]


def chat(
    rid: str = "c1",
    messages: list[dict[str, Any]] | None = None,
    extra: dict[str, Any] | None = None,
    resume: dict[str, Any] | None = None,
    model: str = "tiny-model",
    **p: Any,
) -> GenerationRequest:
    env: dict[str, Any] = {
        "request_id": rid,
        "kind": "chat",
        "model": model,
        "params": {"max_tokens": 6, "seed": 1, **p},
        "messages": messages if messages is not None else json.loads(json.dumps(MESSAGES)),
        "extra": extra or {},
    }
    if resume is not None:
        env["resume"] = resume
    return GenerationRequest.from_envelope(env)


async def collect(it: Any) -> list[Delta]:
    return [d async for d in it]


def chat_prompt_ids(messages: list[dict[str, Any]]) -> list[int]:
    text = fv.render_conversation(messages, True, False)
    return fv.FakeTokenizer().encode(text, add_special_tokens=False)


def expected(ids: list[int], seed: int | None, n: int) -> str:
    return "".join(fv.expected_words(ids, seed, n))


async def eventually(cond: Any, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.001)


def last_request(fake: fv.FakeVLLM) -> dict[str, Any]:
    return fake.engine.requests[-1]


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


# -- generation through vLLM's serving layer ------------------------------------------------
@pytest.mark.unit
async def test_chat_streams_deltas_with_usage() -> None:
    b, fake = await started()
    deltas = await collect(b.generate(chat()))
    ids = chat_prompt_ids(MESSAGES)
    assert "".join(d.text for d in deltas) == expected(ids, 1, 6)
    assert [d.tokens for d in deltas] == [1] * 6  # from vLLM's continuous usage stats
    assert all(d.finish_reason is None for d in deltas[:-1])
    last = deltas[-1]
    assert (last.finish_reason, last.prompt_tokens, last.completion_tokens) == (
        "length",
        len(ids),
        6,
    )
    req = last_request(fake)
    sp = req["params"]
    assert (sp.max_tokens, sp.seed, sp.n, sp.output_kind) == (6, 1, 1, fv.RequestOutputKind.DELTA)
    # vLLM's serving layer names it; the engine makes it unique internally.
    assert req["request_id"] == "chatcmpl-c1" and req["internal_id"].startswith("chatcmpl-c1-")
    assert fake.engine.aborted == [] and fake.engine.external_aborts == []
    assert b.stats() == {"running": 0, "waiting": 0, "kv_usage": 0.0}


@pytest.mark.unit
async def test_completion_streams_deltas() -> None:
    b, fake = await started()
    deltas = await collect(b.generate(completion(max_tokens=9)))
    ids = fv.FakeTokenizer().encode("tell me a story")
    assert "".join(d.text for d in deltas) == expected(ids, 7, 9)
    assert deltas[-1].finish_reason == "length"
    assert (deltas[-1].prompt_tokens, deltas[-1].completion_tokens) == (len(ids), 9)
    assert sum(d.tokens for d in deltas) == 9
    req = last_request(fake)
    assert req["prompt"]["prompt"] == "tell me a story" and req["request_id"] == "cmpl-r1-0"
    assert (req["params"].temperature, req["params"].max_tokens) == (0.0, 9)


@pytest.mark.unit
async def test_stop_sequence_ends_the_request() -> None:
    ids = fv.FakeTokenizer().encode("tell me a story")
    full = expected(ids, 7, 12)
    stop = full.split(" ")[4][:3]
    b, fake = await started()
    deltas = await collect(b.generate(completion(max_tokens=12, stop=[stop])))
    assert "".join(d.text for d in deltas) == full[: full.find(stop)]
    assert deltas[-1].finish_reason == "stop"
    assert last_request(fake)["params"].stop == [stop]
    # vLLM's stop_reason names the stop string that ended it: on the last delta only.
    assert deltas[-1].stop_sequence == stop
    assert all(d.stop_sequence is None for d in deltas[:-1])


@pytest.mark.unit
async def test_only_a_stop_string_that_hit_is_named() -> None:
    """Chat too; an answer that ends on its own (EOS: vLLM's stop_reason None) or at
    max_tokens names no stop string."""
    ids = chat_prompt_ids(MESSAGES)
    stop = expected(ids, 1, 6).split(" ")[3][:2]
    b, _ = await started()
    deltas = await collect(b.generate(chat(max_tokens=6, stop=["qqq", stop])))
    assert (deltas[-1].finish_reason, deltas[-1].stop_sequence) == ("stop", stop)
    deltas = await collect(b.generate(chat(max_tokens=6, stop=["qqq"])))
    assert (deltas[-1].finish_reason, deltas[-1].stop_sequence) == ("length", None)
    b, _ = await started(script=["All", " done"])
    deltas = await collect(b.generate(chat(max_tokens=6, stop=["qqq"])))
    assert "".join(d.text for d in deltas) == "All done"
    assert (deltas[-1].finish_reason, deltas[-1].stop_sequence) == ("stop", None)


@pytest.mark.unit
async def test_client_messages_reach_vllm_as_sent() -> None:
    """Multimodal parts, assistant tool calls and tool results go to vLLM's renderer as the
    client sent them (the old backend flattened text and refused images)."""
    messages = [
        {"role": "developer", "content": "answer in French"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what is this?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                {"type": "input_audio", "input_audio": {"data": "UklG", "format": "wav"}},
            ],
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    b, _ = await started()
    sent = json.loads(json.dumps(messages))
    await collect(b.generate(chat(messages=sent, extra={"mm_processor_kwargs": {"fps": 2}})))
    serving = b.state.openai_serving_chat
    assert serving.rendered[-1]["messages"] == messages
    assert "<image_url><input_audio>" in serving.rendered[-1]["text"]


@pytest.mark.unit
async def test_carried_fields_reach_the_engine() -> None:
    extra = {
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
        "logit_bias": {"42": -100},
        "min_tokens": 2,
        "repetition_penalty": 1.1,
        "top_k": 5,
        "min_p": 0.05,
        "user": "u-1",
        "include_stop_str_in_output": True,
    }
    b, fake = await started()
    await collect(b.generate(chat(extra=extra, temperature=0.3, top_p=0.8, stop=["zz"])))
    sp = last_request(fake)["params"]
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, 0.25, 1.1)
    assert (sp.logit_bias, sp.min_tokens, sp.top_k, sp.min_p) == ({42: -100}, 2, 5, 0.05)
    assert (sp.temperature, sp.top_p, sp.stop, sp.include_stop_str_in_output) == (
        0.3,
        0.8,
        ["zz"],
        True,
    )


@pytest.mark.unit
async def test_unset_sampling_values_take_the_model_generation_config() -> None:
    """temperature/top_p left unset by the client use the model's generation_config defaults,
    as `vllm serve` does (the old backend forced 1.0)."""
    b, fake = await started()
    await collect(b.generate(chat()))
    sp = last_request(fake)["params"]
    assert (sp.temperature, sp.top_p, sp.top_k) == (0.6, 0.9, 20)
    await collect(b.generate(chat(temperature=0.0)))
    assert last_request(fake)["params"].temperature == 0.0
    b2, fake2 = await started(make_cfg(generation_config="vllm"))
    await collect(b2.generate(chat()))
    assert (last_request(fake2)["params"].temperature, last_request(fake2)["params"].top_p) == (
        1.0,
        1.0,
    )


@pytest.mark.unit
async def test_tool_calls_come_back_as_deltas() -> None:
    script = [
        "<tool_call>",
        '{"name": "get_weather", ',
        '"arguments": {"city": "Paris"}}',
        "</tool_call>",
    ]
    cfg = make_cfg(tool_call_parser="hermes", enable_auto_tool_choice=True)
    b, fake = await started(cfg, script=script)
    deltas = await collect(b.generate(chat(extra={"tools": TOOLS, "parallel_tool_calls": False})))
    calls = [c for d in deltas for c in d.tool_calls or ()]
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("chatcmpl-tool-")
    args = "".join(c["function"].get("arguments") or "" for c in calls)
    assert json.loads(args) == {"city": "Paris"}
    assert all(c["index"] == 0 for c in calls)
    assert "".join(d.text for d in deltas) == ""
    assert deltas[-1].finish_reason == "tool_calls"
    assert deltas[-1].completion_tokens == sum(d.tokens for d in deltas) == 4
    sent = fake.engine.requests[-1]
    assert sent["params"].max_tokens == 6


@pytest.mark.unit
async def test_auto_tool_choice_without_a_parser_is_an_invalid_request() -> None:
    b, _ = await started()
    with pytest.raises(E.InvalidRequest, match="tool-call-parser"):
        await collect(b.generate(chat(extra={"tools": TOOLS})))


@pytest.mark.unit
async def test_reasoning_comes_back_beside_the_text() -> None:
    script = ["<think>", "let me", " think", "</think>", "Paris"]
    b, _ = await started(make_cfg(reasoning_parser="deepseek_r1"), script=script)
    deltas = await collect(b.generate(chat(max_tokens=20)))
    assert "".join(d.reasoning or "" for d in deltas) == "let me think"
    assert "".join(d.text for d in deltas) == "Paris"
    assert deltas[-1].finish_reason == "stop"


@pytest.mark.unit
async def test_chat_logprobs_come_back_in_openai_shape() -> None:
    b, fake = await started()
    deltas = await collect(b.generate(chat(extra={"logprobs": True, "top_logprobs": 2})))
    assert last_request(fake)["params"].logprobs == 2
    entries = [e for d in deltas for e in (d.logprobs or {}).get("content", [])]
    assert len(entries) == 6
    assert [e["token"] for e in entries] == [d.text for d in deltas]
    first = entries[0]
    assert set(first) == {"token", "logprob", "bytes", "top_logprobs"}
    assert first["bytes"] == list(first["token"].encode())
    assert len(first["top_logprobs"]) == 2 and first["top_logprobs"][0]["token"] == first["token"]


@pytest.mark.unit
async def test_completion_logprobs_come_back_in_openai_shape() -> None:
    b, _ = await started()
    deltas = await collect(b.generate(completion(max_tokens=3, extra={"logprobs": 1})))
    assert all(
        set(d.logprobs or {}) >= {"tokens", "token_logprobs", "top_logprobs"} for d in deltas
    )
    assert [t for d in deltas for t in (d.logprobs or {})["tokens"]] == [d.text for d in deltas]
    offsets = [o for d in deltas for o in (d.logprobs or {})["text_offset"]]
    assert offsets == [0, len(deltas[0].text), len(deltas[0].text) + len(deltas[1].text)]


@pytest.mark.unit
async def test_structured_output_from_response_format() -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "mood": {"type": "string"}},
        "required": ["city", "mood"],
    }
    rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    b, fake = await started()
    deltas = await collect(b.generate(chat(max_tokens=50, extra={"response_format": rf})))
    assert last_request(fake)["params"].structured_outputs == fv.StructuredOutputsParams(
        json=schema
    )
    assert set(json.loads("".join(d.text for d in deltas))) == {"city", "mood"}
    assert deltas[-1].finish_reason == "stop"


@pytest.mark.unit
async def test_structured_outputs_and_legacy_guided_fields() -> None:
    b, fake = await started()
    await collect(b.generate(chat(extra={"structured_outputs": {"choice": ["yes", "no"]}})))
    assert last_request(fake)["params"].structured_outputs == fv.StructuredOutputsParams(
        choice=["yes", "no"]
    )
    # vLLM 0.33 ignores the removed guided_* fields; tokenbus carries them over.
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    await collect(
        b.generate(completion(extra={"guided_json": schema, "guided_decoding_backend": "x"}))
    )
    assert last_request(fake)["params"].structured_outputs == fv.StructuredOutputsParams(
        json=schema
    )


@pytest.mark.unit
async def test_lora_adapter_is_chosen_by_model_name() -> None:
    cfg = make_cfg(enable_lora=True, lora_modules={"sql-lora": "/adapters/sql"})
    b, fake = await started(cfg)
    assert b.served_models == ["tiny-model", "sql-lora"]
    await collect(b.generate(chat(model="sql-lora")))
    lora = last_request(fake)["lora_request"]
    assert (lora.lora_name, lora.lora_path) == ("sql-lora", "/adapters/sql")
    await collect(b.generate(chat()))
    assert last_request(fake)["lora_request"] is None
    with pytest.raises(E.ModelNotFound):
        await collect(b.generate(chat(model="other-model")))


@pytest.mark.unit
async def test_an_adapter_loaded_at_run_time_is_served_and_unloaded(tmp_path: Path) -> None:
    """Through vLLM's front end, as POST /v1/load_lora_adapter: served by its name once
    loaded (its LoRARequest reaches the engine), listed in served_models, gone once
    unloaded; a missing folder, a base model's name and LoRA off are 400s."""
    folder = tmp_path / "sql"
    folder.mkdir()
    b, fake = await started(make_cfg(enable_lora=True))
    await b.load_adapter("sql", str(folder))
    assert b.served_models == ["tiny-model", "sql"] and b.adapters == {"sql": str(folder)}
    await collect(b.generate(chat(model="sql")))
    lora = last_request(fake)["lora_request"]
    assert (lora.lora_name, lora.lora_path) == ("sql", str(folder))
    await b.load_adapter("sql", str(folder))  # again: in place, as vLLM's load_inplace
    with pytest.raises(E.InvalidRequest) as missing:
        await b.load_adapter("other", str(tmp_path / "none"))
    assert missing.value.param == "path" and "none" in missing.value.message
    with pytest.raises(E.InvalidRequest, match="base model"):
        await b.load_adapter("tiny-model", str(folder))
    await b.unload_adapter("sql")
    assert b.served_models == ["tiny-model"] and not b.adapters
    with pytest.raises(E.ModelNotFound):
        await collect(b.generate(chat(model="sql")))
    off, _ = await started()
    with pytest.raises(E.InvalidRequest, match="enable_lora"):
        await off.load_adapter("sql", str(folder))


@pytest.mark.unit
async def test_model_without_chat_template_is_an_invalid_request() -> None:
    b, _ = await started(make_cfg(model="base-model-no-template"))
    with pytest.raises(E.InvalidRequest, match="chat template"):
        await collect(b.generate(chat(model="base-model-no-template")))


@pytest.mark.unit
async def test_concurrent_requests_stream_independently() -> None:
    b, _ = await started()
    reqs = [completion(f"r{i}", prompt=f"prompt number {i}", max_tokens=5 + i) for i in range(8)]
    results = await asyncio.gather(*(collect(b.generate(r)) for r in reqs))
    for i, deltas in enumerate(results):
        ids = fv.FakeTokenizer().encode(f"prompt number {i}")
        assert "".join(d.text for d in deltas) == expected(ids, 7, 5 + i)
        assert deltas[-1].completion_tokens == 5 + i


# -- request migration ----------------------------------------------------------------------
@pytest.mark.unit
async def test_resumed_chat_continues_the_assistant_reply() -> None:
    b, fake = await started()
    resume = {"text": " so far", "tokens": 2}
    await collect(b.generate(chat(max_tokens=6, resume=resume)))
    rendered = b.state.openai_serving_chat.rendered[-1]
    assert rendered["messages"][-1] == {"role": "assistant", "content": " so far"}
    assert rendered["text"].endswith("[assistant]  so far")  # left open, no new prompt
    assert last_request(fake)["params"].max_tokens == 4


@pytest.mark.unit
async def test_resumed_chat_extends_a_client_prefill() -> None:
    messages = [*MESSAGES, {"role": "assistant", "content": "Sure:"}]
    b, _ = await started()
    req = chat(
        messages=json.loads(json.dumps(messages)),
        extra={"continue_final_message": True, "add_generation_prompt": False},
        resume={"text": " one", "tokens": 1},
    )
    await collect(b.generate(req))
    rendered = b.state.openai_serving_chat.rendered[-1]
    assert rendered["messages"][-1] == {"role": "assistant", "content": "Sure: one"}
    assert len(rendered["messages"]) == 3


@pytest.mark.unit
async def test_resumed_completion_continues_after_the_text() -> None:
    b, fake = await started()
    await collect(b.generate(completion(max_tokens=5, resume={"text": " once", "tokens": 1})))
    req = last_request(fake)
    assert req["prompt"]["prompt"] == "tell me a story once"
    assert req["params"].max_tokens == 4


@pytest.mark.unit
async def test_resumed_request_without_budget_left_generates_nothing() -> None:
    """No token may be generated past the budget (the old backend's max(1, ...) made one)."""
    b, fake = await started()
    deltas = await collect(b.generate(chat(max_tokens=5, resume={"text": "abc", "tokens": 5})))
    assert [(d.text, d.tokens, d.finish_reason) for d in deltas] == [("", 0, "length")]
    assert fake.engine.requests == []


# -- cancellation ---------------------------------------------------------------------------
@pytest.mark.unit
async def test_closing_the_stream_aborts_only_that_request() -> None:
    """Two requests share a caller id (x-request-id survives migration): closing one must
    not abort the other. vLLM aborts by its own internal id; no abort by external id."""
    b, fake = await started()
    a = b.generate(chat("dup", max_tokens=40))
    other = asyncio.create_task(collect(b.generate(chat("dup", max_tokens=30))))
    got = [await a.__anext__() for _ in range(3)]
    assert all(d.finish_reason is None for d in got)
    assert b.stats()["running"] >= 1
    internal_a = fake.engine.requests[0]["internal_id"]
    await a.aclose()
    await eventually(lambda: internal_a in fake.engine.aborted)
    deltas = await other
    assert deltas[-1].finish_reason == "length" and deltas[-1].completion_tokens == 30
    assert fake.engine.aborted == [internal_a]
    assert fake.engine.external_aborts == []
    assert fake.engine.running == set()
    assert b.stats() == {"running": 0, "waiting": 0, "kv_usage": 0.0}


@pytest.mark.unit
async def test_cancelling_the_consumer_task_aborts_the_request() -> None:
    b, fake = await started(token_delay=0.005)
    first = asyncio.Event()

    async def consume() -> None:
        async for _ in b.generate(completion("task-cancel", max_tokens=500)):
            first.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(first.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await eventually(lambda: len(fake.engine.aborted) == 1)
    assert fake.engine.external_aborts == [] and fake.engine.running == set()


@pytest.mark.unit
async def test_a_finished_request_is_not_aborted_when_the_consumer_stops_reading() -> None:
    b, fake = await started()
    it = b.generate(completion("done", max_tokens=3))
    async for d in it:
        if d.finish_reason is not None:
            break  # the worker stops at the final delta without draining the iterator
    assert b.stats()["running"] == 0
    await it.aclose()
    await asyncio.sleep(0.01)
    assert fake.engine.aborted == []


@pytest.mark.unit
async def test_the_engine_has_the_request_before_the_stream_is_read() -> None:
    """generate() starts the request (vLLM renders it and queues it on its generator's first
    step): the engine has it while the worker still sends its ack, and the stream read after
    that is the whole answer, its first delta included."""
    b, fake = await started(token_delay=0.002)
    it = b.generate(chat("early", max_tokens=6))
    assert getattr(it, "starting", False)
    await eventually(lambda: len(fake.engine.requests) == 1)
    deltas = await collect(it)
    assert "".join(d.text for d in deltas) == expected(chat_prompt_ids(MESSAGES), 1, 6)
    assert deltas[-1].finish_reason == "length" and deltas[-1].completion_tokens == 6
    assert fake.engine.aborted == []


@pytest.mark.unit
async def test_a_started_stream_closed_before_it_is_read_aborts_the_request() -> None:
    """The worker's ack or accept frame failed after generate(): the stream is closed unread,
    its first step is stopped and the engine request aborted, whether the step had reached
    the engine or not."""
    b, fake = await started(token_delay=0.05)
    it = b.generate(chat("unread", max_tokens=200))
    await eventually(lambda: len(fake.engine.requests) == 1)
    await it.aclose()
    internal = fake.engine.requests[0]["internal_id"]
    await eventually(lambda: fake.engine.aborted == [internal])
    assert fake.engine.running == set() and b.stats()["running"] == 0
    never = b.generate(chat("never", max_tokens=200))
    await never.aclose()  # before its first step had a turn of the loop: it never runs
    assert fake.engine.running == set() and len(fake.engine.requests) == 1
    with pytest.raises(StopAsyncIteration):
        await never.__anext__()


@pytest.mark.unit
async def test_a_request_vllm_refuses_on_its_first_step_raises_when_read() -> None:
    """A refusal raised in the first step (here the engine's own length check) reaches the
    reader of the stream as the typed error, as when the stream started on being read."""
    b, _ = await started(make_cfg(max_model_len=8))
    it = b.generate(completion("long", prompt="a prompt that is longer than eight tokens here"))
    with pytest.raises(E.InvalidRequest):
        await it.__anext__()
    await it.aclose()


# -- errors ---------------------------------------------------------------------------------
@pytest.mark.unit
async def test_prompt_longer_than_max_model_len_is_an_invalid_request() -> None:
    """vLLM's VLLMValidationError is a VLLMClientError, not a ValueError: a 400, not a
    retryable engine error that every replica would be tried with."""
    b, _ = await started(make_cfg(max_model_len=8))
    with pytest.raises(E.InvalidRequest, match="maximum context length") as info:
        await collect(b.generate(completion(prompt="one two three four five six seven eight")))
    assert not info.value.retryable and info.value.status == 400
    assert not issubclass(fv.VLLMValidationError, ValueError)


@pytest.mark.unit
async def test_request_model_validation_errors_are_invalid_requests() -> None:
    b, _ = await started()
    with pytest.raises(E.InvalidRequest, match="top_logprobs"):
        b.generate(chat(extra={"top_logprobs": 3}))  # refused before it is accepted
    with pytest.raises(E.InvalidRequest):
        b.generate(chat(extra={"top_k": "many"}))  # pydantic's own error


@pytest.mark.unit
async def test_sampling_values_vllm_refuses_are_invalid_requests() -> None:
    b, _ = await started()
    with pytest.raises(E.InvalidRequest, match="top_p"):
        await collect(b.generate(completion(top_p=0.0)))
    with pytest.raises(E.InvalidRequest):
        b.generate(completion(max_tokens=0))


@pytest.mark.unit
async def test_engine_failure_mid_stream_is_a_retryable_engine_error() -> None:
    b, _ = await started(fail_after=3)
    got: list[Delta] = []
    with pytest.raises(E.EngineError) as info:
        async for d in b.generate(completion(max_tokens=10)):
            got.append(d)
    assert len(got) == 3 and info.value.retryable


@pytest.mark.unit
async def test_dead_engine_is_an_engine_error() -> None:
    b, fake = await started()
    fake.engine.dead = True
    with pytest.raises(E.EngineError, match="died"):
        await collect(b.generate(completion()))


@pytest.mark.unit
async def test_a_dead_engine_is_reported_in_the_backends_health() -> None:
    # What the worker's engine watch reads at each heartbeat (docs/deploy.md, "Engine
    # health"): vLLM's AsyncLLM.errored, before any request finds out.
    b, fake = await started()
    assert b.health() is None
    fake.engine.dead = True
    assert "died" in (b.health() or "")


@pytest.mark.unit
async def test_request_level_error_finish_is_an_engine_error() -> None:
    b, _ = await started(finish_with="error")
    with pytest.raises(E.EngineError, match="Internal server error"):
        await collect(b.generate(completion(max_tokens=4)))


@pytest.mark.unit
async def test_abort_finish_is_an_engine_error() -> None:
    b, _ = await started(finish_with="abort")
    with pytest.raises(E.EngineError, match="aborted"):
        await collect(b.generate(chat(max_tokens=4)))


@pytest.mark.unit
async def test_queue_overflow_is_a_busy_replica() -> None:
    b, _ = await started(fail_after=0, error=fv.QueueOverflowError())
    with pytest.raises(E.ReplicaBusy):
        await collect(b.generate(chat()))


@pytest.mark.unit
async def test_generate_before_start_is_an_engine_error() -> None:
    b = VLLMBackend(make_cfg(), vllm=fv.FakeVLLM())
    with pytest.raises(E.EngineError):
        b.generate(completion())


# -- stream decoding ------------------------------------------------------------------------
# -- tracing: the trace context handed on to vLLM's own tracing ------------------------------
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _tracing_env(monkeypatch: pytest.MonkeyPatch, endpoint: str | None) -> None:
    """Tracing configured (or not) by the standard variables; vLLM's protocol variable,
    which start() may set, restored afterwards."""
    for var in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_TRACES_EXPORTER", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(OTLP_PROTOCOL_ENV, "x")
    monkeypatch.delenv(OTLP_PROTOCOL_ENV)
    if endpoint is None:
        monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    else:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)


@pytest.mark.unit
async def test_traced_requests_hand_their_traceparent_to_vllm_generate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _tracing_env(monkeypatch, "http://127.0.0.1:4318")
    b, fake = await started()
    # vLLM traces to the same collector, over the same protocol as tokenbus.
    assert fake.engine.vllm_config.observability_config.otlp_traces_endpoint == (
        "http://127.0.0.1:4318/v1/traces"
    )
    assert os.environ[OTLP_PROTOCOL_ENV] == "http/protobuf"
    for req in (chat(), completion()):
        req.trace_headers = {"traceparent": TRACEPARENT}
        await collect(b.generate(req))
        assert last_request(fake)["trace_headers"] == {"traceparent": TRACEPARENT}
    plain = chat(rid="c2")  # a request the worker did not trace: nothing handed on
    await collect(b.generate(plain))
    assert last_request(fake)["trace_headers"] is None


@pytest.mark.unit
async def test_untraced_worker_leaves_vllm_tracing_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    _tracing_env(monkeypatch, None)
    b, fake = await started()
    assert fake.engine.vllm_config.observability_config.otlp_traces_endpoint is None
    assert OTLP_PROTOCOL_ENV not in os.environ
    await collect(b.generate(chat()))
    assert last_request(fake)["trace_headers"] is None


@pytest.mark.unit
async def test_operator_otlp_endpoint_for_vllm_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    _tracing_env(monkeypatch, "http://127.0.0.1:4318")
    _b, fake = await started(make_cfg(otlp_traces_endpoint="http://collector:4317"))
    assert fake.engine.vllm_config.observability_config.otlp_traces_endpoint == (
        "http://collector:4317"
    )
    assert OTLP_PROTOCOL_ENV not in os.environ  # vLLM's own default (gRPC) stays


@pytest.mark.unit
def test_decoder_skips_keep_alives_and_needs_a_finish() -> None:
    dec = vs.StreamDecoder(chat=True)
    assert dec.feed(": keep-alive\n\n") is None
    chunk = {
        "id": "x",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "m",
        "choices": [
            {"index": 0, "delta": {"content": "hi"}, "logprobs": None, "finish_reason": None}
        ],
        "usage": {"prompt_tokens": 3, "total_tokens": 4, "completion_tokens": 1},
    }
    d = dec.feed(f"data: {json.dumps(chunk)}\n\n")
    assert d is not None and (d.text, d.tokens) == ("hi", 1)
    with pytest.raises(E.EngineError, match="without finishing"):
        dec.feed("data: [DONE]\n\n")


@pytest.mark.unit
def test_decoder_error_event() -> None:
    dec = vs.StreamDecoder(chat=False)
    err = {"error": {"message": "bad", "type": "BadRequestError", "param": "x", "code": 400}}
    with pytest.raises(vs.ErrorEvent) as info:
        dec.feed(f"data: {json.dumps(err)}\n\n")
    assert info.value.info["code"] == 400


@pytest.mark.unit
def test_error_statuses_map_to_typed_errors() -> None:
    assert isinstance(vs.error_for_status(400, "x"), E.InvalidRequest)
    assert isinstance(vs.error_for_status(422, "x"), E.InvalidRequest)
    assert isinstance(vs.error_for_status(501, "x"), E.InvalidRequest)
    assert isinstance(vs.error_for_status(404, "x"), E.ModelNotFound)
    assert isinstance(vs.error_for_status(503, "x"), E.ReplicaBusy)
    assert isinstance(vs.error_for_status(500, "x"), E.EngineError)
    assert "died" in vs.error_for_status(500, "x", engine_dead=True).message


# -- vllm serve options ---------------------------------------------------------------------
def serve_parser() -> Any:
    return fv.make_arg_parser(fv.FlexibleArgumentParser(prog="vllm serve"))


@pytest.mark.unit
def test_serve_argv_writes_options_as_vllm_serve_flags() -> None:
    argv = vs.serve_argv(
        {
            "model": "/m",
            "max_model_len": "32k",
            "tp": 2,
            "enable_prefix_caching": False,
            "enforce_eager": True,
            "disable_log_stats": False,
            "enable_auto_tool_choice": True,
            "tool_call_parser": "hermes",
            "lora_modules": {"a": "/la", "b": "/lb"},
            "served_model_name": ["x", "y"],
            "limit_mm_per_prompt": {"image": 2},
            "gpu_memory_utilization": 0.8,
        },
        serve_parser(),
    )
    assert argv == [
        "--model",
        "/m",
        "--max-model-len",
        "32k",
        "-tp",
        "2",
        "--disable-prefix-caching",
        "--enforce-eager",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--lora-modules",
        "a=/la",
        "b=/lb",
        "--served-model-name",
        "x",
        "y",
        "--limit-mm-per-prompt",
        '{"image": 2}',
        "--gpu-memory-utilization",
        "0.8",
    ]
    args = serve_parser().parse_args(argv)
    assert (args.max_model_len, args.tensor_parallel_size, args.enable_prefix_caching) == (
        32000,
        2,
        False,
    )
    assert [m.name for m in args.lora_modules] == ["a", "b"]
    assert args.limit_mm_per_prompt == {"image": 2}


@pytest.mark.unit
def test_serve_argv_booleans_follow_vllm_enable_disable_pairs() -> None:
    parser = serve_parser()

    def parsed(opts: dict[str, Any]) -> Any:
        return serve_parser().parse_args(vs.serve_argv(opts, parser))

    assert vs.serve_argv({"disable_prefix_caching": True}, parser) == ["--disable-prefix-caching"]
    assert parsed({"disable_prefix_caching": True}).enable_prefix_caching is False
    assert parsed({"disable_prefix_caching": False}).enable_prefix_caching is True
    assert parsed({"enable_prefix_caching": "true"}).enable_prefix_caching is True
    assert parsed({"enforce_eager": False}).enforce_eager is False
    assert vs.serve_argv({"disable_log_stats": False}, parser) == []


@pytest.mark.unit
def test_serve_argv_refuses_unknown_options() -> None:
    with pytest.raises(ValueError, match="no_such_option"):
        vs.serve_argv({"no_such_option": 1}, serve_parser())


# -- lifecycle, config, stats ---------------------------------------------------------------
@pytest.mark.unit
async def test_start_parses_engine_and_front_end_options_like_vllm_serve(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    cfg = make_cfg(
        model="served-name",
        tp=2,
        gpus="2,3",
        opts={
            "model": "/models/tiny",
            "max-model-len": "32K",
            "tool_call_parser": "hermes",
            "enable_auto_tool_choice": True,
            "reasoning_parser": "qwen3",
            "chat_template": "/templates/t.jinja",
        },
    )
    b, fake = await started(cfg)
    args = b.args
    assert (args.model, args.served_model_name, args.max_model_len) == (
        "/models/tiny",
        ["served-name"],
        32768,
    )
    assert (args.tool_call_parser, args.reasoning_parser, args.chat_template) == (
        "hermes",
        "qwen3",
        "/templates/t.jinja",
    )
    assert args.plugins_initialised
    mc = fake.engine.model_config
    assert (mc.model, mc.served_model_name, mc.max_model_len) == (
        "/models/tiny",
        "served-name",
        32768,
    )
    assert fake.engine.vllm_config.parallel_config.tensor_parallel_size == 2 == b.tp
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert fake.engine.mm_cache_resets == 1
    await b.stop()
    assert fake.engine.shut_down
    await b.stop()  # idempotent


@pytest.mark.unit
async def test_engine_is_built_with_the_api_server_usage_context() -> None:
    """`vllm serve` builds with UsageContext.OPENAI_API_SERVER: on an H100 1024 sequences and
    8192 batched tokens, not the engine-context defaults 128/2048."""
    _, fake = await started()
    assert fake.engine.construct_kwargs["usage_context"] is fv.UsageContext.OPENAI_API_SERVER
    sched = fake.engine.vllm_config.scheduler_config
    assert (sched.max_num_seqs, sched.max_num_batched_tokens) == (1024, 8192)
    _, fake2 = await started(make_cfg(max_num_seqs=64))
    assert fake2.engine.vllm_config.scheduler_config.max_num_seqs == 64


@pytest.mark.unit
async def test_effective_tp_comes_from_the_engine_option(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    b = VLLMBackend(make_cfg(gpus="0,1", tensor_parallel_size=2), vllm=fv.FakeVLLM())
    assert b.tp == 2  # before start: from the options
    await b.start()
    assert b.tp == 2
    b2, _ = await started(make_cfg(gpus="0,1,2,3", tp=2, opts={"tp": 4}))
    assert b2.tp == 4  # -tp, vLLM's alias, wins over --tp's default


@pytest.mark.unit
async def test_engine_build_does_not_block_the_event_loop() -> None:
    ticks = 0
    stop = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await asyncio.sleep(0.01)

    task = asyncio.create_task(ticker())
    t0 = time.monotonic()
    b, fake = await started(build_delay=0.3)
    stop.set()
    await task
    assert time.monotonic() - t0 >= 0.3
    assert ticks >= 10  # the loop kept running while vLLM was being built
    assert fake.engine.built_in_thread != threading.current_thread().name
    assert b.engine is fake.engine


@pytest.mark.unit
async def test_cancelled_start_shuts_the_engine_down_when_built() -> None:
    fake = fv.FakeVLLM(build_delay=0.2)
    b = VLLMBackend(make_cfg(), vllm=fake)
    task = asyncio.create_task(b.start())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await eventually(lambda: bool(fake.engines) and fake.engine.shut_down)
    assert b.engine is None


@pytest.mark.unit
async def test_engine_processes_are_spawned_not_forked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MULTIPROC_ENV, raising=False)
    await started()
    assert os.environ[MULTIPROC_ENV] == "spawn"
    monkeypatch.setenv(MULTIPROC_ENV, "fork")  # the operator's choice stays
    await started()
    assert os.environ[MULTIPROC_ENV] == "fork"


@pytest.mark.unit
async def test_bad_options_fail_start_with_a_clear_error() -> None:
    with pytest.raises(ValueError, match="not a `vllm serve` option"):
        await started(make_cfg(no_such_option=1))
    with pytest.raises(TypeError, match="requires --tool-call-parser"):
        await started(make_cfg(enable_auto_tool_choice=True))
    with pytest.raises(KeyError, match="invalid tool call parser"):
        await started(make_cfg(enable_auto_tool_choice=True, tool_call_parser="nope"))
    with pytest.raises(ValueError, match="invalid vllm option"):
        await started(make_cfg(max_model_len="lots"))


@pytest.mark.unit
async def test_too_few_gpus_for_tensor_parallel_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    with pytest.raises(RuntimeError, match="needs 4 GPUs"):
        await started(make_cfg(tp=4, gpus="0,1"))


@pytest.mark.unit
async def test_served_name_is_left_to_a_lora_module_of_that_name() -> None:
    cfg = make_cfg(model="sql-lora", opts={"model": "/base", "lora_modules": ["sql-lora=/a/sql"]})
    b, fake = await started(cfg)
    assert b.args.served_model_name is None
    assert b.served_models == ["/base", "sql-lora"]
    await collect(b.generate(chat(model="sql-lora")))
    assert last_request(fake)["lora_request"].lora_name == "sql-lora"


@pytest.mark.unit
async def test_endpoints_follow_the_model_tasks() -> None:
    gen = VLLMBackend(make_cfg(), vllm=fv.FakeVLLM())
    assert gen.endpoints() == ["chat", "completions"]
    pool = VLLMBackend(make_cfg(runner="pooling"), vllm=fv.FakeVLLM())
    assert pool.endpoints() == ["embeddings"]  # a guess before start
    await pool.start()
    assert pool.endpoints() == ["embeddings"]
    with pytest.raises(E.InvalidRequest, match="does not serve chat"):
        pool.generate(chat())
    await gen.start()
    assert gen.endpoints() == ["chat", "completions"]
    with pytest.raises(E.InvalidRequest, match="does not serve embeddings"):
        await gen.embed(embedding_request(["x"]))


def embedding_request(inputs: list[Any], **extra: Any) -> GenerationRequest:
    return GenerationRequest.from_envelope(
        {
            "request_id": "e1",
            "kind": "embeddings",
            "model": "tiny-model",
            "input": inputs,
            "params": {},
            "extra": extra,
        }
    )


@pytest.mark.unit
async def test_embeddings_through_vllm_embedding_handler() -> None:
    b, fake = await started(make_cfg(runner="pooling"))
    out = await b.embed(embedding_request(["hello world", "bye"]))
    assert len(out.vectors) == 2 and all(len(v) == 8 for v in out.vectors)
    assert out.vectors[0] != out.vectors[1]
    tok = fv.FakeTokenizer()
    assert out.prompt_tokens == len(tok.encode("hello world")) + len(tok.encode("bye"))
    out = await b.embed(embedding_request([[5, 6, 7], [8]]))
    assert len(out.vectors) == 2 and out.prompt_tokens == 4
    out = await b.embed(embedding_request(["a"], dimensions=4, user="u"))
    assert len(out.vectors[0]) == 4
    assert fake.engine.encodes[-1]["params"].dimensions == 4
    with pytest.raises(E.InvalidRequest, match="hidden size"):
        await b.embed(embedding_request(["a"], dimensions=64))
    with pytest.raises(E.InvalidRequest, match="at least one prompt"):
        await b.embed(embedding_request([]))


@pytest.mark.unit
async def test_stats_come_from_vllm_scheduler_snapshots() -> None:
    b, fake = await started()
    # vLLM calls the stat logger it was given with each step's SchedulerStats.
    (sink,) = fake.engine.stat_loggers
    it = b.generate(completion("s1", max_tokens=50))
    await it.__anext__()
    assert b.stats() == {"running": 1, "waiting": 0, "kv_usage": 0.0}  # our own count
    sink.record(
        fv.SchedulerStats(
            num_running_reqs=3, num_waiting_reqs=2, num_skipped_waiting_reqs=1, kv_cache_usage=0.25
        ),
        None,
    )
    assert b.stats() == {"running": 3, "waiting": 3, "kv_usage": 0.25}
    b.observe_scheduler_stats(
        types.SimpleNamespace(num_running_reqs=1, num_waiting_reqs=0, gpu_cache_usage=0.5)
    )
    assert b.stats() == {"running": 1, "waiting": 0, "kv_usage": 0.5}
    await it.aclose()
    assert b.stats() == {"running": 0, "waiting": 0, "kv_usage": 0.5}


@pytest.mark.unit
def test_stats_never_raise() -> None:
    b = VLLMBackend(make_cfg())
    b._sched = {0: ("x", None, object())}  # type: ignore[dict-item]
    b._inflight[object()] = True
    assert b.stats() == {"running": 0, "waiting": 0, "kv_usage": 0.0}


@pytest.mark.unit
def test_create_returns_the_vllm_backend() -> None:
    b = backends.create(make_cfg())
    assert isinstance(b, VLLMBackend) and b.name == "vllm"


@pytest.mark.stack
def test_importing_the_backend_loads_neither_vllm_nor_torch() -> None:
    code = (
        "import sys, engine_worker.backends.vllm_backend as m; "
        "from services.config import WorkerSettings; "
        "m.VLLMBackend(WorkerSettings(backend='vllm')).endpoints(); "
        "assert 'vllm' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -- pin_gpus -------------------------------------------------------------------------------
@pytest.mark.unit
def test_pin_gpus_sets_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    pin_gpus("")
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    pin_gpus(" 0, 1 ")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"
    pin_gpus("3")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3"


@pytest.mark.unit
def test_pin_gpus_refuses_to_change_after_torch_is_imported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))
    pin_gpus("0,1")
    pin_gpus("0, 1")
    pin_gpus("")
    with pytest.raises(RuntimeError, match="torch is already imported"):
        pin_gpus("2")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"


# -- vLLM's interface: the fake and (when installed) the real thing ---------------------------
# Parameters of what the backend calls, as vLLM 0.33 defines them (the fake must match).
SIGNATURES: dict[str, tuple[str, ...]] = {
    "AsyncLLM.from_vllm_config": (
        "vllm_config",
        "start_engine_loop",
        "usage_context",
        "stat_loggers",
        "enable_log_requests",
        "aggregate_engine_logging",
        "disable_log_stats",
    ),
    "AsyncLLM.generate": (
        "prompt",
        "sampling_params",
        "request_id",
        "prompt_text",
        "lora_request",
        "trace_headers",
    ),
    "AsyncLLM.is_tracing_enabled": (),
    "Request": ("scope", "receive"),
    "AsyncLLM.abort": ("request_id", "internal"),
    "AsyncLLM.shutdown": ("timeout",),
    "AsyncEngineArgs.from_cli_args": ("args",),
    "AsyncEngineArgs.create_engine_config": ("usage_context", "headless"),
    "init_app_state": ("engine_client", "state", "args", "supported_tasks"),
    "StatLoggerBase.record": ("scheduler_stats", "iteration_stats", "mm_cache_stats", "engine_idx"),
    "create_error_response": ("message", "err_type", "status_code", "param"),
    "make_arg_parser": ("parser",),
    "validate_parsed_serve_args": ("args",),
    "init_parser_plugin": ("args",),
    "validate_api_server_args": ("args",),
}
REQUEST_FIELDS = {
    "LoadLoRAAdapterRequest": ("lora_name", "lora_path", "load_inplace"),
    "UnloadLoRAAdapterRequest": ("lora_name",),
    "ChatCompletionRequest": (
        "messages",
        "model",
        "max_completion_tokens",
        "stream",
        "stream_options",
        "request_id",
        "continue_final_message",
        "add_generation_prompt",
        "echo",
        "tools",
        "tool_choice",
        "logprobs",
        "top_logprobs",
        "response_format",
        "structured_outputs",
        "min_tokens",
        "repetition_penalty",
    ),
    "CompletionRequest": (
        "prompt",
        "model",
        "max_tokens",
        "stream",
        "stream_options",
        "request_id",
    ),
}


def _params(ns: Any, dotted: str) -> list[str]:
    obj = ns
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return [p for p in inspect.signature(obj).parameters if p not in ("self", "cls")]


def check_vllm_interface(ns: Any, serving: dict[str, Any]) -> None:
    for name in vs.VLLM_NAMES:
        assert hasattr(ns, name), name
    for dotted, wanted in SIGNATURES.items():
        got = _params(ns, dotted)
        assert got[: len(wanted)] == list(wanted) or set(wanted) <= set(got), (dotted, got)
    for cls_name, wanted_fields in REQUEST_FIELDS.items():
        fields = getattr(ns, cls_name).model_fields
        assert set(wanted_fields) <= set(fields), (cls_name, set(wanted_fields) - set(fields))
    assert ns.UsageContext.OPENAI_API_SERVER
    assert _params(serving["chat"], "create_chat_completion")[:2] == ["request", "raw_request"]
    assert _params(serving["completion"], "create_completion")[:2] == ["request", "raw_request"]
    assert _params(serving["embedding"], "__call__")[:2] == ["request", "raw_request"]


@pytest.mark.unit
def test_the_fake_has_vllm_names_and_signatures() -> None:
    check_vllm_interface(
        fv.FakeVLLM(),
        {
            "chat": fv.OpenAIServingChat,
            "completion": fv.OpenAIServingCompletion,
            "embedding": fv.ServingEmbedding,
        },
    )


@pytest.mark.unit
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_installed_vllm_has_the_names_and_signatures_used() -> None:
    """GPU-free: the installed vLLM provides every name the backend imports, with the
    parameters it passes, and classifies a validation error as a 400."""
    ns = vs.load_vllm()
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.entrypoints.pooling.embed.serving import ServingEmbedding
    from vllm.exceptions import VLLMClientError, VLLMValidationError

    check_vllm_interface(
        ns,
        {
            "chat": OpenAIServingChat,
            "completion": OpenAIServingCompletion,
            "embedding": ServingEmbedding,
        },
    )
    assert issubclass(VLLMValidationError, VLLMClientError)
    assert ns.create_error_response(VLLMValidationError("too long")).error.code == 400
    parser = ns.make_arg_parser(ns.FlexibleArgumentParser(prog="vllm serve"))
    argv = vs.serve_argv(
        {"model": "m", "max_model_len": "32k", "tool_call_parser": "hermes", "tp": 2}, parser
    )
    args = parser.parse_args(argv)
    assert (args.max_model_len, args.tensor_parallel_size, args.tool_call_parser) == (
        32000,
        2,
        "hermes",
    )


# -- a real model ---------------------------------------------------------------------------
def _gpu_available() -> bool:
    if importlib.util.find_spec("vllm") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


@pytest.mark.unit
@pytest.mark.gpu
@pytest.mark.timeout(900)
async def test_real_vllm_tiny_model() -> None:
    if not _gpu_available():
        pytest.skip("needs vllm and a GPU")
    model = os.environ.get("TOKENBUS_TEST_VLLM_MODEL")
    if not model:
        pytest.skip("set TOKENBUS_TEST_VLLM_MODEL to a small model path or name")
    cfg = make_cfg(
        model=model,
        max_model_len=512,
        gpu_memory_utilization=0.3,
        enforce_eager=True,
    )
    b = VLLMBackend(cfg)
    await b.start()
    try:
        req = completion("g1", prompt="The capital of France is", max_tokens=8)
        req.model = model
        deltas = await collect(b.generate(req))
        last = deltas[-1]
        assert last.finish_reason in ("stop", "length")
        assert last.prompt_tokens > 0 and 0 < last.completion_tokens <= 8
        assert last.completion_tokens == sum(d.tokens for d in deltas)
        req = completion("g2", prompt="1, 2, 3, 4,", max_tokens=30, stop=["7"])
        req.model = model
        assert "7" not in "".join(d.text for d in await collect(b.generate(req)))
        req = chat("g3", max_tokens=8, extra={"logprobs": True, "top_logprobs": 1}, model=model)
        chat_deltas = await collect(b.generate(req))
        assert chat_deltas[-1].finish_reason in ("stop", "length")
        assert any(d.logprobs for d in chat_deltas)
        req = completion("g4", prompt="Count forever:", max_tokens=400, temperature=1.0)
        req.model = model
        it = b.generate(req)
        await it.__anext__()
        await it.aclose()
        await asyncio.sleep(0.5)
        st = b.stats()
        assert st["running"] == 0 and st["waiting"] == 0
        assert 0.0 <= st["kv_usage"] <= 1.0
    finally:
        await b.stop()


@pytest.mark.unit
@pytest.mark.gpu
@pytest.mark.timeout(900)
async def test_real_vllm_prefill_hands_over_to_a_decode_engine_with_nixl() -> None:
    """Prefill/decode disaggregation on a GPU (docs/disaggregation.md): two engines with
    vLLM's NixlConnector (``kv_transfer_config`` passed through as an engine option), the
    prefill's whole answer carries the hand-over, the decode engine reads the prompt's KV
    cache with it and answers as a whole run would (greedy)."""
    if not _gpu_available():
        pytest.skip("needs vllm and a GPU")
    model = os.environ.get("TOKENBUS_TEST_VLLM_MODEL")
    if not model or importlib.util.find_spec("nixl") is None:
        pytest.skip("set TOKENBUS_TEST_VLLM_MODEL and install nixl (vLLM's KV transfer)")
    kv = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    opts = {"max_model_len": 512, "gpu_memory_utilization": 0.3, "enforce_eager": True}
    prefill = VLLMBackend(make_cfg(model=model, kv_transfer_config=kv, **opts))
    decode = VLLMBackend(make_cfg(model=model, kv_transfer_config=kv, **opts))
    await prefill.start()
    await decode.start()
    try:
        ask = {"do_remote_decode": True, "do_remote_prefill": False}
        req = chat("pd1", max_tokens=1, extra={"kv_transfer_params": ask, "temperature": 0})
        req.model = model
        kvt = (await collect(prefill.generate(req)))[-1].kv_transfer_params
        assert kvt is not None and kvt.get("do_remote_prefill") is True
        req = chat("pd2", max_tokens=8, extra={"kv_transfer_params": kvt, "temperature": 0})
        req.model = model
        handed = await collect(decode.generate(req))
        req = chat("pd3", max_tokens=8, extra={"temperature": 0})
        req.model = model
        whole = await collect(decode.generate(req))
        assert "".join(d.text for d in handed) == "".join(d.text for d in whole)
    finally:
        await prefill.stop()
        await decode.stop()


# -- the adapter's cost ---------------------------------------------------------------------
def _chunk_events(n: int) -> list[str]:
    """What vLLM streams for an n-token chat reply with continuous usage (its shapes)."""
    base = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    out = [
        "data: "
        + json.dumps(
            {
                **base,
                "choices": [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
                "usage": {"prompt_tokens": 20, "total_tokens": 20, "completion_tokens": 0},
            }
        )
        + "\n\n"
    ]
    for i in range(1, n + 1):
        choice: dict[str, Any] = {
            "index": 0,
            "delta": {"content": " word"},
            "logprobs": None,
            "finish_reason": None,
            "token_ids": None,
        }
        if i == n:
            choice.update(finish_reason="length", stop_reason=None)
        usage = {"prompt_tokens": 20, "total_tokens": 20 + i, "completion_tokens": i}
        out.append(f"data: {json.dumps({**base, 'choices': [choice], 'usage': usage})}\n\n")
    usage = {"prompt_tokens": 20, "total_tokens": 20 + n, "completion_tokens": n}
    out.append(f"data: {json.dumps({**base, 'choices': [], 'usage': usage})}\n\n")
    out.append("data: [DONE]\n\n")
    return out


class _InstantServing:
    """A serving object that streams precomputed events at once (no engine, no vLLM work)."""

    def __init__(self, events: list[str]) -> None:
        self.events = events

    async def create_chat_completion(self, request: Any, raw_request: Any = None) -> Any:
        async def gen() -> AsyncGenerator[str, None]:
            for e in self.events:
                yield e

        return gen()


async def measure_adapter(requests: int = 2000, tokens: int = 100) -> dict[str, float]:
    """µs of the adapter's own work: per chunk (decode the event, make the Delta, pass it
    through the async generator) and per request (the body, the backend's call set-up)."""
    b, _ = await started()
    events = _chunk_events(tokens)
    serving = _InstantServing(events)
    req = chat(max_tokens=tokens)
    noop_model = types.SimpleNamespace(model_validate=lambda body: body)

    # per chunk: the decoder alone, and the whole stream path
    dec_t = time.perf_counter()
    for _ in range(requests // 10):
        dec = vs.StreamDecoder(True)
        for e in events:
            dec.feed(e)
    dec_us = (time.perf_counter() - dec_t) / (requests // 10 * len(events)) * 1e6

    async def one() -> None:
        async for _ in b._stream(noop_model.model_validate({}), serving, True):
            pass

    t = time.perf_counter()
    for _ in range(requests // 10):
        await one()
    stream_us = (time.perf_counter() - t) / (requests // 10 * len(events)) * 1e6

    # per request: building the OpenAI body tokenbus hands to vLLM's request model
    t = time.perf_counter()
    for _ in range(requests):
        vs.chat_body(req, "tiny-model")
    body_us = (time.perf_counter() - t) / requests * 1e6
    return {
        "decode_us_per_chunk": dec_us,
        "stream_us_per_chunk": stream_us,
        "body_us_per_request": body_us,
    }


@pytest.mark.unit
async def test_adapter_cost_is_measurable() -> None:
    costs = await measure_adapter(requests=50, tokens=20)
    assert all(v > 0 for v in costs.values())


if __name__ == "__main__":
    res = asyncio.run(measure_adapter())
    for k, v in res.items():
        print(f"{k}: {v:.2f}")
