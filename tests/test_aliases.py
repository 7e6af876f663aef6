"""Model aliases (issue 33): names clients ask for, served by the model an operator maps them
to, globally (CLI, admin API, configuration) or per key; the answer names what was asked.
Real nats-server, real processes, the openai SDK, httpx and the NATS client."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest
from nats.aio.client import Client as NATS

from auth.store import KeyStore
from bus_schemas import errors as E
from bus_schemas import headers as H
from bus_schemas import subjects
from services import aliases as A
from services import audit
from services.aliases import AliasTable, check_alias, check_key_aliases
from tests.support.inprocess import stack
from tests.support.natsserver import NatsServer
from tests.support.procs import Procs, start_stack
from tests.support.repo import run_cli
from tests.support.waits import wait_for, wait_for_key
from tokenbus import Client

MSG = [{"role": "user", "content": "hi"}]


async def _answers(c: openai.AsyncOpenAI, name: str) -> list[str]:
    """The ``model`` of a whole and a streamed chat and completions answer to ``name``."""
    out = [(await c.chat.completions.create(model=name, messages=MSG, max_tokens=3)).model]  # type: ignore[arg-type]
    out.append((await c.completions.create(model=name, prompt="hi", max_tokens=3)).model)
    chat = await c.chat.completions.create(model=name, messages=MSG, max_tokens=3, stream=True)  # type: ignore[arg-type]
    out += [e.model async for e in chat]
    text = await c.completions.create(model=name, prompt="hi", max_tokens=3, stream=True)
    out += [e.model async for e in text]
    return out


async def _alias_events(nc: NATS, name: str) -> list[audit.AuditEvent]:
    return [e for e in await audit.read(nc, limit=None) if e.target == name]


@pytest.mark.stack
async def test_a_cli_alias_is_served_listed_audited_and_removed(
    procs: Procs, model: str, nc: NATS
) -> None:
    name, cfg_name = f"claude-{model}", f"cfg-{model}"
    env = {
        "TOKENBUS_INGRESS__PIPELINE": '["route"]',
        "TOKENBUS_ROUTER__ALIASES": json.dumps({cfg_name: model}),
    }
    stack_ = await start_stack(procs, model, env=env)
    cli = {"TOKENBUS_NATS_URL": procs.url}
    r = run_cli("router", "alias", name, model, env=cli)
    assert r.returncode == 0, r.stdout + r.stderr
    async with stack_.openai() as c:
        for _ in range(50):  # the bridge's watch has it within milliseconds
            try:
                answers = await _answers(c, name)
                break
            except openai.NotFoundError:
                await asyncio.sleep(0.05)
        assert set(answers) == {name} and len(answers) > 4
        # A configured alias, too (compose and Kubernetes set it in the environment).
        assert set(await _answers(c, cfg_name)) == {cfg_name}
        listed = {m.id: m for m in (await c.models.list()).data}
        assert getattr(listed[name], "alias_of", None) == model
        assert getattr(listed[cfg_name], "alias_of", None) == model
        assert getattr(listed[model], "alias_of", None) is None
        shown = run_cli("router", "aliases", "--json", env=cli)
        rows = {x["name"]: x for x in json.loads(shown.stdout)["aliases"]}
        assert rows[name] == {"name": name, "model": model, "source": "runtime"}
        # No chains, no served model hidden: refused when set, naming the field.
        chain = run_cli("router", "alias", f"x-{model}", name, env=cli)
        assert chain.returncode == 2 and "model" in chain.stdout and "chain" in chain.stdout
        shadow = run_cli("router", "alias", model, "other", env=cli)
        assert shadow.returncode == 2 and "name" in shadow.stdout and "serves" in shadow.stdout
        gone = run_cli("router", "alias", name, "--remove", env=cli)
        assert gone.returncode == 0, gone.stdout + gone.stderr
        for _ in range(50):
            try:
                await c.chat.completions.create(model=name, messages=MSG, max_tokens=2)  # type: ignore[arg-type]
                await asyncio.sleep(0.05)
            except openai.NotFoundError:
                break
        else:
            pytest.fail("the removed alias is still served")
        assert name not in {m.id for m in (await c.models.list()).data}
    events = await _alias_events(nc, name)
    assert [e.action for e in events] == [audit.ALIAS_CHANGED] * 2
    assert events[0].details["model"] == model and events[0].actor.startswith("cli:")
    assert events[1].details["removed"] is True and events[1].details["previous"] == model


@pytest.mark.stack
async def test_admin_api_key_aliases_and_the_allow_list(
    procs: Procs, model: str, keys: KeyStore, nc: NATS
) -> None:
    name, ghost = f"gpt-{model}", f"ghost-{model}"
    admin, admin_rec = await keys.create("ops", admin=True)
    plain, _ = await keys.create("plain")
    # The key's own alias wins over the global one (which names a model nobody serves).
    mine, _ = await keys.create("mine", aliases={name: model})
    # An allow-list accepts the alias' served model, or the alias name itself.
    by_served, _ = await keys.create("by-served", models=[model])
    other, _ = await keys.create("other", models=["something-else"])
    env = {"TOKENBUS_INGRESS__PIPELINE": '["auth", "route"]'}
    stack_ = await start_stack(procs, model, env=env, settle=0.3)
    base = "/v1/admin/routing/aliases"
    async with stack_.http(timeout=30) as h:
        adm = {"api-key": admin}
        r = await h.put(f"{base}/{name}", json={"model": model}, headers={"api-key": plain})
        assert r.status_code == 403
        r = await h.put(f"{base}/{name}", json={"model": ghost}, headers=adm)
        assert r.status_code == 200, r.text
        r = await h.put(f"{base}/{ghost}-2", json={"model": name}, headers=adm)
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"
        r = await h.put(f"{base}/{model}", json={"model": ghost}, headers=adm)
        assert r.status_code == 400 and r.json()["error"]["param"] == "name"
        r = await h.get(base, headers=adm)
        assert {"name": name, "model": ghost, "source": "runtime"} in r.json()["aliases"]
        # A key's aliases are checked as well (here: a chain through the global alias).
        r = await h.post(
            "/v1/admin/keys", json={"name": "bad", "aliases": {"x": name}}, headers=adm
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "aliases.x"
        body = {"model": name, "messages": MSG, "max_tokens": 2}

        async def ask(key: str, **over: Any) -> Any:
            return await h.post(
                "/v1/chat/completions", json={**body, **over}, headers={"api-key": key}
            )

        for _ in range(50):  # until the bridge has the global alias
            if ghost in (await ask(plain)).text:
                break
            await asyncio.sleep(0.05)
        r = await ask(plain)
        assert r.status_code == 404 and ghost in r.json()["error"]["message"]
        r = await ask(mine)
        assert r.status_code == 200 and r.json()["model"] == name, r.text
        models = (await h.get("/v1/models", headers={"api-key": mine})).json()["data"]
        assert {"id": name, "alias_of": model} in [
            {"id": m["id"], "alias_of": m.get("alias_of")} for m in models
        ]
        # The global alias to a model with no replica is not listed (nor served).
        listed = (await h.get("/v1/models", headers={"api-key": plain})).json()["data"]
        assert name not in {m["id"] for m in listed}
        r = await h.put(f"{base}/{name}", json={"model": model}, headers=adm)
        assert r.status_code == 200
        for _ in range(50):
            r = await ask(by_served)
            if r.status_code == 200:
                break
            await asyncio.sleep(0.05)
        assert r.status_code == 200 and r.json()["model"] == name
        r = await ask(other)
        assert r.status_code == 403 and r.json()["error"]["param"] == "model"
        r = await h.delete(f"{base}/{name}", headers=adm)
        assert r.status_code == 200 and r.json()["removed"] == model
    events = await _alias_events(nc, name)
    assert [e.details.get("model") for e in events] == [ghost, model, None]
    assert {e.actor for e in events} == {audit.key_actor(admin_rec.id)}
    assert all(e.request_id for e in events)


@pytest.mark.bus
async def test_nats_client_asks_for_an_alias(
    nats_server: NatsServer, model: str, nc: NATS, keys: KeyStore, client: Client
) -> None:
    name, own = f"codex-{model}", f"own-{model}"
    key, rec = await keys.create("nats", aliases={own: model})
    seen: list[dict[str, str]] = []

    async def spy(msg: Any) -> None:
        seen.append(dict(msg.headers or {}))

    await nc.subscribe(subjects.engine_generate(model, f"{model}-w0"), cb=spy)
    async with stack(nats_server.url, model, workers=1, auths=1) as svcs:
        await wait_for_key(svcs, rec.id)
        await A.set_alias(nc, name, model)
        await wait_for(lambda: svcs["auth"][0].aliases.resolve(name) == model)
        done = await client.chat_completion(name, MSG, max_tokens=2, api_key=key)
        assert done.model == name and done.text
        mine = await client.completion(own, "hi", max_tokens=2, api_key=key)
        assert mine.model == own and mine.text
        # The request travelled as the served model, naming the alias asked.
        assert [(h[H.MODEL], h[H.MODEL_ALIAS]) for h in seen] == [(model, name), (model, own)]
        await A.remove_alias(nc, name)
        await wait_for(lambda: svcs["auth"][0].aliases.resolve(name) == name)
        with pytest.raises(E.ModelNotFound):
            await client.chat_completion(name, MSG, max_tokens=2, api_key=key)


@pytest.mark.bus
async def test_the_router_resolves_without_auth(
    nats_server: NatsServer, model: str, nc: NATS, client: Client
) -> None:
    name = f"small-{model}"
    async with stack(nats_server.url, model, workers=1, router={"aliases": {name: model}}):
        done = await client.chat_completion(name, MSG, max_tokens=2)
        assert done.model == name and done.replica == f"{model}-w0"


@pytest.mark.unit
def test_chains_and_shadows_are_refused() -> None:
    table = AliasTable({"a": "m"})
    table.runtime["b"] = "n"
    assert table.resolve("a") == "m" and table.resolve("b", {"b": "k"}) == "k"
    assert table.resolve("m") == "m"
    check_alias("c", "m", table.all(), {"m"})
    for name, model, param in (("c", "a", "model"), ("m", "x", "name"), ("n", "y", "name")):
        with pytest.raises(E.InvalidRequest) as ei:
            check_alias(name, model, {**table.all(), "z": "n"}, {"m"})
        assert ei.value.param == param
    with pytest.raises(E.InvalidRequest) as ei:
        check_key_aliases({"k": "a"}, table.all(), {"m"})
    assert ei.value.param == "aliases.k"
    check_key_aliases({"a": "m"}, table.all(), {"m"})  # a key's alias may override a global one
