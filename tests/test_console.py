"""The operator's console (gateway/console.py, docs/console.md) against a real stack: a real
nats-server, sim workers and the bridge as real processes; HTTP-level tests with httpx (they
need no browser). The tests that drive Debian's headless Chromium with Selenium are
tests/test_console_browser.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import fnmatch
import io
import itertools
import json
import signal
import threading
import time
import tomllib
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import quote

import httpx
import nats
import pytest

from auth.keys import KeyRecord
from bus_schemas import codec
from gateway import console_bus, console_spend, console_usage
from gateway.console import Console
from gateway.console_session import Session, Sessions
from router.kv_check import KVCheck
from router.registry import Registry
from services.config import Settings
from telemetry import records
from tests.support.busdata import key_store, new_model
from tests.support.natsserver import spawn_nats
from tests.support.ports import free_port
from tests.support.procs import Procs, ProcStack, start_stack, start_worker
from tests.support.repo import ROOT
from tests.support.waits import wait_for

ENV = {
    "TOKENBUS_INGRESS__PIPELINE": '["auth", "route"]',
    # Dollars per million tokens: the usage page prices what it counts.
    "TOKENBUS_ROUTER__PRICE": '{"input": 1000, "output": 2000}',
}
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


class Down:
    """A monitoring URL whose server does not answer (a proxy's 503 to every read), counting
    the reads of its ``/varz``: how often the bridge reads the monitoring endpoints."""

    def __init__(self) -> None:
        self.reads = 0
        down = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/varz":
                    down.reads += 1
                self.send_error(503)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class Bus:
    """The module's own nats-server, with its monitoring port (the Bus page reads /varz)."""

    url: str
    monitor: str  # its monitoring endpoint
    down: Down  # a monitoring URL that does not answer, counting its reads

    @property
    def dead(self) -> str:
        return self.down.url


@pytest.fixture(scope="module")
def bus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bus]:
    port, mport = free_port(), free_port()
    store = tmp_path_factory.mktemp("console-nats")
    server = spawn_nats(
        port, "-a", "127.0.0.1", "-p", str(port), "-m", str(mport), "-js",
        "-sd", str(store), "-n", "console-node",
    )  # fmt: skip
    down = Down()
    try:
        yield Bus(f"nats://127.0.0.1:{port}", f"http://127.0.0.1:{mport}", down)
    finally:
        down.close()
        server.terminate()
        server.wait(10)


@dataclass
class Env:
    stack: ProcStack
    bus: Bus
    model: str
    admin: str  # an admin key
    plain: str  # a key of the owner "team-a" that is not an admin key
    plain_id: str
    sibling_id: str  # another key of team-a
    other_id: str  # a key of another owner


@pytest.fixture(scope="module")
async def env(bus: Bus, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Env]:
    async with key_store(bus.url) as keys:
        admin, _ = await keys.create("console-admin", admin=True)
        plain, rec = await keys.create("team-a-app", owner="team-a")
        _, sibling = await keys.create("team-a-batch", owner="team-a")
        _, other = await keys.create("team-b-app", owner="team-b")
    model = new_model()
    monitors = {"TOKENBUS_TELEMETRY__NATS_MONITOR_URLS": json.dumps([bus.monitor, bus.dead])}
    with Procs(bus.url, tmp_path_factory.mktemp("console")) as ps:
        stack = await start_stack(
            ps,
            model,
            workers=2,
            worker_args=("--sim-prefill-ms", "2", "--sim-decode-ms", "1"),
            env=ENV | monitors,
        )
        yield Env(stack, bus, model, admin, plain, rec.id, sibling.id, other.id)


async def login(h: httpx.AsyncClient, key: str) -> dict[str, Any]:
    """Log ``h`` in (its cookie jar keeps the session); the session's answer."""
    r = await h.post("/console/api/session", json={"key": key})
    assert r.status_code == 200, r.text
    return dict(r.json())


def csrf(me: dict[str, Any]) -> dict[str, str]:
    return {"X-CSRF-Token": me["csrf_token"]}


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert {"message", "type", "code"} <= set(err), err
    if param is not None:
        assert err["param"] == param, err


@pytest.mark.stack
async def test_the_page_and_its_assets_are_served_with_a_strict_policy(env: Env) -> None:
    async with env.stack.http() as h:
        r = await h.get("/console")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        csp = r.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
        assert r.headers["x-frame-options"] == "DENY"
        assert '<script type="module" src="/console/static/app.js">' in r.text
        for name, kind in (("app.js", "text/javascript"), ("style.css", "text/css")):
            r = await h.get(f"/console/static/{name}")
            assert r.status_code == 200 and r.headers["content-type"].startswith(kind), name
        for bad in ("/console/static/../console.py", "/console/static/nope.js", "/console/x"):
            assert_openai_error(await h.get(bad), 404)


@pytest.mark.stack
async def test_login_sets_a_strict_http_only_cookie_and_logout_ends_the_session(env: Env) -> None:
    async with env.stack.http() as h:
        r = await h.post("/console/api/session", json={"key": env.admin})
        assert r.status_code == 200, r.text
        cookie = r.headers["set-cookie"]
        assert cookie.startswith("tb_console=")
        flags = {f.strip().split("=")[0].lower() for f in cookie.split(";")[1:]}
        assert {"httponly", "samesite", "path", "max-age"} <= flags, cookie
        assert "SameSite=Strict" in cookie and "Path=/console" in cookie
        assert "secure" not in flags  # plain HTTP here; Secure where the bridge has TLS
        assert env.admin not in cookie and env.admin not in r.text  # the key is not handed back
        me = r.json()
        assert me["role"] == "admin" and len(me["csrf_token"]) == 32
        assert (await h.get("/console/api/session")).json()["key_id"] == me["key_id"]
        # Logging out needs the CSRF token too.
        assert_openai_error(await h.delete("/console/api/session"), 403)
        r = await h.delete("/console/api/session", headers=csrf(me))
        assert r.status_code == 200 and "Max-Age=0" in r.headers["set-cookie"]
        # The old cookie, presented again, is refused.
        old = cookie.split(";")[0].split("=", 1)[1]
        async with env.stack.http(cookies={"tb_console": old}) as again:
            assert_openai_error(await again.get("/console/api/session"), 401)
            assert_openai_error(await again.get("/console/api/keys"), 401)
    # Nothing of the key reached a log.
    for p in env.stack.procs.procs:
        assert env.admin not in p.output(), p.name


@pytest.mark.stack
async def test_writes_need_the_csrf_token_and_the_consoles_own_origin(env: Env) -> None:
    async with env.stack.http() as h:
        me = await login(h, env.admin)
        body = {"name": "csrf-made", "rpm": 5}
        assert_openai_error(await h.post("/console/api/keys", json=body), 403)
        bad = {"X-CSRF-Token": "0" * 32}
        assert_openai_error(await h.post("/console/api/keys", json=body, headers=bad), 403)
        evil = {**csrf(me), "Origin": "https://evil.example"}
        assert_openai_error(await h.post("/console/api/keys", json=body, headers=evil), 403)
        own = {**csrf(me), "Origin": env.stack.base}
        r = await h.post("/console/api/keys", json=body, headers=own)
        assert r.status_code == 201, r.text
        made = r.json()
        assert made["key"].startswith(f"tb-{made['id']}_") and made["rpm"] == 5
        # Listed, never with the secret or its hash; found by name.
        page = (await h.get("/console/api/keys", params={"q": "csrf-made"})).json()
        assert [k["id"] for k in page["data"]] == [made["id"]] and page["total"] == 1
        assert all("key" not in k and "hash" not in k for k in page["data"])
        # Edited, rotated (a new secret, once), revoked: each through the admin API.
        r = await h.patch(f"/console/api/keys/{made['id']}", json={"tpm": 900}, headers=csrf(me))
        assert r.status_code == 200 and r.json()["tpm"] == 900
        r = await h.post(
            f"/console/api/keys/{made['id']}/rotate", json={"overlap_s": 0}, headers=csrf(me)
        )
        assert r.status_code == 200 and r.json()["key"] != made["key"]
        r = await h.delete(f"/console/api/keys/{made['id']}", headers=csrf(me))
        assert r.status_code == 200 and r.json()["enabled"] is False
        # The audit page names the console's admin key as the actor of each change.
        events = (await h.get("/console/api/audit")).json()["data"]
        mine = [e for e in events if e["target"] == made["id"]]
        assert {e["action"] for e in mine} == {
            "key.created",
            "key.updated",
            "key.rotated",
            "key.revoked",
        }
        assert {e["actor"] for e in mine} == {f"key:{me['key_id']}"}


