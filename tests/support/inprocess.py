"""Services in the test's own process on a real bus: their settings, and a stack of them."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from services import config
from tests.support.waits import wait_for


def settings(url: str, **over: Any) -> config.Settings:
    over.setdefault("log_level", "warning")
    over.setdefault("ingress", {"pipeline": ["route"]})
    over.setdefault("drain_timeout_s", 10.0)
    return config.load(nats_url=url, **over)


@contextlib.asynccontextmanager
async def stack(
    url: str,
    model: str,
    *,
    workers: int = 2,
    with_ingress: bool = True,
    with_router: bool = True,
    auths: int = 0,
    ratelimits: int = 0,
    filters: int = 0,
    worker: dict[str, Any] | None = None,
    **over: Any,
) -> AsyncIterator[dict[str, Any]]:
    """Ingress, router and sim workers (and ``auths`` auth stages, which then sit in the
    pipeline) in this process: the integration tests' bus."""
    from auth.service import Auth
    from engine_worker.worker import Worker
    from gateway.ingress import Ingress
    from router.service import Router

    w = {"model": model, "heartbeat_interval_s": 0.2, **(worker or {})}
    from auth.ratelimit import RateLimit

    svcs: dict[str, Any] = {"workers": [], "auth": [], "ratelimit": [], "filter": []}
    from filter.service import Filter

    if auths or ratelimits or filters:
        stages = (
            ["auth"] * bool(auths)
            + ["ratelimit"] * bool(ratelimits)
            + ["filter"] * bool(filters)
            + ["route"]
        )
        over.setdefault("ingress", {"pipeline": stages})
    async with contextlib.AsyncExitStack() as es:
        for _ in range(auths):
            svcs["auth"].append(await es.enter_async_context(Auth(settings(url, **over))))
        for _ in range(filters):
            svcs["filter"].append(await es.enter_async_context(Filter(settings(url, **over))))
        for _ in range(ratelimits):
            svcs["ratelimit"].append(await es.enter_async_context(RateLimit(settings(url, **over))))
        if with_ingress:
            svcs["ingress"] = await es.enter_async_context(Ingress(settings(url, **over)))
        if with_router:
            svcs["router"] = await es.enter_async_context(Router(settings(url, **over)))
        for i in range(workers):
            ws = settings(url, worker={**w, "replica": f"{model}-w{i}"}, **over)
            svcs["workers"].append(await es.enter_async_context(Worker(ws)))
        if with_router and workers:
            await wait_for(lambda: len(svcs["router"].registry.live(model)) == workers)
        yield svcs
