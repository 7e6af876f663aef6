"""The vllm backend against vLLM 0.33 itself, on CPU, behind the scripted engine core.

Everything but the GPU step is vLLM's own code (its serve parser, AsyncLLM, renderer, chat
template, output processor, hermes tool parser, OpenAI serving classes); the engine core is
:mod:`engine_worker.backends.scripted_core` on a tiny checkpoint built here. The stack is real:
a nats-server, ingress, router and the HTTP bridge as processes, driven by the openai SDK and
httpx; the vllm worker runs in this process so the test can see what its engine core saw.
The migration test runs two vllm workers as processes of their own and kills one mid-stream.

Skipped unless vLLM is importable (``make test-vllm`` builds a venv that has it).
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import json
import os
import signal
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import openai
import pytest

from bus_schemas import errors as E
from engine_worker.backends import scripted_core as sc
from tests.support.busdata import new_model
from tests.support.inprocess import settings
from tests.support.natsserver import NatsServer
from tests.support.procs import Procs, ProcStack, start_stack
from tests.support.waits import wait_for, wait_replicas
from tests.test_migration import _victim

pytestmark = pytest.mark.stack

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (make test-vllm)", allow_module_level=True)

# The PyPI wheel is built for CUDA; on a machine without a GPU vLLM picks its CPU platform.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

MAX_MODEL_LEN = 400
TOOL_CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
STOPPER_TEXT = "Hello world, the quick brown fox jumps over the lazy dog."
SCRIPTS = [
    sc.Script(marker="weather", text=f"<tool_call>\n{json.dumps(TOOL_CALL)}\n</tool_call>"),
    sc.Script(marker="stopper", text=STOPPER_TEXT),
    sc.Script(marker="ponder", text="<think>Let me think about it.</think>Hello world"),
]
HELLO = [{"role": "user", "content": "Hello world"}]


class VLLMStack:
    """The stack's processes, the in-process vllm worker and its scripted engine core."""

    def __init__(self, procs: ProcStack, worker: Any, reasoner: Any, embedder: Any) -> None:
        self.procs = procs
        self.worker = worker
        self.model = procs.model
        self.reasoner = reasoner
        self.reasoning_model = reasoner.model
        self.embedder = embedder
        self.embedding_model = embedder.model

    @property
    def core(self) -> sc.ScriptedCoreClient:
        """The engine core of the first model's worker."""
        core = self.worker.backend.engine.engine_core
        assert isinstance(core, sc.ScriptedCoreClient)
        return core