@pytest.mark.stack
async def test_a_key_that_is_not_an_admin_key_sees_its_owner_and_changes_nothing(
    env: Env,
) -> None:
    async with env.stack.http() as h:
        me = await login(h, env.plain)
        assert me["role"] == "owner" and me["owner"] == "team-a"
        listed = (await h.get("/console/api/keys", params={"limit": 500})).json()["data"]
        assert {k["id"] for k in listed} == {env.plain_id, env.sibling_id}
        assert_openai_error(await h.get(f"/console/api/keys/{env.other_id}"), 404)
        for page in (
            "replicas",
            "audit",
            "bus",
            "routing",
            "routing/aliases",
            "owners/team-a/budget",
            "owners",
            "adapters",
        ):
            assert_openai_error(await h.get(f"/console/api/{page}"), 403)
        # Every write, even with the session's own CSRF token.
        writes: list[tuple[str, str, Any]] = [
            ("POST", "keys", {"name": "sneaky", "admin": True}),
            ("PATCH", f"keys/{env.plain_id}", {"admin": True}),
            ("PATCH", f"keys/{env.other_id}", {"rpm": 1}),
            ("DELETE", f"keys/{env.other_id}", None),
            ("POST", f"keys/{env.other_id}/rotate", {}),
            ("PUT", "owners/team-a/budget", {"budget_usd": 1e6}),
            ("PUT", "routing/" + env.model, {"policy": "round_robin"}),
            (
                "PUT",
                "routing/" + env.model,
                {"pool_policy": "concurrency_tiered", "tiered": {"threshold": 1}},
            ),
            ("POST", "adapters", {"name": "sneaky-lora", "model": env.model, "path": "/tmp"}),
            ("DELETE", "adapters/sneaky-lora", None),
            ("DELETE", "routing/" + env.model, None),
            ("PUT", "routing/aliases/sneaky-alias", {"model": env.model}),
            ("DELETE", "routing/aliases/sneaky-alias", None),
            ("POST", "jobs/batch_x/cancel", None),
        ]
        for method, path, body in writes:
            r = await h.request(method, f"/console/api/{path}", json=body, headers=csrf(me))
            assert_openai_error(r, 403)
            assert r.json()["error"]["code"] == "insufficient_permissions", (path, r.text)
    async with key_store(env.stack.procs.url) as keys:
        assert not (await keys.get(env.plain_id)).admin
        assert (await keys.get(env.other_id)).enabled


@pytest.mark.stack
async def test_routing_is_set_and_reset_through_the_routing_admin_api(env: Env) -> None:
    path = f"/console/api/routing/{env.model}"
    async with env.stack.http() as h:
        me = await login(h, env.admin)
        # Without the CSRF token: refused, nothing changed.
        assert_openai_error(await h.put(path, json={"policy": "round_robin"}), 403)
        assert_openai_error(await h.delete(path), 403)
        listed = (await h.get("/console/api/routing")).json()["models"]
        assert env.model not in {m["model"] for m in listed}
        r = await h.put(path, json={"policy": "round_robin"}, headers=csrf(me))
        assert r.status_code == 200, r.text
        assert r.json()["routing"]["policy"] == "round_robin"
        listed = (await h.get("/console/api/routing")).json()["models"]
        assert {m["model"]: m["override"] for m in listed}[env.model] == {"policy": "round_robin"}
        assert (await h.get(path)).json()["routing"]["policy"] == "round_robin"
        # A policy that does not exist: the admin API's 400, naming the field.
        r = await h.put(path, json={"policy": "fastest"}, headers=csrf(me))
        assert_openai_error(r, 400, "policy")
        assert "round_robin" in r.json()["error"]["message"]  # it lists the ones there are
        assert_openai_error(await h.put(path, json={}, headers=csrf(me)), 400)
        # Reset: back to the configuration's routing.
        r = await h.delete(path, headers=csrf(me))
        assert r.status_code == 200 and r.json()["override"] is None, r.text
        listed = (await h.get("/console/api/routing")).json()["models"]
        assert env.model not in {m["model"] for m in listed}
        events = (await h.get("/console/api/audit")).json()["data"]
        mine = [e for e in events if e["action"] == "routing.changed" and e["target"] == env.model]
        assert len(mine) >= 2 and {e["actor"] for e in mine} == {f"key:{me['key_id']}"}


@pytest.mark.stack
async def test_replicas_show_their_adapters_and_the_kv_checks_tokens(env: Env) -> None:
    # kv_aware predicts cached prompt tokens (the sim's KV events); the workers sum them
    # beside their engine's reports and heartbeat the totals, which the page shows.
    path = f"/console/api/routing/{env.model}"
    client = env.stack.openai(env.admin)
    async with env.stack.http() as h:
        me = await login(h, env.admin)

        async def mine() -> list[dict[str, Any]]:
            data = (await h.get("/console/api/replicas")).json()["data"]
            return [r for r in data if r["model"] == env.model]

        async def announced() -> bool:  # a worker's first beat comes before its KV events
            rows = await mine()
            return len(rows) == 2 and all(r["kv_check"] is not None for r in rows)

        await wait_for(announced, timeout=20, what="both replicas with their KV check")
        for r in await mine():
            assert r["adapters"] == [], r  # none loaded at run time
            k = r["kv_check"]
            assert {"requests", "predicted", "reported", "ratio", "verdict"} <= set(k), r
            assert all(isinstance(k[n], int) for n in ("requests", "predicted", "reported"))
            assert k["verdict"] in ("trusted", "distrusted", "incompatible")  # in-process
        r = await h.put(path, json={"policy": "kv_aware"}, headers=csrf(me))
        assert r.status_code == 200, r.text
        try:
            prompt = "the same long prompt, again and again, so that its blocks are cached " * 8

            async def predicted() -> bool:
                # One more request each time: the first ones go before the KV events arrive.
                await client.chat.completions.create(
                    model=env.model, messages=[{"role": "user", "content": prompt}], max_tokens=2
                )
                return sum(r["kv_check"]["predicted"] for r in await mine()) > 0

            await wait_for(predicted, timeout=30, what="predicted cache hits in heartbeats")
            for r in await mine():
                k = r["kv_check"]
                assert k["predicted"] >= 0 and k["reported"] >= 0 and k["verdict"] == "trusted"
                if k["predicted"]:
                    assert k["requests"] >= 1 and k["reported"] > 0
                    assert k["ratio"] == round(k["reported"] / k["predicted"], 3)
                else:
                    assert k["ratio"] is None
        finally:
            r = await h.delete(path, headers=csrf(me))
            assert r.status_code == 200, r.text


@pytest.mark.stack
async def test_jobs_list_a_batchs_input_output_and_error_files(env: Env) -> None:
    client = env.stack.openai(env.plain)
    lines = [
        {"custom_id": "good", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": env.model, "messages": [{"role": "user", "content": "hi"}],
                  "max_tokens": 2}},
        {"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}},
    ]  # fmt: skip
    body = "".join(json.dumps(line) + "\n" for line in lines).encode()
    f = await client.files.create(file=("in.jsonl", body), purpose="batch")
    b = await client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    async with env.stack.http() as h:
        await login(h, env.admin)

        async def done() -> dict[str, Any] | None:
            data = (await h.get("/console/api/jobs")).json()["data"]
            job = next((j for j in data if j["id"] == b.id), None)
            return job if job and job["status"] in ("completed", "failed") else None

        await wait_for(done, timeout=30, what="the batch done in the jobs listing")
        job = await done()
        assert job is not None and job["status"] == "completed", job
        assert job["input_file_id"] == f.id and job["owner"] == env.plain_id
        assert job["output_file_id"] and job["error_file_id"], job
    # The owner's session lists it with its files too.
    async with env.stack.http() as h:
        await login(h, env.plain)
        data = (await h.get("/console/api/jobs")).json()["data"]
        mine = {j["id"]: j for j in data}
        assert mine[b.id]["output_file_id"] == job["output_file_id"]


def assert_attachment(r: httpx.Response, body: bytes) -> None:
    """A download the browser saves and never renders."""
    assert r.status_code == 200, r.text
    assert r.content == body
    assert r.headers["content-disposition"].startswith("attachment"), r.headers
    assert r.headers["content-type"] == "application/octet-stream"
    assert r.headers["x-content-type-options"] == "nosniff"


