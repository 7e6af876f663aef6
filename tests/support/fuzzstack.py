"""The stack the HTTP fuzz tests hit: every stage on, one sim worker, a key with room to spare."""

from __future__ import annotations

import contextlib
import json
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

from tests.support.busdata import key_store, new_model
from tests.support.procs import Procs, ProcStack, start_stack


class FuzzStack:
    """A stack for the HTTP fuzz tests: its base URL, a key with room to spare, the model."""

    def __init__(self, stack: ProcStack, key: str) -> None:
        self.base, self.key, self.model, self.procs = stack.base, key, stack.model, stack.procs

    def assert_serving(self) -> None:
        """Every process alive, and a plain chat request answered 200."""
        assert all(p.alive() for p in self.procs.procs)
        assert_chat_served(self.base, self.model, self.key)


def assert_chat_served(base: str, model: str, key: str | None = None) -> None:
    """A plain two-token chat request to the bridge at ``base`` is answered 200 (the check
    that a stack still serves after hostile input)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(base_url=base, timeout=30) as h:
        r = h.post(
            "/v1/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            headers=headers,
        )
    assert r.status_code == 200, r.text


@contextlib.asynccontextmanager
async def open_fuzz_stack(
    nats_url: str, tmp: Path, env: dict[str, str], worker_args: tuple[str, ...], **limits: int
) -> AsyncIterator[FuzzStack]:
    """Every stage on (auth, ratelimit, filter, route), one sim worker, a key with
    ``limits``, and the bridge settings in ``env``."""
    async with key_store(nats_url, watch=False) as keys:
        key, _ = await keys.create(tmp.name, **limits)
    pipeline = {
        "TOKENBUS_INGRESS__PIPELINE": '["auth", "ratelimit", "filter", "route"]',
        # The production heartbeat (0.5 s), not the suite's 0.2 s: these tests hold the API's
        # contract, not a fault's timing, and a worker starved of the CPU for 0.6 s on a
        # loaded machine (four test workers on two cores) was taken for lost mid-answer and
        # its next request refused "no live replica" (CI run ba, a valid request's 503).
        "TOKENBUS_WORKER__HEARTBEAT_INTERVAL_S": "0.5",
    }
    with Procs(nats_url, tmp) as procs:
        stack = await start_stack(
            procs,
            new_model(),
            *("ingress", "auth", "ratelimit", "filter", "router"),
            worker_args=worker_args,
            env={**pipeline, **env},
            settle=0.5,
        )
        yield FuzzStack(stack, key)


def in_shard(case: Any, shard: int, shards: int) -> bool:
    """Whether schemathesis' ``case`` is ``shard``'s (0-based) of ``shards``: a function of the
    request as generated (method, path, query, body), so that the files an operation's cases
    are split over each send their part, and every case is sent by one of them."""
    # Anything JSON cannot write (schemathesis' NOT_SET for an absent body) by its type's name:
    # the same in every process, where its repr would hold an address.
    key = json.dumps(
        [case.method, case.path, case.query, case.body],
        sort_keys=True,
        default=lambda o: type(o).__name__,
    )
    return zlib.crc32(b"shard:" + key.encode()) % shards == shard
