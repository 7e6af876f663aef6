"""LoRA adapters loaded at run time (issue 51, docs/adapters.md): the admin API, the CLI and
the router's loads on demand, on a real bus with real processes (sim workers modelling the
load's time, ``max_loras`` and the checks vLLM's load makes); HTTP through the openai SDK
and httpx, NATS through the tokenbus client."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path
from typing import Any

import openai
import pytest
from nats.aio.client import Client as NATS

from auth.store import KeyStore
from bus_schemas import codec, subjects
from bus_schemas import errors as E
from engine_worker.backends.base import GenerationRequest
from engine_worker.backends.sim import SimEngine
from services import audit
from services.config import SimSettings
from tests.support.procs import Procs, start_stack, start_worker
from tests.support.repo import run_cli
from tests.support.waits import live_replicas, wait_for
from tokenbus import Client

MSG = [{"role": "user", "content": "write me a query"}]
BASE = "/v1/admin/adapters"
# A load takes 50 ms; a token 20 ms (an answer of 60 tokens runs over a second, long enough
# to be on the adapter while it is unloaded).
SIM = {"TOKENBUS_WORKER__SIM__LORA_LOAD_MS": "50", "TOKENBUS_WORKER__SIM__DECODE_MS": "20"}


def adapter_dir(tmp_path: Path, name: str, rank: int = 8) -> str:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"r": rank, "peft_type": "LORA"}))
    return str(folder)


async def _events(nc: NATS, name: str) -> list[audit.AuditEvent]:
    return [e for e in await audit.read(nc, limit=None) if e.target == name]


@pytest.mark.stack
async def test_an_adapter_is_loaded_served_listed_and_unloaded_after_its_requests(
    procs: Procs, model: str, keys: KeyStore, nc: NATS, tmp_path: Path
) -> None:
    name = f"sql-{model}"
    path = adapter_dir(tmp_path, name)
    admin, admin_rec = await keys.create("ops", admin=True)
    plain, _ = await keys.create("plain")
    env = {"TOKENBUS_INGRESS__PIPELINE": '["auth", "route"]', **SIM}
    stack = await start_stack(procs, model, workers=2, env=env, settle=0.3)
    adm = {"api-key": admin}
    async with stack.http(timeout=30) as h, stack.openai(plain) as c:
        # Unknown before its load: a 404 that names it.
        with pytest.raises(openai.NotFoundError, match=name):
            await c.chat.completions.create(model=name, messages=MSG, max_tokens=2)  # type: ignore[arg-type]
        load = {"name": name, "model": model, "path": path}
        r = await h.post(BASE, json=load, headers={"api-key": plain})
        assert r.status_code == 403
        r = await h.post(BASE, json=load, headers=adm)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["adapter"] == {**load, "replicas": 1} and not out["failed"]
        [held] = out["loaded"]
        assert held["replica"] in {f"{model}-0", f"{model}-1"} and held["load_ms"] >= 50
        # Served at once (the load's answer came after the replica's heartbeat saying so).
        whole = await c.chat.completions.create(model=name, messages=MSG, max_tokens=3)  # type: ignore[arg-type]
        assert whole.model == name and whole.usage and whole.usage.completion_tokens == 3
        text = await c.completions.create(model=name, prompt="select", max_tokens=3, stream=True)
        assert {e.model async for e in text} == {name}
        listed = {m.id: m.model_dump() for m in (await c.models.list()).data}
        assert listed[name]["parent"] == model and listed[name]["root"] == path
        assert "parent" not in listed[model]
        rows = (await h.get(BASE, headers=adm)).json()["adapters"]
        assert [x for x in rows if x["name"] == name] == [
            {**load, "replicas": 1, "wanted": True, "loaded_on": [held["replica"]]}
        ]
        # Bad input: each a 400 (or 404) naming what is wrong, and the stack goes on.
        bad = [
            ({k: v for k, v in load.items() if k != "path"}, 400, "path"),
            ({**load, "replicas": 0}, 400, "replicas"),
            ({**load, "extra": 1}, 400, "extra"),
            ({**load, "name": model}, 400, "name"),
            ({**load, "name": f"x-{name}", "model": f"none-{model}"}, 404, "model"),
            ({**load, "name": f"x-{name}", "path": str(tmp_path / "nowhere")}, 400, "path"),
        ]
        for body, status, param in bad:
            r = await h.post(BASE, json=body, headers=adm)
            assert r.status_code == status, (body, r.text)
            assert r.json()["error"]["param"] == param, (body, r.text)
        # A failed load names the replica it failed on.
        r = await h.post(BASE, json={**load, "name": f"x-{name}", "path": "/nowhere"}, headers=adm)
        assert f"{model}-" in r.json()["error"]["message"]
        r = await h.post(
            BASE,
            json={**load, "name": f"big-{name}", "path": adapter_dir(tmp_path, "big", 64)},
            headers=adm,
        )
        assert r.status_code == 400 and "max_lora_rank" in r.json()["error"]["message"]
        r = await h.delete(f"{BASE}/none-{name}", headers=adm)
        assert r.status_code == 404
        r = await h.delete(f"{BASE}/{name}?drain_s=soon", headers=adm)
        assert r.status_code == 400 and r.json()["error"]["param"] == "drain_s"

        # Unload drains: a stream on the adapter runs to its end, then it is gone.
        stream = await c.chat.completions.create(
            model=name,  # type: ignore[arg-type]
            messages=MSG,
            max_tokens=60,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        first = await stream.__anext__()
        unload = asyncio.create_task(h.delete(f"{BASE}/{name}?drain_s=60", headers=adm))
        rest = [e async for e in stream]
        finish = [ch.finish_reason for e in [first, *rest] for ch in e.choices if ch.finish_reason]
        assert finish == ["length"] and rest[-1].usage and rest[-1].usage.completion_tokens == 60
        r = await unload
        assert r.status_code == 200, r.text
        assert r.json()["unloaded"] == [{"replica": held["replica"], "drained": 1, "cut": 0}]
        with pytest.raises(openai.NotFoundError, match=name):
            await c.chat.completions.create(model=name, messages=MSG, max_tokens=2)  # type: ignore[arg-type]
        assert name not in {m.id for m in (await c.models.list()).data}
        # Every service still serves the base model.
        ok = await c.chat.completions.create(model=model, messages=MSG, max_tokens=2)  # type: ignore[arg-type]
        assert ok.choices[0].message.content
    events = await _events(nc, name)
    assert [e.action for e in events] == [audit.ADAPTER_LOADED, audit.ADAPTER_UNLOADED]
    assert {e.actor for e in events} == {audit.key_actor(admin_rec.id)}


@pytest.mark.fault
async def test_the_router_loads_a_wanted_adapter_beside_a_busy_holder_and_after_a_lost_one(
    procs: Procs, model: str, client: Client, tmp_path: Path
) -> None:
    """Through the router service (NATS clients): one request at a time per replica; a
    second request while the only holder is busy has the adapter loaded on the other
    replica; with every holder killed, a request has it loaded on a replica left."""
    name = f"chat-{model}"
    path = adapter_dir(tmp_path, name)
    env = {"TOKENBUS_INGRESS__PIPELINE": '["route"]', **SIM}
    stack = await start_stack(
        procs,
        model,
        "ingress",
        "router",
        workers=2,
        bridge=False,
        env=env,
        worker_args=("--max-concurrency", "1"),
    )
    cli = {"TOKENBUS_NATS_URL": procs.url}
    r = run_cli("adapters", "load", name, "--model", model, "--path", path, env=cli)
    assert r.returncode == 0, r.stdout + r.stderr
    [first] = json.loads(r.stdout)["loaded"]
    holder = first["replica"]
    other = ({f"{model}-0", f"{model}-1"} - {holder}).pop()
    long = client.chat(name, MSG, max_tokens=60, ignore_eos=True)
    it = long.__aiter__()
    await it.__anext__()  # on the holder now, which takes one request at a time
    assert long.replica == holder
    second = await client.chat_completion(name, MSG, max_tokens=3)
    assert second.model == name and second.usage.completion_tokens == 3
    _ = [c async for c in it]
    assert long.finish_reason == "length"
    shown = run_cli("adapters", "list", "--json", env=cli)
    [row] = [x for x in json.loads(shown.stdout)["adapters"] if x["name"] == name]
    assert row["loaded_on"] == sorted([holder, other]), row
    # Both holders killed; a new replica starts: the first request loads it there.
    for w in stack.workers:
        w.signal(signal.SIGKILL)
    fresh = start_worker(procs, model, 2, env=env)

    async def beats() -> bool:
        return f"{model}-2" in await live_replicas(procs.url, model, wait=2.5)

    await wait_for(beats, timeout=30, what="the new replica beats")
    answer = await client.chat_completion(name, MSG, max_tokens=3)
    assert answer.model == name
    assert fresh.alive()
    shown = run_cli("adapters", "list", "--json", env=cli)
    [row] = [x for x in json.loads(shown.stdout)["adapters"] if x["name"] == name]
    assert row["loaded_on"] == [f"{model}-2"], row
    gone = run_cli("adapters", "unload", name, "--drain", "5", env=cli)
    assert gone.returncode == 0, gone.stdout + gone.stderr
    assert [x["replica"] for x in json.loads(gone.stdout)["unloaded"]] == [f"{model}-2"]
    missing = run_cli("adapters", "unload", name, env=cli)
    assert missing.returncode == 2 and "no adapter" in missing.stdout
    bad = run_cli("adapters", "load", name, "--model", model, "--path", "/nowhere", env=cli)
    assert bad.returncode == 2 and f"{model}-2" in bad.stdout and "/nowhere" in bad.stdout


@pytest.mark.stack
async def test_a_replica_answers_a_bad_adapter_command_with_a_clear_error(
    procs: Procs, model: str, nc: NATS
) -> None:
    await start_stack(procs, model, bridge=False, env=SIM)
    subject = subjects.worker_adapters(model, f"{model}-0")

    async def ask(body: Any) -> dict[str, Any]:
        data = body if isinstance(body, bytes) else codec.encode(body)
        return codec.decode_map((await nc.request(subject, data, timeout=10)).data)

    for body, where in [
        (b"\xc1 not msgpack", "invalid"),
        ({"op": "explode"}, "op"),
        ({"op": "load", "name": "x" * 300, "path": "/tmp"}, "name"),
        ({"op": "unload", "name": "never-loaded"}, "never-loaded"),
        ({"op": "load", "name": model, "path": "/tmp"}, "name of its own"),
    ]:
        out = await ask(body)
        assert out["ok"] is False and out["replica"] == f"{model}-0", out
        assert where in json.dumps(out["error"]), (body, out)
    out = await ask({"op": "list"})
    assert out == {
        "type": "adapters",
        "ok": True,
        "replica": f"{model}-0",
        "model": model,
        "adapters": {},
    }


@pytest.mark.unit
async def test_the_sim_holds_at_most_max_loras_adapters_in_a_batch() -> None:
    """vLLM's scheduler under max_loras=1: a request on a second adapter waits until the
    first adapter's requests leave the batch; requests on the base model never wait."""
    engine = SimEngine(SimSettings(decode_ms=2, prefill_ms=1, max_loras=1, answer_tokens_median=0))
    engine.adapters.update(a="/a", b="/b")

    def req(model: str) -> GenerationRequest:
        return GenerationRequest(
            request_id=model,
            kind="chat",
            model=model,
            max_tokens=5,
            messages=[{"role": "user", "content": "hi"}],
        )

    a, b, base = engine.generate(req("a")), engine.generate(req("b")), engine.generate(req("m"))
    running = {s.lora for s in (*engine.running, *engine.prefilling)}
    assert running == {"a", None} and [s.lora for s in engine.waiting] == ["b"]
    text_a = [d async for d in a]
    assert sum(len(d.text) > 0 for d in text_a) >= 1
    text_b = [d async for d in b]
    assert text_b and [d async for d in base]
    assert not engine.waiting and not engine.running


