"""The ratelimit stage: admits a request against its key's limits (see :mod:`auth.limits`)
and reconciles token reservations with the usage workers report."""

from __future__ import annotations

import contextlib
import time
from typing import Any

from nats.aio.msg import Msg

from auth.limits import Limiter, info_header
from bus_schemas import codec, marks, subjects
from bus_schemas import errors as E
from bus_schemas import headers as H
from services.runtime import Service


def parse_limits(value: str | None) -> tuple[int | None, int | None, int | None]:
    parts = (value or "").split(",")
    parts += [""] * (3 - len(parts))
    vals = [int(p) if p.strip().isdigit() else None for p in parts[:3]]
    return vals[0], vals[1], vals[2]


def estimate_tokens(env: dict[str, Any]) -> int:
    """Prompt (about four characters a token) plus the most the request may generate."""
    chars = len(env.get("prompt") or "") + sum(
        len(str(m.get("content") or "")) for m in env.get("messages") or ()
    )
    params = env.get("params") or {}
    return (chars + 3) // 4 + int(params.get("max_tokens", 0))


class RateLimit(Service):
    """Holds every key to its RPM, TPM and concurrency limits across all instances."""

    name = subjects.STAGE_RATELIMIT

    async def setup(self) -> None:
        self.limiter = await Limiter(self.nc).open()
        self._usage_sub = await self.nc.subscribe(
            subjects.usage(), queue=subjects.STAGE_RATELIMIT, cb=self._on_usage
        )
        await self.add_endpoint(
            "ratelimit",
            subjects.stage(subjects.STAGE_RATELIMIT),
            self.handle,
            queue=subjects.STAGE_RATELIMIT,
        )

    async def on_stop(self) -> None:
        with contextlib.suppress(Exception):
            await self._usage_sub.unsubscribe()

    async def handle(self, msg: Msg) -> None:
        hdrs = dict(msg.headers or {})
        principal = hdrs.get(H.PRINCIPAL)
        rpm, tpm, conc = parse_limits(hdrs.get(H.LIMITS))
        if principal and (rpm is not None or tpm is not None or conc is not None):
            env = codec.decode_map(msg.data)
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
                if not self.settings.ratelimit.fail_open:
                    raise E.ServiceUnavailable(
                        "the rate limiter cannot reach its store; retry"
                    ) from None
                self.log.warning("ratelimit_fail_open", error=str(exc), principal=principal)
            else:
                flags = ("w" if rpm is not None or tpm is not None else "") + (
                    "c" if conc is not None else ""
                )
                hdrs[H.RATELIMIT] = f"{adm.window},{adm.reserved},{flags}"
                if adm.info:
                    hdrs[H.RATELIMIT_INFO] = info_header(adm.info)
        await self.forward_next(msg, hdrs, msg.data)

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