@pytest.mark.stack
async def test_a_batchs_input_file_is_downloaded_by_the_admin_and_its_owner_only(
    env: Env,
) -> None:
    client = env.stack.openai(env.plain)
    line = {"custom_id": "one", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": env.model, "messages": [{"role": "user", "content": "hi"}],
                     "max_tokens": 2}}  # fmt: skip
    body = (json.dumps(line) + "\n").encode()
    f = await client.files.create(file=("<b>in</b>.html", body), purpose="batch")
    b = await client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    theirs = await env.stack.openai(env.admin).files.create(
        file=("admins.jsonl", b"{}\n"), purpose="batch"
    )
    async with env.stack.http() as h:
        assert_openai_error(await h.get(f"/console/api/files/{f.id}/content"), 401)
        await login(h, env.admin)
        data = (await h.get("/console/api/jobs")).json()["data"]
        job = next(j for j in data if j["id"] == b.id)
        r = await h.get(f"/console/api/files/{job['input_file_id']}/content")
        assert_attachment(r, body)
        # The file's own name, made safe to put in the header.
        assert r.headers["content-disposition"] == 'attachment; filename="_b_in__b_.html"'
        assert_attachment(await h.get(f"/console/api/files/{theirs.id}/content"), b"{}\n")
    async with env.stack.http() as h:
        await login(h, env.plain)
        assert_attachment(await h.get(f"/console/api/files/{f.id}/content"), body)
        # Another owner's file is answered exactly as one that does not exist.
        other = await h.get(f"/console/api/files/{theirs.id}/content")
        assert_openai_error(other, 404)
        missing = await h.get("/console/api/files/file-000000000000000000000000/content")
        assert_openai_error(missing, 404)
        assert other.json()["error"]["code"] == missing.json()["error"]["code"]


@pytest.mark.stack
async def test_a_background_response_is_looked_up_by_id_and_cancelled(env: Env) -> None:
    resp = await env.stack.openai(env.plain).responses.create(
        model=env.model, input="hi", background=True, max_output_tokens=4
    )
    async with env.stack.http() as h:
        await login(h, env.plain)  # the owner sees it, and changes nothing
        r = await h.get(f"/console/api/responses/{resp.id}")
        assert r.status_code == 200, r.text
        assert r.json()["id"] == resp.id and r.json()["owner"] == env.plain_id
        assert r.json()["status"] in ("queued", "in_progress", "completed", "incomplete"), r.json()
    async with env.stack.http() as h:
        me = await login(h, env.admin)
        r = await h.get(f"/console/api/responses/{resp.id}")
        assert r.status_code == 200 and r.json()["owner"] == env.plain_id, r.text
        # Through the Responses API's cancel: an open one is cancelled, a finished one kept.
        c = await h.post(f"/console/api/responses/{resp.id}/cancel", headers=csrf(me))
        assert c.status_code == 200, c.text
        assert c.json()["status"] in ("cancelled", "completed", "incomplete"), c.json()
        again = (await h.get(f"/console/api/responses/{resp.id}")).json()
        assert again["status"] == c.json()["status"]
        assert_openai_error(await h.get("/console/api/responses/resp_nope"), 404)


@pytest.mark.stack
async def test_another_owners_background_response_is_not_found_for_an_owner(env: Env) -> None:
    theirs = await env.stack.openai(env.admin).responses.create(
        model=env.model, input="hi", background=True, max_output_tokens=4
    )
    async with env.stack.http() as h:
        me = await login(h, env.plain)
        assert_openai_error(await h.get(f"/console/api/responses/{theirs.id}"), 404)
        cancel = await h.post(f"/console/api/responses/{theirs.id}/cancel", headers=csrf(me))
        assert_openai_error(cancel, 403)  # a write, and not an admin's session


async def _responses(h: httpx.AsyncClient, **params: Any) -> dict[str, Any]:
    """A page of the console's listing of background responses."""
    r = await h.get("/console/api/responses", params=params)
    assert r.status_code == 200, r.text
    return dict(r.json())


@pytest.mark.stack
async def test_background_responses_are_listed_newest_first_paged_and_per_owner(env: Env) -> None:
    mine = [
        (
            await env.stack.openai(env.plain).responses.create(
                model=env.model, input=f"hi {i}", background=True, max_output_tokens=4
            )
        ).id
        for i in range(3)
    ]
    theirs = await env.stack.openai(env.admin).responses.create(
        model=env.model, input="the admin's", background=True, max_output_tokens=4
    )
    async with env.stack.http() as h:
        me = await login(h, env.admin)

        async def ended() -> dict[str, Any] | None:
            whole = await _responses(h, limit=100)
            by = {r["id"]: r for r in whole["data"]}
            # (incomplete: the answer reached max_output_tokens, as OpenAI says it)
            done = all(by.get(i, {}).get("status") == "incomplete" for i in [*mine, theirs.id])
            return whole if done else None

        await wait_for(ended, timeout=30, what="the four responses listed as ended")
        whole = await ended()
        assert whole is not None and whole["total"] == len(whole["data"])
        listed = [r["id"] for r in whole["data"]]
        assert [i for i in listed if i in mine] == mine[::-1]  # newest first
        times = [r["created_at"] for r in whole["data"]]
        assert times == sorted(times, reverse=True)
        by = {r["id"]: r for r in whole["data"]}
        for rid in mine:
            assert by[rid]["owner"] == env.plain_id and by[rid]["model"] == env.model
            assert by[rid]["output_tokens"] == 4 and "events" not in by[rid]  # ended
        assert by[theirs.id]["owner"] == me["key_id"]
        # Paged two at a time by cursor: the pages make the whole, in order.
        seen: list[str] = []
        params: dict[str, Any] = {"limit": 2}
        while True:
            page = await _responses(h, **params)
            assert len(page["data"]) <= 2 and page["total"] == whole["total"]
            seen += [r["id"] for r in page["data"]]
            if not page["has_more"]:
                break
            params["after"] = page["last_id"]
        assert seen == [r["id"] for r in whole["data"]]
        for bad in ({"limit": "0"}, {"limit": "101"}, {"after": "x"}):
            assert_openai_error(await h.get("/console/api/responses", params=bad), 400)
    async with env.stack.http() as h:
        me = await login(h, env.plain)  # an owner's session: its owner's keys' responses only
        page = await _responses(h, limit=100)
        ids = [r["id"] for r in page["data"]]
        assert set(mine) <= set(ids) and theirs.id not in ids
        assert {r["owner"] for r in page["data"]} <= {env.plain_id, env.sibling_id}
        assert page["total"] == len(ids)
        # Another owner's response as the cursor is refused as one that does not exist.
        other = await h.get("/console/api/responses", params={"after": theirs.id})
        missing = await h.get("/console/api/responses", params={"after": "resp_" + "0" * 32})
        assert_openai_error(other, 400, "after")
        assert_openai_error(missing, 400, "after")
        assert_openai_error(await h.get(f"/console/api/responses/{theirs.id}"), 404)
        cancel = await h.post(f"/console/api/responses/{theirs.id}/cancel", headers=csrf(me))
        assert_openai_error(cancel, 403)
        # A deleted response leaves the listing.
        await env.stack.openai(env.plain).responses.delete(mine[0])
        left = [r["id"] for r in (await _responses(h, limit=100))["data"]]
        assert mine[0] not in left and set(mine[1:]) <= set(left)


async def slow_response(env: Env) -> str:
    """A background response of the key ``env.plain`` that runs for many seconds (a long
    answer at 1 ms a token, each event kept on JetStream): the test cancels it."""
    resp = await env.stack.openai(env.plain).responses.create(
        model=env.model,
        input="a long one",
        background=True,
        max_output_tokens=60000,
        extra_body={"ignore_eos": True},  # the sim's answer runs to max_output_tokens
    )
    return resp.id


@pytest.mark.stack
async def test_an_open_background_response_shows_progress_and_only_the_admin_cancels_it(
    env: Env,
) -> None:
    slow = await slow_response(env)
    async with key_store(env.bus.url) as keys:
        evil, _ = await keys.create("team-evil-app", owner="team-evil")
    async with env.stack.http() as h:
        me = await login(h, env.admin)

        async def running() -> dict[str, Any] | None:
            rows = (await _responses(h, limit=100))["data"]
            row = next((r for r in rows if r["id"] == slow), None)
            ok = row and row["status"] == "in_progress" and row.get("events", 0) > 0
            return row if ok else None

        await wait_for(running, timeout=30, what="the response running, with its events")
        # Another owner's key: not listed, not found, not cancelled, by the console or the
        # Responses API.
        async with env.stack.http() as e:

            async def logged_in() -> bool:  # its key reaches the bridge's cache in a second
                return (await e.post("/console/api/session", json={"key": evil})).is_success

            await wait_for(logged_in, timeout=10, what="the other owner's key logged in")
            who = (await e.get("/console/api/session")).json()
            assert slow not in [r["id"] for r in (await _responses(e, limit=100))["data"]]
            assert_openai_error(await e.get(f"/console/api/responses/{slow}"), 404)
            c = await e.post(f"/console/api/responses/{slow}/cancel", headers=csrf(who))
            assert_openai_error(c, 403)
        async with env.stack.http("/v1") as api:
            auth = {"Authorization": f"Bearer {evil}"}
            assert_openai_error(await api.post(f"/responses/{slow}/cancel", headers=auth), 404)
            assert_openai_error(await api.get(f"/responses/{slow}", headers=auth), 404)
        row = await running()
        assert row is not None, "another owner's attempts changed the response"
        # The admin cancels it from the listing (the Responses API's cancel).
        c = await h.post(f"/console/api/responses/{slow}/cancel", headers=csrf(me))
        assert c.status_code == 200 and c.json()["status"] == "cancelled", c.text

        async def cancelled() -> bool:
            rows = (await _responses(h, limit=100))["data"]
            return any(r["id"] == slow and r["status"] == "cancelled" for r in rows)

        await wait_for(cancelled, timeout=30, what="the response listed as cancelled")
    stored = await env.stack.openai(env.plain).responses.retrieve(slow)
    assert stored.status == "cancelled"


