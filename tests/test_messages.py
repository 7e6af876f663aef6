"""Anthropic's Messages API (``/v1/messages``) end to end: real processes on a real bus (the
full pipeline, keys checked), driven by the official ``anthropic`` SDK and the tokenbus NATS
client; and the translation (:mod:`dialects.messages`) on its own.

One stack for the module: a sim worker (exact, deterministic answers), an ``openai``-backend
worker in front of the fake upstream (to see what reached the engine, and reasoning), the
auth / ratelimit / filter / ingress / router services (the NATS path) and the bridge.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import anthropic
import pytest

from engine_worker.backends.base import GenerationRequest
from engine_worker.backends.sim import count_tokens, expected_text
from tests.conftest import (
    NatsServer,
    Procs,
    ProcStack,
    Upstream,
    key_store,
    new_model,
    start_stack,
    start_worker,
    wait_replicas,
)

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
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Upstream]:
    up = Upstream(tmp_path_factory.mktemp("upstream"))
    try:
        yield up
    finally:
        up.stop()


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
