"""The worker's side of its flow control (engine_worker/flow.py): the flow control a
worker's settings make, and a request's place in it from what auth and the client said."""

from __future__ import annotations

import math
import time
from typing import Any

from bus_schemas import headers as H
from bus_schemas import marks
from engine_worker.flow import FlowConfig, FlowControl, Ticket, class_of
from engine_worker.generation import Generation


def flow_control(cfg: Any) -> FlowControl | None:
    """The flow control of a worker with settings ``cfg`` (``worker``), None when off."""
    f = cfg.flow
    if not f.enabled:
        return None
    slots = f.slots or engine_batch(cfg)
    slots = max(1, min(slots, cfg.max_concurrency))
    reserved = {c: max(1, math.ceil(share * slots)) for c, share in f.reserved.items() if share > 0}
    return FlowControl(
        FlowConfig(
            slots=slots,
            reserved=reserved,
            max_queued=dict(f.max_queued),
            max_queued_tokens=dict(f.max_queued_tokens),
            max_wait_s=dict(f.max_wait_s),
            aging_s=f.aging_s,
            input_weight=f.input_weight,
            output_weight=f.output_weight,
            displace=f.displace,
        )
    )


def engine_batch(cfg: Any) -> int:
    """The sequences the engine runs at once, as configured: the sim's ``max_running``,
    vLLM's ``max_num_seqs`` (its default, 256, when unset); for an upstream server it is
    not known here: ``max_concurrency``."""
    if cfg.backend == "sim":
        return int(cfg.sim.max_running)
    if cfg.backend == "vllm":
        return int(cfg.vllm.engine_args.get("max_num_seqs") or 256)
    return int(cfg.max_concurrency)


def request_class(hdrs: dict[str, str] | None) -> str:
    """The request's class (``service_tier``) as auth settled it."""
    return class_of((hdrs or {}).get(H.PRIORITY))


def _weight(value: str | None) -> float:
    try:
        w = float(value) if value else 1.0
    except ValueError:
        return 1.0
    return w if 0 < w < 1e6 else 1.0


def _prompt_estimate(gen: Generation) -> int:
    """The prompt's tokens, estimated before the engine counts them (4 characters a
    token, of the text the envelope carries, as the ratelimit stage estimates them): what
    the flow control charges and bounds queues by."""
    return gen.prompt_chars() // 4 + 1


def queue_attrs(t: Ticket) -> dict[str, Any]:
    """The queue event's attributes on the request's span: its class and its wait."""
    return {
        "tokenbus.service_tier": t.cls,
        "tokenbus.queue_wait_ms": round((time.monotonic() - t.arrived) * 1000, 3),
    }


def seconds_left(hdrs: dict[str, str]) -> float | None:
    """Time left before the request's deadline, or None when it carries none."""
    deadline = marks.deadline_ms(hdrs)
    return None if deadline is None else max(0.0, deadline / 1000.0 - time.time())


def ticket(flow: FlowControl, gen: Generation) -> Ticket:
    """The request's place in the flow control, from what auth and the client said; a
    higher class that displaces it cancels its task."""
    hdrs = gen.headers
    left = seconds_left(hdrs)
    ttft = marks.number(hdrs.get(H.TTFT_OBJECTIVE))
    t = flow.enter(
        flow=hdrs.get(H.FLOW) or hdrs.get(H.PRINCIPAL) or "",
        sub=hdrs.get(H.FAIRNESS, "")[:128],
        cls=request_class(hdrs),
        weight=_weight(hdrs.get(H.FLOW_WEIGHT)),
        prompt_tokens=_prompt_estimate(gen),
        deadline=None if left is None else time.monotonic() + left,
        ttft_objective_s=ttft / 1000.0 if ttft else None,
        max_tokens=gen.req.remaining_tokens,
    )
    task = gen.task

    def displace() -> None:
        if not task.done():
            task.cancel()

    t.on_displace = displace
    return t