@pytest.mark.stack
async def test_replicas_name_their_host(env: Env) -> None:
    import socket

    async with env.stack.http() as h:
        await login(h, env.admin)
        data = (await h.get("/console/api/replicas")).json()["data"]
        mine = [r for r in data if r["model"] == env.model]
        assert len(mine) == 2 and all(r["host"] == socket.gethostname() for r in mine), mine


@pytest.mark.stack
async def test_an_alias_is_created_and_deleted_through_the_routing_admin_api(env: Env) -> None:
    alias = f"console-alias-{uuid.uuid4().hex[:8]}"
    path = f"/console/api/routing/aliases/{alias}"

    async def aliases(h: httpx.AsyncClient) -> dict[str, tuple[str, str]]:
        rows = (await h.get("/console/api/routing/aliases")).json()["aliases"]
        return {a["name"]: (a["model"], a["source"]) for a in rows}

    async with env.stack.http() as h:
        me = await login(h, env.admin)
        assert_openai_error(await h.put(path, json={"model": env.model}), 403)
        assert alias not in await aliases(h)
        r = await h.put(path, json={"model": env.model}, headers=csrf(me))
        assert r.status_code == 200 and r.json() == {"name": alias, "model": env.model}, r.text
        assert (await aliases(h))[alias] == (env.model, "runtime")
        # The admin API's refusals come through as they are: an alias may not hide a served
        # model, and the body must name one.
        r = await h.put(
            f"/console/api/routing/aliases/{env.model}", json={"model": alias}, headers=csrf(me)
        )
        assert_openai_error(r, 400)
        assert_openai_error(await h.put(path, json={}, headers=csrf(me)), 400, "model")
        assert_openai_error(await h.delete(path), 403)
        r = await h.delete(path, headers=csrf(me))
        assert r.status_code == 200 and r.json()["name"] == alias, r.text
        assert alias not in await aliases(h)
        events = (await h.get("/console/api/audit")).json()["data"]
        mine = [e for e in events if e["action"] == "alias.changed" and e["target"] == alias]
        assert len(mine) == 2 and {e["actor"] for e in mine} == {f"key:{me['key_id']}"}


@pytest.mark.stack
async def test_an_owner_budget_is_set_shown_and_removed(env: Env) -> None:
    path = "/console/api/owners/team-budget/budget"
    async with env.stack.http() as h:
        me = await login(h, env.admin)
        assert_openai_error(await h.put(path, json={"budget_usd": 5}), 403)
        body = {"budget_usd": 5, "soft_budget_usd": 4, "period": "day"}
        r = await h.put(path, json=body, headers=csrf(me))
        assert r.status_code == 200, r.text
        got = (await h.get(path)).json()
        assert (got["budget_usd"], got["soft_budget_usd"], got["period"]) == (5, 4, "day")
        r = await h.put(path, json={"period": "week"}, headers=csrf(me))
        assert_openai_error(r, 400, "period")
        body = {"budget_usd": None, "soft_budget_usd": None, "period": "month"}
        r = await h.put(path, json=body, headers=csrf(me))  # what the form sends when emptied
        assert r.status_code == 200 and r.json()["budget_usd"] is None, r.text


@pytest.mark.stack
async def test_bad_input_gets_openai_shaped_errors(env: Env) -> None:
    async with env.stack.http() as h:
        assert_openai_error(await h.post("/console/api/session", json={"key": "tb-nope"}), 401)
        assert_openai_error(await h.post("/console/api/session", json={}), 400, "key")
        r = await h.post(
            "/console/api/session", content=b"key=x", headers={"content-type": "text/plain"}
        )
        assert_openai_error(r, 400)  # a cross-site form cannot log anyone in
        r = await h.post(
            "/console/api/session",
            content=b"{not json",
            headers={"content-type": "application/json"},
        )
        assert_openai_error(r, 400)
        assert_openai_error(await h.get("/console/api/keys"), 401)
        async with env.stack.http(cookies={"tb_console": "forged.token"}) as f:
            assert_openai_error(await f.get("/console/api/keys"), 401)
        me = await login(h, env.admin)
        for query, param in (
            ({"limit": "0"}, "limit"),
            ({"limit": "x"}, "limit"),
            ({"offset": "-1"}, "offset"),
            ({"state": "weird"}, "state"),
        ):
            assert_openai_error(await h.get("/console/api/keys", params=query), 400, param)
        for query, param in (({"since": "soon"}, "since"), ({"bucket": "week"}, "bucket")):
            assert_openai_error(await h.get("/console/api/usage", params=query), 400, param)
        r = await h.post("/console/api/keys", json={"name": "x", "rpm": -1}, headers=csrf(me))
        assert_openai_error(r, 400, "rpm")
        r = await h.post("/console/api/keys", json={"name": "x", "nope": 1}, headers=csrf(me))
        assert_openai_error(r, 400, "nope")
        assert_openai_error(await h.get("/console/api/keys/000000000000"), 404)
        assert_openai_error(await h.get("/console/api/nothing"), 404)


@pytest.mark.stack
async def test_a_revoked_key_ends_its_console_sessions(env: Env) -> None:
    async with env.stack.http() as h, env.stack.http() as h2:
        me = await login(h, env.admin)
        r = await h.post(
            "/console/api/keys", json={"name": "short-admin", "admin": True}, headers=csrf(me)
        )
        made = r.json()
        await login(h2, made["key"])
        assert (await h2.get("/console/api/replicas")).status_code == 200
        await h.delete(f"/console/api/keys/{made['id']}", headers=csrf(me))

        async def ended() -> bool:
            return (await h2.get("/console/api/session")).status_code == 401

        await wait_for(ended, timeout=10, what="the revoked key's session did not end")


@pytest.mark.stack
async def test_usage_is_counted_per_key_and_exported_as_csv(env: Env) -> None:
    client = env.stack.openai(env.plain)
    await client.chat.completions.create(
        model=env.model, messages=[{"role": "user", "content": "count me"}], max_tokens=4
    )
    async with env.stack.http() as h:
        await login(h, env.admin)

        async def counted() -> list[dict[str, Any]]:
            data = (await h.get("/console/api/usage", params={"since": "1h"})).json()["data"]
            return [r for r in data if r["key_id"] == env.plain_id]

        await wait_for(counted, timeout=20, what="the key's request in the usage")
        rows = await counted()
        assert sum(r["requests"] for r in rows) >= 1
        assert sum(r["completion_tokens"] for r in rows) >= 1
        assert sum(r["cost_usd"] for r in rows) > 0
        r = await h.get("/console/api/usage", params={"since": "1h", "format": "csv"})
        assert r.headers["content-type"].startswith("text/csv")
        assert "attachment" in r.headers["content-disposition"]
        table = list(csv.DictReader(io.StringIO(r.text)))
        assert any(row["key_id"] == env.plain_id for row in table)
    # An owner's session sees its owner's usage only.
    async with env.stack.http() as h:
        await login(h, env.plain)
        data = (await h.get("/console/api/usage", params={"since": "1h"})).json()["data"]
        assert data and {r["key_id"] for r in data} <= {env.plain_id, env.sibling_id}


