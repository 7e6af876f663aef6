"""The flow control's schedule (engine_worker/flow.py): fair shares, classes, admission.

Pure bookkeeping on a fake clock; the end-to-end behaviour (a real stack, two tenants) is in
tests/test_flow_e2e.py.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from bus_schemas import errors as E
from engine_worker.flow import FlowConfig, FlowControl, Ticket

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(slots: int = 2, **kw: object) -> tuple[FlowControl, Clock]:
    clock = Clock()
    return FlowControl(FlowConfig(slots=slots, **kw), clock=clock), clock  # type: ignore[arg-type]


def serve_all(fc: FlowControl, tickets: list[Ticket], answer: int = 100) -> list[str]:
    """Finish what runs, one at a time, until nothing is left; the order flows started in."""
    order: list[str] = []
    done: set[int] = set()
    while True:
        running = [t for t in fc.running if id(t) not in done]
        if not running:
            break
        t = running[0]
        order.append(t.flow + (f"/{t.sub}" if t.sub else ""))
        done.add(id(t))
        fc.leave(t, answer)
    assert all(t.granted.is_set() for t in tickets)
    return order


def test_free_slot_starts_at_once_and_the_rest_wait() -> None:
    fc, _ = make(slots=2)
    a = fc.enter(flow="A")
    b = fc.enter(flow="A")
    c = fc.enter(flow="A")
    assert a.granted.is_set() and b.granted.is_set() and not c.granted.is_set()
    assert fc.queued() == 1
    fc.leave(a, 10)
    assert c.granted.is_set() and fc.queued() == 0


def test_a_newcomer_goes_before_a_flooding_tenant() -> None:
    """B's one request waits for one slot, not behind A's backlog (the FIFO would put it
    64th)."""
    fc, _ = make(slots=8)
    flood = [fc.enter(flow="A", prompt_tokens=50) for _ in range(64)]
    b = fc.enter(flow="B", prompt_tokens=8)
    assert not b.granted.is_set()
    fc.leave(flood[0], 128)
    assert b.granted.is_set()


def test_fifo_when_off_would_differ() -> None:
    """The same arrivals in one flow are first come first served: the fairness above is the
    flows', not an accident of the order."""
    fc, _ = make(slots=1)
    first = fc.enter(flow="A")
    ts = [fc.enter(flow="A") for _ in range(3)]
    fc.leave(first, 1)
    assert [t.granted.is_set() for t in ts] == [True, False, False]


def test_weights_share_tokens() -> None:
    """Three flooding flows with weights 1:2:4 are served tokens in that ratio."""
    fc, _ = make(slots=1, input_weight=0.0, output_weight=1.0)
    tickets = []
    for _ in range(140):
        for flow, w in (("w1", 1.0), ("w2", 2.0), ("w4", 4.0)):
            tickets.append(fc.enter(flow=flow, weight=w))
    order = serve_all(fc, tickets)
    first = Counter(order[:140])
    total = sum(first.values())
    for flow, w in (("w1", 1), ("w2", 2), ("w4", 4)):
        assert first[flow] / total == pytest.approx(w / 7, rel=0.1), first


def test_fairness_ids_share_one_key() -> None:
    """Within one key, two agents (fairness ids) alternate; the key's share is unchanged."""
    fc, _ = make(slots=1)
    tickets = [fc.enter(flow="K", sub="agent1") for _ in range(10)]
    tickets += [fc.enter(flow="K", sub="agent2") for _ in range(10)]
    order = serve_all(fc, tickets)
    assert order[1:9] == ["K/agent2", "K/agent1"] * 4 or order[1:9] == ["K/agent1", "K/agent2"] * 4


def test_idle_time_banks_no_credit() -> None:
    """A flow that was away starts level with the busy ones, not at zero: it does not then
    take every slot until it has caught up."""
    fc, _ = make(slots=1, input_weight=0.0, output_weight=1.0)
    tickets = [fc.enter(flow="A") for _ in range(30)]
    for _ in range(20):
        fc.leave(fc.running[0], 100)
    tickets += [fc.enter(flow="B") for _ in range(10)]
    order = serve_all(fc, tickets)
    # From B's arrival on (order[0] was running then), A and B share the slot about evenly
    # (B is not served ten in a row to catch up on A's twenty).
    assert order[1:7].count("B") == 3, order[:7]
    assert order[1:9].count("B") == 4, order[:9]


