"""The content filter on the bus: the input stage and the worker's output scanning."""

from __future__ import annotations

import json
from typing import Any

import pytest

from bus_schemas import errors as E
from engine_worker.backends.sim import expected_text
from filter.output_gate import output_flags, output_scanner
from filter.policy import FilterPolicy
from filter.scanner import Scanner
from tests.support.inprocess import stack
from tests.support.natsserver import NatsServer
from tokenbus import Client

pytestmark = pytest.mark.bus

AWS = "AKIA" + "IOSFODNN7EXAMPLE"


def _filter(policy: str, **policies: dict[str, Any]) -> dict[str, Any]:
    return {"filter": {"default_policy": policy, "policies": policies}}


async def test_blocked_input_is_400_naming_the_detector_not_the_text(
    nats_server: NatsServer, model: str, client: Client
) -> None:
    async with stack(nats_server.url, model, workers=1, filters=2, **_filter("strict")):
        with pytest.raises(E.ContentBlocked) as ei:
            await client.chat_completion(model, [{"role": "user", "content": f"my key {AWS}"}])
        err = ei.value
        assert err.status == 400
        assert err.to_dict()["code"] == "content_blocked.secret.aws_access_key"
        assert AWS not in err.message and AWS not in str(err.to_dict())
        ok = await client.chat_completion(
            model, [{"role": "user", "content": "hello"}], max_tokens=2
        )
        assert ok.usage.completion_tokens == 2


async def test_redacted_input_reaches_the_engine_redacted(
    nats_server: NatsServer, model: str, client: Client
) -> None:
    text = "write to jane.roe@example.org please"
    async with stack(nats_server.url, model, workers=1, filters=1, **_filter("strict")):
        out = await client.chat_completion(model, [{"role": "user", "content": text}], max_tokens=8)
    redacted = Scanner(FilterPolicy.strict()).scan(text).redacted_text
    assert "jane.roe" not in redacted
    # The sim's text is a function of the prompt it saw: it saw the redacted one.
    assert out.text == expected_text(f"<|user|>{redacted}\n", 8)[0]
    assert out.text != expected_text(f"<|user|>{text}\n", 8)[0]


async def test_off_policy_passes_everything(
    nats_server: NatsServer, model: str, client: Client
) -> None:
    async with stack(nats_server.url, model, workers=1, filters=1, **_filter("off")):
        out = await client.chat_completion(
            model, [{"role": "user", "content": f"k {AWS}"}], max_tokens=3
        )
    assert out.text == expected_text(f"<|user|>k {AWS}\n", 3)[0]


def _word_in_output(prompt: str, n: int) -> str:
    return expected_text(prompt, n)[0].split(" ")[6]


def _blocklisted_word(prompt: str, n: int, action: str) -> tuple[str, dict[str, Any]]:
    """A word of the sim's answer to ``prompt``, and a policy that blocklists it with ``action``."""
    word = _word_in_output(prompt, n)
    return word, {"blocklist": [word], "actions": {"blocklist": action}}


async def test_output_is_redacted_as_it_streams(
    nats_server: NatsServer, model: str, client: Client
) -> None:
    prompt = "<|user|>tell me\n"
    word, policy = _blocklisted_word(prompt, 30, "redact")
    async with stack(nats_server.url, model, workers=1, filters=1, **_filter("t", t=policy)):
        s = client.chat(model, [{"role": "user", "content": "tell me"}], max_tokens=30)
        chunks = [ch async for ch in s]
    text = "".join(ch.text for ch in chunks)
    full = expected_text(prompt, 30)[0]
    assert word not in text.split(" ")
    assert text == Scanner(FilterPolicy.from_dict(policy)).scan(full).redacted_text
    assert s.finish_reason == "length" and len(chunks) > 3  # still streamed, not one lump
    assert s.usage is not None and s.usage.completion_tokens == 30


async def test_blocked_output_ends_the_stream_with_content_filter(
    nats_server: NatsServer, model: str, client: Client
) -> None:
    prompt = "<|user|>tell me\n"
    word, policy = _blocklisted_word(prompt, 40, "block")
    async with stack(
        nats_server.url, model, workers=1, filters=1, **_filter("t", t=policy)
    ) as svcs:
        s = client.chat(model, [{"role": "user", "content": "tell me"}], max_tokens=40)
        text = "".join([ch.text async for ch in s])
        assert s.finish_reason == "content_filter"
        assert word not in text.split(" ")
        assert expected_text(prompt, 40)[0].startswith(text.rstrip())
        assert svcs["workers"][0].in_flight == 0


async def test_output_filter_does_not_hold_the_first_word_for_a_flag(
    nats_server: NatsServer, model: str, client: Client
) -> None:
    # The default policy only flags ordinary-looking words (e-mails, entropy, injection), so
    # the worker releases each token as it comes: the first chunk is the first token alone,
    # not held until the next one shows the word has ended.
    prompt = "<|user|>tell me\n"
    first = expected_text(prompt, 1)[0]
    async with stack(nats_server.url, model, workers=1, filters=1, **_filter("default")):
        s = client.chat(model, [{"role": "user", "content": "tell me"}], max_tokens=6)
        chunks = [ch.text async for ch in s]
    assert chunks[0] == first
    assert "".join(chunks) == expected_text(prompt, 6)[0]