async def _publish_usage(url: str, rows: list[tuple[str, str, int]]) -> None:
    """Usage records in TOKENBUS_USAGE as a bridge publishes them: ``(principal, model,
    requests)``, each request 10 prompt and 5 completion tokens, now."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream(timeout=10)
        with contextlib.suppress(Exception):  # the stack's telemetry made it already
            await js.add_stream(records.stream_config())
        batch = [
            records.build(
                request_id=uuid.uuid4().hex,
                source="http",
                model=model,
                timings={"t0": time.time_ns()},
                outcome="ok",
                principal=who,
                prompt_tokens=10,
                completion_tokens=5,
            )
            for who, model, n in rows
            for _ in range(n)
        ]
        await js.publish(records.subject(), codec.encode({"records": batch}))
    finally:
        await nc.drain()


@pytest.mark.stack
async def test_spend_is_paged_charted_with_others_and_exported_whole_and_quoted(
    env: Env,
) -> None:
    # Twelve made-up principals (the costliest has the most requests), one whose name and
    # model a spreadsheet would run as formulas, and the owner team-a's sibling key.
    made = [(f"spend{i:02d}", "spend-model", i + 1) for i in range(12)]
    evil = ("+SUM(1)", '=HYPERLINK("x")', 1)
    await _publish_usage(env.bus.url, [*made, evil, (env.sibling_id, "spend-model", 2)])
    async with env.stack.http() as h:
        await login(h, env.admin)

        async def page(**query: Any) -> dict[str, Any]:
            r = await h.get("/console/api/usage", params={"since": "1h", **query})
            assert r.status_code == 200, r.text
            return dict(r.json())

        async def all_there() -> dict[str, Any] | None:
            u = await page(limit=500)
            keys = {r["key_id"] for r in u["data"]}
            return u if {k for k, _, _ in made} | {evil[0]} <= keys else None

        await wait_for(all_there, timeout=20, what="the published usage")
        whole = await page(limit=500)
        # The table: the costliest first, paged with a total; the pages make up the whole.
        costs = [r["cost_usd"] for r in whole["data"]]
        assert costs == sorted(costs, reverse=True)
        assert whole["total"] == len(whole["data"]) and not whole["has_more"]
        first, second = await page(limit=5), await page(limit=5, offset=5)
        assert len(first["data"]) == 5 and first["has_more"] and first["total"] == whole["total"]
        assert first["data"] == whole["data"][:5] and second["data"] == whole["data"][5:10]
        assert second["offset"] == 5
        # Totals over every row, not the page.
        for f in ("requests", "prompt_tokens", "completion_tokens"):
            assert first["totals"][f] == sum(r[f] for r in whole["data"])
        assert first["totals"]["cost_usd"] == pytest.approx(sum(costs), abs=1e-5)
        # The chart: the 8 keys with the most requests, and the others as one series.
        chart = (await page(measure="requests"))["chart"]
        keys = {r["key_id"] for r in whole["data"]}
        assert len(chart["keys"]) == 8 and chart["others"] == len(keys) - 8
        per_key: dict[str, int] = {}
        for row in whole["data"]:
            per_key[row["key_id"]] = per_key.get(row["key_id"], 0) + row["requests"]
        assert chart["keys"] == sorted(per_key, key=lambda k: (-per_key[k], k))[:8]
        named = {r["key_id"] for r in chart["series"]}
        assert named == {*chart["keys"], "(others)"}
        assert sum(r["requests"] for r in chart["series"]) == first["totals"]["requests"]
        # One key alone: its rows, series and totals only.
        alone = await page(key="spend11")
        assert [(r["key_id"], r["requests"]) for r in alone["data"]] == [("spend11", 12)]
        assert alone["chart"]["keys"] == ["spend11"] and alone["chart"]["others"] == 0
        assert alone["totals"]["requests"] == 12
        assert_openai_error(await h.get("/console/api/usage", params={"measure": "x"}), 400)
        # The export: every row per bucket, key and model, formulas quoted.
        r = await h.get("/console/api/usage/export", params={"since": "1h"})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/csv")
        assert "attachment" in r.headers["content-disposition"]
        table = list(csv.DictReader(io.StringIO(r.text)))
        assert sum(int(row["requests"]) for row in table) >= first["totals"]["requests"]
        assert {k for k, _, _ in made} <= {row["key_id"] for row in table}
        quoted = [row for row in table if row["key_id"] == "'+SUM(1)"]
        assert quoted and quoted[0]["model"] == '\'=HYPERLINK("x")'
        assert not any(row["key_id"].startswith(("=", "+", "-", "@")) for row in table)
    # An owner's session: its owner's keys only, in the table, the chart and the export.
    async with env.stack.http() as h:
        await login(h, env.plain)
        mine = {env.plain_id, env.sibling_id}
        u = (await h.get("/console/api/usage", params={"since": "1h"})).json()
        assert env.sibling_id in {r["key_id"] for r in u["data"]}
        assert {r["key_id"] for r in u["data"]} <= mine and set(u["chart"]["keys"]) <= mine
        assert u["chart"]["others"] == 0
        other = await h.get("/console/api/usage", params={"since": "1h", "key": "spend11"})
        assert other.json()["data"] == [] and other.json()["total"] == 0
        r = await h.get("/console/api/usage/export", params={"since": "1h"})
        assert {row["key_id"] for row in csv.DictReader(io.StringIO(r.text))} <= mine


async def owners_keys(
    env: Env, h: httpx.AsyncClient, me: dict[str, Any], owners: list[str]
) -> list[tuple[str, str]]:
    """A key made for each of ``owners`` through the console, each used once through the
    stack (one chat completion): their (id, secret)."""
    made = []
    for i, owner in enumerate(owners):
        body = {"name": f"grouped-{i}", "owner": owner}
        r = await h.post("/console/api/keys", json=body, headers=csrf(me))
        assert r.status_code == 201, r.text
        made.append((r.json()["id"], r.json()["key"]))
    for _, secret in made:
        await env.stack.openai(secret).chat.completions.create(
            model=env.model, messages=[{"role": "user", "content": "group me"}], max_tokens=4
        )
    return made


_SUMS = ("requests", "prompt_tokens", "completion_tokens")


@pytest.mark.stack
async def test_spend_grouped_by_owner_sums_every_key_of_it_and_shows_its_budget(
    env: Env,
) -> None:
    tag = uuid.uuid4().hex[:6]
    team, solo = f"grp-a-{tag}", f"grp-b-{tag}"
    async with env.stack.http() as h:
        me = await login(h, env.admin)
        (a1, secret), (a2, _), (b1, _) = await owners_keys(env, h, me, [team, team, solo])
        nobody = f"nobody-{tag}"  # a principal that is no key: no owner
        await _publish_usage(env.bus.url, [(nobody, "spend-model", 3)])
        budget = {"budget_usd": 5, "soft_budget_usd": 4, "period": "day"}
        r = await h.put(f"/console/api/owners/{team}/budget", json=budget, headers=csrf(me))
        assert r.status_code == 200, r.text

        async def get(**query: Any) -> dict[str, Any]:
            r = await h.get("/console/api/usage", params={"since": "1h", "limit": 500, **query})
            assert r.status_code == 200, r.text
            return dict(r.json())

        seen: dict[str, dict[str, Any]] = {}

        async def agreed() -> bool:
            """The per-key rows and the owners' rows of one state of the records (the
            worker's record of a request may come after the bridge's)."""
            seen["keys"], seen["owners"] = await get(), await get(group="owner")
            if seen["keys"]["data"] != (await get())["data"]:
                return False
            ours = {r["key_id"] for r in seen["keys"]["data"]} & {a1, a2, b1, nobody}
            return ours == {a1, a2, b1, nobody}

        await wait_for(agreed, timeout=30, what="the keys' usage, settled")
        keys, owners = seen["keys"], seen["owners"]
        rows = {r["owner"]: r for r in owners["data"]}
        assert owners["group"] == "owner" and owners["total"] == len(rows)
        for owner, ids in ((team, {a1, a2}), (solo, {b1})):
            mine = [r for r in keys["data"] if r["key_id"] in ids]
            assert rows[owner]["keys"] == len(ids)
            for f in _SUMS:
                assert rows[owner][f] == sum(r[f] for r in mine), (owner, f)
            assert rows[owner]["cost_usd"] == pytest.approx(
                sum(r["cost_usd"] for r in mine), abs=1e-5
            )
        assert rows[team]["requests"] >= 2 and rows[solo]["requests"] >= 1
        # Keys without an owner (made-up principals here) are one row, owner "".
        assert rows[""]["requests"] >= 3 and rows[""]["keys"] >= 1
        nobody_rows = [r for r in keys["data"] if r["key_id"] == nobody]
        assert rows[""]["requests"] >= sum(r["requests"] for r in nobody_rows) == 3
        # Every owner's rows add up to the same totals as every key's.
        for f in _SUMS:
            assert sum(r[f] for r in owners["data"]) == keys["totals"][f]
        assert owners["totals"]["cost_usd"] == pytest.approx(keys["totals"]["cost_usd"], abs=1e-5)
        assert {r["owner"] for r in owners["chart"]["series"]} <= {*owners["chart"]["owners"], None}
        # One owner alone: its row, its series, its totals and its owner budget.
        one = await get(group="owner", owner=team)
        assert [r["owner"] for r in one["data"]] == [team] and one["owner"] == team
        assert one["chart"]["owners"] == [team] and one["chart"]["others"] == 0
        assert one["totals"]["requests"] == sum(r["requests"] for r in one["chart"]["series"])
        assert one["totals"]["requests"] >= rows[team]["requests"]
        assert one["budget"] == {"period": "day", "budget_usd": 5, "soft_budget_usd": 4}
        assert (await get(group="owner", owner=solo))["budget"] is None
        # The export names each row's owner.
        r = await h.get("/console/api/usage/export", params={"since": "1h"})
        table = list(csv.DictReader(io.StringIO(r.text)))
        assert {row["owner"] for row in table if row["key_id"] in (a1, a2)} == {team}
        assert {row["owner"] for row in table if row["key_id"] == b1} == {solo}
        # Any other grouping is refused.
        for bad in ("model", "owner ", "OWNER"):
            r = await h.get("/console/api/usage", params={"since": "1h", "group": bad})
            assert_openai_error(r, 400, "group")
    # An owner's session: its own owner's row only, and no other owner's view or budget.
    async with env.stack.http() as h:
        await login(h, secret)
        u = (await h.get("/console/api/usage", params={"since": "1h", "group": "owner"})).json()
        assert [r["owner"] for r in u["data"]] == [team] and u["data"][0]["keys"] == 2
        assert u["chart"]["owners"] == [team] and u["chart"]["others"] == 0
        assert u["budget"] is None  # none chosen
        r = await h.get("/console/api/usage", params={"group": "owner", "owner": team})
        assert r.status_code == 200 and r.json()["budget"]["budget_usd"] == 5, r.text
        for other in (solo, "team-a"):
            r = await h.get("/console/api/usage", params={"group": "owner", "owner": other})
            assert_openai_error(r, 404)
        r = await h.get("/console/api/usage/export", params={"since": "1h"})
        assert {row["owner"] for row in csv.DictReader(io.StringIO(r.text))} == {team}


@pytest.mark.unit
async def test_a_slow_summary_is_kept_a_few_seconds_and_made_once_for_concurrent_asks() -> None:
    made: list[int] = []

    async def make() -> console_spend.Summary:
        made.append(1)
        await asyncio.sleep(0.05)
        return console_spend.Summary.of(console_usage.Usage(since=0.0, bucket_s=3600))

    kept = console_spend.Summaries(ttl_s=0.5, min_s=0.0)
    got = await asyncio.gather(*(kept.get(("1h", "hour", None), make) for _ in range(3)))
    assert len(made) == 1 and got[0] is got[1] is got[2]
    assert await kept.get(("1h", "hour", None), make) is got[0]
    await kept.get(("1d", "hour", None), make)  # another period: another read
    assert len(made) == 2
    kept.ttl_s = 0.0  # its summary's time is up (no wait for the 0.5 s to pass)
    await kept.get(("1h", "hour", None), make)  # stale: read again
    assert len(made) == 3
    kept.ttl_s = 0.5
    quick = console_spend.Summaries(min_s=10.0)  # made quickly: not kept
    await quick.get("k", make)
    await quick.get("k", make)
    assert len(made) == 5
    # A caller that leaves does not stop the read for another; a failed read is not kept.
    leaving = asyncio.ensure_future(kept.get("left", make))
    staying = asyncio.ensure_future(kept.get("left", make))
    await wait_for(lambda: len(made) == 6, timeout=10, what="the shared read begun")
    leaving.cancel()
    assert isinstance(await staying, console_spend.Summary) and len(made) == 6

    async def broken() -> console_spend.Summary:
        raise RuntimeError("no stream")

    for _ in range(2):
        with pytest.raises(RuntimeError):
            await kept.get("broken", broken)


@pytest.mark.stack
async def test_the_bus_page_lists_the_server_its_streams_and_a_server_that_does_not_answer(
    env: Env,
) -> None:
    # A request (the usage stream) and a key change (the audit stream) first.
    await env.stack.openai(env.plain).chat.completions.create(
        model=env.model, messages=[{"role": "user", "content": "bus"}], max_tokens=2
    )
    async with env.stack.http() as h:
        me = await login(h, env.admin)
        r = await h.post("/console/api/keys", json={"name": "bus-audited"}, headers=csrf(me))
        assert r.status_code == 201, r.text
        seen: dict[str, Any] = {}

        async def listed() -> bool:
            r = await h.get("/console/api/bus")
            assert r.status_code == 200, r.text
            seen.update(r.json())
            names = {s["name"] for s in seen["streams"]}
            return {"TOKENBUS_USAGE", "TOKENBUS_AUDIT", "KV_tokenbus_keys"} <= names

        await wait_for(listed, timeout=20, what="the usage, audit and keys streams listed")
        assert (await h.get("/console/api/bus")).headers["cache-control"] == "no-store"
        servers = {s["url"]: s for s in seen["servers"]}
        assert servers[env.bus.monitor]["up"] and servers[env.bus.monitor]["name"] == "console-node"
        assert servers[env.bus.monitor]["connections"] >= 1 and servers[env.bus.monitor]["version"]
        assert servers[env.bus.dead] == {"url": env.bus.dead, "up": False}
        fired = {(a["alert"], a["summary"]) for a in seen["alerts"]}
        assert ("TokenbusNATSServerDown", f"{env.bus.dead} does not answer") in fired
        audit = next(s for s in seen["streams"] if s["name"] == "TOKENBUS_AUDIT")
        assert audit["messages"] >= 1 and audit["bytes"] > 0 and audit["cluster"] is None
        for stream in seen["streams"]:
            for c in stream["consumers"]:
                assert c["num_pending"] >= 0 and c["num_ack_pending"] >= 0, c
        assert not seen["truncated"] and "streams_error" not in seen


Events = list[tuple[str, Any]]


class Feed:
    """One open console feed, read on from where the last :meth:`until` stopped."""

    def __init__(self, lines: AsyncIterator[str]) -> None:
        self.lines = lines
        self.seen: Events = []

    async def until(self, cond: Any, timeout: float = 30, what: str = "") -> Events:
        """Events until ``cond(every event so far)`` is true (bounded)."""

        async def run() -> None:
            name = ""
            async for line in self.lines:
                if line.startswith("event: "):
                    name = line[7:]
                elif line.startswith("data: "):
                    self.seen.append((name, json.loads(line[6:])))
                    if cond(self.seen):
                        return
            raise AssertionError(f"the feed ended before {what}")

        if not cond(self.seen):
            try:
                await asyncio.wait_for(run(), timeout)
            except TimeoutError:
                raise AssertionError(f"{what} in time; the feed sent {self.names()}") from None
        return self.seen

    def names(self) -> list[str]:
        return [n for n, _ in self.seen]

    def buses(self) -> list[dict[str, Any]]:
        return [d for n, d in self.seen if n == "bus"]


@contextlib.asynccontextmanager
async def open_feed(h: httpx.AsyncClient, query: str = "") -> AsyncIterator[Feed]:
    async with h.stream("GET", "/console/api/events" + query) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream"
        yield Feed(r.aiter_lines())


def _has_bus(events: Events) -> bool:
    return any(n == "bus" for n, _ in events)


def _streams_of(bus: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {s["name"]: s for s in bus["streams"]}


@pytest.mark.stack
async def test_the_bus_pages_feed_pushes_the_bus_when_it_changes(env: Env) -> None:
    name = f"CONSOLE_FEED_{uuid.uuid4().hex[:8].upper()}"
    nc = await nats.connect(env.bus.url)
    js = nc.jetstream()
    try:
        async with env.stack.http() as h:
            await login(h, env.admin)
            async with open_feed(h, "?page=bus") as f:
                await f.until(_has_bus, what="a bus event")
                first = f.buses()[-1]
                assert {"servers", "streams", "streams_total", "alerts", "truncated"} <= set(first)
                assert {s["url"] for s in first["servers"]} == {env.bus.monitor, env.bus.dead}
                assert name not in _streams_of(first)
                # A stream made on the bus comes by itself, with no Bus API call.
                await js.add_stream(name=name, subjects=[f"consolefeed.{name}"])
                await f.until(
                    lambda ev: name in _streams_of(f.buses()[-1]), what="the new stream pushed"
                )
                for _ in range(3):
                    await js.publish(f"consolefeed.{name}", b"m")
                await f.until(
                    lambda ev: _streams_of(f.buses()[-1]).get(name, {}).get("messages") == 3,
                    what="its three messages pushed",
                )
                # Sent only when it changed: no bus event repeats the one before it.
                buses = f.buses()
                assert all(a != b for a, b in itertools.pairwise(buses))
            # The feed of another page carries no bus events: read past its first tick (the
            # replicas' ages change each tick), which would have carried the read kept.
            async with open_feed(h) as f:
                await f.until(
                    lambda ev: [n for n, _ in ev].count("replicas") >= 2, what="two ticks"
                )
                assert "keys" in f.names() and "bus" not in f.names()
            # A page the feed does not know is refused.
            assert_openai_error(await h.get("/console/api/events?page=nope"), 400, "page")
    finally:
        with contextlib.suppress(Exception):
            await js.delete_stream(name)
        await nc.close()


@pytest.mark.stack
async def test_an_owners_feed_never_carries_the_bus(env: Env) -> None:
    owner = f"team-feed-{uuid.uuid4().hex[:8]}"
    async with key_store(env.bus.url) as keys:
        key, _ = await keys.create("feed-owner-app", owner=owner)
    async with env.stack.http() as adm, env.stack.http() as h:
        await login(adm, env.admin)
        # A bus read is kept in the bridge: an admin's Bus page got one.
        async with open_feed(adm, "?page=bus") as f:
            await f.until(_has_bus, what="the admin's bus event")

        async def logged_in() -> bool:  # its key reaches the bridge's cache in a second
            return (await h.post("/console/api/session", json={"key": key})).is_success

        await wait_for(logged_in, timeout=10, what="the owner's key logged in")
        async with open_feed(h, "?page=bus") as f:
            await f.until(lambda ev: "keys" in f.names(), what="the owner's key count")
            assert f.seen[-1] == ("keys", {"count": 1})
            # A second key of the owner: another tick's events, after every one of the first.
            async with key_store(env.bus.url) as keys:
                await keys.create("feed-owner-batch", owner=owner)
            await f.until(lambda ev: ("keys", {"count": 2}) in ev, what="the second key counted")
            assert set(f.names()) == {"keys"}, f.names()


@pytest.mark.stack
async def test_many_bus_feeds_share_one_read_per_interval(env: Env) -> None:
    async with env.stack.http() as h, contextlib.AsyncExitStack() as feeds:
        await login(h, env.admin)
        began, before = time.monotonic(), env.bus.down.reads
        opened = [await feeds.enter_async_context(open_feed(h, "?page=bus")) for _ in range(8)]
        await asyncio.gather(*(f.until(_has_bus, what="a bus event") for f in opened))
        # With all eight open, until the bridge has read the bus three more times.
        await wait_for(
            lambda: env.bus.down.reads >= before + 3, timeout=40, what="three more bus reads"
        )
        took, reads = time.monotonic() - began, env.bus.down.reads - before
    # One read begins at most every FEED_INTERVAL_S, whatever the number of feeds (one read
    # per feed would make eight in the first second).
    assert reads <= took / console_bus.FEED_INTERVAL_S + 2, (reads, took)


@pytest.mark.unit
async def test_the_bus_read_is_shared_and_begun_once_per_interval() -> None:
    done = asyncio.Event()
    reads: list[int] = []

    async def read() -> dict[str, Any]:
        reads.append(1)
        await done.wait()
        return {"streams": [], "n": len(reads)}

    latest = console_bus.Latest(read, interval_s=3600)
    assert {latest.get() for _ in range(64)} == {None}  # 64 feeds ask at once: one read
    await wait_for(lambda: reads, timeout=10, what="the read begun")
    done.set()
    await wait_for(lambda: latest.get() is not None, timeout=10, what="the read kept")
    assert json.loads(latest.get() or "") == {"streams": [], "n": 1}
    assert latest.reads == 1 and len(reads) == 1
    latest.interval_s = 0.0  # its interval is up (no wait for an hour to pass)
    latest.get()
    latest.interval_s = 3600
    await wait_for(lambda: '"n": 2' in (latest.get() or ""), timeout=10, what="the next read")
    assert len(reads) == latest.reads

    async def broken() -> dict[str, Any]:
        raise RuntimeError("no JetStream")

    latest.read = broken  # a failed read keeps the last
    latest.interval_s = 0.0
    kept = latest.get()
    latest.interval_s = 3600
    assert latest.reads == 3
    await wait_for(lambda: latest._task is None, timeout=10, what="the failed read over")
    assert latest.get() == kept


@dataclass
class Lora:
    """A worker of a model of its own whose sim loads LoRA adapters, and an adapter folder
    it accepts: loading one there touches none of the module's model's replicas."""

    model: str
    replica: str
    path: str


@pytest.fixture(scope="module")
async def lora(env: Env, tmp_path_factory: pytest.TempPathFactory) -> Lora:
    model = new_model()
    loads = {"TOKENBUS_WORKER__SIM__LORA_LOAD_MS": "20"}
    start_worker(env.stack.procs, model, "lora", "--sim-decode-ms", "1", env=loads)
    folder = tmp_path_factory.mktemp("lora") / "sql"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"r": 8, "peft_type": "LORA"}))
    async with env.stack.http() as h:
        await login(h, env.admin)

        async def heard() -> bool:
            data = (await h.get("/console/api/replicas")).json()["data"]
            return any(r["model"] == model for r in data)

        await wait_for(heard, timeout=30, what="the bridge hearing the LoRA worker")
    return Lora(model, f"{model}-lora", str(folder))


@pytest.mark.stack
async def test_an_adapter_is_loaded_and_unloaded_through_the_adapters_admin_api(
    env: Env, lora: Lora
) -> None:
    name = f"sql-{uuid.uuid4().hex[:6]}"
    body = {"name": name, "model": lora.model, "path": lora.path}
    adm = {"api-key": env.admin}

    async def admin_rows(h: httpx.AsyncClient) -> dict[str, Any]:
        r = await h.get("/v1/admin/adapters", headers=adm)
        return {a["name"]: a for a in r.json()["adapters"]}

    async with env.stack.http() as h:
        me = await login(h, env.admin)
        # Without the CSRF token: refused, nothing loaded.
        assert_openai_error(await h.post("/console/api/adapters", json=body), 403)
        assert name not in await admin_rows(h)
        # The admin API's refusals come through as they are (400 naming the field).
        r = await h.post("/console/api/adapters", json={**body, "replicas": 0}, headers=csrf(me))
        assert_openai_error(r, 400, "replicas")
        r = await h.post(
            "/console/api/adapters", json={**body, "model": "no-such-model"}, headers=csrf(me)
        )
        assert_openai_error(r, 404, "model")
        r = await h.post("/console/api/adapters", json=body, headers=csrf(me))
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["adapter"] == {**body, "replicas": 1} and not out["failed"]
        assert [x["replica"] for x in out["loaded"]] == [lora.replica]
        row = {**body, "replicas": 1, "wanted": True, "loaded_on": [lora.replica]}
        listed = (await h.get("/console/api/adapters")).json()["adapters"]
        assert [a for a in listed if a["name"] == name] == [row]
        assert (await admin_rows(h))[name] == row  # the admin API's own state

        async def on_the_replica() -> bool:  # its heartbeats, as the Replicas table shows them
            data = (await h.get("/console/api/replicas")).json()["data"]
            return any(r["replica"] == lora.replica and name in r["adapters"] for r in data)

        await wait_for(on_the_replica, timeout=10, what="the adapter in the replica's beats")
        path = f"/console/api/adapters/{name}"
        assert_openai_error(await h.delete(path, params={"drain_s": "0"}), 403)
        r = await h.delete(path, params={"drain_s": "soon"}, headers=csrf(me))
        assert_openai_error(r, 400, "drain_s")
        r = await h.delete(path, params={"drain_s": "0"}, headers=csrf(me))
        assert r.status_code == 200, r.text
        assert [x["replica"] for x in r.json()["unloaded"]] == [lora.replica]

        async def gone() -> bool:
            return name not in await admin_rows(h)

        await wait_for(gone, timeout=10, what="the adapter unloaded")
        assert_openai_error(await h.delete(path, headers=csrf(me)), 404)
        events = (await h.get("/console/api/audit")).json()["data"]
        mine = [e for e in events if e["target"] == name]
        assert {e["action"] for e in mine} == {"adapter.loaded", "adapter.unloaded"}
        assert {e["actor"] for e in mine} == {f"key:{me['key_id']}"}


@pytest.mark.stack
async def test_the_owners_with_a_budget_are_listed_with_it(env: Env) -> None:
    owners = {
        f"list-{uuid.uuid4().hex[:6]}": (7.5, 6.0, "day"),
        "ünïcode / team": (3, None, "total"),
    }
    async with env.stack.http() as h:
        me = await login(h, env.admin)

        async def listed() -> dict[str, dict[str, Any]]:
            r = await h.get("/console/api/owners")
            assert r.status_code == 200, r.text
            return {b["owner"]: b for b in r.json()["data"]}

        for owner, (hard, soft, period) in owners.items():
            body = {"budget_usd": hard, "soft_budget_usd": soft, "period": period}
            path = f"/console/api/owners/{quote(owner, safe='')}/budget"
            r = await h.put(path, json=body, headers=csrf(me))
            assert r.status_code == 200, r.text
        found = await listed()
        for owner, (hard, soft, period) in owners.items():
            b = found[owner]
            assert (b["budget_usd"], b["soft_budget_usd"], b["period"]) == (hard, soft, period)
            assert b["spent_usd"] == 0 and b["spend_period"], b
        names = list(found)
        assert names == sorted(names)
        # The keys admin API answers the same list.
        r = await h.get("/v1/admin/keys/owners", headers={"api-key": env.admin})
        assert {b["owner"] for b in r.json()["data"]} == set(found)
        # A removed budget is not listed.
        gone = next(iter(owners))
        body = {"budget_usd": None, "soft_budget_usd": None, "period": "day"}
        r = await h.put(f"/console/api/owners/{gone}/budget", json=body, headers=csrf(me))
        assert r.status_code == 200, r.text
        assert gone not in await listed() and "ünïcode / team" in await listed()
    async with env.stack.http() as h:
        await login(h, env.plain)
        assert_openai_error(await h.get("/console/api/owners"), 403)


async def read_events(
    h: httpx.AsyncClient, until: Any, timeout: float = 20
) -> list[tuple[str, Any]]:
    """Events of the console's feed until ``until(events)`` is true (bounded)."""
    seen: list[tuple[str, Any]] = []

    async def run() -> None:
        async with h.stream("GET", "/console/api/events") as r:
            assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream"
            name = ""
            async for line in r.aiter_lines():
                if line.startswith("event: "):
                    name = line[7:]
                elif line.startswith("data: "):
                    seen.append((name, json.loads(line[6:])))
                    if until(seen):
                        return

    await asyncio.wait_for(run(), timeout)
    return seen


