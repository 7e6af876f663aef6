"""The pipeline stages before the router, run inside the HTTP bridge's process.

``auth``, ``ratelimit`` and ``filter`` are services of their own (NATS clients go through
them), but their work is a local computation over shared state: a watched key cache, rate
counters leased from JetStream KV, and the scanner. The bridge runs the same code
in-process (``bridge.fuse_stages``), which saves a process hop per stage for every HTTP
request while keeping every guarantee: keys and revocations come from the same KV watch,
limits hold across the bridge and the limiter services alike (they share the counters), and
the filter applies the same policies.
"""

from __future__ import annotations

from typing import Any

from nats.aio.client import Client as NATS

from auth.ratelimit import RateLimitCheck
from auth.service import authenticate
from auth.store import KeyStore
from bus_schemas import headers as H
from bus_schemas import marks, subjects
from filter.service import Policies, filter_request
from services import tracing
from services.aliases import AliasTable

FUSABLE = (subjects.STAGE_AUTH, subjects.STAGE_RATELIMIT, subjects.STAGE_FILTER)


def stages_before_route(pipeline: list[str]) -> list[str]:
    return [s for s in pipeline if s != subjects.STAGE_ROUTE]


class LocalStages:
    """Runs the configured stages (a subset of auth, ratelimit, filter) on one request."""

    def __init__(self, names: list[str], log: Any) -> None:
        unknown = [n for n in names if n not in FUSABLE]
        if unknown:
            raise ValueError(f"stages {unknown} cannot run in the bridge")
        self.names = names
        self.log = log
        self.keys: KeyStore | None = None
        self.ratelimit: RateLimitCheck | None = None
        self.policies: Policies | None = None
        self.aliases: AliasTable | None = None

    @classmethod
    def can_run(cls, names: list[str]) -> bool:
        return all(n in FUSABLE for n in names)

    async def open(
        self, nc: NATS, settings: Any, owner: str, aliases: AliasTable | None = None
    ) -> LocalStages:
        """Open what the stages need; ``aliases``: the global model aliases auth resolves
        (the request's model changes in its headers only: the caller re-encodes the
        envelope, see :func:`services.aliases.envelope_for`)."""
        if subjects.STAGE_AUTH in self.names:
            self.keys = await KeyStore(nc).open()
            self.aliases = aliases
        if subjects.STAGE_RATELIMIT in self.names:
            self.ratelimit = await RateLimitCheck.open(nc, settings, owner, self.log)
        if subjects.STAGE_FILTER in self.names:
            self.policies = Policies(settings.filter)
        return self

    async def run(
        self, hdrs: dict[str, str], env: dict[str, Any], principal: str | None = None
    ) -> bool:
        """Apply the stages in order (headers and envelope in place); returns whether the
        envelope changed. Raises the stage's error (401, 403, 429, 400, 503). ``principal``:
        the id of the key a trusted caller in this process runs the request for
        (:func:`auth.service.authenticate`)."""
        changed = False
        for name in self.names:
            # Traced, each stage is a span of its own, a child of the bridge's (whose
            # traceparent ``hdrs`` carry): current while it runs, failed with its refusal.
            with tracing.scope(self._span(name, hdrs)):
                if name == subjects.STAGE_AUTH and self.keys is not None:
                    if principal is None:
                        await self.keys.catch_up(hdrs.get(H.API_KEY))
                    authenticate(self.keys, hdrs, self.aliases, key_id=principal)
                elif name == subjects.STAGE_RATELIMIT and self.ratelimit is not None:
                    changed = await self.ratelimit.apply(hdrs, env) or changed
                elif name == subjects.STAGE_FILTER and self.policies is not None:
                    changed = filter_request(self.policies, hdrs, env, self.log) or changed
            marks.append(hdrs, name)
        hdrs.pop(H.ROUTE, None)  # the router is next
        return changed

    @staticmethod
    def _span(name: str, hdrs: dict[str, str]) -> Any:
        if not tracing.on():
            return None
        return tracing.start(
            name,
            hdrs,
            attributes={
                tracing.STAGE: name,
                "tokenbus.fused": True,
                tracing.REQUEST_ID: hdrs.get(H.REQUEST_ID),
                tracing.MODEL: hdrs.get(H.MODEL),
                tracing.KEY_ID: hdrs.get(H.PRINCIPAL),
            },
        )

    async def close(self) -> None:
        if self.ratelimit is not None:
            await self.ratelimit.stop()
        if self.keys is not None:
            await self.keys.close()
