"""The content filter on the bus: the input stage and the worker's output scanning."""

from __future__ import annotations

from typing import Any

import pytest

from bus_schemas import errors as E
from engine_worker.backends.sim import expected_text
from engine_worker.worker import output_flags, output_scanner
from filter.policy import FilterPolicy
from filter.scanner import Scanner
from tests.conftest import NatsServer, stack
from tokenbus import Client

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
    scan = output_scanner({"actions": {"pii.email": "flag", "pii.card": "redact"}}, None)
    assert scan is not None
    assert output_flags(scan, "mail jane.roe@example.org card 4111 1111 1111 1111") == ["pii.email"]
    assert output_flags(scan, "") == []
    assert output_scanner(None, None) is None