def test_a_reserve_is_a_guarantee_not_headroom_kept_empty() -> None:
    """Default requests running inside their reserve leave the rest of the engine to flex
    (spare capacity is used); flex never holds more than the slots outside the reserve."""
    fc, _ = make(slots=8, reserved={"default": 3}, displace=False)
    d = [fc.enter(flow="D", cls="default") for _ in range(3)]
    assert all(t.granted.is_set() for t in d)
    flex = [fc.enter(flow="F", cls="flex") for _ in range(10)]
    assert sum(t.granted.is_set() for t in flex) == 5  # 8 slots, 3 of them default's in use
    for t in d:
        fc.leave(t, 10)
    # Default's reserve is free again, and stays free for it: flex holds its 5.
    assert sum(t.granted.is_set() for t in flex) == 5
    more = [fc.enter(flow="D", cls="default") for _ in range(4)]
    assert [t.granted.is_set() for t in more] == [True, True, True, False]  # the engine is full
    fc.leave(flex[0], 10)
    assert more[3].granted.is_set()  # a freed slot: default first, beyond its reserve too
    fc.leave(more[0], 10)
    # Now default holds 3 and flex 4: the free slot may go to flex (5 of 8 at most).
    assert sum(t.granted.is_set() for t in flex[1:]) == 5


def test_higher_class_first_and_flex_keeps_out_of_the_reserve() -> None:
    fc, _ = make(slots=4, reserved={"default": 1}, displace=False)
    flex = [fc.enter(flow="F", cls="flex") for _ in range(10)]
    assert sum(t.granted.is_set() for t in flex) == 3  # the 4th slot is default's
    d = fc.enter(flow="D", cls="default")
    assert d.granted.is_set()  # at once: it took the reserved slot
    d2 = fc.enter(flow="D", cls="default")
    assert not d2.granted.is_set()
    fc.leave(flex[0], 10)
    assert d2.granted.is_set()  # the next slot goes to default, before 7 waiting flex
    p = fc.enter(flow="P", cls="priority")
    fc.leave(flex[1], 10)
    assert p.granted.is_set()


def test_aging_lifts_a_long_wait() -> None:
    """A flex request behind a steady stream of default ones starts once it has waited
    ``aging_s`` (it then counts as default, and its flow has been served less); without
    aging it would wait as long as default traffic lasts."""
    for aging, started_by in ((10.0, 12), (0.0, None)):
        fc, clock = make(slots=1, aging_s=aging, displace=False)
        fc.enter(flow="D", cls="default")
        flex = fc.enter(flow="F", cls="flex")
        started = None
        for second in range(1, 30):
            clock.t += 1.0
            fc.enter(flow="D", cls="default")
            fc.leave(fc.running[0], 128)
            if flex.granted.is_set():
                started = second
                break
        if started_by is None:
            assert started is None
        else:
            assert started is not None and 10 <= started <= started_by


def test_displacement_before_the_first_byte_only() -> None:
    fc, _ = make(slots=2)
    f1 = fc.enter(flow="F", cls="flex")
    f2 = fc.enter(flow="F", cls="flex")
    fc.started(f1)  # f1 sent its first byte: it stays
    hits: list[Ticket] = []
    f2.on_displace = lambda: hits.append(f2)
    p = fc.enter(flow="P", cls="priority")
    assert p.granted.is_set() and hits == [f2] and f2.displaced and not f1.displaced
    assert fc.displaced["flex"] == 1
    fc.requeue(f2)  # its engine run is over: it waits again, at the head of its queue
    assert not f2.granted.is_set() and fc.queued("flex") == 1
    fc.leave(f1, 5)
    assert f2.granted.is_set()
    # No one left to displace: the next priority request waits.
    fc.started(f2)
    p2 = fc.enter(flow="P", cls="priority")
    assert not p2.granted.is_set()


