"""The bridge's OpenAPI document, and schemathesis fuzzing the live bridge from it.

Requests are generated from ``GET /openapi.json`` (valid ones and, in negative mode, ones
that break the schema) and sent to a real stack: nats-server, ingress, the safety stages,
the router, a sim worker and the bridge, all real processes. Every answer must be no 5xx,
match the documented status, content type and response schema (SSE events included), and
every 4xx body must be OpenAI's error with exactly message/type/param/code. Afterwards
every process must still be alive and serving.

``TOKENBUS_FUZZ_EXAMPLES`` sets the examples per operation of the fuzzing phase (200 by
default, about 25 s on 2 cores; ``make fuzz`` raises it), ``TOKENBUS_FUZZ_SEED`` replays a
run; see docs/fuzzing.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import zlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import schemathesis
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from bus_schemas import errors as E
from gateway import openapi
from tests.support.busdata import key_store
from tests.support.fuzzstack import FuzzStack, open_fuzz_stack
from tests.support.natsserver import NatsServer
from tokenbus.client import Client

pytestmark = pytest.mark.stack

# Examples per operation in schemathesis' fuzzing phase (its examples and coverage phases
# add their own, deterministic, cases), and the run's seed (printed, to replay it).
EXAMPLES = int(os.environ.get("TOKENBUS_FUZZ_EXAMPLES") or 200)
# One seed for the whole run, in every pytest-xdist worker (each imports this module itself):
# the files that split an operation's cases (tests/support/fuzzstack.py's ``in_shard``) must
# generate the same ones. xdist gives its workers one run id.
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID")
SEED = int(
    os.environ.get("TOKENBUS_FUZZ_SEED")
    or (zlib.crc32(_RUN.encode()) if _RUN else random.getrandbits(32))
)


@pytest.fixture(scope="module")
async def fuzz_stack(
    nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[FuzzStack]:
    env = {
        "TOKENBUS_BRIDGE__MAX_BODY_BYTES": "65536",
        "TOKENBUS_BRIDGE__BODY_TIMEOUT_S": "2",
        # A small context bounds every generation (conftest's default is unbounded): a valid
        # max_tokens of 10**9 is refused, as vLLM refuses it, instead of running for ever,
        # and an answer without max_tokens is a short one.
        "TOKENBUS_WORKER__SIM__MAX_MODEL_LEN": "256",
        "TOKENBUS_INGRESS__DEFAULT_MAX_TOKENS": "16",
        # No batch work here (a generated `background: true` is refused with a 400 naming
        # it): background responses left running by one example would slow the next ones
        # past their timeouts. tests/test_batches.py covers them.
        "TOKENBUS_BATCHES__ENABLED": "false",
    }
    # No concurrency limit to run out of: requests the engine refuses leak their slot
    # (test_a_request_the_engine_refuses_frees_its_concurrency_slot), and a long
    # `make fuzz` sends thousands of them.
    async with open_fuzz_stack(
        nats_server.url,
        tmp_path_factory.mktemp("fuzz-openapi"),
        env,
        ("--sim-prefill-ms", "0.2", "--sim-decode-ms", "0.2"),
        rpm=10**6,
        tpm=10**12,
        max_concurrent=10**6,
    ) as fs:
        yield fs


def fuzz_config(stack: FuzzStack, mode: str, examples: int, **more: Any) -> Any:
    """schemathesis' configuration of a run against ``stack``: the seed, a valid key on
    every request, ``examples`` per operation in ``mode`` (``all``, ``positive``), no
    stateful phase; ``more`` adds settings."""
    print(f"schemathesis: {examples} examples, TOKENBUS_FUZZ_SEED={SEED} replays this run")
    return schemathesis.Config.from_dict(
        {
            "seed": SEED,
            "headers": {"Authorization": f"Bearer {stack.key}"},
            "request-timeout": 30,
            "suppress-health-check": ["all"],
            "generation": {"mode": mode, "max-examples": examples},
            "phases": {"stateful": {"enabled": False}},
            # Reproductions show the body as sent (schemathesis would hide every field
            # named like "*token*", max_tokens included), the key still hidden.
            "output": {
                "sanitization": {
                    "keys-to-sanitize": ["authorization", "api-key"],
                    "sensitive-markers": ["authorization"],
                }
            },
            **more,
        }
    )


@pytest.fixture(scope="module")
def api_schema(fuzz_stack: FuzzStack) -> Any:
    """The live document, with the fuzzing configuration and a valid key on every request."""
    # Negative cases of an operation with a path parameter and the api-key header make
    # schemathesis 4.32's own header mutation draw differently on replay (hypothesis
    # FlakyStrategyDefinition, inside schemathesis): those operations get valid-shaped
    # requests only (ids, queries and keys of any value still).
    positive = {
        "include-path-regex": "^/v1/responses/",
        "generation": {"mode": "positive", "max-examples": EXAMPLES},
    }
    config = fuzz_config(fuzz_stack, "all", EXAMPLES, operations=[positive])
    return schemathesis.openapi.from_url(f"{fuzz_stack.base}/openapi.json", config=config)


def openai_error_shape(ctx: Any, response: Any, case: Any) -> None:
    """Every 4xx/5xx body is OpenAI's error object, with exactly its four fields."""
    if response.status_code < 400:
        return
    body = json.loads(response.content)
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert "Traceback" not in err["message"], err