async def _both(rows: Any) -> bool:
    return len(await rows) == 2


@pytest.mark.fault
async def test_the_feed_shows_replicas_and_a_killed_worker_leaves(env: Env) -> None:
    # Last of the module's HTTP tests: it kills a worker.
    async with env.stack.http() as h:
        await login(h, env.admin)

        # Both (a heartbeat late on a loaded machine drops a replica for a moment).
        async def listed() -> list[dict[str, Any]]:
            data = (await h.get("/console/api/replicas")).json()["data"]
            return [r for r in data if r["model"] == env.model]

        await wait_for(
            lambda: _both(listed()), timeout=20, what="both replicas on the replicas page"
        )
        assert all(r["health"] == "ok" and 0 <= r["load"] <= 1 for r in await listed())

        def both(events: list[tuple[str, Any]]) -> bool:
            reps = [d for n, d in events if n == "replicas"]
            return bool(reps) and len([r for r in reps[-1] if r["model"] == env.model]) == 2

        events = await read_events(h, both)
        assert ("keys" in {n for n, _ in events}) and both(events)
        env.stack.workers[1].signal(signal.SIGKILL)

        def one_left(events: list[tuple[str, Any]]) -> bool:
            reps = [d for n, d in events if n == "replicas"]
            mine = [r["replica"] for r in reps[-1] if r["model"] == env.model] if reps else []
            return mine == [f"{env.model}-0"]

        await read_events(h, one_left)
    # An owner's feed carries no replicas.
    async with env.stack.http() as h:
        await login(h, env.plain)
        events = await read_events(h, lambda ev: any(n == "keys" for n, _ in ev))
        assert "replicas" not in {n for n, _ in events}


