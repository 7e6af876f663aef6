"""The auth stage: API key in, principal out.

It looks the key up in the watched key store, refuses missing, unknown, revoked and
expired keys (401) and models the key may not use (403), strips the key from the headers
so no later stage ever sees it, and adds the principal, its limits, its filter policy, the
class it is served in and the flow its fair share counts in (engine_worker/flow.py).
A model alias (the key's own, or a global one) is resolved here (:mod:`services.aliases`).
The service also bounds what each key's large request bodies hold (:mod:`auth.bodyquota`).
"""

from __future__ import annotations

from nats.aio.msg import Msg

from auth.bodyquota import BodyQuota
from auth.budgets import header as budget_header
from auth.callout import CalloutCredentials, CalloutResponder
from auth.store import KeyStore
from bus_schemas import errors as E
from bus_schemas import headers as H
from bus_schemas import subjects
from services import tracing
from services.aliases import AliasTable, envelope_for, retarget, watch_aliases
from services.runtime import Service


def limits_header(rpm: int | None, tpm: int | None, concurrent: int | None) -> str:
    return ",".join("" if v is None else str(v) for v in (rpm, tpm, concurrent))


def authenticate(
    keys: KeyStore,
    hdrs: dict[str, str],
    aliases: AliasTable | None = None,
    *,
    key_id: str | None = None,
) -> bool:
    """The auth stage's work on a request's headers (in place): the key out, the principal,
    its limits and its filter policy in, the model an alias names resolved (the key's own
    aliases first, then ``aliases``); raises 401/403 errors. Returns whether the model
    changed (the envelope's must then follow: :func:`services.aliases.envelope_for`).

    ``key_id``: the request is one a trusted service in this process runs for a key that
    submitted it earlier (a batch line, a background response), never anything a client
    sent: the key is checked by id (still valid, still allowed this model)."""
    try:
        presented = hdrs.pop(H.API_KEY, None)
        rec = keys.by_id(key_id) if key_id is not None else keys.lookup(presented)
        asked = hdrs.get(H.MODEL, "")
        served = aliases.resolve(asked, rec.aliases) if aliases is not None else asked
        keys.authorize(rec, asked, served)
    except E.TokenbusError as exc:
        tracing.verdict(subjects.STAGE_AUTH, "deny", {tracing.ERROR_TYPE: exc.code})
        raise
    if tracing.on():
        tracing.set_attributes(tracing.current(), {tracing.KEY_ID: rec.id})
        tracing.verdict(subjects.STAGE_AUTH, "allow", {tracing.KEY_ID: rec.id})
    hdrs[H.PRINCIPAL] = rec.id
    hdrs[H.LIMITS] = limits_header(rec.rpm, rec.tpm, rec.max_concurrent)
    hdrs[H.FILTER_POLICY] = rec.filter_policy
    hdrs[H.PRIORITY] = rec.tier(hdrs.get(H.PRIORITY))
    hdrs[H.FLOW] = f"owner:{rec.owner}" if rec.fair_by == "owner" and rec.owner else rec.id
    hdrs[H.FLOW_WEIGHT] = repr(rec.weight)
    if rec.budget_usd is not None or rec.soft_budget_usd is not None or rec.owner:
        hdrs[H.BUDGET] = budget_header(
            rec.budget_period, rec.budget_usd, rec.soft_budget_usd, rec.owner
        )
    return retarget(hdrs, asked, served) if aliases is not None else False


class Auth(Service):
    """Authenticates requests and forwards them with a principal instead of a key."""

    name = subjects.STAGE_AUTH

    async def setup(self) -> None:
        self.keys = await KeyStore(self.nc).open()
        self.aliases = await watch_aliases(self.nc, self.settings.router.aliases, self.log)
        self.callout: CalloutResponder | None = None
        if self.settings.nats_callout:
            # NATS clients log in with their key: this service answers the server for them.
            creds = CalloutCredentials.load(self.settings.nats_callout)
            self.callout = CalloutResponder(
                self.keys, self.settings.url(), creds, self.log, self.settings.nats_tls()
            )
            await self.callout.start()
        # Keys' own large request bodies: bounded per key, deleted when done (a key's
        # connection may write them, by the callout above, but not delete them).
        self.bodyquota = BodyQuota(
            self.nc,
            self.keys,
            self.settings.bodies.max_bytes_per_key,
            self.log,
            owner_max=self.settings.bodies.max_bytes_per_owner,
        )
        await self.bodyquota.start()
        await self.stage_endpoints(subjects.STAGE_AUTH).add("auth", self.handle)

    async def on_stop(self) -> None:
        bodyquota = getattr(self, "bodyquota", None)
        if bodyquota is not None:
            await bodyquota.stop()
        if self.callout is not None:
            await self.callout.stop()
        await self.keys.close()
        await self.aliases.close()

    async def handle(self, msg: Msg) -> None:
        hdrs = dict(msg.headers or {})
        data = msg.data
        await self.keys.catch_up(hdrs.get(H.API_KEY))
        if authenticate(self.keys, hdrs, self.aliases):
            data = envelope_for(data, None, hdrs[H.MODEL])
        await self.forward_next(msg, hdrs, data)