# Not schemathesis' positive_data_acceptance / negative_data_rejection: the validators check
# more than a schema says (a cross-field rule, the content filter, the model's context), and
# pydantic's lax mode takes "5" for an integer 5, so neither holds by design.
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    openai_error_shape,
]

# schemathesis (4.32) names each operation's subtest by assigning the test item's `_nodeid`,
# which pytest 9.2 no longer has; give it one that reads the node id and ignores the rename.
if not hasattr(pytest.Item, "_nodeid"):
    pytest.Item._nodeid = property(lambda self: self.nodeid, lambda self, _: None)  # type: ignore[attr-defined]

schema = schemathesis.pytest.from_fixture("api_schema")


def _with_served_model(case: Any, model: str) -> None:
    """Send most generated bodies to the served model, so they get past the model lookup
    and reach the stages and the worker; which ones is a function of the body, so a failure
    replays. The rest keep their generated model (mostly a 404)."""
    body = case.body
    if isinstance(body, dict) and isinstance(body.get("model"), str):
        digest = zlib.crc32(json.dumps(body, sort_keys=True, default=str).encode())
        if digest % 4:
            body["model"] = model


# Every operation's examples in one test (subtests): bounded by their count, not by a wait,
# so the suite's 120 s is no hang guard for it. The Responses API's operations are
# tests/test_fuzz_openapi_responses.py's, chat completions tests/test_fuzz_openapi_chat.py's
# and completions tests/test_fuzz_openapi_completions.py's, each with a stack of its own:
# together they were one file of 98 s of a worker's time, over the 90 s one file may take
# (docs/testing.md), and without the Responses operations still 210 s in the whole suite.
RESPONSES = "^/v1/responses"
CHAT = "^/v1/chat/completions$"
COMPLETIONS = "^/v1/completions$"


@pytest.mark.timeout(600)
@schema.exclude(path_regex=f"{RESPONSES}|{CHAT}|{COMPLETIONS}").parametrize()
def test_the_bridge_keeps_its_openapi_contract(case: Any, fuzz_stack: FuzzStack) -> None:
    keeps_its_contract(case, fuzz_stack)


def keeps_its_contract(case: Any, fuzz_stack: FuzzStack) -> None:
    _with_served_model(case, fuzz_stack.model)
    case.call_and_validate(checks=CHECKS, timeout=30)


# -- the event streams, checked against the document --------------------------------------
STREAMED = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"prompt": "hi"},
}