@pytest.fixture(scope="module")
async def vllm_stack(
    nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[VLLMStack]:
    from engine_worker.worker import Worker

    ckpt = sc.build_checkpoint(tmp_path_factory.mktemp("ckpt"))
    model, reasoning_model = new_model(), new_model()
    engine_args: dict[str, Any] = {
        "model": str(ckpt),
        "max_model_len": MAX_MODEL_LEN,
        "dtype": "bfloat16",
        "enable_auto_tool_choice": True,
        "tool_call_parser": "hermes",
    }
    core = sc.ScriptedCoreSettings(prefill_ms=1, decode_ms=5, scripts=SCRIPTS)

    def worker_settings(name: str, **more: Any) -> Any:
        return settings(
            nats_server.url,
            worker={
                "model": name,
                "replica": f"{name}-vllm",
                "backend": "vllm",
                "heartbeat_interval_s": 0.2,
                # The worker's own setting puts vLLM on the scripted core (vllm_backend).
                "vllm": {
                    "engine_args": {**engine_args, **more},
                    "scripted_core": core.model_dump(),
                },
            },
        )

    embed_model = new_model()
    pooling = {"runner": "pooling", "enable_auto_tool_choice": False, "tool_call_parser": None}
    with Procs(nats_server.url, tmp_path_factory.mktemp("procs")) as ps:
        async with (
            Worker(worker_settings(model)) as worker,
            # A reasoning parser reads every answer as reasoning until </think>: its own model.
            Worker(worker_settings(reasoning_model, reasoning_parser="qwen3")) as reasoner,
            # The same checkpoint as a pooling model: vLLM's embedding handler.
            Worker(worker_settings(embed_model, **pooling)) as embedder,
        ):
            stack = await start_stack(ps, model, "ingress", "router", workers=0)
            await wait_replicas(nats_server.url, reasoning_model, 1)
            await wait_replicas(nats_server.url, embed_model, 1)
            yield VLLMStack(stack, worker, reasoner, embedder)


@pytest.fixture
async def oai(vllm_stack: VLLMStack) -> AsyncIterator[openai.AsyncOpenAI]:
    async with vllm_stack.procs.openai() as c:
        yield c


async def test_chat_whole_counts_tokens_as_vllm_does(
    vllm_stack: VLLMStack, oai: openai.AsyncOpenAI
) -> None:
    out = await oai.chat.completions.create(
        model=vllm_stack.model, messages=HELLO, max_tokens=7, seed=3
    )
    choice = out.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content
    req = vllm_stack.core.added[-1]
    assert out.usage is not None
    assert out.usage.prompt_tokens == len(req.prompt_token_ids)
    assert out.usage.completion_tokens == 7
    # The text is what vLLM's detokeniser makes of the scripted core's tokens.
    core = vllm_stack.core
    assert choice.message.content == core.tokenizer.decode(core.output_ids(req, 7))


async def test_a_continued_reply_goes_on_with_the_same_text(
    vllm_stack: VLLMStack, oai: openai.AsyncOpenAI
) -> None:
    """What migration relies on: the text already sent, at the end of the prompt, makes the
    scripted core go on as it would have (vLLM's continue_final_message renders it so)."""
    kw: dict[str, Any] = {"model": vllm_stack.model, "seed": 9}
    whole = await oai.chat.completions.create(messages=HELLO, max_tokens=12, **kw)
    text = whole.choices[0].message.content or ""
    core = vllm_stack.core
    head = core.tokenizer.decode(core.output_ids(core.added[-1], 5))
    rest = await oai.chat.completions.create(
        messages=[*HELLO, {"role": "assistant", "content": head}],
        max_tokens=7,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
        **kw,
    )
    assert head + (rest.choices[0].message.content or "") == text


async def test_chat_streamed_matches_whole(vllm_stack: VLLMStack, oai: openai.AsyncOpenAI) -> None:
    whole = await oai.chat.completions.create(
        model=vllm_stack.model, messages=HELLO, max_tokens=9, seed=11
    )
    stream = await oai.chat.completions.create(
        model=vllm_stack.model,
        messages=HELLO,
        max_tokens=9,
        seed=11,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, usage = "", None, None
    async for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert text == whole.choices[0].message.content
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 9


async def test_scripted_tool_call_is_parsed_by_hermes(
    vllm_stack: VLLMStack, oai: openai.AsyncOpenAI
) -> None:
    ask = [{"role": "user", "content": "what is the weather in Paris?"}]
    out = await oai.chat.completions.create(
        model=vllm_stack.model, messages=ask, tools=[WEATHER], max_tokens=100
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (TOOL_CALL["name"], TOOL_CALL["arguments"])
    ]


async def test_scripted_tool_call_streamed(vllm_stack: VLLMStack, oai: openai.AsyncOpenAI) -> None:
    ask = [{"role": "user", "content": "what is the weather in Paris?"}]
    stream = await oai.chat.completions.create(
        model=vllm_stack.model, messages=ask, tools=[WEATHER], max_tokens=100, stream=True
    )
    name, args, finish, ids = "", "", None, set()
    async for chunk in stream:
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for tc in c.delta.tool_calls or []:
                if tc.id:
                    ids.add(tc.id)
                if tc.function and tc.function.name:
                    name += tc.function.name
                if tc.function and tc.function.arguments:
                    args += tc.function.arguments
    assert finish == "tool_calls"
    assert len(ids) == 1
    assert (name, json.loads(args)) == (TOOL_CALL["name"], TOOL_CALL["arguments"])


async def test_stop_string_is_vllms(vllm_stack: VLLMStack, oai: openai.AsyncOpenAI) -> None:
    ask = [{"role": "user", "content": "stopper"}]
    out = await oai.chat.completions.create(
        model=vllm_stack.model, messages=ask, max_tokens=100, stop=["brown"]
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == STOPPER_TEXT[: STOPPER_TEXT.index("brown")]
    # vLLM's front end matched the stop string and aborted the request in its engine core.
    rid = vllm_stack.core.added[-1].request_id
    await _eventually(lambda: rid in vllm_stack.core.aborted)


async def test_stop_token_id_finishes_the_request(
    vllm_stack: VLLMStack, oai: openai.AsyncOpenAI
) -> None:
    kw: dict[str, Any] = {"model": vllm_stack.model, "messages": HELLO, "seed": 21}
    await oai.chat.completions.create(max_tokens=1, **kw)
    core = vllm_stack.core
    ids = core.output_ids(core.added[-1], 6)
    stop_at = ids.index(ids[3])
    out = await oai.chat.completions.create(
        max_tokens=50, extra_body={"stop_token_ids": [ids[3]]}, **kw
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    assert out.usage is not None and out.usage.completion_tokens == stop_at + 1
    assert choice.message.content == core.tokenizer.decode(ids[:stop_at])


async def test_prompt_longer_than_max_model_len_is_a_400(
    vllm_stack: VLLMStack, oai: openai.AsyncOpenAI
) -> None:
    long = [{"role": "user", "content": "Hello world " * MAX_MODEL_LEN}]
    with pytest.raises(openai.BadRequestError) as info:
        await oai.chat.completions.create(model=vllm_stack.model, messages=long, max_tokens=5)
    assert "maximum context length is 400 tokens" in str(info.value)


async def test_client_disconnect_aborts_the_engine_request(vllm_stack: VLLMStack) -> None:
    core = vllm_stack.core
    body = {"model": vllm_stack.model, "messages": HELLO, "max_tokens": 380, "stream": True}
    async with (
        vllm_stack.procs.http(timeout=30) as h,
        h.stream("POST", "/v1/chat/completions", json=body) as r,
    ):
        assert r.status_code == 200
        seen = 0
        async for line in r.aiter_lines():
            if line.startswith("data: ") and '"content"' in line:
                seen += 1
                if seen == 3:
                    break
        rid = core.added[-1].request_id
        assert core.added[-1].sampling_params.max_tokens == 380
    # 380 tokens at 5 ms would take 1.9 s; the abort reaches the core well before.
    await _eventually(lambda: rid in core.aborted, timeout=5)
    assert not any(s.rid == rid for s in core.running)


async def test_reasoning_block_is_split_by_the_reasoning_parser(vllm_stack: VLLMStack) -> None:
    body = {
        "model": vllm_stack.reasoning_model,
        "messages": [{"role": "user", "content": "ponder this"}],
        "max_tokens": 100,
    }
    async with vllm_stack.procs.http("/v1", timeout=30) as h:
        whole = (await h.post("/chat/completions", json=body)).json()
        message = whole["choices"][0]["message"]
        # The bridge names it reasoning_content (DeepSeek's name); vLLM 0.33 says reasoning.
        assert (message["reasoning_content"], message["content"]) == (
            "Let me think about it.",
            "Hello world",
        )
        assert whole["choices"][0]["finish_reason"] == "stop"
        reasoning, content = "", ""
        async with h.stream("POST", "/chat/completions", json={**body, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        reasoning += c["delta"].get("reasoning_content") or ""
                        content += c["delta"].get("content") or ""
    assert (reasoning, content) == ("Let me think about it.", "Hello world")


async def test_completion_whole_and_streamed_with_logprobs(
    vllm_stack: VLLMStack, oai: openai.AsyncOpenAI
) -> None:
    kw: dict[str, Any] = {"model": vllm_stack.model, "prompt": "Hello world", "max_tokens": 6}
    whole = await oai.completions.create(**kw, seed=5, logprobs=2)
    choice = whole.choices[0]
    assert choice.finish_reason == "length"
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.top_logprobs is not None
    assert "".join(lp.tokens) == choice.text
    assert len(lp.tokens) == 6 and all(len(t) == 3 for t in lp.top_logprobs)
    assert whole.usage is not None
    assert whole.usage.prompt_tokens == len(vllm_stack.core.added[-1].prompt_token_ids)
    text = ""
    async for chunk in await oai.completions.create(**kw, seed=5, stream=True):
        text += "".join(c.text for c in chunk.choices)
    assert text == choice.text


async def test_chat_logprobs_name_each_token(
    vllm_stack: VLLMStack, oai: openai.AsyncOpenAI
) -> None:
    out = await oai.chat.completions.create(
        model=vllm_stack.model, messages=HELLO, max_tokens=4, logprobs=True, top_logprobs=2
    )
    choice = out.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert "".join(t.token for t in content) == choice.message.content
    assert all(len(t.top_logprobs) == 2 and t.logprob == pytest.approx(-0.25) for t in content)


async def test_embeddings_come_from_vllms_pooling_handler(
    vllm_stack: VLLMStack, oai: openai.AsyncOpenAI
) -> None:
    """A pooling model's worker serves embeddings only: vLLM's embedding handler sends the
    scripted core pooling requests, whose vectors (unit length, one per distinct prompt)
    come back in order, as floats and as base64, with vLLM's prompt token count."""
    model = vllm_stack.embedding_model
    texts = ["Hello world", "the quick brown fox", "Hello world"]
    out = await oai.embeddings.create(model=model, input=texts)
    vectors = [d.embedding for d in out.data]
    assert [d.index for d in out.data] == [0, 1, 2]
    assert len(vectors[0]) == 64  # the checkpoint's hidden size
    assert vectors[0] == vectors[2] != vectors[1]
    assert abs(sum(v * v for v in vectors[1]) - 1.0) < 1e-5
    assert out.usage.prompt_tokens > 0
    core = vllm_stack.embedder.backend.engine.engine_core
    assert all(r.pooling_params is not None for r in core.added)
    assert len(core.added) == 3
    b64 = await oai.embeddings.create(model=model, input="Hello world", encoding_format="base64")
    raw = base64.b64decode(str(b64.data[0].embedding))
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(vectors[0], abs=1e-6)
    with pytest.raises(openai.APIStatusError) as err:
        await oai.chat.completions.create(model=model, messages=HELLO, max_tokens=2)
    assert err.value.status_code in (400, 404)


async def test_a_prefill_hands_its_kv_cache_over_through_vllms_front_end(
    vllm_stack: VLLMStack,
) -> None:
    """Prefill/decode disaggregation (docs/disaggregation.md) on vLLM's own front end over
    the scripted core, which answers as a KV connector (NixlConnector's fields): a request
    with ``kv_transfer_params.do_remote_decode`` is answered whole, its one delta carrying
    the hand-over; the decode request with it reaches the engine core with the parameters
    (vLLM passes them in ``extra_args``) and gives the answer a whole run gives."""
    from engine_worker.backends.base import GenerationRequest

    backend = vllm_stack.worker.backend
    prompt = [{"role": "user", "content": "Hello world, tell me about the weather report"}]

    def req(n: int, **extra: Any) -> GenerationRequest:
        return GenerationRequest(
            request_id=f"pd-{n}-{len(extra)}",
            kind="chat",
            model=vllm_stack.model,
            max_tokens=n,
            messages=prompt,
            extra={"ignore_eos": True, "seed": 7, **extra},
        )

    ask = {"do_remote_decode": True, "do_remote_prefill": False}
    pre = [d async for d in backend.generate(req(1, kv_transfer_params=ask))]
    kvt = pre[-1].kv_transfer_params
    assert kvt is not None and kvt["do_remote_prefill"] is True, pre
    assert kvt["remote_engine_id"] == vllm_stack.core.engine_id
    assert pre[-1].prompt_tokens > 0 and pre[-1].completion_tokens == 1
    handed = [d async for d in backend.generate(req(6, kv_transfer_params=kvt))]
    got = vllm_stack.core.added[-1].sampling_params.extra_args["kv_transfer_params"]
    assert got["remote_block_ids"] == kvt["remote_block_ids"]
    whole = [d async for d in backend.generate(req(6))]
    assert "".join(d.text for d in handed) == "".join(d.text for d in whole)
    assert handed[-1].completion_tokens == 6 and handed[-1].kv_transfer_params is None


def _lora_adapter(path: Path) -> Path:
    """A PEFT LoRA adapter's config for the tiny checkpoint (rank 8 on q_proj and v_proj).
    vLLM's front end reads nothing from the directory: it hands a ``LoRARequest`` naming it
    to the engine core, which loads the weights; the scripted core loads none."""
    path.mkdir(parents=True)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": "tiny-qwen2",
        "r": 8,
        "lora_alpha": 16,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": ["q_proj", "v_proj"],
    }
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def _lora_worker(url: str, model: str, engine_args: dict[str, Any]) -> Any:
    """Settings of a vllm worker ``<model>-vllm`` over the scripted core, beating every
    0.2 s."""
    return settings(
        url,
        worker={
            "model": model,
            "replica": f"{model}-vllm",
            "backend": "vllm",
            "heartbeat_interval_s": 0.2,
            "vllm": {"engine_args": engine_args, "scripted_core": {"prefill_ms": 1}},
        },
    )


async def test_a_lora_adapter_is_listed_and_routed(
    nats_server: NatsServer, vllm_stack: VLLMStack, tmp_path: Path
) -> None:
    """A vllm worker started with a LoRA module (vLLM's ``--lora-modules``) announces the
    adapter's name; the bridge lists it and routes a request naming it to that worker, whose
    engine core is handed the adapter with the request."""
    from engine_worker.worker import Worker

    ckpt = sc.build_checkpoint(tmp_path / "ckpt")
    model = new_model()
    lora = f"{model}-sql-lora"
    adapter = _lora_adapter(tmp_path / "sql-lora")
    engine_args = {
        "model": str(ckpt),
        "max_model_len": MAX_MODEL_LEN,
        "dtype": "bfloat16",
        "enable_lora": True,
        "lora_modules": {lora: str(adapter)},
    }
    cfg = _lora_worker(nats_server.url, model, engine_args)
    async with Worker(cfg) as worker, vllm_stack.procs.http("/v1", timeout=30) as h:
        core = worker.backend.engine.engine_core
        assert isinstance(core, sc.ScriptedCoreClient)
        assert [(x.lora_name, x.lora_path) for x in core.record.loras] == [(lora, str(adapter))]
        listed: set[str] = set()
        for _ in range(100):  # until the bridge has heard the worker's heartbeat
            listed = {m["id"] for m in (await h.get("/models")).json()["data"]}
            if lora in listed:
                break
            await asyncio.sleep(0.1)
        assert {model, lora} <= listed
        body = {"model": lora, "messages": HELLO, "max_tokens": 5, "seed": 4}
        r = await h.post("/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.headers.get("x-tokenbus-replica") == f"{model}-vllm"
        out = r.json()
        assert out["model"] == lora
        assert out["usage"]["completion_tokens"] == 5
        req = core.added[-1]
        assert req.lora_request is not None
        assert (req.lora_request.lora_name, req.lora_request.lora_path) == (lora, str(adapter))
        # The base model's name: no adapter.
        r = await h.post("/chat/completions", json={**body, "model": model})
        assert r.status_code == 200, r.text
        assert core.added[-1].lora_request is None
        assert len(core.added) == 2


async def test_a_lora_adapter_loaded_at_run_time_through_vllms_front_end(
    nats_server: NatsServer, vllm_stack: VLLMStack, tmp_path: Path
) -> None:
    """A vllm worker with LoRA on and no adapter: the adapter command loads one through
    vLLM's own load (its checks, the engine core's add_lora), the bridge routes its name to
    the worker and the engine is handed the adapter; unloaded, it is a 404."""
    from engine_worker.worker import Worker
    from router import adapters as A

    ckpt = sc.build_checkpoint(tmp_path / "ckpt")
    model = new_model()
    lora = f"{model}-rt-lora"
    adapter = _lora_adapter(tmp_path / "rt-lora")
    engine_args = {
        "model": str(ckpt),
        "max_model_len": MAX_MODEL_LEN,
        "dtype": "bfloat16",
        "enable_lora": True,
    }
    replica = f"{model}-vllm"
    cfg = _lora_worker(nats_server.url, model, engine_args)
    nc = await nats.connect(nats_server.url)
    async with Worker(cfg) as worker, vllm_stack.procs.http("/v1", timeout=30) as h:
        core = worker.backend.engine.engine_core
        load = {"type": "adapters", "op": "load", "name": lora, "path": str(adapter)}
        out = await A.command(nc, model, replica, load, 60)
        assert out["adapters"] == {lora: str(adapter)} and out["load_ms"] >= 0
        assert [(x.lora_name, x.lora_path) for x in core.record.loras] == [(lora, str(adapter))]
        body = {"model": lora, "messages": HELLO, "max_tokens": 5, "seed": 4}
        answers: list[Any] = []

        async def answered(status: int) -> bool:
            answers.append(await h.post("/chat/completions", json=body))
            return bool(answers[-1].status_code == status)

        # Until the bridge has heard the worker's heartbeat naming it.
        await wait_for(lambda: answered(200), timeout=10, what="the adapter is not served")
        assert answers[-1].json()["model"] == lora
        req = core.added[-1]
        assert req.lora_request is not None and req.lora_request.lora_name == lora
        # The scripted core reads no weights (a missing folder loads: vLLM's GPU engine
        # would fail it); a base model's name is refused before vLLM is asked.
        with pytest.raises(E.InvalidRequest, match=replica):
            await A.command(nc, model, replica, {**load, "name": model}, 60)
        unload = {"type": "adapters", "op": "unload", "name": lora, "drain_s": 5}
        out = await A.command(nc, model, replica, unload, 60)
        assert out["adapters"] == {} and out["cut"] == 0
        await wait_for(lambda: answered(404), timeout=10, what="the adapter is still served")
    await nc.drain()


async def test_a_long_prompt_is_prefilled_and_decoded_by_two_vllm_workers(
    nats_server: NatsServer, vllm_stack: VLLMStack, tmp_path: Path
) -> None:
    """The whole disaggregated path on vLLM's own front end over the scripted core: a
    prefill worker and a decode worker of one model; the bridge's router sends a long prompt
    to the first (whole, one token: its hand-over comes back) and the request with it to the
    second, whose engine core reads the prompt (kv_transfer_params in its request) and
    answers the client's stream as a whole run does."""
    import re

    from engine_worker.worker import Worker

    ckpt = sc.build_checkpoint(tmp_path / "ckpt")
    model = new_model()
    engine_args = {"model": str(ckpt), "max_model_len": 2048, "dtype": "bfloat16"}

    def pd_worker(role: str) -> Any:
        return settings(
            nats_server.url,
            worker={
                "model": model,
                "replica": f"{model}-{role}",
                "backend": "vllm",
                "pd_role": role,
                "heartbeat_interval_s": 0.2,
                "vllm": {"engine_args": engine_args, "scripted_core": {"prefill_ms": 1}},
            },
        )

    # About 560 tokens as the router counts them (four characters a token): over 512.
    prompt = [{"role": "user", "content": "Hello world, the report " * 93}]
    body = {"model": model, "messages": prompt, "max_tokens": 6, "seed": 3, "ignore_eos": True}
    async with (
        Worker(pd_worker("prefill")) as prefill,
        Worker(pd_worker("decode")) as decode,
        vllm_stack.procs.http("", timeout=30) as h,
    ):
        await wait_replicas(nats_server.url, model, 2)

        async def decided() -> dict[str, float]:
            text = (await h.get("/metrics")).text
            pat = r'tokenbus_pd_decisions_total\{decision="(\w+)"\} ([0-9.]+)'
            return {m.group(1): float(m.group(2)) for m in re.finditer(pat, text)}

        before = (await decided()).get("disaggregated", 0)
        r = await h.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        got = r.json()
        assert (await decided()).get("disaggregated", 0) == before + 1
        pcore, dcore = prefill.backend.engine.engine_core, decode.backend.engine.engine_core
        assert len(pcore.added) == 1 and pcore.added[0].sampling_params.max_tokens == 1
        kvt = dcore.added[-1].sampling_params.extra_args["kv_transfer_params"]
        assert kvt["do_remote_prefill"] is True and kvt["remote_engine_id"] == pcore.engine_id
        assert got["usage"]["completion_tokens"] == 6 and got["usage"]["prompt_tokens"] > 100
        # The same request straight to the decode worker's engine, whole: the same answer.
        from engine_worker.backends.base import GenerationRequest

        whole = GenerationRequest(
            request_id="whole",
            kind="chat",
            model=model,
            max_tokens=6,
            messages=prompt,
            extra={"seed": 3, "ignore_eos": True},
        )
        text = "".join([d.text async for d in decode.backend.generate(whole)])
        assert got["choices"][0]["message"]["content"] == text


async def _read_stream(stream: Any, text: str = "", n: int | None = None) -> tuple[str, Any, Any]:
    """``stream``'s text (after ``text``), finish reason and usage: all of it, or once the
    text has grown by ``n`` content chunks (the stream then left open)."""
    finish, usage, seen = None, None, 0
    async for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            finish = c.finish_reason or finish
            if c.delta.content:
                text += c.delta.content
                seen += 1
        if n is not None and seen >= n:
            break
    return text, finish, usage


async def test_a_vllm_worker_process_killed_mid_stream_is_migrated(
    procs: Procs, tmp_path: Path
) -> None:
    """Two vllm worker processes (vLLM's front end on the scripted core, one checkpoint): the
    one serving a stream is killed -9 after a few chunks; the stream goes on on the other,
    which continues the reply from the text already sent, and ends as one uninterrupted run
    does, token for token."""
    ckpt = sc.build_checkpoint(tmp_path / "ckpt")
    model = new_model()
    engine_args = {"model": str(ckpt), "max_model_len": MAX_MODEL_LEN, "dtype": "bfloat16"}
    worker_env = {
        "TOKENBUS_WORKER__VLLM__ENGINE_ARGS": json.dumps(engine_args),
        "TOKENBUS_WORKER__VLLM__SCRIPTED_CORE": json.dumps({"prefill_ms": 1, "decode_ms": 30}),
        "TOKENBUS_WORKER__HEARTBEAT_INTERVAL_S": "0.25",
    }
    stack = await start_stack(
        procs,
        model,
        "ingress",
        "router",
        workers=2,
        worker_args=("--backend", "vllm"),
        env_for=lambda role, _: worker_env if role == "worker" else {},
        heartbeats=False,  # vLLM's start takes longer than start_stack waits
    )
    await wait_replicas(procs.url, model, 2, timeout=180)
    await asyncio.sleep(0.6)  # the bridge and router hear both
    kw: dict[str, Any] = {
        "model": model,
        "messages": HELLO,
        "max_tokens": 60,
        "seed": 13,
        "stream": True,
        "stream_options": {"include_usage": True},
        "extra_body": {"ignore_eos": True},
    }
    async with stack.openai() as api:
        raw = await api.chat.completions.with_raw_response.create(**kw)
        stream = raw.parse()
        head, _, _ = await _read_stream(stream, n=5)
        first = raw.headers.get("x-tokenbus-replica")
        victim = _victim(stack.workers, first)
        victim.signal(signal.SIGKILL)
        text, finish, usage = await _read_stream(stream, head)
        assert victim.proc.wait(10) == -signal.SIGKILL
        # The same request again, uninterrupted, on the replica left.
        again = await api.chat.completions.with_raw_response.create(**kw)
        assert again.headers.get("x-tokenbus-replica") != first
        whole, whole_finish, whole_usage = await _read_stream(again.parse())
    assert "request_migrated" in stack.bridge.output()
    assert whole_finish == "length"
    assert whole_usage is not None and whole_usage.completion_tokens == 60
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 60
    assert text.startswith(head) and len(text) > len(head)
    assert text == whole


async def _eventually(cond: Any, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


def test_checkpoint_has_no_sampling_defaults(tmp_path: Path) -> None:
    ckpt = sc.build_checkpoint(tmp_path)
    gen = json.loads((ckpt / "generation_config.json").read_text())
    assert set(gen) == {"eos_token_id"}
