"""API keys: format, the KV store, the auth stage across instances, the CLI, HTTP."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from typing import Any

import nats
import openai
import pytest
from nats.js.kv import KeyValue

from auth.keys import hash_key, key_id_of, matches, new_key, parse_duration
from auth.store import KeyStore
from bus_schemas import errors as E
from bus_schemas import subjects
from tests.support.busdata import key_store
from tests.support.inprocess import stack
from tests.support.natsserver import NatsServer, spawn_nats
from tests.support.ports import free_port
from tests.support.procs import Procs, ProcStack, start_stack
from tests.support.repo import run_cli
from tests.support.waits import wait_for, wait_for_key
from tokenbus import Client

MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.unit
def test_keys_are_random_recognisable_and_hashed() -> None:
    key, key_id = new_key()
    assert key.startswith(f"tb-{key_id}_") and key_id_of(key) == key_id
    assert len(key.split("_", 1)[1]) == 43  # 256 bits in URL-safe base64
    assert new_key()[0] != key
    from auth.keys import KeyRecord

    rec = KeyRecord(id=key_id, name="n", hash=hash_key(key))
    other = key[:-1] + ("A" if key[-1] != "A" else "B")  # one character off
    assert matches(key, rec) and not matches(other, rec)
    assert key not in rec.model_dump_json() and "hash" not in rec.public()
    assert key_id_of("sk-not-ours") is None and key_id_of(key + "x") is None
    assert parse_duration("30d") == 30 * 86400 and parse_duration("90s") == 90
    with pytest.raises(ValueError):
        parse_duration("soon")


@pytest.mark.bus
async def test_keys_work_across_two_auth_instances_and_revocation_is_quick(
    nats_server: NatsServer, model: str, keys: KeyStore, client: Client
) -> None:
    key, rec = await keys.create("tester", models=[model])
    other, _ = await keys.create("other-model", models=["elsewhere"])
    async with stack(nats_server.url, model, workers=1, auths=2) as svcs:
        await wait_for_key(svcs, rec.id)
        outs = await asyncio.gather(
            *(client.chat_completion(model, MSG, max_tokens=2, api_key=key) for _ in range(24))
        )
        assert all(o.usage.completion_tokens == 2 for o in outs)
        served = [a.discovery.endpoints[0].num_requests for a in svcs["auth"]]
        assert all(n > 0 for n in served), served  # both instances took requests
        with pytest.raises(E.Unauthorized):
            await client.chat_completion(model, MSG)
        with pytest.raises(E.Unauthorized):
            await client.chat_completion(model, MSG, api_key=key[:-2] + "xx")
        with pytest.raises(E.Forbidden) as ei:
            await client.chat_completion(model, MSG, api_key=other)
        assert ei.value.status == 403
        await keys.revoke(rec.id)
        await wait_for_revoked(svcs, rec.id)
        for _ in range(6):
            with pytest.raises(E.Unauthorized) as ei2:
                await client.chat_completion(model, MSG, api_key=key)
            assert "revoked" in ei2.value.message


async def wait_for_revoked(svcs: dict[str, Any], key_id: str) -> None:
    await wait_for(
        lambda: all(not a.keys._cache[key_id].enabled for a in svcs["auth"]),
        timeout=5,
        interval=0.005,
        what="revocation did not reach every auth instance",
    )


@pytest.mark.bus
async def test_expired_keys_are_refused(
    nats_server: NatsServer, model: str, keys: KeyStore, client: Client
) -> None:
    key, rec = await keys.create("short", expires_at=time.time() + 0.5)
    async with stack(nats_server.url, model, workers=1, auths=1) as svcs:
        await wait_for_key(svcs, rec.id)
        # Until the clock (the auth stage's: this process's) is past the key's expiry.
        expires_at = rec.expires_at or 0.0
        await wait_for(
            lambda: time.time() > expires_at, timeout=10, what="the key's expiry never came"
        )
        with pytest.raises(E.Unauthorized) as ei:
            await client.chat_completion(model, MSG, api_key=key)
        assert "expired" in ei.value.message


@pytest.mark.bus
async def test_the_key_never_reaches_later_stages(
    nats_server: NatsServer, model: str, keys: KeyStore, client: Client
) -> None:
    key, rec = await keys.create("spy-test")
    seen: list[dict[str, str]] = []

    async def spy(msg: Any) -> None:
        seen.append(dict(msg.headers or {}))

    await keys.nc.subscribe(subjects.engine_generate(model, f"{model}-w0"), cb=spy)
    async with stack(nats_server.url, model, workers=1, auths=1) as svcs:
        await wait_for_key(svcs, rec.id)
        await client.chat_completion(model, MSG, max_tokens=2, api_key=key)
    assert seen and all("Tb-Api-Key" not in h for h in seen)
    assert all(key not in json.dumps(h) for h in seen)
    assert seen[0]["Tb-Principal"] == rec.id


def _keys(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return run_cli("--nats-url", url, "keys", *args, timeout=60)


@pytest.mark.stack
def test_keys_cli(nats_server: NatsServer) -> None:
    r = _keys(
        nats_server.url,
        "create",
        "--name",
        "cli-key",
        "--rpm",
        "5",
        "--models",
        "a,b",
        "--expires-in",
        "1d",
    )
    assert r.returncode == 0, r.stderr
    key = r.stdout.strip().splitlines()[-1]
    key_id = key_id_of(key)
    assert key_id
    shown = json.loads(_keys(nats_server.url, "show", key_id, "--json").stdout)
    assert shown["rpm"] == 5 and shown["models"] == ["a", "b"] and "hash" not in shown
    listed = json.loads(_keys(nats_server.url, "list", "--json").stdout)
    assert key_id in {k["id"] for k in listed}
    assert key not in _keys(nats_server.url, "list").stdout
    upd = json.loads(_keys(nats_server.url, "update", key_id, "--tpm", "1000", "--json").stdout)
    assert upd["tpm"] == 1000 and upd["rpm"] == 5
    assert json.loads(_keys(nats_server.url, "revoke", key_id, "--json").stdout)["enabled"] is False
    missing = _keys(nats_server.url, "show", "000000000000")
    assert missing.returncode == 1 and "no key" in missing.stdout


PIPELINE = {"TOKENBUS_INGRESS__PIPELINE": '["auth", "route"]'}


@pytest.mark.stack
async def test_http_clients_authenticate_with_bearer_or_api_key(procs: Procs, model: str) -> None:
    async with key_store(procs.url) as keys:
        key, _ = await keys.create("http", models=[model])
    stack = await start_stack(procs, model, "auth", "router", env=PIPELINE)
    async with stack.openai(key) as c:
        out = await c.chat.completions.create(model=model, messages=MSG, max_tokens=3)
        assert out.usage is not None and out.usage.completion_tokens == 3
    async with stack.openai("tb-000000000000_" + "A" * 43) as c:
        with pytest.raises(openai.AuthenticationError):
            await c.chat.completions.create(model=model, messages=MSG)
    async with stack.http("/v1") as h:
        r = await h.post(
            "/chat/completions",
            json={"model": model, "messages": MSG, "max_tokens": 2},
            headers={"api-key": key},
        )
        assert r.status_code == 200
        r = await h.post("/chat/completions", json={"model": model, "messages": MSG})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        # The model list needs a key too, and shows what the key may use.
        r = await h.get("/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = await h.get("/models", headers={"Authorization": "Bearer tb-000000000000_" + "A" * 43})
        assert r.status_code == 401
        mine = (await h.get("/models", headers={"api-key": key})).json()["data"]
        assert [m["id"] for m in mine] == [model]
        async with key_store(procs.url) as keys:
            other, _ = await keys.create("http-other", models=["not-" + model])
        # Until the bridge's key store hears of it (an unknown key is a 401 until then).
        deadline = time.monotonic() + 20
        while (
            r := await h.get("/models", headers={"Authorization": f"Bearer {other}"})
        ).status_code == 401:
            assert time.monotonic() < deadline, "the bridge never heard of the new key"
            await asyncio.sleep(0.02)
        assert r.status_code == 200 and r.json()["data"] == []
    for p in procs.procs:
        assert key not in p.output(), p.name


async def admin_stack(procs: Procs, model: str) -> tuple[ProcStack, dict[str, str], str]:
    """A stack with the bridge; the headers of an admin key, and a plain key."""
    async with key_store(procs.url) as keys:
        admin, _ = await keys.create("admin", admin=True)
        plain, _ = await keys.create("plain")
    stack = await start_stack(procs, model, "auth", "router", env=PIPELINE)
    return stack, {"Authorization": f"Bearer {admin}"}, plain


@pytest.mark.stack
async def test_admin_api_on_the_bridge(procs: Procs, model: str) -> None:
    stack, adm, plain = await admin_stack(procs, model)
    async with stack.http("/v1") as h:
        assert (await h.get("/admin/keys")).status_code == 401
        r = await h.get("/admin/keys", headers={"Authorization": f"Bearer {plain}"})
        assert r.status_code == 403
        r = await h.post(
            "/admin/keys", headers=adm, json={"name": "made", "rpm": 7, "models": [model]}
        )
        assert r.status_code == 201, r.text
        made = r.json()
        new_key = made.pop("key")
        assert key_id_of(new_key) == made["id"] and made["rpm"] == 7 and "hash" not in made
        listed = (await h.get("/admin/keys", headers=adm)).json()["data"]
        assert made["id"] in {k["id"] for k in listed}
        assert all("key" not in k and "hash" not in k for k in listed)
        r = await h.patch(f"/admin/keys/{made['id']}", headers=adm, json={"rpm": 9})
        assert r.json()["rpm"] == 9
        for bad in ({"rpm": -1}, {"nope": 1}, {}):
            r = await h.post("/admin/keys", headers=adm, json=bad)
            assert r.status_code == 400, (bad, r.text)
        assert (await h.get("/admin/keys/000000000000", headers=adm)).status_code == 404
        body = {"model": model, "messages": MSG, "max_tokens": 2}
        r = await h.post(
            "/chat/completions", json=body, headers={"Authorization": f"Bearer {new_key}"}
        )
        assert r.status_code == 200
        r = await h.delete(f"/admin/keys/{made['id']}", headers=adm)
        assert r.json()["enabled"] is False
        for _ in range(50):
            r = await h.post(
                "/chat/completions", json=body, headers={"Authorization": f"Bearer {new_key}"}
            )
            if r.status_code == 401:
                break
            await asyncio.sleep(0.02)
        assert r.status_code == 401


@pytest.mark.stack
async def test_admin_api_errors_name_the_permission_and_the_field(procs: Procs, model: str) -> None:
    # A key that is valid but not an admin key lacks a permission (403
    # insufficient_permissions), not a model (model_not_allowed); a 400 names its field.
    stack, adm, plain = await admin_stack(procs, model)
    async with stack.http("/v1") as h:
        for path in ("/admin/keys", "/admin/routing", f"/admin/routing/{model}"):
            r = await h.get(path, headers={"Authorization": f"Bearer {plain}"})
            assert r.status_code == 403, (path, r.text)
            err = r.json()["error"]
            assert err["code"] == "insufficient_permissions", err
            assert err["type"] == "permission_error" and "not an admin key" in err["message"]
        r = await h.put(
            f"/admin/routing/{model}",
            headers={"Authorization": f"Bearer {plain}"},
            json={"policy": "round_robin"},
        )
        assert r.status_code == 403 and r.json()["error"]["code"] == "insufficient_permissions"
        # The keys API: each bad field is named.
        for body, param in (
            ({"name": "x", "rpm": -1}, "rpm"),
            ({"name": "x", "nope": 1}, "nope"),
            ({"name": "x", "expires_in": "soon"}, "expires_in"),
            ({"name": "x", "models": "all"}, "models"),
            ({}, "name"),
        ):
            r = await h.post("/admin/keys", headers=adm, json=body)
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["param"] == param, (body, r.text)
        r = await h.post("/admin/keys", headers=adm, json={"name": "made"})
        made = r.json()["id"]
        r = await h.patch(f"/admin/keys/{made}", headers=adm, json={"tpm": 0})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tpm", r.text
        # The routing API: the field, dotted where it is nested.
        url = f"/admin/routing/{model}"
        for body, param in (
            ({"policy": "fastest"}, "policy"),
            ({"tiered": {"threshold": 0}}, "tiered.threshold"),
            ({"load_bound": "high"}, "load_bound"),
            ({"nope": 1}, "nope"),
            # Valid fields that cannot be built: the expert pool needs its classifier.
            ({"pool_policy": "expert"}, "expert.model_dir"),
            (
                {"pool_policy": "expert", "expert": {"model_dir": "/nonexistent"}},
                "expert.model_dir",
            ),
        ):
            r = await h.put(url, headers=adm, json=body)
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            assert err["param"] == param and err["type"] == "invalid_request_error", (body, err)
        r = await h.get(url, headers=adm)
        assert r.status_code == 200 and r.json()["override"] is None  # nothing was changed


@pytest.mark.bus
async def test_a_key_not_yet_in_the_watched_cache_is_read_from_the_bucket(
    nats_server: NatsServer,
) -> None:
    """A key made elsewhere that this store's watch has not delivered (made a moment ago,
    or while the watch sat on a stalled node) is read from the bucket before it is refused;
    an unknown key is still refused."""
    url = nats_server.url
    async with key_store(url) as maker, key_store(url, watch=False) as store:
        key, rec = await maker.create("late")
        with pytest.raises(E.Unauthorized):
            store.lookup(key)  # not in this store's cache (it watches nothing)
        await store.catch_up(key)
        assert store.lookup(key).id == rec.id
        bogus = key[: key.index("_") + 1] + "x" * 20
        await store.catch_up(bogus)
        with pytest.raises(E.Unauthorized):
            store.lookup(bogus)
        await store.catch_up("tb-000000000000_none")
        await store.catch_up(None)


@pytest.mark.bus
async def test_a_key_store_that_does_not_answer_is_a_503_not_an_invalid_key(
    nats_server: NatsServer,
) -> None:
    """A key not in this store's cache, while the bucket does not answer (a node stalled, an
    election under way): the caller is told to retry (503), not that its key is not valid
    (401, what a stalled-node test's fresh key got in CI). A cached key is judged by the
    cache meanwhile."""
    port = free_port()
    bare = spawn_nats(port, "-p", str(port), "-a", "127.0.0.1")  # no JetStream: no responders
    try:
        url = nats_server.url
        async with key_store(url) as maker, key_store(url, watch=False) as store:
            known, _ = await maker.create("known")
            await store.catch_up(known)  # read while the bucket answers: cached
            fresh, _ = await maker.create("fresh")
            # The store's bucket, read through a server without JetStream.
            elsewhere = await nats.connect(f"nats://127.0.0.1:{port}")
            name = store.bucket
            store.kv = KeyValue(name, f"KV_{name}", f"$KV.{name}.", elsewhere.jetstream(), True)
            try:
                with pytest.raises(E.ServiceUnavailable) as got:
                    await store.catch_up(fresh)
                assert got.value.headers["Retry-After"] == "1"
                await store.catch_up(known)  # cached: the cache decides
                assert store.lookup(known).name == "known"
            finally:
                await elsewhere.close()
    finally:
        bare.terminate()
        bare.wait(10)


@pytest.mark.bus
async def test_a_secret_rotated_a_moment_ago_is_read_from_the_bucket(
    nats_server: NatsServer,
) -> None:
    """A key this store has cached, rotated elsewhere before its watch delivered the change:
    the new secret is read from the bucket before it is refused (a login with the new secret
    right after `tokenbus keys rotate` was refused under load); a wrong secret still is."""
    url = nats_server.url
    async with key_store(url) as maker, key_store(url, watch=False) as store:
        key, rec = await maker.create("rotating")
        await store.catch_up(key)
        assert store.lookup(key).id == rec.id  # cached, with the first secret
        new_key, _ = await maker.rotate(rec.id, overlap_s=60)
        with pytest.raises(E.Unauthorized):
            store.lookup(new_key)  # the cache has the record from before the rotation
        await store.catch_up(new_key)
        assert store.lookup(new_key).id == rec.id
        assert store.lookup(key).id == rec.id  # the old secret, within its overlap
        wrong = new_key[: new_key.index("_") + 1] + "y" * 20
        await store.catch_up(wrong)
        with pytest.raises(E.Unauthorized):
            store.lookup(wrong)


@pytest.mark.stack
async def test_a_rotated_key_keeps_its_id_limits_and_budget_and_the_old_one_works_a_while(
    procs: Procs, model: str
) -> None:
    """``POST /v1/admin/keys/{id}/rotate`` and ``tokenbus keys rotate``: a new secret under
    the same id (the limits, the budget and its spend are the id's), the key before working
    for the overlap and refused after it, each rotation audited, the new key shown once."""
    from services import audit

    stack, adm, _ = await admin_stack(procs, model)
    body = {"model": model, "messages": MSG, "max_tokens": 2}

    async def status(h: Any, key: str) -> int:
        r = await h.post("/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        return int(r.status_code)

    async def until(h: Any, key: str, want: int) -> None:
        """Until every auth instance has heard of the change (a key's status flips)."""

        async def flipped() -> bool:
            return await status(h, key) == want

        await wait_for(flipped, timeout=20, what=f"a status of {want}")

    async with stack.http("/v1") as h:
        r = await h.post(
            "/admin/keys",
            headers=adm,
            json={"name": "rotating", "rpm": 50, "budget_usd": 5.0, "models": [model]},
        )
        first = r.json()
        key_id, key1 = first["id"], first.pop("key")
        assert await status(h, key1) == 200
        r = await h.post(f"/admin/keys/{key_id}/rotate", headers=adm, json={"overlap_s": 600})
        assert r.status_code == 200, r.text
        rotated = r.json()
        key2 = rotated.pop("key")
        assert key_id_of(key2) == key_id and key2 != key1
        assert rotated["rpm"] == 50 and rotated["budget_usd"] == 5.0
        assert rotated["previous_until"] > time.time() + 590 and "previous_hash" not in rotated
        # Both work during the overlap (the new one once every auth instance heard of it).
        await until(h, key2, 200)
        assert await status(h, key1) == 200
        # Bad input: a clear 400 or 404, nothing changed.
        for bad in ({"overlap_s": -1}, {"overlap": 5}):
            r = await h.post(f"/admin/keys/{key_id}/rotate", headers=adm, json=bad)
            assert r.status_code == 400, (bad, r.text)
        r = await h.post("/admin/keys/000000000000/rotate", headers=adm, json={})
        assert r.status_code == 404
        assert await status(h, key1) == 200
        # From the CLI, without an overlap: the key before stops at once.
        out = _keys(procs.url, "rotate", key_id, "--overlap", "0")
        assert out.returncode == 0, out.stderr
        key3 = out.stdout.strip().splitlines()[-1]
        assert key_id_of(key3) == key_id and "no overlap" in out.stdout
        await until(h, key3, 200)
        await until(h, key2, 401)
        assert await status(h, key1) == 401
        shown = json.loads(_keys(procs.url, "show", key_id, "--json").stdout)
        assert shown["rpm"] == 50 and shown["budget_usd"] == 5.0 and shown["rotated_at"]
    nc = await nats.connect(procs.url)
    try:
        rotations = [e for e in await audit.read(nc, limit=None) if e.action == "key.rotated"]
    finally:
        await nc.close()
    assert [e.target for e in rotations] == [key_id, key_id]
    for p in procs.procs:
        assert key2 not in p.output() and key3 not in p.output(), p.name
