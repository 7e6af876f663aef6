"""Conformance with OpenAI's own published OpenAPI document.

The document is openai/openai-openapi's, vendored in ``tests/data/openai-openapi/`` (cut
to the operations tokenbus serves by the script beside it; its README names the commit).
schemathesis generates *valid* requests from it (positive mode: the document's examples,
its coverage phase's boundary values, then hypothesis) for every operation tokenbus serves
(chat, completions, embeddings, models, and the Responses API's create, get, delete and
input items) and sends them to a real stack: tests/test_fuzz_openapi.py's (conftest's
``open_fuzz_stack``: every stage, a sim worker with a 256 token context). Every answer must:

* be no 5xx;
* be a 2xx, unless its error is one of :data:`REFUSALS`: a feature tokenbus does not serve,
  what the deployment bounds, what the document says in words only, or a request that
  contradicts itself (each named in docs/openai-api.md);
* match the document's response schema, each event of a stream included (read as OpenAI
  means it: :func:`as_meant`);
* when it is an error, be OpenAI's error object.

``TOKENBUS_FUZZ_EXAMPLES`` sets the examples (an eighth of it per operation of the fuzzing
phase: 50 by default, about a minute on 2 cores), ``TOKENBUS_FUZZ_SEED`` replays a run; see
docs/fuzzing.md.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import pytest
import schemathesis
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import content_type_conformance, response_schema_conformance

from gateway import openapi
from gateway.openapi import sse_event
from tests.support.fuzzstack import FuzzStack, in_shard
from tests.test_fuzz_openapi import fuzz_config, fuzz_stack, openai_error_shape

# The stack the bridge's own contract is fuzzed against (module-scoped: one for this file).
__all__ = ["fuzz_stack"]

ROOT = Path(__file__).resolve().parent.parent
DOC = Path(__file__).parent / "data" / "openai-openapi" / "openapi.json"
EXAMPLES = max(1, int(os.environ.get("TOKENBUS_FUZZ_EXAMPLES") or 400) // 8)


class Refusal(NamedTuple):
    """An error a valid request may get: a pattern its whole ``param`` matches (None: any)
    and one its message holds; ``doc`` is how docs/openai-api.md names it."""

    param: str | None
    message: str
    doc: str


# Features tokenbus does not serve.
NOT_SERVED = [
    Refusal("prompt", r"a token id prompt cannot be read", "refuses what it cannot read"),
    Refusal(
        "prompt",
        r"token id -?\d+ is (past|not in) the model's vocabulary",
        "ids past its vocabulary",
    ),
    Refusal("conversation", r"the Conversations API is not served", "`conversation`"),
    Refusal("context_management", r"compaction is not served", "`context_management`"),
    Refusal("prompt", r"prompt templates are not served", "prompt templates"),
    Refusal(
        "background",
        r"(a background response is kept|background responses are not served here)",
        "`background: true` with `store: false`, or without JetStream",
    ),
    Refusal("truncation", r"'auto' .* is not served", '`truncation: "auto"`'),
    Refusal(
        r"tools\.\d+(\.tools\.\d+)?\.type",
        r"not served by tokenbus: only function tools",
        "built-in tools",
    ),
    Refusal("tool_choice.type", r"is not served: only function tools are", "built-in tools"),
    Refusal(
        r"input\.\d+\.type",
        r"(input item type .* is not|item references are not) served",
        "input items other than",
    ),
    Refusal(r".*\.type", r"the content part type .* is not served", "content parts other than"),
    Refusal(r".*\.(image_url|file_data)", r"an input_(image|file) needs", "an image part needs"),
    Refusal(
        "stream",
        r"only a background response's events are kept to replay",
        "`stream=true` on a response that did not run in the background",
    ),
]
# What the deployment or the model bounds (here: a 64 KiB body, a 256 token context).
BOUNDED = [
    Refusal(None, r"the integer does not fit in 64 bits", "beyond 64 bits"),
    Refusal(None, r"^the request body is larger than", "`bridge.max_body_bytes`"),
    Refusal(None, r"maximum context length is", "context"),
    Refusal("dimensions", r"(less than or equal to 65536|must be an integer from 1)", "dimensions"),
    Refusal("input", r"the sim embeds at most", "dimensions"),
    Refusal("n", r"choices of \d+ prompts is \d+ answers", "`n` times the prompts"),
]
# What the document says in words, not in its schema.
IN_WORDS = [
    Refusal(
        r"(.*\.)?name",
        r"(at least 1 character|should match pattern|needs a name of 1-64)",
        "names of functions and formats",
    ),
    Refusal(
        r"logit_bias(\..*)?", r"(token ids|(greater|less) than or equal to -?100)", "`logit_bias`"
    ),
    Refusal("limit", r"^limit: must be an integer from 1 to 100", "`limit`"),
]
# Requests that contradict themselves or ask for nothing.
INCONSISTENT = [
    Refusal(
        r"tool_choice.*",
        r"(which is not in tools|'required' needs|allows none of)",
        "`tool_choice`",
    ),
    Refusal("top_logprobs", r"needs logprobs: true", "`top_logprobs`"),
    Refusal("input", r"the conversation is empty", "nothing to answer"),
    Refusal("input", r"inputs? must not be empty", "nothing to answer"),
    Refusal("prompt", r"the list holds no prompt", "nothing to answer"),
    Refusal(r"max_(completion_)?tokens", r"greater than or equal to 1", "nothing to answer"),
    Refusal("after", r"^after: no item", "`after`"),
    Refusal(r".*file_id", r"no file with id .* among this key's files", "a `file_id` of no"),
    Refusal(None, r"not a Responses API field", "chat fields sent to `/v1/responses`"),
]
# tokenbus's own extension fields, which OpenAI's document leaves to any value: a request that
# sets one malformed (a fuzzer's extra field named so) is refused, naming it.
EXTENSIONS = [
    Refusal(r"resume(\..*)?", r"^resume", "`resume` (where a moved request continues"),
]
REFUSALS = NOT_SERVED + BOUNDED + IN_WORDS + INCONSISTENT + EXTENSIONS


def refused_on_purpose(err: dict[str, Any]) -> bool:
    """Whether an OpenAI error object is one of :data:`REFUSALS`."""
    param = err.get("param")
    # DOTALL: a fuzzed key may hold a newline, and a param names the key it is under.
    return any(
        (r.param is None or (param is not None and re.fullmatch(r.param, param, re.DOTALL)))
        and re.search(r.message, err["message"])
        for r in REFUSALS
    )


def _no_bare_discriminator(node: dict[str, Any]) -> dict[str, Any]:
    disc = node.get("discriminator")
    if isinstance(disc, dict) and not disc.get("mapping"):
        del node["discriminator"]
    return node


def as_meant(text: str) -> dict[str, Any]:
    """The vendored document (the file stays as OpenAI wrote it), read as OpenAI means it
    where OpenAPI, and so schemathesis, reads it otherwise, plus two answers OpenAI gives
    that it does not describe:

    * A ``discriminator`` without a ``mapping`` names each branch by its schema's name in
      OpenAPI; OpenAI means the ``type`` value each branch already pins (an input item of
      ``type: message`` is no ``InputMessageResource``). They are dropped: ``oneOf`` and the
      branches' own ``type`` still decide.
    * An event stream's ``schema`` is, in OpenAPI 3.1, one event (``{event, data}``);
      OpenAI gives the schema of each event's JSON ``data``. It becomes that, beside
      ``[DONE]`` and an error event (OpenAI's error object, which a stream that fails after
      its headers ends with).
    * ``/completions`` streams (``stream: true``), as OpenAI's API does, but the document
      describes no stream: its events are ``CreateCompletionResponse`` objects whose
      ``finish_reason`` is null until a choice ends, as OpenAI sends them.
    * An embedding asked with ``encoding_format: base64`` is a base64 string (OpenAI's
      answer, and the openai SDK's default); the document allows only the list of floats.
    """
    doc: dict[str, Any] = json.loads(text, object_hook=_no_bare_discriminator)
    schemas = doc["components"]["schemas"]
    chunk = json.loads(json.dumps(schemas["CreateCompletionResponse"]))
    choice = chunk["properties"]["choices"]["items"]["properties"]
    choice["finish_reason"] = {"anyOf": [choice["finish_reason"], {"type": "null"}]}
    schemas["CreateCompletionStreamResponse"] = chunk
    ok = doc["paths"]["/completions"]["post"]["responses"]["200"]["content"]
    ok["text/event-stream"] = {
        "schema": {"$ref": "#/components/schemas/CreateCompletionStreamResponse"}
    }
    error = {"type": "object", "required": ["error"], "properties": {"error": {"type": "object"}}}
    for item in doc["paths"].values():
        for op in item.values():
            for answer in (op.get("responses") or {}).values() if isinstance(op, dict) else ():
                media = (answer.get("content") or {}).get("text/event-stream")
                if media is None:
                    continue
                media["schema"] = sse_event({"anyOf": [media["schema"], error]})
    vector = schemas["Embedding"]["properties"]["embedding"]
    schemas["Embedding"]["properties"]["embedding"] = {
        "anyOf": [vector, {"type": "string", "contentEncoding": "base64"}]
    }
    return doc


@pytest.fixture(scope="module")
def openai_schema(fuzz_stack: FuzzStack) -> Any:
    """OpenAI's document (:func:`as_meant`) against the stack, valid requests only."""
    config = fuzz_config(fuzz_stack, "positive", EXAMPLES, **{"base-url": f"{fuzz_stack.base}/v1"})
    return schemathesis.openapi.from_dict(as_meant(DOC.read_text()), config=config)


def served_or_refused_on_purpose(ctx: Any, response: Any, case: Any) -> None:
    """A valid request is served, or refused for one of :data:`REFUSALS`."""
    if response.status_code < 400:
        return
    err = json.loads(response.content)["error"]
    assert refused_on_purpose(err), f"a valid request was refused: {response.status_code} {err}"


def answer_conforms(ctx: Any, response: Any, case: Any) -> None:
    """A served answer has a documented content type and matches the document's schema
    (errors are not in OpenAI's document; :func:`openai_error_shape` checks them)."""
    if response.status_code < 400:
        content_type_conformance(ctx, response, case)
        response_schema_conformance(ctx, response, case)


CHECKS = [not_a_server_error, served_or_refused_on_purpose, answer_conforms, openai_error_shape]

# As in tests/test_fuzz_openapi.py: schemathesis 4.32 names subtests through `_nodeid`.
if not hasattr(pytest.Item, "_nodeid"):
    pytest.Item._nodeid = property(lambda self: self.nodeid, lambda self, _: None)  # type: ignore[attr-defined]

schema = schemathesis.pytest.from_fixture("openai_schema")

SERVED_ITEMS = {"message", "function_call", "function_call_output", "reasoning"}


def _served_only(body: dict[str, Any]) -> None:
    """Drop from a Responses body the features tokenbus does not serve (NOT_SERVED), so
    that the body reaches the engine (and ``background``: served, but answered queued,
    tests/test_batches.py)."""
    for name in ("conversation", "context_management", "prompt"):
        body.pop(name, None)
    if body.get("background") is True:
        del body["background"]
    if body.get("truncation") == "auto":
        del body["truncation"]
    if isinstance(body.get("tools"), list):
        body["tools"] = [
            t for t in body["tools"] if isinstance(t, dict) and t.get("type") == "function"
        ]
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") not in ("function", "allowed_tools"):
        del body["tool_choice"]
    if isinstance(body.get("input"), list):
        body["input"] = [
            i
            for i in body["input"]
            if isinstance(i, dict) and i.get("type", "message") in SERVED_ITEMS
        ]


def _new_response(stack: FuzzStack) -> str:
    r = httpx.post(
        f"{stack.base}/v1/responses",
        json={"model": stack.model, "input": "hi", "max_output_tokens": 4},
        headers={"Authorization": f"Bearer {stack.key}"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    rid: str = r.json()["id"]
    return rid


@pytest.fixture(scope="module")
def stored(fuzz_stack: FuzzStack) -> str:
    """A stored response of the stack's key."""
    return _new_response(fuzz_stack)


# Every operation's examples in one test (subtests): bounded by their count, not by a wait,
# so the suite's 120 s is no hang guard for it. Creating a response, the operation with the
# most cases (most of the coverage phase's bodies), is tests/test_conformance_openapi_responses
# .py's, _2.py's and _3.py's (a third of its cases each), each with a
# stack of its own: together they were one file of 127 s of a worker's time, over the 90 s one
# file may take (docs/testing.md), and creating a response alone took 184 s in the whole
# suite.
RESPONSES = "^/responses$"


@pytest.mark.stack
@pytest.mark.timeout(600)
@schema.exclude(path_regex=RESPONSES).parametrize()
def test_openai_s_valid_requests_are_served_as_openai_documents(
    case: Any, fuzz_stack: FuzzStack, stored: str
) -> None:
    served_as_documented(case, fuzz_stack, stored)


def creation_shard(shard: int, shards: int) -> Any:
    """The conformance test of creating a response over the ``shard``'s (0-based) part of
    its cases of ``shards`` (``in_shard``): tests/test_conformance_openapi_responses.py and
    the two beside it each run one, with a stack of their own."""

    @pytest.mark.stack
    @pytest.mark.timeout(600)
    @schema.include(path_regex=RESPONSES).parametrize()
    def test(case: Any, fuzz_stack: FuzzStack, stored: str) -> None:
        if in_shard(case, shard, shards):
            served_as_documented(case, fuzz_stack, stored)

    return test


def served_as_documented(case: Any, fuzz_stack: FuzzStack, stored: str) -> None:
    # Every body names the served model (a Responses request may leave it out in the
    # document, for a prompt template's). Seven in eight Responses bodies lose the features
    # tokenbus does not serve, so they reach the engine (the eighth checks their refusal;
    # which ones is a function of the body, so a failure replays). Ids name stored
    # responses of the key: one for reading, a fresh one for each delete.
    body = case.body
    if isinstance(body, dict):
        body["model"] = fuzz_stack.model
        if case.path == "/responses":
            if zlib.crc32(json.dumps(body, sort_keys=True, default=str).encode()) % 8:
                _served_only(body)
                if body.get("input") == []:  # nothing left: continue the stored one
                    body["previous_response_id"] = stored
            if body.get("previous_response_id") is not None:
                body["previous_response_id"] = stored
    if case.path_parameters and "response_id" in case.path_parameters:
        fresh = case.method == "DELETE"
        case.path_parameters["response_id"] = _new_response(fuzz_stack) if fresh else stored
    case.call_and_validate(checks=CHECKS, timeout=30)


# -- streams, each checked against the document --------------------------------------------
def _post(stack: FuzzStack, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{stack.base}/v1{path}",
        json={"model": stack.model, **body},
        headers={"Authorization": f"Bearer {stack.key}"},
        timeout=30,
    )


def _conforms(openai_schema: Any, path: str, body: dict[str, Any], r: httpx.Response) -> None:
    case = openai_schema[path]["POST"].Case(body=body, media_type="application/json")
    case.validate_response(r, checks=[content_type_conformance, response_schema_conformance])


def _events(r: httpx.Response) -> list[Any]:
    data = [e.partition("data: ")[2] for e in r.text.split("\n\n") if e]
    return [json.loads(d) for d in data if d != "[DONE]"]


STREAMED = {
    "/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "/completions": {"prompt": ["one", "two", "three"], "max_tokens": 3},
    "/responses": {"input": "hi", "max_output_tokens": 4},
}


@pytest.mark.stack
@pytest.mark.parametrize("path", list(STREAMED))
def test_a_stream_matches_the_documented_events(
    openai_schema: Any, fuzz_stack: FuzzStack, path: str
) -> None:
    body: dict[str, Any] = {**STREAMED[path], "stream": True}
    if path != "/responses":
        body["stream_options"] = {"include_usage": True}
    r = _post(fuzz_stack, path, body)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "text/event-stream"
    _conforms(openai_schema, path, body, r)
    if path == "/completions":  # one choice per prompt, each closed once
        events = _events(r)
        ends = [c["index"] for e in events for c in e["choices"] if c["finish_reason"]]
        assert sorted(ends) == [0, 1, 2]
        assert events[-1]["usage"]["completion_tokens"] == 9
    # The check has teeth: a first event with a field the document does not name fails.
    head, sep, rest = r.text.partition("\n\n")
    lines = head.split("\n")
    event = json.loads(lines[-1].removeprefix("data: "))
    event["choices" if path != "/responses" else "response"] = "not this"
    lines[-1] = f"data: {json.dumps(event)}"
    forged = httpx.Response(
        200,
        headers={"content-type": "text/event-stream"},
        content=("\n".join(lines) + sep + rest).encode(),
        request=r.request,
    )
    forged.elapsed = r.elapsed
    with pytest.raises(schemathesis.errors.FailureGroup):
        _conforms(openai_schema, path, body, forged)


@pytest.mark.stack
def test_whole_answers_match_the_document(openai_schema: Any, fuzz_stack: FuzzStack) -> None:
    """One answer of each kind the fuzzing reaches only by chance: several prompts, none of
    the output, logprobs, a stored response read back, its input items, its deletion."""
    for path, body in (
        ("/completions", {"prompt": ["a", "b"], "max_tokens": 2, "echo": True}),
        ("/completions", {"prompt": "a b", "max_tokens": 0, "echo": True}),
        ("/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True}),
        ("/embeddings", {"input": ["a", "b"], "encoding_format": "base64"}),
    ):
        r = _post(fuzz_stack, path, body)
        assert r.status_code == 200, r.text
        _conforms(openai_schema, path, body, r)
    rid = _new_response(fuzz_stack)
    auth = {"Authorization": f"Bearer {fuzz_stack.key}"}
    for method, path in (
        ("GET", "/responses/{response_id}"),
        ("GET", "/responses/{response_id}/input_items"),
        ("DELETE", "/responses/{response_id}"),
    ):
        url = f"{fuzz_stack.base}/v1{path.format(response_id=rid)}"
        r = httpx.request(method, url, headers=auth, timeout=30)
        assert r.status_code == 200, r.text
        case = openai_schema[path][method].Case(path_parameters={"response_id": rid})
        case.validate_response(r, checks=[content_type_conformance, response_schema_conformance])


# -- the vendored document and the documented refusals -------------------------------------
@pytest.mark.unit
def test_the_vendored_document_is_the_pinned_cut() -> None:
    """What the README pins, and every operation tokenbus serves is in it."""
    readme = (DOC.parent / "README.md").read_text()
    assert re.search(r"\b[0-9a-f]{40}\b", readme)
    assert (DOC.parent / "LICENSE").read_text().startswith("The MIT License")
    doc = json.loads(DOC.read_text())
    assert doc["info"]["version"] == "2.3.0"
    served = {(p, m) for p, item in doc["paths"].items() for m in item if m != "parameters"}
    # The bridge's own document lists what it serves; OpenAI's API is what is below /v1.
    ours = openapi.document()["paths"]
    assert served == {
        (p.removeprefix("/v1"), m) for p, item in ours.items() if p.startswith("/v1/") for m in item
    }


@pytest.mark.unit
def test_every_refusal_is_documented() -> None:
    text = (ROOT / "docs" / "openai-api.md").read_text()
    section = text.partition("## What a valid request may still be refused")[2]
    section = " ".join(section.partition("\n## ")[0].split())  # as read, lines joined
    assert section
    for r in REFUSALS:
        assert r.doc in section, r


@pytest.mark.unit
def test_the_refusals_have_teeth() -> None:
    msg = "prompt: token id 70000 is past the model's vocabulary (65536 tokens)"
    assert refused_on_purpose({"param": "prompt", "message": msg})
    assert not refused_on_purpose({"param": "top_p", "message": "top_p: must be > 0"})
    assert not refused_on_purpose({"param": "prompt.x", "message": msg})