@pytest.mark.unit
def test_the_page_ships_as_package_data() -> None:
    # A non-editable install (the images, `pip install tokenbus`) has the console's files.
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = meta["tool"]["setuptools"]["package-data"]["gateway"]
    files = sorted((ROOT / "gateway" / "console_static").iterdir())
    assert {"index.html", "app.js", "style.css"} <= {f.name for f in files}
    for f in files:
        assert any(fnmatch.fnmatch(f"console_static/{f.name}", g) for g in globs), f.name


@pytest.mark.unit
def test_the_cookie_is_secure_over_tls_and_never_holds_the_key() -> None:
    # The bridge sets Secure where it serves HTTPS (scope scheme "https"); the flags of both
    # the session's cookie and the one that clears it.
    rec = KeyRecord(id="0123456789ab", name="k", hash="0" * 64, admin=True)
    s = Session(rec, "admin", time.time() + 60, "n" * 32, "c" * 32)
    sessions = Sessions(None, None)  # type: ignore[arg-type]  # no bus needed for cookies
    for secure in (True, False):
        for cookie in (sessions.cookie("tok", s, secure), Sessions.clear_cookie(secure)):
            text = cookie.decode()
            assert "HttpOnly" in text and "SameSite=Strict" in text and "Path=/console" in text
            assert ("; Secure" in text) is secure, text
    assert "Max-Age=0" in Sessions.clear_cookie(True).decode()
    assert 50 <= int(sessions.cookie("tok", s, True).decode().split("Max-Age=")[1][:2]) <= 60