@pytest.mark.stack
async def test_an_openai_worker_loads_adapters_on_its_vllm_upstream(
    nats_server: Any, procs: Procs, model: str, nc: NATS, tmp_path: Path
) -> None:
    """The ``openai`` backend in front of a vLLM server loads and unloads adapters with
    vLLM's runtime endpoints; the worker announces them, a request for one reaches the
    upstream under its name; the upstream's refusal (a missing path) is an error naming the
    replica; an upstream without the endpoints (llama.cpp's server) is refused with why."""
    from engine_worker.worker import Worker
    from router import adapters as A
    from tests.fakes.upstream import FakeUpstream
    from tests.support.inprocess import settings

    await start_stack(procs, model, "ingress", "router", workers=0, bridge=False)
    ups = [FakeUpstream(), FakeUpstream(flavor="llamacpp")]
    for u in ups:
        await u.start()
    try:
        for u, name in zip(ups, (f"{model}-vllm", f"{model}-llama"), strict=True):
            cfg = settings(
                nats_server.url,
                worker={
                    "model": name,
                    "replica": f"{name}-0",
                    "backend": "openai",
                    "heartbeat_interval_s": 0.2,
                    "openai": {"upstream_url": u.url, "upstream_model": "upstream-model"},
                },
            )
            async with Worker(cfg), await Client.connect(nats_server.url) as tb:
                load = {"op": "load", "name": f"{name}-sql", "path": adapter_dir(tmp_path, name)}
                if u.flavor != "vllm":
                    with pytest.raises(E.InvalidRequest, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING"):
                        await A.command(nc, name, f"{name}-0", {"type": "adapters", **load}, 30)
                    continue
                out = await A.command(nc, name, f"{name}-0", {"type": "adapters", **load}, 30)
                assert out["adapters"] == {f"{name}-sql": load["path"]}
                assert u.loras == {f"{name}-sql": load["path"]}

                async def announced(name: str = name) -> bool:
                    beats = await live_replicas(nats_server.url, name)
                    return f"{name}-sql" in (beats.get(f"{name}-0") or {}).get("aliases", [])

                await wait_for(announced, what="the adapter in the heartbeat")
                got = await tb.chat_completion(f"{name}-sql", MSG, max_tokens=2)
                assert got.usage.completion_tokens == 2
                assert u.requests[-1]["model"] == f"{name}-sql"
                with pytest.raises(E.InvalidRequest, match=f"{name}-0.*No adapter found"):
                    bad = {**load, "name": f"{name}-gone", "path": str(tmp_path / "nowhere")}
                    await A.command(nc, name, f"{name}-0", {"type": "adapters", **bad}, 30)
                out = await A.command(
                    nc, name, f"{name}-0", {"type": "adapters", "op": "unload",
                                            "name": f"{name}-sql", "drain_s": 5}, 30,
                )  # fmt: skip
                assert out["adapters"] == {} and u.loras == {}
    finally:
        for u in ups:
            await u.stop()
