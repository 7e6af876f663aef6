"""Rate limits held exactly across several limiter instances, on a real bus."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import nats
import pytest

from auth.limits import BUCKET, WINDOW_S
from auth.ratelimit import estimate_tokens, parse_limits
from auth.store import KeyStore
from bus_schemas import errors as E
from bus_schemas.client import Client
from tests.conftest import NatsServer, Procs, free_port, stack, wait_http, wait_replicas
from tests.test_auth import wait_for_key

MSG = [{"role": "user", "content": "hi"}]


def test_limits_header_and_token_estimate() -> None:
    assert parse_limits("10,,3") == (10, None, 3)
    assert parse_limits("") == (None, None, None)
    env = {"messages": [{"role": "user", "content": "x" * 40}], "params": {"max_tokens": 7}}
    assert estimate_tokens(env) == 17


async def fresh_window(margin: float = 8.0) -> None:
    """Start a test well inside a one-minute window, so all its requests count in one."""
    left = WINDOW_S - time.time() % WINDOW_S
    if left < margin:
        await asyncio.sleep(left + 0.1)


async def _key(url: str, **limits: Any) -> tuple[Any, KeyStore, str, str]:
    nc = await nats.connect(url)
    store = await KeyStore(nc).open()
    key, rec = await store.create("limited", **limits)
    return nc, store, key, rec.id


async def test_rpm_is_exact_across_three_limiters(nats_server: NatsServer, model: str) -> None:
    nc, store, key, kid = await _key(nats_server.url, rpm=10)
    try:
        async with (
            stack(nats_server.url, model, workers=1, auths=1, ratelimits=3) as svcs,
            await Client.connect(nats_server.url) as c,
        ):
            await wait_for_key(svcs, kid)
            await fresh_window()

            async def one() -> Any:
                try:
                    return await c.chat_completion(model, MSG, max_tokens=2, api_key=key)
                except E.TokenbusError as exc:
                    return exc

            outs = await asyncio.gather(*(one() for _ in range(30)))
            ok = [o for o in outs if not isinstance(o, E.TokenbusError)]
            limited = [o for o in outs if isinstance(o, E.RateLimited)]
            assert len(ok) == 10 and len(limited) == 20, outs
            served = [r.discovery.endpoints[0].num_requests for r in svcs["ratelimit"]]
            assert sum(1 for n in served if n > 0) >= 2, served
            err = limited[0]
            assert err.status == 429 and err.retryable
            assert int(err.headers["Retry-After"]) >= 1
            assert err.headers["x-ratelimit-limit-requests"] == "10"
            assert err.headers["x-ratelimit-remaining-requests"] == "0"
            # A limiter restart keeps the count: it lives in the bus, not in the process.
            for r in svcs["ratelimit"]:
                await r.drain(timeout=2)
            async with stack(
                nats_server.url,
                model,
                workers=0,
                with_router=False,
                with_ingress=False,
                ratelimits=1,
            ):
                with pytest.raises(E.RateLimited):
                    await c.chat_completion(model, MSG, max_tokens=2, api_key=key)
    finally:
        await store.close()
        await nc.drain()


async def test_tokens_are_reserved_then_reconciled(nats_server: NatsServer, model: str) -> None:
    nc, store, key, kid = await _key(nats_server.url, tpm=10_000)
    try:
        async with (
            stack(nats_server.url, model, workers=1, auths=1, ratelimits=1) as svcs,
            await Client.connect(nats_server.url) as c,
        ):
            await wait_for_key(svcs, kid)
            await fresh_window()
            s = c.chat(model, MSG, max_tokens=400, api_key=key)
            await s.__anext__()
            kv = await nc.jetstream().key_value(BUCKET)
            window = int(time.time() // WINDOW_S)
            reserved = json.loads((await kv.get(f"rl.{kid}.{window}")).value)["t"]
            assert reserved == 1 + 400  # prompt estimate + max_tokens
            await s.aclose()  # ends early: far fewer tokens than reserved
            for _ in range(100):
                t = json.loads((await kv.get(f"rl.{kid}.{window}")).value)["t"]
                if t < reserved:
                    break
                await asyncio.sleep(0.05)
            assert t < 50, t
            with pytest.raises(E.RateLimited) as ei:
                await c.chat_completion(model, MSG, max_tokens=20_000, api_key=key)
            assert "tokens per minute" in ei.value.message
            assert ei.value.headers["x-ratelimit-limit-tokens"] == "10000"
    finally:
        await store.close()
        await nc.drain()


async def test_concurrency_limit_frees_slots_when_requests_end(
    nats_server: NatsServer, model: str
) -> None:
    nc, store, key, kid = await _key(nats_server.url, max_concurrent=2)
    try:
        async with (
            stack(nats_server.url, model, workers=1, auths=1, ratelimits=2) as svcs,
            await Client.connect(nats_server.url) as c,
        ):
            await wait_for_key(svcs, kid)
            a = c.chat(model, MSG, max_tokens=10_000, api_key=key)
            b = c.chat(model, MSG, max_tokens=10_000, api_key=key)
            await a.__anext__()
            await b.__anext__()
            with pytest.raises(E.RateLimited) as ei:
                await c.chat_completion(model, MSG, max_tokens=2, api_key=key)
            assert "concurrent" in ei.value.message
            await a.aclose()
            for _ in range(100):
                try:
                    out = await c.chat_completion(model, MSG, max_tokens=2, api_key=key)
                    break
                except E.RateLimited:
                    await asyncio.sleep(0.05)
            assert out.usage.completion_tokens == 2
            await b.aclose()
    finally:
        await store.close()
        await nc.drain()


async def test_http_responses_carry_openai_rate_limit_headers(procs: Procs, model: str) -> None:
    nc, store, key, _ = await _key(procs.url, rpm=3, tpm=100_000)
    await store.close()
    await nc.drain()
    env = {"TOKENBUS_INGRESS__PIPELINE": '["auth", "ratelimit", "route"]'}
    port = free_port()
    for name in ("auth", "ratelimit", "router"):
        procs.start(name, "serve", name, env=env)
    procs.start("worker", "serve", "worker", "--model", model, env=env)
    procs.start("bridge", "serve", "bridge", "--port", str(port), env=env)
    await wait_replicas(procs.url, model, 1)
    await wait_http(f"http://127.0.0.1:{port}/ready")
    await asyncio.sleep(0.5)  # the auth instance has loaded the key
    await fresh_window()
    body = {"model": model, "messages": MSG, "max_tokens": 2}
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}/v1", headers={"Authorization": f"Bearer {key}"}
    ) as h:
        remaining = []
        for stream in (False, True, False):
            r = await h.post("/chat/completions", json={**body, "stream": stream})
            assert r.status_code == 200, r.text
            assert r.headers["x-ratelimit-limit-requests"] == "3"
            assert r.headers["x-ratelimit-limit-tokens"] == "100000"
            assert r.headers["x-ratelimit-reset-requests"].endswith("s")
            remaining.append(r.headers["x-ratelimit-remaining-requests"])
        assert remaining == ["2", "1", "0"]
        r = await h.post("/chat/completions", json=body)
        assert r.status_code == 429
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        assert int(r.headers["retry-after"]) >= 1
        assert r.headers["x-ratelimit-remaining-requests"] == "0"