def test_a_full_class_queue_is_429_for_the_flow_over_its_share_else_busy() -> None:
    fc, _ = make(slots=1, max_queued={"default": 4})
    fc.enter(flow="A")
    for _ in range(3):
        fc.enter(flow="A")
    fc.enter(flow="B")
    with pytest.raises(E.RateLimited) as over:
        fc.enter(flow="A")
    assert over.value.headers and int(over.value.headers["Retry-After"]) >= 1
    with pytest.raises(E.ReplicaBusy):
        fc.enter(flow="C")  # not over any share: another replica may take it
    # A refused request leaves nothing behind.
    assert fc.queued() == 4 and "C" not in fc.flows.busy


def test_queued_tokens_bound() -> None:
    fc, _ = make(slots=1, max_queued_tokens={"flex": 100})
    fc.enter(flow="A", cls="flex", prompt_tokens=10)
    fc.enter(flow="A", cls="flex", prompt_tokens=80)
    with pytest.raises(E.TokenbusError):
        fc.enter(flow="B", cls="flex", prompt_tokens=30)
    fc.enter(flow="B", cls="flex", prompt_tokens=20)


def test_lowest_class_is_shed_first() -> None:
    fc, _ = make(slots=1)
    fc.enter(flow="D", cls="default")
    d = fc.enter(flow="D", cls="default")
    f_old = fc.enter(flow="F", cls="flex")
    f_new = fc.enter(flow="F", cls="flex")
    shed = fc.shed_for("priority")
    assert shed is f_new and isinstance(f_new.refused, E.Overloaded)
    assert f_new.refused.headers and "Retry-After" in f_new.refused.headers
    assert fc.shed_for("flex") is None  # nothing below flex
    assert not d.refused and not f_old.refused


def test_deadline_sooner_than_the_expected_wait_is_refused_at_once() -> None:
    fc, clock = make(slots=1)
    t = fc.enter(flow="A")
    clock.t += 2.0
    fc.leave(t, 10)  # a request takes 2 s in the engine
    fc.enter(flow="A")
    for _ in range(5):
        fc.enter(flow="A")
    with pytest.raises(E.Overloaded) as err:
        fc.enter(flow="B", deadline=clock.t + 1.0)
    assert "deadline" in err.value.message
    fc.enter(flow="B", deadline=clock.t + 60.0)


def test_ttft_objective_orders_within_a_fairness_id() -> None:
    fc, _ = make(slots=1)
    fc.enter(flow="A")
    late = fc.enter(flow="A", ttft_objective_s=5.0)
    soon = fc.enter(flow="A", ttft_objective_s=0.5)
    fc.leave(fc.running[0], 1)
    assert soon.granted.is_set() and not late.granted.is_set()


async def test_wait_raises_after_the_class_limit_and_frees_the_place() -> None:
    fc = FlowControl(FlowConfig(slots=1, max_wait_s={"default": 0.05}))
    fc.enter(flow="A")
    t = fc.enter(flow="B")
    with pytest.raises(E.Overloaded) as err:
        await fc.wait(t)
    assert err.value.headers and "Retry-After" in err.value.headers
    assert fc.queued() == 0
    fc.leave(t)
    assert "B" not in fc.flows.busy


async def test_wait_returns_when_granted() -> None:
    fc = FlowControl(FlowConfig(slots=1))
    first = fc.enter(flow="A")
    t = fc.enter(flow="B")
    waiter = asyncio.ensure_future(fc.wait(t))
    await asyncio.sleep(0)
    assert not waiter.done()
    fc.leave(first, 3)
    await asyncio.wait_for(waiter, 1)


def test_stats_per_class() -> None:
    fc, _ = make(slots=1)
    fc.enter(flow="A", cls="flex")
    fc.enter(flow="A", cls="flex", prompt_tokens=40)
    st = fc.stats()
    assert st["flex"]["running"] == 1 and st["flex"]["queued"] == 1
    assert st["flex"]["queued_tokens"] == 40 and st["default"]["queued"] == 0


