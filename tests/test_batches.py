"""The Files and Batch APIs (gateway/files_api.py, gateway/batches_api.py; their stores and
the runner in jobs/) with the official openai SDK, on a real nats-server with JetStream and real
processes: auth, ratelimit, filter, ingress, router, sim workers and the HTTP bridge (whose
processes run the lines).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import nats
import openai
import pytest
from nats.aio.client import Client as NATS
from nats.js.errors import NotFoundError

from bus_schemas import subjects
from jobs.background import EVENTS_STREAM
from jobs.batches import parse_input
from jobs.inprocess import BACKGROUND as BACKGROUND_KEY
from jobs.inprocess import RERUN as RERUN_KEY
from services.caller import MAX_MIGRATIONS
from tests.support.busdata import key_store, new_model
from tests.support.natsserver import NatsServer
from tests.support.ports import free_port
from tests.support.procs import Procs, ProcStack, start_stack
from tests.support.repo import run_cli
from tests.support.waits import wait_for

ENV = {
    "TOKENBUS_INGRESS__PIPELINE": '["auth", "ratelimit", "filter", "route"]',
    # A runner killed mid-line hands its lines on after 3 s (60 s by default).
    "TOKENBUS_BATCHES__ACK_WAIT_S": "3",
    "TOKENBUS_FILES__MAX_FILE_BYTES": "2000000",
    # What one key's files may hold at once (test_one_key_cannot_fill_the_file_store).
    "TOKENBUS_FILES__MAX_BYTES_PER_KEY": "3000000",
}


@dataclass
class Env:
    stack: ProcStack
    model: str
    key: str
    other: str
    procs: Procs


@pytest.fixture(scope="module")
async def env(
    nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Env]:
    async with key_store(nats_server.url) as keys:
        key, _ = await keys.create("batches-a")
        other, _ = await keys.create("batches-b")
    with Procs(nats_server.url, tmp_path_factory.mktemp("batches")) as ps:
        stack = await start_stack(
            ps,
            new_model(),
            "auth",
            "ratelimit",
            "filter",
            "ingress",
            "router",
            workers=2,
            worker_args=("--sim-prefill-ms", "2", "--sim-decode-ms", "1"),
            env=ENV,
        )
        yield Env(stack, stack.model, key, other, ps)


@pytest.fixture
async def oai(env: Env) -> AsyncIterator[openai.AsyncOpenAI]:
    async with env.stack.openai(env.key) as c:
        yield c


@pytest.fixture
async def other(env: Env) -> AsyncIterator[openai.AsyncOpenAI]:
    async with env.stack.openai(env.other) as c:
        yield c


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


def chat_line(model: str, cid: str, max_tokens: int = 5, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": cid,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": model,
            "messages": [{"role": "user", "content": f"hello {cid}"}],
            "max_tokens": max_tokens,
            **body,
        },
    }


async def wait_batch(
    oai: openai.AsyncOpenAI, batch_id: str, until: tuple[str, ...], timeout: float = 120.0
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        b = await oai.batches.retrieve(batch_id)
        if b.status in until:
            return b
        assert time.monotonic() < deadline, f"batch still {b.status}: {b.request_counts}"
        await asyncio.sleep(0.2)


async def lines_of(oai: openai.AsyncOpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    raw = (await oai.files.content(file_id)).read()
    return [json.loads(x) for x in raw.decode().splitlines() if x.strip()]


# -- files --------------------------------------------------------------------------------
@pytest.mark.stack
async def test_files_are_stored_listed_read_and_deleted_by_their_key_only(
    oai: openai.AsyncOpenAI, other: openai.AsyncOpenAI, env: Env
) -> None:
    data = jsonl([chat_line(env.model, "a")])
    f = await oai.files.create(file=("in.jsonl", data), purpose="batch")
    assert (f.object, f.bytes, f.filename, f.purpose) == ("file", len(data), "in.jsonl", "batch")
    assert f.id.startswith("file-") and f.expires_at and f.expires_at > f.created_at
    assert (await oai.files.retrieve(f.id)).id == f.id
    assert (await oai.files.content(f.id)).read() == data
    assert f.id in [x.id async for x in oai.files.list()]
    assert f.id in [x.id async for x in oai.files.list(purpose="batch")]
    # Another key: as if the file did not exist.
    for call in (
        other.files.retrieve(f.id),
        other.files.content(f.id),
        other.files.delete(f.id),
    ):
        with pytest.raises(openai.NotFoundError):
            await call
    assert f.id not in [x.id async for x in other.files.list()]
    assert (await oai.files.delete(f.id)).deleted
    with pytest.raises(openai.NotFoundError):
        await oai.files.retrieve(f.id)


@pytest.mark.stack
async def test_bad_uploads_are_clear_errors(oai: openai.AsyncOpenAI, env: Env) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        await oai.files.create(file=("x.jsonl", b"{}"), purpose="fine-tune")
    assert exc.value.body and "purpose" in str(exc.value.body)
    with pytest.raises(openai.APIStatusError) as too_big:
        await oai.files.create(file=("big.jsonl", b"x" * 2_100_000), purpose="batch")
    assert too_big.value.status_code == 413
    async with env.stack.http("/v1", headers={"Authorization": f"Bearer {env.key}"}) as h:
        r = await h.post("/files", json={"purpose": "batch"})
        assert r.status_code == 400 and "multipart" in r.json()["error"]["message"]
        r = await h.post("/files", files={"purpose": (None, "batch")})
        assert r.status_code == 400 and r.json()["error"]["param"] == "file"
    async with env.stack.http("/v1") as h:  # no key
        assert (await h.get("/files")).status_code == 401


@pytest.mark.stack
async def test_one_key_cannot_fill_the_file_store(
    nats_server: NatsServer, other: openai.AsyncOpenAI, env: Env
) -> None:
    """A tenant uploading file after file is refused past its share of the store (429
    insufficient_quota), over HTTP and over NATS alike; another key still uploads, and
    deleting a file makes room again."""
    from bus_schemas import errors as E
    from tokenbus import Client

    async with key_store(nats_server.url) as keys:
        hog, _ = await keys.create("batches-hog")
    big = b"x" * 1_900_000
    async with env.stack.openai(hog) as h:
        first = await h.files.create(file=("a.jsonl", big), purpose="batch")
        with pytest.raises(openai.RateLimitError) as exc:
            await h.files.create(file=("b.jsonl", big), purpose="batch")
        assert exc.value.code == "insufficient_quota" and "delete" in exc.value.message
        assert [f.id async for f in h.files.list()] == [first.id]
        async with await Client.connect(env.procs.url, api_key=hog) as tb:
            fits = await tb.files_create(b"y" * 900_000, "c.jsonl")  # 2.8 MB held
            with pytest.raises(E.InsufficientQuota):
                await tb.files_create(b"y" * 900_000, "d.jsonl")
            await tb.files_delete(fits["id"])
        # Another key is not charged for the hog's files.
        mine = await other.files.create(file=("c.jsonl", big), purpose="batch")
        await other.files.delete(mine.id)
        await h.files.delete(first.id)
        again = await h.files.create(file=("b.jsonl", big), purpose="batch")
        await h.files.delete(again.id)


# -- batches ------------------------------------------------------------------------------
@pytest.mark.stack
async def test_a_batch_of_200_lines_answers_each_good_line_once_and_each_bad_one_as_an_error(
    oai: openai.AsyncOpenAI, other: openai.AsyncOpenAI, env: Env
) -> None:
    good = [chat_line(env.model, f"c{i}") for i in range(180)]
    bad = [chat_line("no-such-model", f"m{i}") for i in range(10)]
    bad += [chat_line(env.model, f"t{i}", max_tokens=-1) for i in range(5)]
    bad += [{**chat_line(env.model, f"n{i}"), "body": {"model": env.model}} for i in range(5)]
    lines = good + bad
    lines = lines[::2] + lines[1::2]  # good and bad mixed
    f = await oai.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    b = await oai.batches.create(
        input_file_id=f.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "nightly"},
    )
    assert b.status == "validating" and b.metadata == {"job": "nightly"}
    done = await wait_batch(oai, b.id, ("completed", "failed"))
    assert done.status == "completed", done.errors
    counts = done.request_counts
    assert counts is not None and (counts.total, counts.completed, counts.failed) == (200, 180, 20)
    out = await lines_of(oai, done.output_file_id)
    assert sorted(x["custom_id"] for x in out) == sorted(x["custom_id"] for x in good)
    for x in out:
        assert x["response"]["status_code"] == 200 and x["error"] is None
        assert x["response"]["body"]["object"] == "chat.completion"
        assert x["response"]["body"]["choices"][0]["message"]["content"]
    errs = await lines_of(oai, done.error_file_id)
    assert sorted(x["custom_id"] for x in errs) == sorted(x["custom_id"] for x in bad)
    status = {x["custom_id"][0]: x["response"]["status_code"] for x in errs}
    assert status == {"m": 404, "t": 400, "n": 400}
    assert all(x["response"]["body"]["error"]["message"] for x in errs)
    assert b.id in [x.id async for x in oai.batches.list()]
    # Operators see every key's batches; the bridge's metrics count the lines.
    cli = {"TOKENBUS_NATS_URL": env.procs.url}
    listed = json.loads(run_cli("batches", "--json", env=cli, check=True).stdout)
    mine = next(x for x in listed if x["id"] == b.id)
    assert mine["status"] == "completed" and mine["owner"]
    shown = json.loads(run_cli("batches", "show", b.id, "--json", env=cli, check=True).stdout)
    assert shown["request_counts"] == {"total": 200, "completed": 180, "failed": 20}
    table = run_cli("batches", env=cli, check=True).stdout
    assert b.id in table and "180+20/200" in table
    async with env.stack.http() as h:
        text = (await h.get("/metrics")).text
    assert 'tokenbus_batch_lines_total{outcome="ok"}' in text
    ok = [
        ln for ln in text.splitlines() if ln.startswith('tokenbus_batch_lines_total{outcome="ok"}')
    ]
    assert float(ok[0].split()[-1]) >= 180
    # Another key sees none of it.
    assert b.id not in [x.id async for x in other.batches.list()]
    for call in (
        other.batches.retrieve(b.id),
        other.batches.cancel(b.id),
        other.files.content(done.output_file_id or ""),
    ):
        with pytest.raises(openai.NotFoundError):
            await call


@pytest.mark.stack
async def test_an_embeddings_batch(oai: openai.AsyncOpenAI, env: Env) -> None:
    lines = [
        {
            "custom_id": f"e{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": env.model, "input": f"text {i}"},
        }
        for i in range(30)
    ]
    lines.append(
        {"custom_id": "bad", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}
    )
    f = await oai.files.create(file=("emb.jsonl", jsonl(lines)), purpose="batch")
    b = await oai.batches.create(
        input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    done = await wait_batch(oai, b.id, ("completed", "failed"))
    out = await lines_of(oai, done.output_file_id)
    assert len(out) == 30 and {x["custom_id"] for x in out} == {f"e{i}" for i in range(30)}
    assert all(x["response"]["body"]["data"][0]["embedding"] for x in out)
    (err,) = await lines_of(oai, done.error_file_id)
    assert err["custom_id"] == "bad" and err["response"]["status_code"] == 400


@pytest.mark.stack
async def test_a_responses_batch_stores_its_responses_for_the_batch_key(
    oai: openai.AsyncOpenAI, other: openai.AsyncOpenAI, env: Env
) -> None:
    lines = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/responses",
            "body": {"model": env.model, "input": f"question {i}", "max_output_tokens": 64},
        }
        for i in range(3)
    ]
    f = await oai.files.create(file=("resp.jsonl", jsonl(lines)), purpose="batch")
    b = await oai.batches.create(
        input_file_id=f.id, endpoint="/v1/responses", completion_window="24h"
    )
    done = await wait_batch(oai, b.id, ("completed", "failed"))
    out = await lines_of(oai, done.output_file_id)
    assert sorted(x["custom_id"] for x in out) == ["r0", "r1", "r2"]
    body = out[0]["response"]["body"]
    assert body["object"] == "response" and body["status"] in ("completed", "incomplete")
    assert body["output"][0]["content"][0]["text"]
    # Stored as the batch key's own response, as if that key had sent it.
    assert (await oai.responses.retrieve(body["id"])).id == body["id"]
    with pytest.raises(openai.NotFoundError):
        await other.responses.retrieve(body["id"])


@pytest.mark.stack
async def test_a_malformed_file_fails_validation_with_its_line_numbers(
    oai: openai.AsyncOpenAI, env: Env
) -> None:
    ok = json.dumps(chat_line(env.model, "a"))
    text = "\n".join(
        [
            ok,
            "{not json",
            json.dumps({**chat_line(env.model, "b"), "url": "/v1/embeddings"}),
            json.dumps(chat_line(env.model, "c")),
            json.dumps(chat_line(env.model, "a")),  # custom_id a again
            json.dumps({**chat_line(env.model, "d"), "method": "GET"}),
        ]
    )
    f = await oai.files.create(file=("bad.jsonl", text.encode()), purpose="batch")
    b = await oai.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = await wait_batch(oai, b.id, ("failed", "completed"))
    assert done.status == "failed" and done.errors and done.errors.data
    got = {(e.line, e.code) for e in done.errors.data}
    assert got == {
        (2, "invalid_json_line"),
        (3, "mismatched_endpoint"),
        (5, "duplicate_custom_id"),
        (6, "invalid_value"),
    }
    assert done.output_file_id is None and done.failed_at


@pytest.mark.stack
async def test_bad_create_requests_are_clear_errors(oai: openai.AsyncOpenAI, env: Env) -> None:
    f = await oai.files.create(
        file=("in.jsonl", jsonl([chat_line(env.model, "a")])), purpose="batch"
    )
    with pytest.raises(openai.NotFoundError):
        await oai.batches.create(
            input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h"
        )
    for kw in (
        {"endpoint": "/v1/moderations", "completion_window": "24h"},
        {"endpoint": "/v1/chat/completions", "completion_window": "1h"},
    ):
        with pytest.raises(openai.BadRequestError):
            await oai.batches.create(input_file_id=f.id, **kw)  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError):
        await oai.batches.retrieve("batch_nope")


@pytest.mark.stack
async def test_a_cancelled_batch_stops_and_keeps_what_it_answered(
    oai: openai.AsyncOpenAI, env: Env
) -> None:
    lines = [chat_line(env.model, f"s{i}", max_tokens=2500, ignore_eos=True) for i in range(80)]
    f = await oai.files.create(file=("slow.jsonl", jsonl(lines)), purpose="batch")
    b = await oai.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    await wait_batch(oai, b.id, ("in_progress",))
    c = await oai.batches.cancel(b.id)
    assert c.status == "cancelling" and c.cancelling_at
    done = await wait_batch(oai, b.id, ("cancelled",), timeout=60)
    counts = done.request_counts
    assert counts is not None and counts.total == 80
    assert counts.completed + counts.failed < 80
    out = await lines_of(oai, done.output_file_id)
    assert len(out) == counts.completed
    with pytest.raises(openai.BadRequestError):
        await oai.batches.cancel(b.id)


@pytest.mark.unit
def test_input_lines_are_checked_one_by_one() -> None:
    ok = chat_line("m", "a")
    lines, errors = parse_input(jsonl([ok, {**ok, "custom_id": "b"}]), "/v1/chat/completions", 10)
    assert [x["custom_id"] for x in lines] == ["a", "b"] and not errors
    assert [x["line"] for x in lines] == [1, 2]
    _, errors = parse_input(b"\n\n", "/v1/chat/completions", 10)
    assert [e["code"] for e in errors] == ["empty_file"]
    _, errors = parse_input(b"\xff\xfe", "/v1/chat/completions", 10)
    assert [e["code"] for e in errors] == ["invalid_file"]
    many = jsonl([{**ok, "custom_id": str(i)} for i in range(11)])
    _, errors = parse_input(many, "/v1/chat/completions", 10)
    assert [e["code"] for e in errors] == ["too_many_lines"]
    _, errors = parse_input(jsonl([{**ok, "body": []}, [1]]), "/v1/chat/completions", 10)  # type: ignore[list-item]
    assert [(e["line"], e["param"]) for e in errors] == [(1, "body"), (2, None)]


@pytest.mark.stack
async def test_an_open_deployment_serves_files_to_anyone(procs: Procs) -> None:
    """Without auth in the pipeline files belong to nobody in particular (as stored
    responses do): any caller reads them."""
    stack = await start_stack(procs, new_model(), "ingress", "router", workers=1)
    async with stack.openai() as a, httpx.AsyncClient(base_url=f"{stack.base}/v1") as h:
        f = await a.files.create(file=("x.jsonl", b"{}\n"), purpose="batch")
        assert (await h.get(f"/files/{f.id}")).json()["id"] == f.id


@pytest.mark.stack
async def test_a_bridge_that_could_not_open_its_stores_serves_them_once_it_can(
    private_nats: NatsServer, tmp_path: Any
) -> None:
    """A bridge whose file and batch stores cannot be opened at its start (in the nemesis:
    their streams without a leader after two host crashes; here, another stream holding the
    batch queue's subjects) tries again until they open, instead of serving without files,
    batches and background responses for the rest of its life (the nemesis' background
    response left in_progress, seed 202)."""
    nc = await nats.connect(private_nats.url)
    js = nc.jetstream()
    await js.add_stream(name="IN_THE_WAY", subjects=[subjects.batch_work_wildcard()])
    try:
        with Procs(private_nats.url, tmp_path) as ps:
            web = free_port()
            bridge = ps.start("bridge", "serve", "bridge", "--port", str(web))
            await wait_for(
                lambda: "files_not_served_here" in bridge.output(),
                timeout=60,
                what="the bridge did not start without its stores",
            )
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{web}/v1") as h:
                upload = {"file": ("x.jsonl", b"{}\n"), "purpose": (None, "batch")}
                assert (await h.post("/files", files=upload)).status_code == 404
                await js.delete_stream("IN_THE_WAY")
                await wait_for(
                    lambda: "files_served_here" in bridge.output(),
                    timeout=60,
                    what="the stores were not opened again",
                )
                r = await h.post("/files", files=upload)
                assert r.status_code == 200, r.text
    finally:
        await nc.close()


# -- background responses --------------------------------------------------------------------
@pytest.mark.stack
async def test_a_background_response_is_queued_then_run_and_only_its_key_sees_it(
    oai: openai.AsyncOpenAI, other: openai.AsyncOpenAI, env: Env
) -> None:
    r = await oai.responses.create(
        model=env.model, input="tell me a story", background=True, max_output_tokens=64
    )
    assert r.status == "queued" and r.background is True and not r.output
    deadline = time.monotonic() + 60
    while r.status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, r.status
        await asyncio.sleep(0.1)
        r = await oai.responses.retrieve(r.id)
    assert r.status in ("completed", "incomplete") and r.output_text
    assert r.usage is not None and r.usage.output_tokens > 0
    with pytest.raises(openai.NotFoundError):
        await other.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        await other.responses.cancel(r.id)
    # A finished one is answered as it is; a response that was not in the background is
    # not cancellable.
    assert (await oai.responses.cancel(r.id)).status == r.status
    plain = await oai.responses.create(model=env.model, input="hi", max_output_tokens=4)
    with pytest.raises(openai.BadRequestError):
        await oai.responses.cancel(plain.id)
    with pytest.raises(openai.BadRequestError):
        await oai.responses.create(model=env.model, input="x", background=True, store=False)
    with pytest.raises(openai.NotFoundError):  # refused before it is queued
        await oai.responses.create(model="no-such-model", input="x", background=True)


@pytest.mark.stack
async def test_a_background_response_is_cancelled_mid_run(
    oai: openai.AsyncOpenAI, env: Env
) -> None:
    r = await oai.responses.create(
        model=env.model,
        input="a long one",
        background=True,
        max_output_tokens=20_000,
        extra_body={"ignore_eos": True},
    )
    deadline = time.monotonic() + 30
    while (r := await oai.responses.retrieve(r.id)).status != "in_progress":
        assert time.monotonic() < deadline, r.status
        await asyncio.sleep(0.05)
    c = await oai.responses.cancel(r.id)
    assert c.status == "cancelled"
    # Until the runner has stopped and written it down: it ends the response's kept events
    # with response.cancelled (after writing the record) once the generation has stopped.
    nc = await nats.connect(env.procs.url)
    try:
        deadline = time.monotonic() + 30
        while await last_event_type(nc, r.id) != "response.cancelled":
            assert time.monotonic() < deadline, "the runner never ended the cancelled response"
            await asyncio.sleep(0.05)
    finally:
        await nc.drain()
    assert (await oai.responses.retrieve(r.id)).status == "cancelled"


async def last_event_type(nc: NATS, response_id: str) -> str | None:
    """The type of the last event JetStream keeps for a background response (None: none)."""
    try:
        msg = await nc.jetstream().get_last_msg(EVENTS_STREAM, subjects.batch_events(response_id))
    except NotFoundError:
        return None
    kind = json.loads(msg.data or b"{}").get("type")
    return str(kind) if kind is not None else None


@pytest.mark.stack
async def test_a_background_stream_resumes_from_a_sequence_number(env: Env) -> None:
    """Streamed in the background: the client reads some events and goes; it comes back
    with ``starting_after`` and gets every later event, once, to the end."""
    body = {
        "model": env.model,
        "input": "stream me",
        "background": True,
        "stream": True,
        "max_output_tokens": 200,
    }
    first: list[dict[str, Any]] = []
    async with env.stack.http("/v1", headers={"Authorization": f"Bearer {env.key}"}) as h:
        async with h.stream("POST", "/responses", json=body, timeout=30) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    first.append(json.loads(line[6:]))
                    if len(first) == 6:
                        break  # the client goes away
        rid = first[0]["response"]["id"]
        last = first[-1]["sequence_number"]
        rest: list[dict[str, Any]] = []
        async with h.stream(
            "GET",
            f"/responses/{rid}",
            params={"stream": "true", "starting_after": last},
            timeout=60,
        ) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    rest.append(json.loads(line[6:]))
        final = (await h.get(f"/responses/{rid}")).json()
    seqs = [e["sequence_number"] for e in first + rest]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # none lost, none twice
    assert rest[-1]["type"] in ("response.completed", "response.incomplete")
    text = "".join(e["delta"] for e in first + rest if e["type"] == "response.output_text.delta")
    assert text and text == final["output"][0]["content"][0]["text"]
    # A response that did not run in the background keeps no events to replay.
    async with env.stack.http("/v1", headers={"Authorization": f"Bearer {env.key}"}) as h:
        plain = (
            await h.post("/responses", json={**body, "background": False, "stream": False})
        ).json()
        r = await h.get(f"/responses/{plain['id']}", params={"stream": "true"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream"


@pytest.mark.stack
async def test_a_nats_client_submits_and_collects_a_batch(env: Env) -> None:
    """The same through ingress over NATS (``Client.files_create``, ``batches_create``,
    ``wait_batch``, ``file_content``), the lines run by the bridges' runners; another key
    sees none of it; a file over the bus's max_payload is a clear error."""
    from bus_schemas import errors as E
    from tokenbus import Client

    lines = [chat_line(env.model, f"n{i}") for i in range(12)]
    async with await Client.connect(env.procs.url, api_key=env.key) as tb:
        f = await tb.files_create(jsonl(lines), "nats.jsonl")
        assert f["purpose"] == "batch" and (await tb.file(f["id"]))["bytes"] == len(jsonl(lines))
        b = await tb.batches_create(f["id"], "/v1/chat/completions", metadata={"via": "nats"})
        assert b["status"] == "validating" and b["id"] in [x["id"] for x in await tb.batches()]
        done = await tb.wait_batch(b["id"], timeout=60, poll_s=0.2)
        assert done["status"] == "completed", done
        out = [json.loads(x) for x in (await tb.file_content(done["output_file_id"])).splitlines()]
        assert sorted(x["custom_id"] for x in out) == sorted(x["custom_id"] for x in lines)
        # Another key, on a connection of its own (a request is answered only in the inbox
        # of the key it carries: docs/safety.md), sees none of it.
        async with await Client.connect(env.procs.url, api_key=env.other) as them:
            with pytest.raises(E.NotFound):
                await them.batch(b["id"])
            with pytest.raises(E.NotFound):
                await them.file_content(done["output_file_id"])
        with pytest.raises(E.InvalidRequest):
            await tb.batches_create(f["id"], "/v1/moderations")
        with pytest.raises(E.PayloadTooLarge):
            await tb.files_create(b"x" * (2 << 20), "big.jsonl")
        await tb.files_delete(f["id"])
        with pytest.raises(E.NotFound):
            await tb.file(f["id"])


@pytest.mark.stack
async def test_a_nats_client_runs_follows_resumes_and_cancels_background_responses(
    env: Env,
) -> None:
    """``Client.background_response`` through ingress, run by the bridges' runners: its
    events followed, left, and resumed after a sequence number with none lost or repeated;
    the same response over HTTP; another key sees and cancels none of it; a long one is
    cancelled mid-run; bad requests are clear errors."""
    from bus_schemas import errors as E
    from tokenbus import Client

    async with await Client.connect(env.procs.url, api_key=env.key) as tb:
        q = await tb.background_response(env.model, "tell me over nats", max_output_tokens=40)
        assert q["status"] == "queued" and q["background"] is True
        first: list[dict[str, Any]] = []
        async for ev in tb.response_events(q["id"], poll_s=0.1, timeout=60):
            first.append(ev)
            if len(first) == 5:
                break  # the client goes away
        last = first[-1]["sequence_number"]
        rest = [
            ev
            async for ev in tb.response_events(q["id"], starting_after=last, poll_s=0.1, timeout=60)
        ]
        seqs = [e["sequence_number"] for e in first + rest]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # none lost, none twice
        assert rest[-1]["type"] in ("response.completed", "response.incomplete")
        done = await tb.get_response(q["id"])
        deltas = [e["delta"] for e in first + rest if e["type"] == "response.output_text.delta"]
        assert deltas and "".join(deltas) == done["output"][0]["content"][0]["text"]
        # Each poll reads on from the cursor the last one returned, not from the first event.
        raw = tb._batches(None)
        whole = await raw.call("response_events", {"id": q["id"], "starting_after": -1})
        assert [e["sequence_number"] for e in whole["events"]] == list(range(seqs[-1] + 1))
        assert whole["ended"] and whole["cursor"] > 0
        more = {"id": q["id"], "starting_after": -1, "cursor": whole["cursor"]}
        again = await raw.call("response_events", more)
        assert again["events"] == [] and again["cursor"] == whole["cursor"]
        with pytest.raises(E.InvalidRequest):
            await raw.call("response_events", {**more, "cursor": "x"})
        async with env.stack.openai(env.key) as oai:  # one store for NATS and HTTP
            assert (await oai.responses.retrieve(q["id"])).status == done["status"]
        async with await Client.connect(env.procs.url, api_key=env.other) as them:
            with pytest.raises(E.NotFound):
                await them.get_response(q["id"])
            with pytest.raises(E.NotFound):
                await them.response_cancel(q["id"])
        assert (await tb.response_cancel(q["id"]))["status"] == done["status"]  # as it is

        long = await tb.background_response(
            env.model, "a long one", max_output_tokens=20_000, ignore_eos=True
        )
        deadline = time.monotonic() + 30
        while (await tb.get_response(long["id"]))["status"] != "in_progress":
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        assert (await tb.response_cancel(long["id"]))["status"] == "cancelled"
        ends = [ev async for ev in tb.response_events(long["id"], poll_s=0.1, timeout=30)]
        assert ends[-1]["type"] == "response.cancelled"
        assert (await tb.get_response(long["id"]))["status"] == "cancelled"

        with pytest.raises(E.InvalidRequest):  # refused by the client, before sending
            await tb.background_response(env.model, "x", max_output_tokens=-1)
        with pytest.raises(E.InvalidRequest):  # refused by ingress: a background one is kept
            await tb.background_response(env.model, "x", store=False)
        with pytest.raises(E.NotFound):
            await tb.get_response("resp_" + "0" * 32)
        plain = await tb.response(env.model, "not in the background", max_output_tokens=4)
        with pytest.raises(E.InvalidRequest):  # keeps no events, cannot be cancelled
            await tb.response_cancel(plain["id"])


async def jetstream_ready(nc: NATS, timeout: float = 20) -> None:
    """Until the server just started answers JetStream's API."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            await nc.jetstream(timeout=1).account_info()
            return
        except Exception:  # not enabled yet, or no answer yet
            assert time.monotonic() < deadline, "JetStream never answered"
            await asyncio.sleep(0.05)


@pytest.mark.bus
async def test_a_fresh_store_lists_no_batch_and_its_runner_sweeps_quietly(tmp_path: Any) -> None:
    """On a bus where no batch was ever made (``make up``'s first minutes), listing and the
    runners' sweep find nothing, without an error (nats-py raises for an empty bucket)."""
    from jobs.batches import BatchStore
    from services.config import BatchSettings
    from tests.support.natsserver import NatsServer

    srv = NatsServer(tmp_path).start()
    try:
        nc = await nats.connect(srv.url)
        await jetstream_ready(nc)
        store = await BatchStore(nc, BatchSettings(), 3600).open()
        assert await store.all() == []
        assert await store.owned("") == [] and await store.owned("k1") == []
        await nc.close()
    finally:
        srv.stop()


@pytest.mark.bus
async def test_a_keys_listing_reads_its_index_which_a_store_from_before_gets_filled(
    tmp_path: Any,
) -> None:
    """A key's batches are listed from the owner index (another key's are not in it); a
    store made before the index existed has it filled from the records when opened."""
    from jobs.batches import BY_OWNER, BatchStore, new_batch
    from services.config import BatchSettings
    from tests.support.natsserver import NatsServer

    srv = NatsServer(tmp_path).start()
    try:
        nc = await nats.connect(srv.url)
        await jetstream_ready(nc)
        store = await BatchStore(nc, BatchSettings(), 3600).open()
        made: dict[str, list[str]] = {"k1": [], "k2": [], "": []}
        for i in range(7):
            owner = ("k1", "k2", "")[i % 3]
            b = new_batch("/v1/chat/completions", f"file-{i}", "24h", None)
            await store.create({"owner": owner, "batch": b, "total": 0})
            made[owner].append(b["id"])
        for owner, ids in made.items():
            assert sorted(b["id"] for b in await store.owned(owner)) == sorted(ids)
        assert await store.owned("k3") == []
        await nc.jetstream().delete_key_value(BY_OWNER)  # as before the index
        again = await BatchStore(nc, BatchSettings(), 3600).open()
        for owner, ids in made.items():
            assert sorted(b["id"] for b in await again.owned(owner)) == sorted(ids)
        await nc.close()
    finally:
        srv.stop()


@pytest.mark.bus
async def test_a_background_run_whose_end_was_not_stored_is_not_settled(tmp_path: Any) -> None:
    """The runner's work is settled (acknowledged) only once the response's record says it
    ended: the app answers 200 even when it could not write the end over the record (its
    ``store: false``), and then the response would stay ``in_progress`` for good (found by
    the nemesis run: JetStream stalled past the write's patience). Such a run goes back to
    the queue; one whose end is stored is settled."""
    from dialects import responses as R
    from jobs.background import Background
    from jobs.batches import BatchStore
    from jobs.response_store import open_store
    from services.config import BatchSettings, ResponsesSettings

    srv = NatsServer(tmp_path).start()
    try:
        nc = await nats.connect(srv.url)
        await jetstream_ready(nc)
        store = await BatchStore(nc, BatchSettings(), 3600).open()
        responses = await open_store(nc, ResponsesSettings())
        writes: list[str] = []
        calls: list[str] = []
        runs: list[tuple[bytes, int]] = []

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            """The gateway's Responses API as the runner sees it: events, a 200, and the
            end written over the record only while ``writes`` allows it."""
            rid = scope[BACKGROUND_KEY]
            calls.append(rid)
            # Every run under one request id; a run after one that was lost is numbered
            # after the attempts that run could have made.
            runs.append((dict(scope["headers"])[b"x-request-id"], scope[RERUN_KEY].first))
            rec = await responses.get(rid, "k1")
            rec["response"]["status"] = "completed"
            if writes and writes.pop(0) == "store":
                assert await responses.replace(rid, rec)
            await send({"type": "http.response.start", "status": 200, "headers": []})
            ev = {"type": "response.completed", "response": rec["response"], "sequence_number": 0}
            body = f"event: response.completed\ndata: {json.dumps(ev)}\n\n".encode()
            await send({"type": "http.response.body", "body": body, "more_body": False})

        bg = await Background(nc, store, responses, app, lambda chat: None).open(600)
        req = R.parse({"model": "m", "input": "hi", "background": True})
        queued = await bg.queue(req, {"model": "m", "input": "hi", "background": True}, "k1", None)
        work = {"batch": queued["id"], "owner": "k1", "body": {"model": "m", "input": "hi"}}
        writes.append("lost")  # the write of its end did not happen
        assert await bg.run(work) is False
        assert (await responses.get(queued["id"], "k1"))["response"]["status"] == "in_progress"
        writes.append("store")  # run again: this time it is kept
        assert await bg.run(work) is True
        assert (await responses.get(queued["id"], "k1"))["response"]["status"] == "completed"
        assert await bg.run(work) is True  # a repeat of settled work runs nothing
        assert writes == [] and calls == [queued["id"]] * 2
        assert runs[0][0] == runs[1][0] and [n for _, n in runs] == [0, MAX_MIGRATIONS + 1]
        await nc.close()
    finally:
        srv.stop()


@pytest.mark.bus
async def test_a_line_given_again_after_its_answer_was_written_is_not_run_again(
    tmp_path: Any,
) -> None:
    """A runner that died after writing a line's answer, before acknowledging the line,
    leaves it to be given to another runner: that one finds the answer and settles the line
    without running it (nor paying for it) again. A line given again without an answer runs."""
    from types import SimpleNamespace

    from jobs.batch_runner import BatchRunner
    from jobs.batches import BatchStore, new_batch
    from services.config import BatchSettings

    srv = NatsServer(tmp_path).start()
    try:
        nc = await nats.connect(srv.url)
        await jetstream_ready(nc)
        store = await BatchStore(nc, BatchSettings(), 3600).open()
        batch = new_batch("/v1/chat/completions", "file-x", "24h", None)
        batch["status"] = "in_progress"
        await store.create({"batch": batch, "owner": "k1"})
        ran: list[str] = []

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            ran.append(dict(scope["headers"])[b"x-request-id"].decode())
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}", "more_body": False})

        runner = BatchRunner(nc, store, None, app, BatchSettings())  # type: ignore[arg-type]

        def line(n: int) -> dict[str, Any]:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            url = "/v1/chat/completions"
            return {"batch": batch["id"], "n": n, "custom_id": f"c{n}", "url": url, "body": body}

        def given(times: int) -> Any:
            return SimpleNamespace(metadata=SimpleNamespace(num_delivered=times))

        answer = {"custom_id": "c0", "response": {"status_code": 200}, "n": 0}
        assert await store.record_result(batch["id"], 0, answer)
        assert await runner._line(batch["id"], line(0), given(2)) is True
        assert ran == []  # answered before: settled, not run
        assert await runner._line(batch["id"], line(1), given(2)) is True
        assert len(ran) == 1 and await store.answered(batch["id"], 1)
        await nc.close()
    finally:
        srv.stop()


# -- files as inputs --------------------------------------------------------------------------
PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 32


@pytest.mark.stack
async def test_a_request_names_its_keys_files_by_id_and_no_other_keys(
    oai: openai.AsyncOpenAI, other: openai.AsyncOpenAI, env: Env
) -> None:
    """A chat ``file`` part, a Responses ``input_file`` and ``input_image``, and an Anthropic
    ``document`` block name files of the key's own ``/v1/files`` by id: served. Another
    key's file is a 404 (as ``GET /v1/files/{id}`` answers it); a file that is not an image
    in an image part, a 400 naming the part; an id of nothing, a 404."""
    doc = await oai.files.create(file=("notes.txt", b"remember the milk"), purpose="user_data")
    img = await oai.files.create(file=("pic.png", PNG), purpose="vision")
    assert (doc.purpose, img.purpose) == ("user_data", "vision")
    part = {"type": "file", "file": {"file_id": doc.id}}
    msgs: Any = [{"role": "user", "content": [part, {"type": "text", "text": "and?"}]}]
    out = await oai.chat.completions.create(model=env.model, messages=msgs, max_tokens=3)
    assert out.choices[0].message.content
    content: Any = [
        {"type": "input_file", "file_id": doc.id},
        {"type": "input_image", "file_id": img.id},
        {"type": "input_text", "text": "what are these?"},
    ]
    r = await oai.responses.create(
        model=env.model, input=[{"role": "user", "content": content}], max_output_tokens=3
    )
    assert r.status in ("completed", "incomplete") and r.output_text
    with pytest.raises(openai.NotFoundError):
        await other.chat.completions.create(model=env.model, messages=msgs, max_tokens=3)
    with pytest.raises(openai.NotFoundError):
        await other.responses.create(
            model=env.model, input=[{"role": "user", "content": content}], max_output_tokens=3
        )
    bad: Any = [{"type": "input_image", "file_id": doc.id}]
    with pytest.raises(openai.BadRequestError) as ei:
        await oai.responses.create(model=env.model, input=[{"role": "user", "content": bad}])
    assert "not an image" in str(ei.value) and "input.0.content.0.file_id" in str(ei.value)
    gone: Any = [{"role": "user", "content": [{"type": "file", "file": {"file_id": "file-x"}}]}]
    with pytest.raises(openai.NotFoundError):
        await oai.chat.completions.create(model=env.model, messages=gone, max_tokens=3)
    async with httpx.AsyncClient(base_url=env.stack.base, timeout=30) as h:
        block = {"type": "document", "source": {"type": "file", "file_id": doc.id}}
        body = {
            "model": env.model,
            "max_tokens": 3,
            "messages": [{"role": "user", "content": [block, {"type": "text", "text": "hm"}]}],
        }
        r2 = await h.post("/v1/messages", json=body, headers={"x-api-key": env.key})
        assert r2.status_code == 200, r2.text
        r2 = await h.post("/v1/messages", json=body, headers={"x-api-key": env.other})
        assert r2.status_code == 404, r2.text
