"""The vllm backend against a fake engine with vLLM's v1 AsyncLLM interface (no GPU needed),
plus one GPU test that runs a real model when vLLM, a GPU and a model path are available."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys
import types
from typing import Any

import pytest

from bus_schemas import errors as E
from engine_worker import backends
from engine_worker.backends.base import Delta, GenerationRequest
from engine_worker.backends.vllm_backend import VLLMBackend, pin_gpus
from services.config import VLLMSettings, WorkerSettings

try:  # tests/ is a package when run from the repo root with rootdir on sys.path
    from tests.fakes import fake_vllm as fv
except ImportError:  # pytest's default rootdir-less import puts tests/ itself on sys.path
    from fakes import fake_vllm as fv  # type: ignore[no-redef]


def make_cfg(**vllm: Any) -> WorkerSettings:
    return WorkerSettings(backend="vllm", model="tiny-model", vllm=VLLMSettings(**vllm))


async def started(
    engine: fv.FakeAsyncLLM | None = None,
    *,
    cumulative: bool = False,
    cfg: WorkerSettings | None = None,
) -> tuple[VLLMBackend, fv.FakeAsyncLLM]:
    engine = engine or fv.FakeAsyncLLM()
    seen: dict[str, Any] = {}

    def factory(args: dict[str, Any]) -> fv.FakeAsyncLLM:
        seen.update(args)
        engine.engine_args = args
        return engine

    b = VLLMBackend(
        cfg or make_cfg(),
        engine_factory=factory,
        sampling_params_cls=fv.SamplingParams,
        request_output_kind=None if cumulative else fv.RequestOutputKind,
    )
    await b.start()
    return b, engine


def completion(
    rid: str = "r1", prompt: str = "tell me a story", **params: Any
) -> GenerationRequest:
    p = {"max_tokens": 12, "temperature": 0.0, "seed": 7, **params}
    return GenerationRequest.from_envelope(
        {
            "request_id": rid,
            "kind": "completion",
            "model": "tiny-model",
            "prompt": prompt,
            "params": p,
        }
    )


def chat(rid: str = "c1", **params: Any) -> GenerationRequest:
    p = {"max_tokens": 6, "seed": 1, **params}
    return GenerationRequest.from_envelope(
        {
            "request_id": rid,
            "kind": "chat",
            "model": "tiny-model",
            "params": p,
            "messages": [
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}],
                },
            ],
        }
    )


async def collect(it: Any) -> list[Delta]:
    return [d async for d in it]


def expected(prompt: str, seed: int | None, n: int) -> str:
    ids = fv.FakeTokenizer().encode(prompt)
    return "".join(fv.expected_words(ids, seed, n))


# -- generation -----------------------------------------------------------------------------
async def test_streams_deltas_and_finishes_with_usage() -> None:
    b, engine = await started()
    deltas = await collect(b.generate(completion(max_tokens=12)))
    assert len(deltas) == 12  # one per token: the fake emits every step
    assert all(d.finish_reason is None for d in deltas[:-1])
    last = deltas[-1]
    assert last.finish_reason == "length"
    assert "".join(d.text for d in deltas) == expected("tell me a story", 7, 12)
    assert sum(d.tokens for d in deltas) == 12
    assert last.completion_tokens == 12
    assert last.prompt_tokens == len(fv.FakeTokenizer().encode("tell me a story"))
    # The request reached the engine as vLLM expects it.
    prompt, sp, rid = engine.requests[0]
    assert (prompt, rid) == ("tell me a story", "r1")
    assert sp.output_kind is fv.RequestOutputKind.DELTA
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.seed, sp.stop) == (12, 0.0, 1.0, 7, [])
    assert engine.external_aborts == [] and engine.aborted == []
    assert b.stats() == {"running": 0, "waiting": 0, "kv_usage": 0.0}


async def test_cumulative_outputs_are_turned_into_deltas() -> None:
    b, engine = await started(cumulative=True)
    deltas = await collect(b.generate(completion(max_tokens=9)))
    assert engine.requests[0][1].output_kind is fv.RequestOutputKind.CUMULATIVE
    assert "".join(d.text for d in deltas) == expected("tell me a story", 7, 9)
    assert [d.tokens for d in deltas] == [1] * 9
    assert deltas[-1].completion_tokens == 9


async def test_stop_sequence_ends_the_request_without_the_stop_text() -> None:
    full = expected("tell me a story", 7, 12)
    stop = full.split(" ")[4][:3]  # part of the 4th word
    k = full.find(stop)
    b, engine = await started()
    deltas = await collect(b.generate(completion(max_tokens=12, stop=[stop])))
    text = "".join(d.text for d in deltas)
    assert text == full[:k]
    assert deltas[-1].finish_reason == "stop"
    assert engine.requests[0][1].stop == [stop]
    # Text that could have been the start of the stop string was never sent early.
    assert all(stop not in d.text for d in deltas)
    assert deltas[-1].completion_tokens == sum(d.tokens for d in deltas) < 12


async def test_chat_uses_the_tokenizer_chat_template() -> None:
    b, engine = await started()
    deltas = await collect(b.generate(chat()))
    tok = engine.tokenizer
    assert tok.template_calls == [
        {
            "conversation": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "hi there"},
            ],
            "tokenize": False,
            "add_generation_prompt": True,
        }
    ]
    rendered = "<s>[system] be brief\n[user] hi there\n[assistant]"
    prompt = engine.requests[0][0]
    # Token ids without a second BOS: the template already holds one.
    assert prompt == {"prompt_token_ids": tok.encode(rendered, add_special_tokens=False)}
    assert prompt["prompt_token_ids"][0] != fv.BOS_ID
    assert deltas[-1].prompt_tokens == len(prompt["prompt_token_ids"])
    assert deltas[-1].finish_reason == "length"


async def test_chat_without_template_uses_plain_rendering() -> None:
    engine = fv.FakeAsyncLLM(tokenizer=fv.FakeTokenizer(chat_template=None))
    b, engine = await started(engine)
    req = chat()
    await collect(b.generate(req))
    assert engine.requests[0][0] == req.prompt_text()


async def test_async_get_tokenizer_of_older_vllm_is_awaited() -> None:
    b, _ = await started(fv.FakeAsyncLLM(async_get_tokenizer=True))
    assert isinstance(b.tokenizer, fv.FakeTokenizer)


async def test_non_text_content_is_rejected() -> None:
    b, _ = await started()
    req = chat()
    assert req.messages is not None
    req.messages[1]["content"] = [{"type": "image_url", "image_url": {"url": "x"}}]
    with pytest.raises(E.InvalidRequest):
        await collect(b.generate(req))


async def test_concurrent_requests_stream_independently() -> None:
    b, _ = await started()
    reqs = [completion(f"r{i}", prompt=f"prompt number {i}", max_tokens=5 + i) for i in range(8)]
    results = await asyncio.gather(*(collect(b.generate(r)) for r in reqs))
    for i, deltas in enumerate(results):
        assert "".join(d.text for d in deltas) == expected(f"prompt number {i}", 7, 5 + i)
        assert deltas[-1].completion_tokens == 5 + i


# -- cancellation ---------------------------------------------------------------------------
async def test_closing_the_stream_mid_way_aborts_the_request() -> None:
    b, engine = await started()
    it = b.generate(completion("cancel-me", max_tokens=50))
    got = [await it.__anext__() for _ in range(3)]
    assert all(d.finish_reason is None for d in got)
    assert b.stats()["running"] == 1
    await it.aclose()
    assert engine.external_aborts == ["cancel-me"]
    assert engine.running == set()
    assert b.stats() == {"running": 0, "waiting": 0, "kv_usage": 0.0}


async def test_cancelling_the_consumer_task_aborts_the_request() -> None:
    b, engine = await started(fv.FakeAsyncLLM(token_delay=0.01))
    first = asyncio.Event()

    async def consume() -> None:
        async for _ in b.generate(completion("task-cancel", max_tokens=500)):
            first.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(first.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert "task-cancel" in engine.external_aborts
    assert engine.running == set()


async def test_a_finished_request_is_not_aborted_when_the_consumer_stops_reading() -> None:
    b, engine = await started()
    it = b.generate(completion("done", max_tokens=3))
    async for d in it:
        if d.finish_reason is not None:
            break  # the worker stops at the final delta without draining the iterator
    assert b.stats()["running"] == 0  # not in flight even before the iterator is closed
    await it.aclose()
    assert engine.aborted == []


# -- errors ---------------------------------------------------------------------------------
async def test_engine_failure_mid_stream_is_an_engine_error() -> None:
    b, _ = await started(fv.FakeAsyncLLM(fail_after=3))
    got: list[Delta] = []
    with pytest.raises(E.EngineError) as info:
        async for d in b.generate(completion(max_tokens=10)):
            got.append(d)
    assert len(got) == 3
    assert "EngineGenerateError" in info.value.message
    assert info.value.retryable


async def test_dead_engine_is_an_engine_error() -> None:
    b, engine = await started()
    engine.shut_down = True
    with pytest.raises(E.EngineError, match="died"):
        await collect(b.generate(completion()))


async def test_request_level_error_finish_is_an_engine_error() -> None:
    b, _ = await started(fv.FakeAsyncLLM(finish_with="error"))
    with pytest.raises(E.EngineError, match="failed the request"):
        await collect(b.generate(completion(max_tokens=4)))


async def test_validation_error_from_vllm_is_an_invalid_request() -> None:
    b, _ = await started(fv.FakeAsyncLLM(fail_after=0, error=ValueError("prompt too long")))
    with pytest.raises(E.InvalidRequest, match="prompt too long"):
        await collect(b.generate(completion()))


async def test_bad_parameters_are_rejected() -> None:
    b, _ = await started()
    with pytest.raises(E.InvalidRequest):
        b.generate(completion(max_tokens=0))
    with pytest.raises(E.InvalidRequest, match="top_p"):
        await collect(b.generate(completion(top_p=0.0)))


async def test_generate_before_start_is_an_engine_error() -> None:
    b = VLLMBackend(make_cfg(), engine_factory=lambda args: fv.FakeAsyncLLM())
    with pytest.raises(E.EngineError):
        b.generate(completion())


# -- lifecycle, config, stats ---------------------------------------------------------------
async def test_start_builds_engine_args_and_stop_shuts_down(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    cfg = WorkerSettings(
        backend="vllm",
        model="served-name",
        tp=2,
        vllm=VLLMSettings(gpus="2,3", engine_args={"max_model_len": 256}),
    )
    b, engine = await started(cfg=cfg)
    assert engine.engine_args == {
        "max_model_len": 256,
        "model": "served-name",
        "tensor_parallel_size": 2,
    }
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"
    await b.stop()
    assert engine.shut_down
    await b.stop()  # idempotent


async def test_explicit_model_in_engine_args_wins() -> None:
    _, engine = await started(cfg=make_cfg(engine_args={"model": "/models/tiny"}))
    assert engine.engine_args["model"] == "/models/tiny"


async def test_too_few_gpus_for_tensor_parallel_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    cfg = WorkerSettings(backend="vllm", tp=4, vllm=VLLMSettings(gpus="0,1"))
    with pytest.raises(RuntimeError, match="needs 4 GPUs"):
        await started(cfg=cfg)


async def test_stats_come_from_vllm_scheduler_snapshots() -> None:
    b, _ = await started()
    it = b.generate(completion("s1", max_tokens=50))
    await it.__anext__()
    assert b.stats() == {"running": 1, "waiting": 0, "kv_usage": 0.0}  # our own count
    b.observe_scheduler_stats(
        fv.SchedulerStats(num_running_reqs=3, num_waiting_reqs=2, kv_cache_usage=0.25)
    )
    assert b.stats() == {"running": 3, "waiting": 2, "kv_usage": 0.25}
    # Older vLLM releases called it gpu_cache_usage.
    b.observe_scheduler_stats(
        types.SimpleNamespace(num_running_reqs=1, num_waiting_reqs=0, gpu_cache_usage=0.5)
    )
    assert b.stats() == {"running": 1, "waiting": 0, "kv_usage": 0.5}
    await it.aclose()
    # Idle: a stale snapshot must not keep reporting load.
    assert b.stats() == {"running": 0, "waiting": 0, "kv_usage": 0.5}


def test_stats_never_raise() -> None:
    b = VLLMBackend(make_cfg())
    b._sched = {0: ("x", None, object())}  # type: ignore[dict-item]
    b._inflight[object()] = True
    assert b.stats() == {"running": 0, "waiting": 0, "kv_usage": 0.0}


def test_create_returns_the_vllm_backend() -> None:
    b = backends.create(make_cfg())
    assert isinstance(b, VLLMBackend) and b.name == "vllm"


def test_importing_the_backend_loads_neither_vllm_nor_torch() -> None:
    code = (
        "import sys, engine_worker.backends.vllm_backend as m; "
        "m.VLLMBackend; "
        "assert 'vllm' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -- pin_gpus -------------------------------------------------------------------------------
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


def test_pin_gpus_refuses_to_change_after_torch_is_imported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))
    pin_gpus("0,1")  # unchanged: fine
    pin_gpus("0, 1")
    pin_gpus("")  # nothing asked: fine
    with pytest.raises(RuntimeError, match="torch is already imported"):
        pin_gpus("2")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"


# -- a real model ---------------------------------------------------------------------------
def _gpu_available() -> bool:
    if importlib.util.find_spec("vllm") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


@pytest.mark.gpu
@pytest.mark.timeout(900)
async def test_real_vllm_tiny_model() -> None:
    if not _gpu_available():
        pytest.skip("needs vllm and a GPU")
    model = os.environ.get("TOKENBUS_TEST_VLLM_MODEL")
    if not model:
        pytest.skip("set TOKENBUS_TEST_VLLM_MODEL to a small model path or name")
    cfg = make_cfg(
        engine_args={
            "model": model,
            "max_model_len": 512,
            "gpu_memory_utilization": 0.3,
            "enforce_eager": True,
        }
    )
    b = VLLMBackend(cfg)
    await b.start()
    try:
        deltas = await collect(
            b.generate(completion("g1", prompt="The capital of France is", max_tokens=8))
        )
        last = deltas[-1]
        assert last.finish_reason in ("stop", "length")
        assert last.prompt_tokens > 0
        assert 0 < last.completion_tokens <= 8
        assert last.completion_tokens == sum(d.tokens for d in deltas)
        assert "".join(d.text for d in deltas)

        stop_deltas = await collect(
            b.generate(completion("g2", prompt="1, 2, 3, 4,", max_tokens=30, stop=["7"]))
        )
        assert "7" not in "".join(d.text for d in stop_deltas)

        chat_deltas = await collect(b.generate(chat("g3", max_tokens=8)))
        assert chat_deltas[-1].finish_reason in ("stop", "length")

        it = b.generate(completion("g4", prompt="Count forever:", max_tokens=400, temperature=1.0))
        await it.__anext__()
        await it.aclose()
        await asyncio.sleep(0.5)
        st = b.stats()
        assert st["running"] == 0 and st["waiting"] == 0
        assert 0.0 <= st["kv_usage"] <= 1.0
    finally:
        await b.stop()