def test_heartbeat_flow_stats_become_metrics() -> None:
    """What a worker's heartbeat says of its flow control is what the telemetry service
    exports: per class, per flow, and the queue depth per model an autoscaler reads."""
    from prometheus_client import CollectorRegistry, generate_latest

    from telemetry.metrics import ReplicaLoad

    fc, _ = make(slots=1)
    first = fc.enter(flow="A", cls="flex", prompt_tokens=4)
    fc.started(first)  # its first byte went out: B cannot displace it
    fc.enter(flow="A", cls="flex", prompt_tokens=40)
    fc.enter(flow="B", cls="default")
    fc.leave(first, 6)  # B goes next (higher class); A's second waits
    load = ReplicaLoad()
    hb = {"replica": "r1", "model": "m", "flow": fc.stats(), "flows": fc.flow_stats()}
    load.heartbeat(hb)
    reg = CollectorRegistry()
    reg.register(load)
    text = generate_latest(reg).decode()
    assert 'tokenbus_flow_queued{class="flex",model="m",replica="r1"} 1.0' in text
    assert 'tokenbus_flow_running{class="default",model="m",replica="r1"} 1.0' in text
    assert 'tokenbus_flow_served_total{class="flex",model="m",replica="r1"} 1.0' in text
    assert 'tokenbus_model_queue_depth{class="flex",model="m"} 1.0' in text
    assert 'tokenbus_flow_key_tokens_total{flow="A",model="m",replica="r1"} 10.0' in text
    assert 'tokenbus_flow_key_queued{flow="A",model="m",replica="r1"} 1.0' in text
    # A heartbeat of an older worker (no flow) exports none of it, and nothing breaks.
    load.heartbeat({"replica": "r1", "model": "m", "flow": "junk"})
    assert "tokenbus_flow_queued{" not in generate_latest(reg).decode()


def test_routers_reports_add_to_the_queue_depth_of_a_model_without_replicas() -> None:
    """A model scaled to zero has no heartbeat: its queue depth is what routers and bridges
    hold for it (their waiting rooms), summed over instances, gone once they report none
    or stop reporting."""
    from prometheus_client import CollectorRegistry, generate_latest

    from router.dispatch import queue_report
    from telemetry.metrics import ReplicaLoad

    load = ReplicaLoad()
    reg = CollectorRegistry()
    reg.register(load)
    load.queue_report(queue_report("r1", {("m0", "default"): 2, ("m0", "flex"): 1}, 1.0))
    load.queue_report(queue_report("r2", {("m0", "default"): 3}, 1.0))
    load.queue_report({"instance": "bad", "waiting": {"m0": {"default": "many"}}})
    text = generate_latest(reg).decode()
    assert 'tokenbus_model_queue_depth{class="default",model="m0"} 5.0' in text
    assert 'tokenbus_router_waiting{class="flex",model="m0"} 1.0' in text
    assert 'tokenbus_model_replicas{model="m0"} 0.0' in text
    load.queue_report(queue_report("r1", {}, 1.0))
    text = generate_latest(reg).decode()
    assert 'tokenbus_model_queue_depth{class="default",model="m0"} 3.0' in text
    assert 'class="flex",model="m0"' not in text


def test_a_request_that_could_not_finish_by_its_deadline_is_refused_before_it_starts() -> None:
    """Not only the wait: a request is refused at once when its wait plus its expected time
    in the engine (the recent mean, or less for a short max_tokens) passes its deadline."""
    fc, clock = make(slots=1)
    t = fc.enter(flow="A")
    clock.t += 2.0
    fc.leave(t, 10)  # 2 s in the engine, 0.2 s an answer token
    fc.enter(flow="A")  # runs
    with pytest.raises(E.Overloaded) as err:
        fc.enter(flow="B", deadline=clock.t + 1.5, max_tokens=100)
    assert "before its deadline" in err.value.message
    short = fc.enter(flow="B", deadline=clock.t + 1.5, max_tokens=5)  # about 1 s: it fits
    assert not short.granted.is_set() and fc.queued() == 1