@pytest.mark.unit
def test_the_kv_check_column_says_unknown_trusted_distrusted_or_incompatible() -> None:
    registry = Registry()
    for n, check in enumerate(({"requests": 2, "predicted": 64, "reported": 48}, None, {})):
        hb: dict[str, Any] = {"replica": f"r{n}", "model": "m", "adapters": {"b": "/b", "a": "/a"}}
        if check is not None:
            hb["kv_check"] = check
        registry.update(hb)
    kv = KVCheck(None, None)
    none: Any = None  # the admin and routing handlers: the replicas need neither
    rows = {r["replica"]: r for r in Console(none, none, registry, Settings())._replicas()}
    assert rows["r0"]["adapters"] == ["a", "b"]
    assert rows["r1"]["kv_check"] is None  # its heartbeats carry no totals
    zero = {"requests": 0, "predicted": 0, "reported": 0, "ratio": None, "verdict": None}
    assert rows["r2"]["kv_check"] == zero  # no in-process router: no verdict
    want = {"requests": 2, "predicted": 64, "reported": 48, "ratio": 0.75, "verdict": None}
    assert rows["r0"]["kv_check"] == want
    console = Console(none, none, registry, Settings(), kv)
    assert console._replicas()[0]["kv_check"]["verdict"] == "trusted"
    kv.disagreeing["r0"] = "reported 48 where 64 were predicted"
    assert console._replicas()[0]["kv_check"]["verdict"] == "distrusted"
    kv.incompatible["r0"] = "block size 32"
    assert console._replicas()[0]["kv_check"]["verdict"] == "incompatible"


@pytest.mark.stack
def test_replicas_show_their_site_and_the_router_s_spill_over() -> None:
    """Issue 71: the replicas page names each replica's site, with its accepts' round trip
    where this bridge's router measured it, and what that router did with its own site's
    requests: kept there, or spilled (by site)."""
    from router.dispatch import SITE_PLACEMENTS

    registry = Registry()
    for name, site in (("s-a0", "a"), ("s-b0", "b"), ("s-x", "")):
        registry.update({"replica": name, "model": "m", **({"site": site} if site else {})})
    registry.get("s-b0").heard_ack(0.0123)  # type: ignore[union-attr]
    none: Any = None
    console = Console(none, none, registry, Settings(site="a"))
    rows = {r["replica"]: r for r in console._replicas()}
    assert rows["s-a0"]["site"] == "a" and "ack_ms" not in rows["s-a0"]
    assert rows["s-b0"]["site"] == "b" and rows["s-b0"]["ack_ms"] == 12.3
    assert "site" not in rows["s-x"]
    before = console._placements()
    SITE_PLACEMENTS.labels("a", "local").inc(3)
    SITE_PLACEMENTS.labels("b", "spilled").inc(2)
    after = console._placements()
    assert after["site"] == "a"
    assert after["kept"] - before["kept"] == 3
    assert after["spilled"]["b"] - before["spilled"].get("b", 0) == 2
    page = (resources.files("gateway") / "console_static" / "app.js").read_text()
    assert "renderPlacements(out.placements)" in page and 'class: "site"' in page
