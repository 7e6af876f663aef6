"""The ratelimit stage: admits a request against its key's limits (see :mod:`auth.limits`)
and reconciles token reservations with the usage workers report."""

from __future__ import annotations

import contextlib
import time
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from auth.limits import Limiter, info_header
from bus_schemas import codec, marks, subjects
from bus_schemas import errors as E
from bus_schemas import headers as H
from bus_schemas.messages import envelope_chars
from services.runtime import Service


def parse_limits(value: str | None) -> tuple[int | None, int | None, int | None]:
    parts = (value or "").split(",")
    parts += [""] * (3 - len(parts))
    vals = [int(p) if p.strip().isdigit() else None for p in parts[:3]]
    return vals[0], vals[1], vals[2]


def estimate_tokens(env: dict[str, Any]) -> int:
    """Prompt (about four characters a token) plus the most the request may generate."""
    chars = envelope_chars(env)
    params = env.get("params") or {}
    return (chars + 3) // 4 + int(params.get("max_tokens", 0))


class RateLimitCheck:
    """The ratelimit stage's work on one request, shared by the stage service and the HTTP
    bridge (which runs it in-process): admit against the key's limits, or raise."""

    def __init__(self, limiter: Limiter, *, fail_open: bool, log: Any) -> None:
        self.limiter = limiter
        self.fail_open = fail_open
        self.log = log

    async def apply(self, hdrs: dict[str, str], env: dict[str, Any]) -> None:
        """Admit (headers updated in place with what the worker reports back) or raise."""
        principal = hdrs.get(H.PRINCIPAL)
        rpm, tpm, conc = parse_limits(hdrs.get(H.LIMITS))
        if not principal or (rpm is None and tpm is None and conc is None):
            return
        deadline = marks.deadline_ms(hdrs)
        rid = hdrs.get(H.REQUEST_ID) or str(env.get("request_id", ""))
        try:
            adm = await self.limiter.admit(
                principal,
                rid,
                rpm=rpm,
                tpm=tpm,
                concurrent=conc,
                tokens=estimate_tokens(env),
                deadline_s=deadline / 1000 if deadline else time.time() + 600,
            )
        except E.TokenbusError:
            raise
        except Exception as exc:
            if not self.fail_open:
                raise E.ServiceUnavailable(
                    "the rate limiter cannot reach its store; retry"
                ) from None
            self.log.warning("ratelimit_fail_open", error=str(exc), principal=principal)
            return
        flags = ("w" if rpm is not None or tpm is not None else "") + (
            "c" if conc is not None else ""
        )
        # The worker sends the real usage to this limiter instance (it holds the slot).
        hdrs[H.RATELIMIT] = f"{adm.window},{adm.reserved},{flags},{self.limiter.owner}"
        if adm.info:
            hdrs[H.RATELIMIT_INFO] = info_header(adm.info)

    async def start(self, nc: NATS) -> None:
        """Listen for the usage reports of requests this instance admitted."""
        self._usage_sub = await nc.subscribe(subjects.usage(self.limiter.owner), cb=self._on_usage)

    async def stop(self) -> None:
        with contextlib.suppress(Exception):
            await self._usage_sub.unsubscribe()
        await self.limiter.close()

    async def _on_usage(self, msg: Msg) -> None:
        try:
            u = codec.decode_map(msg.data)
            flags = str(u.get("flags", ""))
            await self.limiter.settle(
                str(u["principal"]),
                str(u["request_id"]),
                int(u["window"]),
                int(u["reserved"]),
                int(u["used"]),
                concurrent="c" in flags,
                windowed="w" in flags,
            )
        except Exception as exc:
            self.log.warning("usage_not_settled", error=str(exc))


class RateLimit(Service):
    """Holds every key to its RPM, TPM and concurrency limits across all instances."""

    name = subjects.STAGE_RATELIMIT

    async def setup(self) -> None:
        limiter = await Limiter(self.nc, owner=f"ratelimit-{self.id}").open()
        self.check = RateLimitCheck(
            limiter, fail_open=self.settings.ratelimit.fail_open, log=self.log
        )
        await self.check.start(self.nc)
        await self.add_endpoint(
            "ratelimit",
            subjects.stage(subjects.STAGE_RATELIMIT),
            self.handle,
            queue=subjects.STAGE_RATELIMIT,
        )

    @property
    def limiter(self) -> Limiter:
        return self.check.limiter

    async def on_stop(self) -> None:
        await self.check.stop()

    async def handle(self, msg: Msg) -> None:
        hdrs = dict(msg.headers or {})
        if H.LIMITS in hdrs and H.PRINCIPAL in hdrs:
            await self.check.apply(hdrs, codec.decode_map(msg.data))
        await self.forward_next(msg, hdrs, msg.data)
