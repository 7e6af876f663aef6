"""End to end over HTTP: real processes (ingress, router, two workers, the bridge) on a real
nats-server, driven by the official openai SDK and httpx."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from engine_worker.backends.sim import expected_text
from tests.support.busdata import new_model
from tests.support.natsserver import NatsServer
from tests.support.procs import Procs, ProcStack, start_stack
from tests.support.waits import live_replicas, wait_for

pytestmark = pytest.mark.stack

MSG = [{"role": "user", "content": "hello there"}]
PROMPT = "<|user|>hello there\n"


@pytest.fixture(scope="module")
async def http_stack(
    nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ProcStack]:
    """One stack for the whole module: ingress, router, two workers, the bridge."""
    with Procs(nats_server.url, tmp_path_factory.mktemp("http-stack")) as ps:
        yield await start_stack(
            ps,
            new_model(),
            "ingress",
            "router",
            workers=2,
            worker_args=("--sim-prefill-ms", "5", "--sim-decode-ms", "2"),
            env={"TOKENBUS_BRIDGE__MAX_BODY_BYTES": "65536"},
        )


@pytest.fixture
async def oai(http_stack: ProcStack) -> AsyncIterator[openai.AsyncOpenAI]:
    async with http_stack.openai() as c:
        yield c


async def test_chat_streaming_with_the_openai_sdk(
    http_stack: ProcStack, oai: openai.AsyncOpenAI
) -> None:
    stream = await oai.chat.completions.create(
        model=http_stack.model,
        messages=MSG,
        max_tokens=12,
        seed=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, usage, roles = "", None, None, []
    async for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for ch in chunk.choices:
            if ch.delta.role:
                roles.append(ch.delta.role)
            text += ch.delta.content or ""
            finish = ch.finish_reason or finish
    assert text == expected_text(PROMPT, 12, seed=5)[0]
    assert finish == "length"
    assert roles == ["assistant"]
    assert usage is not None and usage.completion_tokens == 12
    assert usage.total_tokens == usage.prompt_tokens + 12


async def test_chat_whole_with_the_openai_sdk(
    http_stack: ProcStack, oai: openai.AsyncOpenAI
) -> None:
    full = expected_text(PROMPT, 30)[0]
    stop = " " + full.split(" ")[3]
    out = await oai.chat.completions.create(
        model=http_stack.model,
        messages=MSG,
        max_completion_tokens=30,
        stop=stop,
        temperature=0.2,
        top_p=0.9,
    )
    assert out.choices[0].message.content == full[: full.find(stop)]
    assert out.choices[0].finish_reason == "stop"
    assert out.usage is not None and out.usage.completion_tokens >= 3
    assert out.object == "chat.completion" and out.model == http_stack.model


async def test_text_completions_streaming_and_not(
    http_stack: ProcStack, oai: openai.AsyncOpenAI
) -> None:
    out = await oai.completions.create(model=http_stack.model, prompt="abc", max_tokens=6)
    assert out.choices[0].text == expected_text("abc", 6)[0]
    assert out.usage is not None and out.usage.completion_tokens == 6
    stream = await oai.completions.create(
        model=http_stack.model, prompt="abc", max_tokens=6, stream=True
    )
    text = "".join([c.choices[0].text async for c in stream if c.choices])
    assert text == expected_text("abc", 6)[0]


async def test_models_health_ready(http_stack: ProcStack, oai: openai.AsyncOpenAI) -> None:
    models = [m.id async for m in oai.models.list()]
    assert http_stack.model in models
    async with http_stack.http() as h:
        assert (await h.get("/health")).json() == {"status": "ok"}
        ready = (await h.get("/ready")).json()
        assert ready["status"] == "ready" and http_stack.model in ready["models"]
        metrics = (await h.get("/metrics")).text
        assert "tokenbus_bridge_requests_total" in metrics
        assert "process_resident_memory_bytes" in metrics


def _bad_cases(model: str) -> list[tuple[str, bytes | None, Any, int, str]]:
    ok = {"model": model, "messages": MSG}
    return [
        ("malformed json", b'{"model": "x", "messages": [', None, 400, "invalid_json"),
        ("not an object", b"[1, 2]", None, 400, "invalid_request"),
        ("wrong type", None, {**ok, "max_tokens": "lots"}, 400, "invalid_request"),
        ("wrong type messages", None, {"model": model, "messages": 5}, 400, "invalid_request"),
        ("empty messages", None, {"model": model, "messages": []}, 400, "invalid_request"),
        ("missing model", None, {"messages": MSG}, 400, "invalid_request"),
        ("n=0", None, {**ok, "n": 0}, 400, "invalid_request"),
        ("temperature", None, {**ok, "temperature": 9}, 400, "invalid_request"),
        ("unknown model", None, {**ok, "model": "no-such-model"}, 404, "model_not_found"),
        (
            "unknown model streaming",
            None,
            {**ok, "model": "nope", "stream": True},
            404,
            "model_not_found",
        ),
        (
            "oversized",
            b'{"model": "x", "messages": [{"role": "user", "content": "' + b"x" * 70_000 + b'"}]}',
            None,
            413,
            "payload_too_large",
        ),
    ]


async def test_bad_input_gets_openai_shaped_errors_and_everything_keeps_serving(
    http_stack: ProcStack,
) -> None:
    async with http_stack.http(timeout=30) as h:
        for name, raw, body, status, code in _bad_cases(http_stack.model):
            if raw is not None:
                r = await h.post(
                    "/v1/chat/completions",
                    content=raw,
                    headers={"Content-Type": "application/json"},
                )
            else:
                r = await h.post("/v1/chat/completions", json=body)
            assert r.status_code == status, (name, r.text)
            err = r.json()["error"]
            assert err["code"] == code, name
            assert err["message"] and "Traceback" not in err["message"], name
            assert set(err) == {"message", "type", "param", "code"}, name
        r = await h.post(
            "/v1/chat/completions",
            json={"model": http_stack.model, "messages": MSG, "max_tokens": 2},
        )
        assert r.status_code == 200
        r = await h.get("/v1/nowhere")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert http_stack.all_alive()


async def test_the_sdk_raises_its_own_typed_errors(
    http_stack: ProcStack, oai: openai.AsyncOpenAI
) -> None:
    with pytest.raises(openai.NotFoundError):
        await oai.chat.completions.create(model="no-such-model", messages=MSG)
    with pytest.raises(openai.BadRequestError):
        await oai.chat.completions.create(model=http_stack.model, messages=[])


async def test_client_disconnect_cancels_generation_on_the_worker(
    http_stack: ProcStack, nats_server: NatsServer
) -> None:
    async with http_stack.http(timeout=30) as h:
        body = {"model": http_stack.model, "messages": MSG, "max_tokens": 50_000, "stream": True}
        async with h.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.aiter_lines()  # kept open: the connection stays up
            async for line in lines:
                if line.startswith("data: ") and '"content":"' in line and '""' not in line:
                    break
            busy = await live_replicas(nats_server.url, http_stack.model)
            assert sum(hb["in_flight"] for hb in busy.values()) == 1
    # 50k tokens at 2 ms each would take 100 s; the abort frees the replica at once.
    for _ in range(50):
        live = await live_replicas(nats_server.url, http_stack.model, 0.3)
        if live and sum(hb["in_flight"] + hb["running"] for hb in live.values()) == 0:
            break
    else:
        raise AssertionError("the worker kept generating after the client left")


async def test_concurrent_streams_spread_over_both_workers(
    http_stack: ProcStack, oai: openai.AsyncOpenAI
) -> None:
    async def one() -> str:
        out = await oai.chat.completions.create(model=http_stack.model, messages=MSG, max_tokens=20)
        return out.choices[0].message.content or ""

    outs = await asyncio.gather(*(one() for _ in range(40)))
    assert all(o == expected_text(PROMPT, 20)[0] for o in outs)
    log = "".join(p.output() for p in http_stack.workers)
    served = {p.name: p.output().count('"event": "request"') for p in http_stack.workers}
    assert all(n > 0 for n in served.values()), served
    assert '"outcome": "length"' in log


def test_sse_wire_format_is_openais(http_stack: ProcStack) -> None:
    body = {
        "model": http_stack.model,
        "messages": MSG,
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.Client(base_url=http_stack.base) as h:
        r = h.post("/v1/chat/completions", json=body)
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [ln[6:] for ln in r.text.split("\n") if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    objs = [json.loads(e) for e in events[:-1]]
    assert all(o["object"] == "chat.completion.chunk" for o in objs)
    assert len({o["id"] for o in objs}) == 1
    assert objs[-1]["choices"] == [] and objs[-1]["usage"]["completion_tokens"] == 3
    assert objs[-2]["choices"][0]["finish_reason"] == "length"


async def test_logs_have_one_canonical_line_per_request_and_no_tracebacks(
    http_stack: ProcStack,
) -> None:
    # Requests of its own, answered 200, 400, 404 and 413 (the test does not lean on the
    # tests before it in the file having run on this stack).
    cases = {c[3]: c for c in _bad_cases(http_stack.model)}
    async with http_stack.http(timeout=30) as h:
        r = await h.post(
            "/v1/chat/completions",
            json={"model": http_stack.model, "messages": MSG, "max_tokens": 2},
        )
        assert r.status_code == 200, r.text
        for status, (_, raw, body, _, _) in cases.items():
            headers = {"Content-Type": "application/json"}
            r = await h.post("/v1/chat/completions", content=raw, json=body, headers=headers)
            assert r.status_code == status, r.text

    def bridge_lines() -> list[dict[str, Any]]:
        out = http_stack.bridge.output().splitlines()
        return [json.loads(ln) for ln in out if ln.startswith("{")]

    def statuses() -> set[int]:
        return {ln["status"] for ln in bridge_lines() if ln.get("event") == "request"}

    await wait_for(lambda: statuses() >= {200, 400, 404, 413}, what="the bridge's lines")

    def served() -> bool:  # the worker's line of the 200 (written as its stream ends)
        return any('"event": "request"' in w.output() for w in http_stack.workers)

    await wait_for(served, what="a worker's request line")
    for p in http_stack.procs.procs:
        out = p.output()
        assert "Traceback" not in out, p.name
    lines = [
        json.loads(ln)
        for p in http_stack.workers
        for ln in p.output().splitlines()
        if ln.startswith("{")
    ]
    reqs = [ln for ln in lines if ln.get("event") == "request"]
    assert reqs and all(
        {"request_id", "outcome", "duration_ms", "replica", "model"} <= set(r) for r in reqs
    )
    assert len({r["request_id"] for r in reqs}) == len(reqs)
    http_reqs = [ln for ln in bridge_lines() if ln.get("event") == "request"]
    assert {r["status"] for r in http_reqs} >= {200, 400, 404, 413}
    assert all({"request_id", "kind", "outcome", "duration_ms"} <= set(r) for r in http_reqs)


def test_log_files_exist(http_stack: ProcStack) -> None:
    assert all(Path(p.log).exists() for p in http_stack.procs.procs)


async def test_request_ids_from_clients_are_kept_only_when_plain(http_stack: ProcStack) -> None:
    body = {"model": http_stack.model, "messages": MSG, "max_tokens": 2}
    async with http_stack.http() as h:
        ok = await h.post("/v1/chat/completions", json=body, headers={"x-request-id": "abc-1.2"})
        assert ok.headers["x-request-id"] == "abc-1.2"
        odd = await h.post(
            "/v1/chat/completions",
            json=body,
            headers={"x-request-id": "no spaces allowed " + "x" * 200},
        )
        assert odd.status_code == 200
        assert odd.headers["x-request-id"] != "no spaces allowed " + "x" * 200
        assert len(odd.headers["x-request-id"]) == 32


async def test_the_bridge_refuses_what_no_replicas_context_holds_and_lists_the_context(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    with Procs(nats_server.url, tmp_path) as ps:
        s = await start_stack(
            ps,
            new_model(),
            "ingress",
            "router",
            worker_args=("--sim-prefill-ms", "1", "--sim-decode-ms", "1"),
            env={"TOKENBUS_WORKER__SIM__MAX_MODEL_LEN": "100"},
        )
        async with s.http() as h:
            # /v1/models says the context length, as vLLM's does (once the bridge has the
            # new replica's heartbeat: /ready may already hold from other tests' models).
            listed: dict[str, Any] = {}
            for _ in range(100):
                listed = {m["id"]: m for m in (await h.get("/v1/models")).json()["data"]}
                if s.model in listed:
                    break
                await asyncio.sleep(0.05)
            assert listed[s.model]["max_model_len"] == 100
        async with s.openai() as oai:
            for stream in (False, True):
                with pytest.raises(openai.BadRequestError) as ei:
                    await oai.chat.completions.create(
                        model=s.model, messages=MSG, max_tokens=10**12, stream=stream
                    )
                err = ei.value.body
                assert isinstance(err, dict)
                assert err["code"] == "context_length_exceeded", err
                assert err["param"] == "max_tokens"
                # Refused by the bridge, before the engine: the prompt was never counted.
                assert "maximum context length is 100 tokens" in err["message"]
                assert "in the completion alone" in err["message"]
            # Under the context but not with the prompt: the engine counts and refuses.
            with pytest.raises(openai.BadRequestError) as ei:
                await oai.chat.completions.create(model=s.model, messages=MSG, max_tokens=99)
            assert isinstance(ei.value.body, dict)
            assert "in the messages" in ei.value.body["message"]
            # What fits is served.
            out = await oai.chat.completions.create(model=s.model, messages=MSG, max_tokens=5)
            assert out.usage is not None and out.usage.completion_tokens == 5
