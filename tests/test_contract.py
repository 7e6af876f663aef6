"""The bus contract: subjects, codec, errors, frames, exported schemas."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from bus_schemas import codec, frames, subjects
from bus_schemas import errors as E
from bus_schemas.export import SCHEMA_DIR, render, schemas
from bus_schemas.messages import (
    ChatCompletionRequest,
    ChunkFrame,
    CompletionRequest,
    FinalFrame,
    Heartbeat,
)
from bus_schemas.side_outputs import GENERATION, SIDE_OUTPUTS, WIRE_KEYS
from gateway.validation import envelope

pytestmark = pytest.mark.unit


def test_exported_schemas_match_the_models() -> None:
    current = schemas()
    on_disk = {p.stem for p in SCHEMA_DIR.glob("*.json")}
    assert on_disk == set(current), "run `python -m bus_schemas.export`"
    for name, schema in current.items():
        assert (SCHEMA_DIR / f"{name}.json").read_text() == render(schema), (
            f"{name}.json is stale: run `python -m bus_schemas.export`"
        )


def test_every_exported_model_has_described_fields() -> None:
    for name, schema in schemas().items():
        assert schema.get("description"), f"{name} has no docstring"


@pytest.mark.parametrize("name", ["llama-3.1-8b", "org/model.v2", "a b*c>", "ünï", "x~y"])
def test_subject_tokens_are_safe_and_reversible(name: str) -> None:
    tok = subjects.token(name)
    assert all(c.isalnum() or c in "_-~" for c in tok)
    assert "." not in tok and "*" not in tok and ">" not in tok and " " not in tok
    assert subjects.untoken(tok) == name


@pytest.mark.parametrize("tok", ["~", "a~4", "~zz", "~FF"])
def test_a_token_no_name_makes_is_a_value_error(tok: str) -> None:
    # (A forged member subject, tb.v1.members.~, raised out of a subscription's callback.)
    with pytest.raises(ValueError):
        subjects.untoken(tok)


def test_distinct_names_never_share_a_token() -> None:
    assert subjects.token("a.b") != subjects.token("a_b")
    assert subjects.token("a/b") != subjects.token("a~2Fb")


def test_subjects_are_versioned_and_built_in_one_place() -> None:
    assert subjects.request("chat") == "tb.v1.req.chat"
    assert subjects.engine_generate("m.x", "r1") == "tb.v1.engine.m~2Ex.r1.generate"
    assert subjects.heartbeat("m", "r") == "tb.v1.heartbeat.m.r"
    assert subjects.request("embeddings") == "tb.v1.req.embeddings"
    with pytest.raises(ValueError):
        subjects.request("images")
    with pytest.raises(ValueError):
        subjects.token("")


def test_inbox_split_only_for_tokenbus_inboxes() -> None:
    prefix = subjects.inbox_prefix("bridge-1")
    assert subjects.split_inbox(f"{prefix}.abc") == (prefix, "abc")
    assert subjects.split_inbox("_INBOX.xyz.1") is None


def test_codec_round_trip_and_rejects_garbage() -> None:
    obj = {"a": [1, 2.5, "x", None, b"\x00"], "b": {"c": True}}
    assert codec.decode(codec.encode(obj)) == obj
    with pytest.raises(E.InvalidRequest):
        codec.decode(b"\xc1")
    with pytest.raises(E.InvalidRequest):
        codec.decode_map(codec.encode([1, 2]))


def test_typed_errors_cross_the_wire_with_status_and_retryable() -> None:
    for klass in E.ERRORS_BY_CODE.values():
        err = klass("msg", param="p")
        frame = frames.decode(frames.error(err))
        assert frame["t"] == frames.ERROR
        back = E.TokenbusError.from_dict(frame["error"])
        assert type(back) is klass
        assert (back.code, back.status, back.retryable, back.param) == (
            err.code,
            err.status,
            err.retryable,
            "p",
        )
    body = E.NoReplica("none").openai_body()
    assert body == {
        "error": {"message": "none", "type": "server_error", "param": None, "code": "no_replica"}
    }


def test_unknown_error_codes_keep_the_senders_status() -> None:
    err = E.TokenbusError.from_dict(
        {"code": "brand_new", "status": 418, "message": "teapot", "retryable": True}
    )
    assert E.http_status(err) == 418
    assert err.to_dict()["code"] == "brand_new"
    assert err.to_dict()["retryable"] is True


def test_stream_frames() -> None:
    a = frames.decode(frames.accept("r1", "q", 0.5))
    assert (a["replica"], a["request_id"], a["heartbeat_s"]) == ("r1", "q", 0.5)
    c = frames.decode(frames.chunk("hi", 2, 7))
    assert (c["t"], c["d"], c["n"], c["i"]) == ("c", "hi", 2, 7)
    f = frames.decode(frames.final("length", 3, 4, {"t0": 1}))
    assert f["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert "stop_sequence" not in f  # additive: only a stop string that ended it is sent
    f = frames.decode(frames.final("stop", 3, 4, {"t0": 1}, stop_sequence="\n\n"))
    assert f["stop_sequence"] == "\n\n"
    assert FinalFrame.model_validate(f).stop_sequence == "\n\n"
    b = frames.decode(frames.batch([("a", b"x"), ("b", b"y")]))
    assert b["t"] == frames.BATCH and [tuple(i) for i in b["f"]] == [("a", b"x"), ("b", b"y")]


def test_the_side_outputs_table_names_the_fields_that_carry_them() -> None:
    """Each side output of bus_schemas.side_outputs is a chunk frame key, a field of the
    caller's chunk and (a generation's) of a backend's delta, in the table's order."""
    from engine_worker.backends.base import Delta
    from services.chunks import Chunk

    names = [s.name for s in SIDE_OUTPUTS]
    assert [k for k in ChunkFrame.model_fields if k not in ("t", "d", "n", "i")] == [*WIRE_KEYS]
    assert [f.name for f in fields(Chunk)][3:] == names
    assert [f.name for f in fields(Delta) if f.name in names] == [s.name for s in GENERATION]


def test_openai_requests_validate_like_openai() -> None:
    req = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ],
            "stop": "x",
            "max_completion_tokens": 5,
            "unknown_field": 1,
        }
    )
    assert req.messages[0].text() == "ab"
    assert req.stop == ["x"]
    assert req.sampling(100).max_tokens == 5
    assert (
        ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "a"}]}
        )
        .sampling(100)
        .max_tokens
        == 100
    )
    for bad in (
        {"model": "m", "messages": []},
        {"model": "m", "messages": [{"role": "robot", "content": "a"}]},
        {"model": "m", "messages": "hi"},
        {"model": "m", "messages": [{"role": "user", "content": "a"}], "n": 0},
        {"model": "m", "messages": [{"role": "user", "content": "a"}], "n": 129},
        {"model": "m", "messages": [{"role": "user", "content": "a"}], "temperature": 3},
        {"model": "m", "messages": [{"role": "user", "content": "a"}], "max_tokens": 0},
        {
            "model": "m",
            "messages": [{"role": "user", "content": "a"}],
            "stop": ["a", "b", "c", "d", "e"],
        },
        {"messages": [{"role": "user", "content": "a"}]},
    ):
        with pytest.raises(ValueError):
            ChatCompletionRequest.model_validate(bad)
    assert CompletionRequest.model_validate({"model": "m", "prompt": ["p"]}).prompt_text == "p"
    # Several prompts are one HTTP request (a choice each: the bridge sends one request per
    # prompt), and max_tokens 0 the prompt alone; an envelope holds one prompt and a token.
    for body in ({"prompt": ["p", "q"]}, {"prompt": "p", "max_tokens": 0}):
        req = CompletionRequest.model_validate({"model": "m", **body})
        with pytest.raises(E.InvalidRequest):
            envelope("completions", req, body, "r", default_max_tokens=8, deadline_ms=None)
    with pytest.raises(ValueError):
        CompletionRequest.model_validate({"model": "m", "prompt": []})


def test_heartbeat_model_accepts_what_workers_send() -> None:
    from engine_worker.worker import Worker
    from services.config import Settings

    w = Worker(Settings(nats_url="nats://127.0.0.1:1"))
    Heartbeat.model_validate(w.heartbeat_body())


def test_heartbeats_name_their_host_and_old_ones_without_it_stay_valid(tmp_path: Path) -> None:
    import socket

    from engine_worker.worker import Worker
    from router.registry import Registry
    from services.config import Settings

    def host(**kw: Any) -> str:
        w = Worker(Settings(nats_url="nats://127.0.0.1:1", **kw))
        body = w.heartbeat_body()
        Heartbeat.model_validate(body)
        return str(body["host"])

    assert host() == socket.gethostname()
    # A GPU host's bus login (worker-<host>) names the host the deployment gave it, from the
    # settings or from its login file; the worker's own setting wins over both.
    assert host(nats_user="worker-gpu-3", nats_password="x") == "gpu-3"
    login = tmp_path / "worker-gpu-4.json"
    login.write_text(json.dumps({"user": "worker-gpu-4", "password": "x"}))
    assert host(nats_login_file=str(login)) == "gpu-4"
    assert host(nats_user="worker", nats_password="x") == socket.gethostname()
    assert host(worker={"host": "rack2-node7"}, nats_user="worker-gpu-3") == "rack2-node7"
    # A heartbeat from before the field is valid, and says no host.
    old = Worker(Settings(nats_url="nats://127.0.0.1:1")).heartbeat_body()
    del old["host"]
    assert Heartbeat.model_validate(old).host == ""
    reg = Registry()
    r = reg.update(old)
    assert r is not None and r.host == "" and "host" not in r.to_dict()
    r = reg.update({**old, "seq": old["seq"] + 1, "host": "gpu-9"})
    assert r is not None and r.host == "gpu-9" and r.to_dict()["host"] == "gpu-9"