def test_output_flags_names_flagged_detectors_only() -> None:
    policy = FilterPolicy.from_dict({"actions": {"pii.email": "flag", "pii.card": "redact"}})
    scan = output_scanner(policy, None)
    assert scan is not None
    assert output_flags(scan, "mail jane.roe@example.org card 4111 1111 1111 1111") == ["pii.email"]
    assert output_flags(scan, "") == []
    assert output_scanner(None, None) is None


# -- every text a client sends, and every text the engine returns -----------------------------
async def test_input_filter_scans_parts_tool_arguments_and_tool_results(
    nats_server: NatsServer, model: str, client: Client
) -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,QUtJQQ=="}}
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": ""}}
    hiding_places: list[list[dict[str, Any]]] = [
        [{"role": "user", "content": [image, {"type": "text", "text": f"key {AWS}"}]}],
        [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "tool_calls": [
                    {**call, "function": {"name": "f", "arguments": f'{{"k":"{AWS}"}}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        ],
        [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": AWS}]},
        ],
        [  # a custom tool's call: its input is free text
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "c2", "type": "custom", "custom": {"name": "sh", "input": f"cat {AWS}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "c2", "content": "ok"},
        ],
    ]
    async with stack(nats_server.url, model, workers=1, filters=1, **_filter("strict")):
        for messages in hiding_places:
            with pytest.raises(E.ContentBlocked):
                await client.chat_completion(model, messages, max_tokens=2)
        # An image part is not text: its base64 is not scanned (it counts toward body size).
        ok = await client.chat_completion(
            model, [{"role": "user", "content": [image, {"type": "text", "text": "hi"}]}]
        )
        assert ok.text
        with pytest.raises(E.ContentBlocked):
            await client.embeddings(model, ["fine", f"key {AWS}"])
        # Tool descriptions are rendered into the prompt by chat templates: scanned too.
        tool = {"type": "function", "function": {"name": "f", "description": f"use {AWS}"}}
        with pytest.raises(E.ContentBlocked):
            await client.chat_completion(model, [{"role": "user", "content": "hi"}], tools=[tool])
        reasoning = {"role": "assistant", "content": "ok", "reasoning_content": AWS}
        with pytest.raises(E.ContentBlocked):
            await client.chat_completion(model, [{"role": "user", "content": "hi"}, reasoning])


def _tool_with(word: str) -> dict[str, Any]:
    """A tool whose only argument the sim fills with ``word``."""
    params = {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": [word]}},
        "required": ["city"],
    }
    return {"type": "function", "function": {"name": "visit", "parameters": params}}


async def test_output_filter_covers_tool_call_arguments(
    nats_server: NatsServer, model: str, client: Client
) -> None:
    ask = [{"role": "user", "content": "go"}]
    redact = {"blocklist": ["atlantis"], "actions": {"blocklist": "redact"}}
    block = {"blocklist": ["atlantis"], "actions": {"blocklist": "block"}}
    filters = {"filter": {"default_policy": "r", "policies": {"r": redact, "b": block}}}
    async with stack(nats_server.url, model, workers=1, filters=1, **filters):
        out = await client.chat_completion(
            model, ask, tools=[_tool_with("atlantis")], logprobs=True
        )
        assert out.finish_reason == "tool_calls" and out.tool_calls is not None
        args = out.tool_calls[0]["function"]["arguments"]
        assert "atlantis" not in args and "REDACTED" in args
        # The logprobs of the arguments' tokens would spell out what was redacted.
        assert out.logprobs is None
        clean = await client.chat_completion(model, ask, tools=[_tool_with("rome")], logprobs=True)
        assert clean.logprobs is not None and clean.tool_calls is not None
    async with stack(
        nats_server.url,
        model,
        workers=1,
        filters=1,
        filter={"default_policy": "b", "policies": {"b": block}},
    ):
        out = await client.chat_completion(model, ask, tools=[_tool_with("atlantis")])
        assert out.finish_reason == "content_filter"
        assert out.tool_calls is None
        fine = await client.chat_completion(model, ask, tools=[_tool_with("rome")])
        assert fine.tool_calls is not None
        assert json.loads(fine.tool_calls[0]["function"]["arguments"]) == {"city": "rome"}


async def test_logprobs_are_withheld_when_the_filter_changed_the_text(
    nats_server: NatsServer, model: str, client: Client
) -> None:
    prompt = "<|user|>tell me\n"
    word, policy = _blocklisted_word(prompt, 20, "redact")
    ask = [{"role": "user", "content": "tell me"}]
    async with stack(nats_server.url, model, workers=1, filters=1, **_filter("t", t=policy)):
        changed = await client.chat_completion(model, ask, max_tokens=20, logprobs=True)
        assert word not in changed.text.split(" ")
        # Their tokens would show the redacted word: none are sent.
        assert changed.logprobs is None
        clean = await client.chat_completion(model, ask, max_tokens=5, logprobs=True)
        assert clean.text == expected_text(prompt, 5)[0]
        assert clean.logprobs is not None
        assert "".join(t["token"] for t in clean.logprobs["content"]) == clean.text
