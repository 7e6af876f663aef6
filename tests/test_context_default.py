"""A request that sets no answer budget gets the context's worth of room, as OpenAI and
``vllm serve`` give it, not a fixed 512: the agent loops (Codex, Claude Code) never set one,
and a patch written in one turn must not be cut. Real processes, the openai SDK and httpx."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from engine_worker.backends.base import GenerationRequest
from engine_worker.backends.sim import _start, answer_tokens, count_tokens
from tests.support.procs import Procs, start_stack

pytestmark = pytest.mark.stack

FAST = ("--sim-prefill-ms", "0.5", "--sim-decode-ms", "0.2")


def long_answer(system: str | None = None) -> tuple[str, int]:
    """A user message whose answer (under ``system``) ends on its own after more than 512
    tokens, and that length."""
    for i in range(10_000):
        content = f"write the whole module, part {i}"
        msgs = [{"role": "system", "content": system}] if system else []
        msgs.append({"role": "user", "content": content})
        prompt = GenerationRequest("r", "chat", "m", 1, messages=msgs).prompt_text()
        n = answer_tokens(_start(prompt, None))
        if n is not None and 600 < n < 1500:
            return content, n
    raise AssertionError("no prompt with a long answer")


@pytest.fixture
async def base(procs: Procs, model: str) -> str:
    # The sim's own default context (conftest gives the suite a far larger one).
    env = {"TOKENBUS_WORKER__SIM__MAX_MODEL_LEN": "131072"}
    stack = await start_stack(procs, model, worker_args=FAST, env=env)
    return stack.base


async def test_chat_without_max_tokens_writes_its_whole_answer(base: str, model: str) -> None:
    content, n = long_answer()
    api = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    out = await api.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}]
    )
    assert out.usage is not None
    assert (out.choices[0].finish_reason, out.usage.completion_tokens) == ("stop", n)


async def test_a_codex_shaped_turn_is_not_cut_at_512(base: str, model: str) -> None:
    # What Codex sends: instructions, input items, streamed, no max_output_tokens.
    instructions = "You are a coding agent."
    content, n = long_answer(instructions)
    body: dict[str, Any] = {
        "model": model,
        "instructions": instructions,
        "input": [{"type": "message", "role": "user", "content": content}],
        "store": False,
    }
    api = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    whole = await api.responses.create(**body)
    assert whole.status == "completed" and whole.usage is not None
    assert whole.usage.output_tokens == n
    done = None
    async with await api.responses.create(**body, stream=True) as events:
        async for ev in events:
            if ev.type == "response.completed":
                done = ev.response
    assert done is not None and done.status == "completed" and done.usage is not None
    assert done.usage.output_tokens == n


async def test_a_claude_code_shaped_request_fits_the_context(base: str, model: str) -> None:
    # Claude Code asks for 32 000 tokens of answer on every turn: the sim's 128k context
    # holds it, and the answer ends on its own.
    system = "You are Claude Code."
    content, n = long_answer(system)
    body = {
        "model": model,
        "max_tokens": 32_000,
        "system": system,
        "messages": [{"role": "user", "content": content}],
    }
    async with httpx.AsyncClient(base_url=base, timeout=60) as h:
        r = await h.post("/v1/messages", json=body, headers={"x-api-key": "unused"})
    assert r.status_code == 200, r.text
    msg = r.json()
    assert (msg["stop_reason"], msg["usage"]["output_tokens"]) == ("end_turn", n)


async def test_the_default_is_what_the_context_leaves(procs: Procs, model: str) -> None:
    env = {"TOKENBUS_WORKER__SIM__MAX_MODEL_LEN": "900"}
    stack = await start_stack(procs, model, worker_args=FAST, env=env)
    content = "how long can you go"
    prompt = GenerationRequest(
        "r", "chat", "m", 1, messages=[{"role": "user", "content": content}]
    ).prompt_text()
    api = openai.AsyncOpenAI(base_url=f"{stack.base}/v1", api_key="unused", max_retries=0)
    out = await api.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": content}],
        extra_body={"ignore_eos": True},
    )
    assert out.usage is not None
    assert (out.choices[0].finish_reason, out.usage.completion_tokens) == (
        "length",
        900 - count_tokens(prompt),
    )
    # A budget the client sets beyond the context stays a 400, as vLLM answers it.
    with pytest.raises(openai.BadRequestError) as ei:
        await api.chat.completions.create(
            model=model, messages=[{"role": "user", "content": content}], max_tokens=2_000
        )
    assert ei.value.code == "context_length_exceeded"