@pytest.mark.parametrize("path", list(STREAMED))
def test_a_streamed_answer_matches_the_documented_events(
    api_schema: Any, fuzz_stack: FuzzStack, path: str
) -> None:
    body = {
        **STREAMED[path],
        "model": fuzz_stack.model,
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    case = api_schema[path]["POST"].Case(body=body, media_type="application/json")
    r = httpx.post(
        fuzz_stack.base + path,
        json=body,
        headers={"Authorization": f"Bearer {fuzz_stack.key}"},
        timeout=30,
    )
    assert r.headers["content-type"] == "text/event-stream"
    assert r.text.endswith("data: [DONE]\n\n")
    case.validate_response(r, checks=[response_schema_conformance, openai_error_shape])
    # The check has teeth: an event with a field the document does not name fails it.
    first, sep, rest = r.text.partition("\n\n")
    event = json.loads(first.removeprefix("data: "))
    event["surprise"] = 1
    forged = httpx.Response(
        200,
        headers={"content-type": "text/event-stream"},
        content=f"data: {json.dumps(event)}{sep}{rest}".encode(),
        request=r.request,
    )
    forged.elapsed = r.elapsed
    with pytest.raises(schemathesis.errors.FailureGroup) as failed:
        case.validate_response(forged, checks=[response_schema_conformance])
    # The forged event, the first, is the one that fails (the real stream passed above).
    assert "SSE event violates schema\n\nEvent #0:" in str(failed.value.exceptions[0])


def test_a_streamed_response_matches_the_documented_events(
    api_schema: Any, fuzz_stack: FuzzStack
) -> None:
    body = {"model": fuzz_stack.model, "input": "hi", "max_output_tokens": 4, "stream": True}
    case = api_schema["/v1/responses"]["POST"].Case(body=body, media_type="application/json")
    r = httpx.post(
        fuzz_stack.base + "/v1/responses",
        json=body,
        headers={"Authorization": f"Bearer {fuzz_stack.key}"},
        timeout=30,
    )
    assert r.headers["content-type"] == "text/event-stream"
    events = [e for e in r.text.split("\n\n") if e]
    assert events[0].startswith("event: response.created\n")
    # four tokens: incomplete (max_output_tokens), unless the sim ended first
    assert events[-1].startswith(("event: response.completed\n", "event: response.incomplete\n"))
    case.validate_response(r, checks=[response_schema_conformance, openai_error_shape])
    # An event without its number fails the check.
    head, _, data = events[0].partition("\ndata: ")
    event = json.loads(data)
    del event["sequence_number"]
    forged = httpx.Response(
        200,
        headers={"content-type": "text/event-stream"},
        content=(
            "\n\n".join([f"{head}\ndata: {json.dumps(event)}", *events[1:]]) + "\n\n"
        ).encode(),
        request=r.request,
    )
    forged.elapsed = r.elapsed
    with pytest.raises(schemathesis.errors.FailureGroup):
        case.validate_response(forged, checks=[response_schema_conformance])


# -- the document ---------------------------------------------------------------------------
def test_openapi_json_is_served_and_names_the_requests_and_paths(fuzz_stack: FuzzStack) -> None:
    r = httpx.get(f"{fuzz_stack.base}/openapi.json", timeout=10)
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/json"
    doc = r.json()
    assert doc["openapi"].startswith("3.1")
    schemas = doc["components"]["schemas"]
    for name in ("ChatCompletionRequest", "CompletionRequest", "EmbeddingRequest"):
        assert name in schemas
        # Fields tokenbus does not act on are carried to the engine.
        assert schemas[name]["additionalProperties"] is True
    assert {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/responses",
        "/v1/responses/{response_id}",
        "/v1/responses/{response_id}/input_items",
        "/v1/models",
        "/health",
        "/ready",
        "/openapi.json",
    } <= set(doc["paths"])
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatCompletionRequest"
    }
    assert set(chat["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert doc["components"]["securitySchemes"]["bearerAuth"]["scheme"] == "bearer"
    assert doc == openapi.document()


def test_every_error_status_is_documented() -> None:
    doc = openapi.document()
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"):
        responses = doc["paths"][path]["post"]["responses"]
        assert {str(s) for s in openapi.STATUSES} <= set(responses), path
    # Each has its own words, not just the standard phrase.
    assert set(openapi.STATUSES) <= set(openapi.ERRORS)
    assert 408 in openapi.STATUSES and 503 in openapi.STATUSES


def test_the_document_is_valid_openapi() -> None:
    schemathesis.openapi.from_dict(openapi.document()).validate()


# -- regressions: what the fuzzing found, kept as plain tests -------------------------------
# A prompt longer than the model's context (256 tokens here): admitted by the rate limiter,
# then refused by the engine before it starts (400 context_length_exceeded). Found by the
# fuzzing above (its key ran out of concurrency slots after some thousand examples).
TOO_LONG = {"messages": [{"role": "user", "content": " ".join(["word"] * 400)}], "max_tokens": 2}


async def test_a_request_the_engine_refuses_frees_its_concurrency_slot(
    fuzz_stack: FuzzStack, nats_server: NatsServer
) -> None:
    async with key_store(nats_server.url, watch=False) as keys:
        key, _ = await keys.create("two-at-once", rpm=10**6, tpm=10**12, max_concurrent=2)
    auth = {"Authorization": f"Bearer {key}"}
    hi = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with httpx.AsyncClient(base_url=fuzz_stack.base, timeout=30) as h:
        for _ in range(50):  # until the bridge has seen the new key
            r = await h.post(
                "/v1/chat/completions", json={"model": fuzz_stack.model, **hi}, headers=auth
            )
            if r.status_code != 401:
                break
            await asyncio.sleep(0.1)
        assert r.status_code == 200, r.text
        for _ in range(2):
            r = await h.post(
                "/v1/chat/completions", json={"model": fuzz_stack.model, **TOO_LONG}, headers=auth
            )
            assert r.status_code == 400, r.text
            assert r.json()["error"]["code"] == "context_length_exceeded"
        # Nothing is running for this key now: a third request must be served.
        r = await h.post(
            "/v1/chat/completions", json={"model": fuzz_stack.model, **hi}, headers=auth
        )
    assert r.status_code == 200, r.text
    # The same over NATS, through the stage services: the router ends the refused request
    # (the engine's refusal came back in its ack) and gives the slot back.
    async with await Client.connect(nats_server.url) as c:
        for _ in range(3):
            with pytest.raises(E.ContextLengthExceeded):
                await c.chat_completion(
                    fuzz_stack.model, TOO_LONG["messages"], max_tokens=2, api_key=key
                )
        out = await c.chat_completion(fuzz_stack.model, hi["messages"], max_tokens=2, api_key=key)
        assert out.usage.completion_tokens == 2


# -- after the fuzzing ----------------------------------------------------------------------
def test_everything_still_serves_after_the_fuzzing(fuzz_stack: FuzzStack) -> None:
    still_serving(fuzz_stack)


def still_serving(fuzz_stack: FuzzStack) -> None:
    """Every process alive and serving, no traceback in any log, the key in none."""
    fuzz_stack.assert_serving()
    for p in fuzz_stack.procs.procs:
        assert "Traceback" not in p.output(), p.name
        assert fuzz_stack.key not in p.output(), p.name


def contract_tests(path_regex: str) -> tuple[Any, Any]:
    """The contract test over the operations ``path_regex`` names, and the check that the
    stack still serves after it: what a file that fuzzes some of the operations on a stack
    of its own runs (tests/test_fuzz_openapi_chat.py and the others beside this one)."""

    @pytest.mark.timeout(600)
    @schema.include(path_regex=path_regex).parametrize()
    def contract(case: Any, fuzz_stack: FuzzStack) -> None:
        keeps_its_contract(case, fuzz_stack)

    def serving(fuzz_stack: FuzzStack) -> None:
        still_serving(fuzz_stack)

    return contract, serving
