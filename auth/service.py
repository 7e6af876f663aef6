"""The auth stage: API key in, principal out.

It looks the key up in the watched key store, refuses missing, unknown, revoked and
expired keys (401) and models the key may not use (403), strips the key from the headers
so no later stage ever sees it, and adds the principal, its limits and its filter policy.
"""

from __future__ import annotations

from nats.aio.msg import Msg

from auth.callout import CalloutCredentials, CalloutResponder
from auth.store import KeyStore
from bus_schemas import errors as E
from bus_schemas import headers as H
from bus_schemas import subjects
from services import tracing
from services.runtime import Service


def limits_header(rpm: int | None, tpm: int | None, concurrent: int | None) -> str:
    return ",".join("" if v is None else str(v) for v in (rpm, tpm, concurrent))


def authenticate(keys: KeyStore, hdrs: dict[str, str]) -> None:
    """The auth stage's work on a request's headers (in place): the key out, the principal,
    its limits and its filter policy in; raises 401/403 errors."""
    try:
        rec = keys.lookup(hdrs.pop(H.API_KEY, None))
        keys.authorize(rec, hdrs.get(H.MODEL, ""))
    except E.TokenbusError as exc:
        tracing.verdict(subjects.STAGE_AUTH, "deny", {tracing.ERROR_TYPE: exc.code})
        raise
    if tracing.on():
        tracing.set_attributes(tracing.current(), {tracing.KEY_ID: rec.id})
        tracing.verdict(subjects.STAGE_AUTH, "allow", {tracing.KEY_ID: rec.id})
    hdrs[H.PRINCIPAL] = rec.id
    hdrs[H.LIMITS] = limits_header(rec.rpm, rec.tpm, rec.max_concurrent)
    hdrs[H.FILTER_POLICY] = rec.filter_policy


class Auth(Service):
    """Authenticates requests and forwards them with a principal instead of a key."""

    name = subjects.STAGE_AUTH

    async def setup(self) -> None:
        self.keys = await KeyStore(self.nc).open()
        self.callout: CalloutResponder | None = None
        if self.settings.nats_callout:
            # NATS clients log in with their key: this service answers the server for them.
            creds = CalloutCredentials.load(self.settings.nats_callout)
            self.callout = CalloutResponder(
                self.keys, self.settings.url(), creds, self.log, self.settings.nats_tls()
            )
            await self.callout.start()
        await self.add_endpoint(
            "auth", subjects.stage(subjects.STAGE_AUTH), self.handle, queue=subjects.STAGE_AUTH
        )

    async def on_stop(self) -> None:
        if self.callout is not None:
            await self.callout.stop()
        await self.keys.close()

    async def handle(self, msg: Msg) -> None:
        hdrs = dict(msg.headers or {})
        authenticate(self.keys, hdrs)
        await self.forward_next(msg, hdrs, msg.data)
