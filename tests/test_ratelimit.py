"""Rate limits held exactly across several limiter instances, on a real bus."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
import structlog
from nats.aio.client import Client as NATS

from auth.limits import BUCKET, WINDOW_S, Admission, Limiter, parse_info
from auth.ratelimit import DEFAULT_RESERVE, RateLimitCheck, estimate_tokens, fit_tpm, parse_limits
from auth.store import KeyStore
from bus_schemas import codec, subjects
from bus_schemas import errors as E
from bus_schemas import headers as H
from services import usage
from tests.support.busdata import key_store
from tests.support.inprocess import stack
from tests.support.natsserver import NatsServer
from tests.support.procs import Procs, start_stack
from tests.support.waits import fresh_window, wait_for_key
from tokenbus import Client

MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.unit
def test_limits_header_and_token_estimate() -> None:
    assert parse_limits("10,,3") == (10, None, 3)
    assert parse_limits("") == (None, None, None)
    env = {"messages": [{"role": "user", "content": "x" * 40}], "params": {"max_tokens": 7}}
    assert estimate_tokens(env) == 17


@pytest.mark.unit
def test_a_default_max_tokens_is_fitted_to_the_keys_tpm_and_reserves_little() -> None:
    from bus_schemas.messages import FILL_CONTEXT

    env = {
        "messages": [{"role": "user", "content": "x" * 40}],
        "params": {"max_tokens": FILL_CONTEXT, "max_tokens_set": False},
    }
    # The client set none: the answer may fill the context, so it is reserved at
    # DEFAULT_RESERVE (the real use is charged when it ends) ...
    assert estimate_tokens(env) == 10 + DEFAULT_RESERVE
    # ... and never outgrows the key's minute: lowered to what the TPM leaves after the prompt.
    assert fit_tpm(env, 1_000) and env["params"]["max_tokens"] == 990
    assert not fit_tpm(env, 5_000)  # already within it
    assert fit_tpm(env, 5) and env["params"]["max_tokens"] == 1  # at least one token
    # The client's own value is left alone (refused as too big, as before).
    own = {"messages": [], "params": {"max_tokens": 10**6, "max_tokens_set": True}}
    assert not fit_tpm(own, 1_000) and own["params"]["max_tokens"] == 10**6


@pytest.mark.bus
async def test_rpm_is_exact_across_three_limiters(
    nats_server: NatsServer, model: str, keys: KeyStore, client: Client
) -> None:
    key, rec = await keys.create("limited", rpm=10)
    async with stack(nats_server.url, model, workers=1, auths=1, ratelimits=3) as svcs:
        await wait_for_key(svcs, rec.id)
        await fresh_window()

        async def one() -> Any:
            try:
                return await client.chat_completion(model, MSG, max_tokens=2, api_key=key)
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
                await client.chat_completion(model, MSG, max_tokens=2, api_key=key)


@pytest.mark.bus
async def test_tokens_are_reserved_then_reconciled(
    nats_server: NatsServer, model: str, keys: KeyStore, client: Client
) -> None:
    key, rec = await keys.create("limited", tpm=10_000)
    kid = rec.id
    async with stack(nats_server.url, model, workers=1, auths=1, ratelimits=1) as svcs:
        await wait_for_key(svcs, kid)
        await fresh_window()
        s = client.chat(model, MSG, max_tokens=400, api_key=key)
        await s.__anext__()
        kv = await keys.nc.jetstream().key_value(BUCKET)
        window = int(time.time() // WINDOW_S)
        reserved = json.loads((await kv.get(f"rl.{kid}.{window}")).value)["t"]
        assert reserved == 1 + 400  # prompt estimate + max_tokens
        await s.aclose()  # ends early: far fewer tokens than reserved
        # The unused tokens come back to the key: a request that fits the minute only
        # with them is admitted (401 + 9 701 > 10 000), as soon as the usage report is in.
        for _ in range(100):
            try:
                big = client.chat(model, MSG, max_tokens=9_700, api_key=key)
                await big.__anext__()
                break
            except E.RateLimited:
                await asyncio.sleep(0.05)
        else:
            pytest.fail("the unused reservation never came back")
        await big.aclose()
        # The key's window never holds more than the limit, whatever was given back.
        assert json.loads((await kv.get(f"rl.{kid}.{window}")).value)["t"] <= 10_000
        # Fits a whole minute's budget but not what is left of this one: wait and retry.
        with pytest.raises(E.RateLimited) as ei:
            await client.chat_completion(model, MSG, max_tokens=9_999, api_key=key)
        assert "tokens per minute" in ei.value.message
        assert ei.value.headers["x-ratelimit-limit-tokens"] == "10000"
        assert int(ei.value.headers["Retry-After"]) >= 1
        # More than any minute holds: the client's to fix, a 400 naming the field.
        with pytest.raises(E.TokensExceedLimit) as big:
            await client.chat_completion(model, MSG, max_tokens=20_000, api_key=key)
        assert big.value.status == 400 and big.value.param == "max_tokens"
        assert "Limit 10000, Requested 20001" in big.value.message
        assert not big.value.retryable


@pytest.mark.bus
async def test_a_request_without_max_tokens_gets_the_context_within_the_keys_tpm(
    nats_server: NatsServer, model: str, keys: KeyStore, client: Client
) -> None:
    """No max_tokens: the answer may fill the context (not 512), lowered to the key's TPM
    by the ratelimit stage; over NATS through the stage service."""
    key, rec = await keys.create("small-tpm", tpm=700)
    async with stack(nats_server.url, model, workers=1, auths=1, ratelimits=1) as svcs:
        await wait_for_key(svcs, rec.id)
        await fresh_window()
        whole = await client.chat_completion(model, MSG, api_key=key, ignore_eos=True)
        # 700 less the prompt's estimate (one token): the engine ran to the lowered budget.
        assert whole.usage is not None
        assert (whole.finish_reason, whole.usage.completion_tokens) == ("length", 699)


@pytest.mark.bus
async def test_concurrency_limit_frees_slots_when_requests_end(
    nats_server: NatsServer, model: str, keys: KeyStore, client: Client
) -> None:
    key, rec = await keys.create("limited", max_concurrent=2)
    async with stack(nats_server.url, model, workers=1, auths=1, ratelimits=2) as svcs:
        await wait_for_key(svcs, rec.id)
        a = client.chat(model, MSG, max_tokens=10_000, api_key=key)
        b = client.chat(model, MSG, max_tokens=10_000, api_key=key)
        await a.__anext__()
        await b.__anext__()
        with pytest.raises(E.RateLimited) as ei:
            await client.chat_completion(model, MSG, max_tokens=2, api_key=key)
        assert "concurrent" in ei.value.message
        await a.aclose()
        for _ in range(100):
            try:
                out = await client.chat_completion(model, MSG, max_tokens=2, api_key=key)
                break
            except E.RateLimited:
                await asyncio.sleep(0.05)
        assert out.usage.completion_tokens == 2
        await b.aclose()


@pytest.mark.stack
async def test_http_responses_carry_openai_rate_limit_headers(procs: Procs, model: str) -> None:
    async with key_store(procs.url) as keys:
        key, _ = await keys.create("limited", rpm=3, tpm=100_000)
    env = {"TOKENBUS_INGRESS__PIPELINE": '["auth", "ratelimit", "route"]'}
    # settle: the auth instance has loaded the key
    stack = await start_stack(procs, model, "auth", "ratelimit", "router", env=env, settle=0.5)
    await fresh_window()
    body = {"model": model, "messages": MSG, "max_tokens": 2}
    async with stack.http("/v1", headers={"Authorization": f"Bearer {key}"}) as h:
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


# --- the limiter's leases, on a real bus --------------------------------------------------


async def _admit(lim: Limiter, principal: str, rid: str, **limits: Any) -> Any:
    args: dict[str, Any] = {"rpm": None, "tpm": None, "concurrent": None, **limits}
    try:
        return await lim.admit(principal, rid, tokens=10, deadline_s=time.time() + 60, **args)
    except E.RateLimited as exc:
        return exc


@pytest.mark.bus
async def test_a_busy_key_far_from_its_limit_rarely_touches_the_store(nc: NATS) -> None:
    bucket = "test_busy_key"  # its own bucket: revisions count this key's writes only
    lim = await Limiter(nc, bucket=bucket).open()
    try:
        await fresh_window()
        for i in range(200):
            adm = await _admit(lim, "busy", f"r{i}", rpm=1_000_000, tpm=100_000_000)
            assert isinstance(adm, Admission)
        kv = await nc.jetstream().key_value(bucket)
        entry = await kv.get(f"rl.busy.{int(time.time() // WINDOW_S)}")
        # Leases of 1, 2, 4, ... requests: a handful of writes, not one per request.
        assert entry.revision is not None and entry.revision < 20, entry.revision
        state = json.loads(entry.value or b"{}")
        assert state["r"] >= 200 and state["t"] >= 200 * 10
        assert adm.info["x-ratelimit-remaining-requests"] == str(1_000_000 - 200)
    finally:
        await lim.close()


@pytest.mark.bus
async def test_leases_never_admit_more_than_the_limit_across_instances(nc: NATS) -> None:
    lims = [await Limiter(nc).open() for _ in range(3)]
    try:
        await fresh_window()
        outs = await asyncio.gather(
            *(_admit(lims[i % 3], "shared", f"r{i}", rpm=200) for i in range(300))
        )
        admitted = sum(isinstance(o, Admission) for o in outs)
        # Never above the limit; below it only by what an instance leased and did not use.
        assert 180 <= admitted <= 200, admitted
        assert all(isinstance(o, (Admission, E.RateLimited)) for o in outs)
    finally:
        for lim in lims:
            await lim.close()


@pytest.mark.bus
async def test_concurrency_slots_move_between_instances_and_expire_with_a_dead_one(
    nc: NATS,
) -> None:
    a = await Limiter(nc, owner="a", lease_ttl_s=1.5).open()
    b = await Limiter(nc, owner="b", lease_ttl_s=1.5).open()
    try:
        got = [await _admit(a, "k", f"a{i}", concurrent=4) for i in range(3)]
        assert all(isinstance(g, Admission) for g in got)
        assert isinstance(await _admit(b, "k", "b0", concurrent=4), Admission)
        refused = await _admit(b, "k", "b1", concurrent=4)
        assert isinstance(refused, E.RateLimited) and "concurrent" in refused.message
        # A request ends on a: its slot goes back to the store and b can take it.
        assert await a.settle("k", "a0", 10)
        assert isinstance(await _admit(b, "k", "b1", concurrent=4), Admission)
        # a dies without giving its two slots back: they expire with its lease.
        assert a._renewer is not None
        a._renewer.cancel()
        assert isinstance(await _admit(b, "k", "b2", concurrent=4), E.RateLimited)
        for _ in range(60):
            if isinstance(await _admit(b, "k", "b2", concurrent=4), Admission):
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail("the dead instance's slots never expired")
    finally:
        await b.close()


@pytest.mark.bus
async def test_usage_reports_settle_only_attempts_the_limiter_admitted(nc: NATS) -> None:
    # Usage subjects are open to every worker: a report for a request (or an attempt) this
    # limiter never admitted, or one that claims another window or reservation, must not
    # charge the key's tokens nor free its slots. Reports go through the real stage check.
    lim = await Limiter(nc, bucket="test_forged_usage").open()
    check = RateLimitCheck(lim, fail_open=False, log=structlog.get_logger())
    await check.start(nc)
    kv = await nc.jetstream().key_value("test_forged_usage")
    env = {"messages": MSG, "params": {"max_tokens": 99}}  # reserves 1 + 99 tokens

    async def used_tokens(window: int) -> int:
        return int(json.loads((await kv.get(f"rl.forge.{window}")).value or b"{}")["t"])

    async def report(rid: str, **body: Any) -> None:
        base = {"principal": "forge", "request_id": rid, "flags": "wc", "used": 0}
        await nc.publish(subjects.usage(lim.owner), codec.encode({**base, **body}))

    try:
        await fresh_window()
        hdrs = {H.PRINCIPAL: "forge", H.LIMITS: ",1000,1", H.REQUEST_ID: "real"}
        await check.apply(hdrs, env)
        window = int(hdrs[H.RATELIMIT].split(",")[0])
        leased = await used_tokens(window)
        assert leased >= 100
        # Forged: an unknown request, the real one's next attempt, and the real one under
        # another key; each claims a huge use in this window.
        await report("nobody", window=window, reserved=0, used=900)
        await report("real", window=window, reserved=0, used=900, attempt=1)
        await report("real", window=window, reserved=0, used=900, principal="other")
        await nc.flush()
        await asyncio.sleep(0.2)  # a negative check: the forged reports change nothing
        assert await used_tokens(window) == leased
        assert await lim.settle("forge", "nobody", 900) is False
        # The key's one concurrency slot is still taken by the real request.
        again = {H.PRINCIPAL: "forge", H.LIMITS: ",1000,1", H.REQUEST_ID: "second"}
        with pytest.raises(E.RateLimited):
            await check.apply(again, env)
        leased = await used_tokens(window)  # that try leased ahead too (kept locally)
        # The real report (a window and reservation it does not own, in its body) settles
        # what was admitted: 100 reserved, 7 used, in the admitted window.
        await report("real", window=window + 5, reserved=100_000, used=7, prompt=2, completion=5)
        for _ in range(100):
            if await used_tokens(window) == leased - 93:
                break
            await asyncio.sleep(0.05)
        assert await used_tokens(window) == leased - 93
        await check.apply(again, env)  # the slot went back with the real report
        assert H.RATELIMIT in again
        # Its duplicate changes nothing more.
        await report("real", used=7, prompt=2, completion=5)
        await nc.flush()
        await asyncio.sleep(0.2)  # a negative check: the duplicate changes nothing
        assert await used_tokens(window) == leased - 93
    finally:
        await check.stop()


@pytest.mark.bus
async def test_a_migration_counts_once_on_proof_of_admission_only(nc: NATS) -> None:
    # The ratelimit stage's check on a real bus: a migrated request (Tb-Migration) brings
    # the ticket of its first admission and is not counted again; a forged, borrowed or
    # replayed ticket proves nothing and the request is counted like any other.
    lim = await Limiter(nc).open()
    check = RateLimitCheck(lim, fail_open=False, log=structlog.get_logger())
    env = {"messages": MSG, "params": {"max_tokens": 4}}

    async def admit(rid: str, migration: int = 0, ticket: str | None = None) -> dict[str, str]:
        hdrs = {H.PRINCIPAL: "mig", H.LIMITS: "2,,", H.REQUEST_ID: rid}
        if migration:
            hdrs[H.MIGRATION] = str(migration)
        if ticket is not None:
            hdrs[H.ADMISSION] = ticket
        await check.apply(hdrs, env)
        return hdrs

    try:
        await fresh_window()
        first = await admit("a")
        ticket = first[H.ADMISSION]
        moved = await admit("a", 1, ticket)  # free: the limit of 2 still has room for one
        moved_again = await admit("a", 2, moved[H.ADMISSION])  # a second migration too
        assert moved_again[H.ADMISSION] != moved[H.ADMISSION]
        await admit("b")  # the key's second request
        for rid, migration, t in [
            ("a", 1, ticket),  # replayed: each ticket is good once
            ("c", 1, ticket),  # borrowed from another request
            ("a", 3, ticket.replace(",w,", ",,")),  # altered
            ("a", 1, "1,2,w,x,0,9999999999," + "0" * 32),  # made up
            ("a", 0, moved_again[H.ADMISSION]),  # not a migration
        ]:
            with pytest.raises(E.RateLimited):
                await admit(rid, migration, t)
    finally:
        await lim.close()


@pytest.mark.bus
@pytest.mark.parametrize("near", [False, True], ids=["far-from-the-limit", "near-the-limit"])
async def test_usage_reports_settle_in_the_lease_or_in_few_store_writes(
    nc: NATS, near: bool
) -> None:
    # Every finished request reports what it used, and the unused part of its reservation
    # goes back. Far from the key's limit it goes back to this instance's lease: no store
    # write at all (it was one compare-and-set per finished request). Near the limit it
    # goes back to the shared counter, where other instances can lease it, and reports
    # that arrive while a write is in flight go together in the next.
    bucket = f"test_settle_{'near' if near else 'far'}"  # its own: revisions count ours
    lim = await Limiter(nc, bucket=bucket, owner=f"settle-{time.time_ns()}").open()
    check = RateLimitCheck(lim, fail_open=False, log=structlog.get_logger())
    await check.start(nc)
    env = {"messages": MSG, "params": {"max_tokens": 40}}
    need = estimate_tokens(env)
    tpm = 100 * need + 100 if near else 100_000_000
    limits = f",{tpm},"
    try:
        await fresh_window()
        admitted = []
        for i in range(100):
            hdrs = {H.PRINCIPAL: "settle", H.LIMITS: limits, H.REQUEST_ID: f"r{i}"}
            await check.apply(hdrs, env)
            admitted.append(hdrs)
        kv = await nc.jetstream().key_value(bucket)
        key = f"rl.settle.{int(time.time() // WINDOW_S)}"
        before = await kv.get(key)
        for _ in range(50):  # a lease taken ahead in the background lands first
            await asyncio.sleep(0.2)
            again = await kv.get(key)
            if again.revision == before.revision:
                break
            before = again
        assert before.revision is not None
        for i, hdrs in enumerate(admitted):  # each used 5 of the tokens it reserved
            await usage.report(nc, hdrs, f"r{i}", max_tokens=40, prompt_tokens=2, completion=3)
        await nc.flush()
        for _ in range(100):
            if not lim.awaiting_report():
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail(f"{lim.awaiting_report()} reports were never settled")
        after = await kv.get(key)
        for _ in range(50):  # the last compare-and-set may still be in flight
            await asyncio.sleep(0.1)
            again = await kv.get(key)
            if again.revision == after.revision:
                break
            after = again
        writes = (after.revision or 0) - before.revision
        if near:
            assert 1 <= writes < 50, writes
            assert json.loads(after.value or b"{}")["t"] < json.loads(before.value or b"{}")["t"]
        else:
            assert writes == 0, writes
        # Either way the next admission counts exactly what was used: 5 tokens for each
        # reported request, its own whole reservation.
        probe = {H.PRINCIPAL: "settle", H.LIMITS: limits, H.REQUEST_ID: "probe"}
        await check.apply(probe, env)
        left = int(parse_info(probe[H.RATELIMIT_INFO])["x-ratelimit-remaining-tokens"])
        assert left == tpm - 100 * 5 - need
        assert json.loads(after.value or b"{}")["t"] <= tpm
    finally:
        await check.stop()
