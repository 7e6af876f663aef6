"""`tokenbus up --backend vllm`: the whole stack `make up` starts, on vLLM 0.33 itself.

`tokenbus up` in a fresh folder (embedded nats-server on the locked bus, every stage:
ingress, auth, rate limiter, content filter, router, telemetry, the HTTP bridge) with one
``--backend vllm`` worker on the scripted engine core (docs/vllm.md), which the worker's
settings turn on through the environment, as a user without a GPU would. Driven by the
openai SDK with the dev key `tokenbus up` writes. On a GPU, ``pytest -m gpu`` runs the same
stack on a real model instead (``TOKENBUS_TEST_VLLM_MODEL``; docs/vllm.md).

Skipped unless vLLM is importable (``make test-vllm`` builds a venv that has it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from engine_worker.backends import scripted_core as sc
from tests.support.pids import stop_process
from tests.support.ports import free_port
from tests.test_vllm_real import HELLO, TOOL_CALL, WEATHER, _read_stream

pytestmark = pytest.mark.stack

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (make test-vllm)", allow_module_level=True)

MODEL = "tiny-vllm"
MAX_MODEL_LEN = 400
CORE = sc.ScriptedCoreSettings(
    prefill_ms=1,
    decode_ms=2,
    scripts=[
        sc.Script(marker="weather", text=f"<tool_call>\n{json.dumps(TOOL_CALL)}\n</tool_call>")
    ],
)


class UpStack:
    def __init__(self, folder: Path, port: int, real: bool) -> None:
        self.folder = folder
        self.port = port
        self.real = real  # a real model on a GPU, not the scripted core
        self.key = (folder / ".tokenbus" / "dev-key").read_text().strip()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def logs(self) -> str:
        return "\n".join(p.read_text() for p in (self.folder / ".tokenbus" / "logs").glob("*.log"))


def _ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/ready").status_code == 200
    except httpx.HTTPError:
        return False


def _gpu_model() -> str:
    """The real model for the ``gpu`` run: ``$TOKENBUS_TEST_VLLM_MODEL`` on a CUDA GPU."""
    model = os.environ.get("TOKENBUS_TEST_VLLM_MODEL", "")
    if not model:
        pytest.skip("set TOKENBUS_TEST_VLLM_MODEL to a small model's path or name")
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return model


@pytest.fixture(scope="module", params=["scripted", pytest.param("gpu", marks=pytest.mark.gpu)])
def up(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[UpStack]:
    """The stack on the scripted core, or (``pytest -m gpu``) on a real model."""
    real = request.param == "gpu"
    folder = tmp_path_factory.mktemp("up")
    (folder / ".venv").symlink_to(Path(sys.executable).parent.parent)
    port, nats_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENBUS_")}
    options = [f"max_model_len={MAX_MODEL_LEN}", "enable_auto_tool_choice=true"]
    options.append("tool_call_parser=hermes")
    if real:
        options += [f"model={_gpu_model()}", "gpu_memory_utilization=0.3", "enforce_eager=true"]
    else:
        options += [f"model={sc.build_checkpoint(folder / 'ckpt')}", "dtype=bfloat16"]
        env["VLLM_TARGET_DEVICE"] = "cpu"
        env["TOKENBUS_WORKER__VLLM__SCRIPTED_CORE"] = CORE.model_dump_json()
    args = ["up", "--port", str(port), "--nats-port", str(nats_port), "--workers", "1"]
    args += ["--backend", "vllm", "--model", MODEL]
    for opt in options:
        args += ["--engine-arg", opt]
    log = open(folder / "up.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [".venv/bin/tokenbus", *args], cwd=folder, env=env, stdout=log, stderr=log
    )
    try:
        deadline = time.monotonic() + (900 if real else 240)  # vLLM's imports and start
        while not (folder / ".tokenbus" / "dev-key").exists() or not _ready(port):
            assert proc.poll() is None, (folder / "up.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (folder / "up.log").read_text()[-3000:]
            time.sleep(0.3)
        yield UpStack(folder, port, real)
    finally:
        stop_process(proc, 60)
        log.close()


# Greedy, and to max_tokens: a real model's whole and streamed replies match too.
SAME: dict[str, Any] = {
    "messages": HELLO,
    "seed": 3,
    "temperature": 0,
    "extra_body": {"ignore_eos": True},
}


@pytest.fixture
async def api(up: UpStack) -> Any:
    async with openai.AsyncOpenAI(base_url=up.url, api_key=up.key, max_retries=0) as c:
        yield c


async def test_chat_whole_and_streamed_through_every_stage(api: openai.AsyncOpenAI) -> None:
    whole = await api.chat.completions.create(model=MODEL, max_tokens=12, **SAME)
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 12
    assert whole.usage.prompt_tokens > 0
    stream = await api.chat.completions.create(
        model=MODEL,
        max_tokens=12,
        **SAME,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, usage = await _read_stream(stream)
    assert text == whole.choices[0].message.content and text
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 12


async def test_completion_and_a_tool_call_parsed_by_hermes(
    up: UpStack, api: openai.AsyncOpenAI
) -> None:
    done = await api.completions.create(
        model=MODEL, prompt="Hello", max_tokens=5, seed=1, extra_body={"ignore_eos": True}
    )
    assert done.usage is not None and done.usage.completion_tokens == 5
    if up.real:
        return  # the tool call below is the scripted core's
    call = await api.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER],  # type: ignore[list-item]
        max_tokens=60,
    )
    choice = call.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls
    fn = choice.message.tool_calls[0].function  # type: ignore[union-attr]
    assert fn.name == "get_weather" and json.loads(fn.arguments) == TOOL_CALL["arguments"]


async def test_vllms_400_and_the_gateways_401(up: UpStack, api: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        await api.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hello world " * 300}],
            max_tokens=5,
        )
    assert "maximum context length is 400 tokens" in str(err.value)
    async with openai.AsyncOpenAI(base_url=up.url, api_key="sk-wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            await bad.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
    # The stack is still serving after both.
    ok = await api.chat.completions.create(model=MODEL, max_tokens=2, **SAME)
    assert ok.usage is not None and ok.usage.completion_tokens == 2
