"""Bounded waits: for a condition, for services and replicas on the bus, for an HTTP endpoint."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from auth.limits import WINDOW_S
from bus_schemas import codec, subjects
from services.runtime import servers


async def wait_for(
    cond: Any, timeout: float = 30.0, interval: float = 0.02, what: str = "condition not met"
) -> None:
    """Until ``cond()`` is true (a coroutine it returns is awaited: a look over the network),
    at most ``timeout`` seconds: a bound for a loaded machine (four test workers on two
    cores), not a measure; it returns as soon as the condition holds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        held = cond()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return
        await asyncio.sleep(interval)
    raise AssertionError(f"{what} in time")


def wait_until(
    cond: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02, what: str = "condition"
) -> None:
    """:func:`wait_for` for a test that is not a coroutine: until ``cond()`` is true, at most
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} not met in time")
        time.sleep(interval)


async def wait_started(
    nc: NATS,
    services: dict[str, int],
    model: str = "",
    replicas: int = 0,
    timeout: float = 30,
) -> None:
    """Until ``services[name]`` instances of each tokenbus service ``name`` answer discovery
    (``$SRV.PING``: a service answers once its setup is done, its key cache loaded and its
    subscriptions made), then until each of them (the queue groups' members) and
    ``replicas`` replicas of ``model`` have beaten once more: every service has heard every
    member and every replica, as the router that routes to them must."""
    pongs: dict[str, set[str]] = {name: set() for name in services}
    heard: dict[str, float] = {}  # member id or replica -> when last heard

    async def on_pong(msg: Msg) -> None:
        info = json.loads(msg.data)
        name = str(info.get("name", "")).removeprefix("tokenbus-")
        if name in pongs:
            pongs[name].add(str(info["id"]))

    async def on_member(msg: Msg) -> None:
        heard[str(codec.decode_map(msg.data).get("id"))] = time.monotonic()

    async def on_heartbeat(msg: Msg) -> None:
        hb = codec.decode_map(msg.data)
        if model and hb.get("model") == model and not hb.get("draining"):
            heard[f"replica:{hb.get('replica')}"] = time.monotonic()

    inbox = nc.new_inbox()
    subs = [
        await nc.subscribe(inbox, cb=on_pong),
        await nc.subscribe(subjects.members_wildcard(), cb=on_member),
        await nc.subscribe(subjects.heartbeat_wildcard(), cb=on_heartbeat),
    ]
    deadline = time.monotonic() + timeout
    try:
        while not all(len(pongs[name]) >= n for name, n in services.items()):
            assert time.monotonic() < deadline, f"not every service started: {pongs}"
            await nc.publish("$SRV.PING", b"", reply=inbox)
            await asyncio.sleep(0.1)
        since = time.monotonic()
        members = set().union(*pongs.values())

        def fresh() -> bool:
            new = {k for k, at in heard.items() if at > since}
            reps = sum(k.startswith("replica:") for k in new)
            return members <= new and reps >= replicas

        while not fresh():
            assert time.monotonic() < deadline, f"not every member and replica beat: {heard}"
            await asyncio.sleep(0.05)
    finally:
        for sub in subs:
            await sub.unsubscribe()


async def wait_for_key(svcs: dict[str, Any], key_id: str) -> None:
    """Until every in-process auth stage of ``svcs`` has the key in its cache."""
    await wait_for(
        lambda: all(key_id in a.keys._cache for a in svcs["auth"]),
        timeout=2,
        interval=0.01,
        what="the key never reached every auth instance",
    )


async def fresh_window(margin: float = 8.0) -> None:
    """Start a test well inside a one-minute rate-limit window, so all its requests count
    in one."""
    left = WINDOW_S - time.time() % WINDOW_S
    if left < margin:
        await asyncio.sleep(left + 0.1)


async def live_replicas(
    url: str, model: str, wait: float = 0.6, **login: Any
) -> dict[str, dict[str, Any]]:
    """Replicas of ``model`` heard on the bus within ``wait`` seconds (latest heartbeat each);
    ``url`` may name several nodes of a cluster, the first preferred. ``login``: nats-py's
    connect options (the admin role on a locked bus)."""
    nc = await nats.connect(servers(url), dont_randomize=True, **login)
    seen: dict[str, dict[str, Any]] = {}

    async def cb(msg: Any) -> None:
        hb = codec.decode_map(msg.data)
        if hb.get("model") == model:
            seen[hb["replica"]] = hb

    await nc.subscribe(subjects.heartbeat_wildcard(), cb=cb)
    await asyncio.sleep(wait)
    await nc.drain()
    return seen


async def wait_replicas(url: str, model: str, n: int, timeout: float = 60, **login: Any) -> None:
    # What each replica said last, over every look: an idle replica beats only every few
    # seconds, so n of them need not all beat within one short look.
    deadline = time.monotonic() + timeout
    heard: dict[str, dict[str, Any]] = {}
    while time.monotonic() < deadline:
        heard.update(await live_replicas(url, model, 0.5, **login))
        if len([r for r in heard.values() if not r.get("draining")]) >= n:
            return
    raise AssertionError(f"{n} replicas of {model} did not appear")


async def wait_http(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient() as c:
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if (await c.get(url)).status_code == 200:
                    return
            await asyncio.sleep(0.1)
    raise AssertionError(f"{url} not ready")
