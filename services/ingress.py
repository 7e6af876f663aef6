"""Ingress: validates requests from NATS clients and the bridge, builds the envelope, and
starts it down the pipeline (a routing slip in the ``Tb-Route`` header)."""

from __future__ import annotations

import uuid

from nats.aio.msg import Msg

from bus_schemas import codec, marks, subjects
from bus_schemas import errors as E
from bus_schemas import headers as H
from services import validation
from services.runtime import Service


class Ingress(Service):
    """Validates requests and forwards them to the first pipeline stage."""

    name = subjects.STAGE_INGRESS

    async def setup(self) -> None:
        pipeline = list(self.settings.ingress.pipeline)
        if not pipeline or pipeline[-1] != subjects.STAGE_ROUTE:
            pipeline = [s for s in pipeline if s != subjects.STAGE_ROUTE] + [subjects.STAGE_ROUTE]
        self._first = subjects.stage(pipeline[0])
        self._rest = ",".join(pipeline[1:])
        await self.add_endpoint(
            "requests", subjects.requests_wildcard(), self.handle, queue=subjects.QUEUE_INGRESS
        )

    async def handle(self, msg: Msg) -> None:
        if not msg.reply:
            self.log.warning("request_without_reply_subject", subject=msg.subject)
            return
        t1 = marks.now_ns()
        kind = msg.subject.rpartition(".")[2]
        if kind not in subjects.KINDS:
            raise E.NotFound(f"unknown request kind {kind!r}")
        req = validation.parse(kind, codec.decode(msg.data))
        if validation.prompt_chars(req) > self.settings.ingress.max_prompt_chars:
            raise E.PayloadTooLarge(
                f"the prompt is longer than {self.settings.ingress.max_prompt_chars} characters"
            )
        hdrs = dict(msg.headers or {})
        rid = hdrs.get(H.REQUEST_ID) or uuid.uuid4().hex
        hdrs[H.REQUEST_ID] = rid
        env = validation.envelope(
            kind, req, rid,
            default_max_tokens=self.settings.ingress.default_max_tokens,
            deadline_ms=marks.deadline_ms(hdrs),
        )
        hdrs[H.MODEL] = req.model
        hdrs[H.KIND] = kind
        if self._rest:
            hdrs[H.ROUTE] = self._rest
        else:
            hdrs.pop(H.ROUTE, None)
        marks.append(hdrs, "ingress", t1)
        await self.nc.publish(self._first, codec.encode(env), reply=msg.reply, headers=hdrs)
