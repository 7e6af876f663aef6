"""The ``predicted_latency`` policy (issue 68 item 3, docs/routing.md): replicas learn their
engine's speed from their own requests (engine_worker/perf.py) and announce it; the router
predicts each candidate's time to first token from its queue and the prompt tokens it would
compute (the KV index's cached prefix taken off), and its time per output token from its
batch, and picks the fastest replica that meets the request's class target."""

from __future__ import annotations

import random
import time
from typing import Any

import pytest

from auth.store import KeyStore
from bus_schemas import kv_events as K
from bus_schemas.messages import render_prompt
from engine_worker.perf import EnginePerf
from router.kv_index import KVIndex
from router.policies import PredictedLatency, RouteRequest, make_load_policy
from router.registry import Replica
from services.config import LatencyTarget, ModelRouting
from tests.support.inprocess import stack
from tests.support.natsserver import NatsServer
from tests.support.waits import wait_for, wait_for_key
from tokenbus import Client

BS = 4
PERF = {
    "ttft_base_ms": 10.0,
    "prefill_ms_per_token": 1.0,
    "queue_ms_per_waiting": 100.0,
    "tpot_base_ms": 10.0,
    "tpot_ms_per_running": 1.0,
}


def _replica(name: str, **kw: Any) -> Replica:
    return Replica(name, "m", f"s.{name}", max_concurrency=64, perf=dict(PERF), **kw)


def _stored(idx: KVIndex, name: str, chain: list[int]) -> None:
    """``name``'s KV events say it stored ``chain`` (its first batch)."""
    batch = {"type": K.BATCH, "replica": name, "model": "m", "boot": "b", "block_size": BS}
    events = [K.stored(chain, None, BS)]
    idx.apply({**batch, "seq_first": 1, "seq_last": 1, "ts_ms": 1, "events": events})


def _configured(idx: KVIndex, **kv: Any) -> Any:
    """``predicted_latency`` as a router builds it from its configuration (the ``kv``
    settings given, the rest and the class targets at their defaults)."""
    spec = ModelRouting(policy="predicted_latency", kv=kv)
    return make_load_policy(
        "predicted_latency",
        bound=1.25,
        block_chars=256,
        kv_index=idx,
        kv_weights=spec.kv.model_dump(),
        latency_targets=dict(spec.latency_targets),
    )


def _held_by_b() -> tuple[KVIndex, list[int], RouteRequest]:
    """An index where b holds a ~100-token prompt whole and a none of it: the index, the
    prompt's block chain and the request."""
    idx = KVIndex()
    _synced(idx, "a", "b")
    text = render_prompt([{"role": "user", "content": "x" * 400}])
    chain = K.text_block_hashes(text, BS)
    _stored(idx, "b", chain)
    return idx, chain, RouteRequest("m", rendered=text, env={})


def _synced(idx: KVIndex, *names: str) -> None:
    for n in names:
        idx.load({"replica": n, "boot": "b", "block_size": BS, "seq": 0, "blocks": []})


@pytest.mark.unit
def test_an_engine_learns_its_own_speed_from_its_requests() -> None:
    perf = EnginePerf()
    assert perf.heartbeat() is None  # nothing announced before it knows
    rnd = random.Random(1)
    for _ in range(100):
        tokens, waiting, running = rnd.randint(10, 2000), rnd.randint(0, 5), rnd.randint(0, 30)
        ahead = rnd.randint(0, 5000)
        perf.observe(
            ttft_ms=20 + 0.5 * (tokens + ahead) + 30 * waiting,
            computed_tokens=tokens,
            waiting=waiting,
            ahead_tokens=ahead,
            tpot_ms=10 + 0.25 * running,
            running=running,
        )
    got = perf.heartbeat()
    assert got is not None
    assert abs(got["prefill_ms_per_token"] - 0.5) < 0.01
    assert got["backlog_ms_per_token"] == got["prefill_ms_per_token"]  # one speed for both
    assert abs(got["queue_ms_per_waiting"] - 30) < 1
    assert abs(got["ttft_base_ms"] - 20) < 2
    assert abs(got["tpot_ms_per_running"] - 0.25) < 0.01


@pytest.mark.unit
def test_a_backlog_is_priced_at_the_engines_speed_before_the_replica_ever_had_one() -> None:
    """A replica whose first requests found nothing ahead of them: the backlog that comes
    with the first burst is its prompt tokens left, computed at the speed its own requests
    taught it, not at a coefficient it had nothing to learn from."""
    perf = EnginePerf()
    rnd = random.Random(2)
    for _ in range(12):
        tokens = rnd.randint(100, 4000)
        perf.observe(
            ttft_ms=15 + 0.2 * tokens, computed_tokens=tokens, waiting=0, tpot_ms=None, running=0
        )
    got = perf.heartbeat()
    assert got is not None
    assert abs(got["prefill_ms_per_token"] - 0.2) < 0.01
    assert abs(got["backlog_ms_per_token"] - 0.2) < 0.01


@pytest.mark.unit
def test_the_replica_predicted_first_to_answer_wins_within_the_class_target() -> None:
    idx = KVIndex()
    _synced(idx, "a", "b")
    targets = {
        "default": LatencyTarget(ttft_ms=2000, tpot_ms=100),
        "priority": LatencyTarget(ttft_ms=150, tpot_ms=20),
    }
    policy = PredictedLatency(idx, targets=targets, work_weight=0.0)  # TTFT alone
    text = render_prompt([{"role": "user", "content": "x" * 400}])  # ~100 tokens
    req = RouteRequest("m", rendered=text, env={})
    a, b = _replica("a"), _replica("b", waiting=2)
    # b has two sequences waiting ahead: 200 ms more.
    assert policy.choose([a, b], req) is a
    ta, tb = policy.predictions["a"][0], policy.predictions["b"][0]
    assert round(tb - ta) == 200
    # The whole prompt cached on b: ~100 ms less prefill, still behind 200 ms of queue.
    chain = K.text_block_hashes(text, BS)
    _stored(idx, "b", chain)
    assert policy.choose([a, b], req) is a
    b.waiting = 0  # its queue empty: the cached prefix wins, and is predicted
    assert policy.choose([a, b], req) is b
    tokens = -(-len(text) // 4)
    assert policy.prediction("b") == min(len(chain), (tokens - 1) // BS) * BS > 0
    # A priority request: a's TTFT would meet 150 ms, but its batch is too slow per token.
    a.running, b.running = 5, 30
    b.waiting = 2  # b: 200 ms of queue + ~1 token; tpot 41 ms > 20
    preq = RouteRequest("m", rendered=text, env={}, tier="priority")
    assert policy.choose([a, b], preq) is a  # a: ~110 ms, tpot 16 ms: meets both
    a.running = 20  # a's tpot 31 ms: neither meets; the lowest TTFT all the same
    unmet = policy.unmet
    assert policy.choose([a, b], preq) is a  # ~111 ms against ~211 ms
    assert policy.unmet == unmet + 1


@pytest.mark.unit
def test_the_longer_the_queue_a_request_joins_the_more_its_cached_prefix_counts() -> None:
    """A request's prefill delays every request that queues behind it, so its work counts
    more the longer the queue it joins (the backlog's wait against the class's TTFT target).
    Lightly loaded, the replica that starts sooner wins; with the same gap between two long
    queues, the one holding the prompt's prefix does (under overload sending each request to
    the soonest start spread sessions, lost their cached prefixes and cost 20-30 % of the
    goodput: docs/benchmarks.md)."""
    idx = KVIndex()
    _synced(idx, "a", "b")
    text = render_prompt([{"role": "user", "content": "x" * 400}])  # ~100 tokens
    _stored(idx, "b", K.text_block_hashes(text, BS))
    req = RouteRequest("m", rendered=text, env={})
    policy = PredictedLatency(idx, targets={"default": LatencyTarget(ttft_ms=2000)})

    def choice(backlog_a: int, backlog_b: int) -> str:
        a, b = _replica("a"), _replica("b")
        now = time.monotonic()
        a.told_backlog(backlog_a, now)  # tokens, at 1 ms each (PERF)
        b.told_backlog(backlog_b, now)
        return policy.choose([a, b], req).replica

    # b holds the prompt but starts 250 ms later: a's ~100 ms of prefill is worth less.
    assert choice(0, 250) == "a"
    # Both queues about the target long, the same 250 ms apart: b's cached prefix wins.
    assert choice(2000, 2250) == "b"


@pytest.mark.unit
def test_until_every_replica_announced_its_speed_kv_aware_routes() -> None:
    idx = KVIndex()
    _synced(idx, "a", "b")
    spec = ModelRouting(policy="predicted_latency")
    policy = make_load_policy(
        "predicted_latency",
        bound=1.25,
        block_chars=256,
        kv_index=idx,
        latency_targets=dict(spec.latency_targets),
    )
    assert isinstance(policy, PredictedLatency)
    a = _replica("a")
    b = Replica("b", "m", "s.b", max_concurrency=64, reported_in_flight=0)
    a.reported_in_flight = 32
    req = RouteRequest("m", rendered=render_prompt([{"role": "user", "content": "y" * 80}]))
    assert policy.choose([a, b], req) is b  # kv_aware's cost: b is less loaded
    assert policy.predictions == {}


@pytest.mark.bus
async def test_replicas_announce_their_speed_and_long_prompts_go_to_the_fast_one(
    nats_server: NatsServer, model: str, client: Client
) -> None:
    """Two sim replicas, one prefilling fifty times slower per token: once both announced
    what they learned, new long prompts go to the fast one."""
    from engine_worker.worker import Worker
    from tests.support.inprocess import settings

    sim = {"kv_cache_blocks": 4096, "block_size": BS, "prefill_ms": 1.0, "decode_ms": 1.0}
    w = {"model": model, "heartbeat_interval_s": 0.2}
    fast_sim = {**sim, "prefill_ms_per_token": 0.02}
    slow_sim = {**sim, "prefill_ms_per_token": 1.0}
    router = {"policy": "predicted_latency"}
    async with stack(nats_server.url, model, workers=0, router=router) as svcs:
        fast = Worker(
            settings(nats_server.url, worker={**w, "replica": f"{model}-f", "sim": fast_sim})
        )
        slow = Worker(
            settings(nats_server.url, worker={**w, "replica": f"{model}-s", "sim": slow_sim})
        )
        async with fast, slow:
            registry = svcs["router"].registry
            await wait_for(lambda: len(registry.live(model)) == 2, what="replicas not seen")
            n = 0

            async def learned() -> bool:
                nonlocal n
                n += 1
                text = f"{n} warm up " * (5 + 20 * (n % 5))
                await client.chat_completion(
                    model, [{"role": "user", "content": text}], max_tokens=2
                )
                return all(r.perf for r in registry.live(model))

            await wait_for(learned, timeout=120, interval=0, what="speeds never announced")
            fp = registry.get(fast.replica).perf
            sp = registry.get(slow.replica).perf
            assert sp["prefill_ms_per_token"] > fp["prefill_ms_per_token"]
            served = []
            for i in range(6):
                text = f"{i} a long new question " * 40
                out = await client.chat_completion(
                    model, [{"role": "user", "content": text}], max_tokens=2
                )
                served.append(out.replica)
            assert served == [fast.replica] * 6


# A prompt long enough for every router count below (a count is held to its prompt's length).
LONG: dict[str, Any] = {"messages": [{"role": "user", "content": "x" * 20_000}]}


def _gen(headers: dict[str, str], env: dict[str, Any]) -> Any:
    from engine_worker.backends.base import GenerationRequest
    from engine_worker.generation import Generation

    req = GenerationRequest(request_id="x", kind="chat", model="m", max_tokens=1)
    return Generation("r", headers, env, req, task=None)  # type: ignore[arg-type]


@pytest.mark.unit
def test_a_replica_counts_the_prompt_tokens_it_has_still_to_compute() -> None:
    """engine_worker/backlog.py: a request counts from its entry to its first token, for the
    router's expected tokens, and what was ahead of it is noted for the latency model."""
    from bus_schemas import headers as H
    from engine_worker.backlog import PrefillBacklog

    b = PrefillBacklog()
    first = _gen({H.PREFILL_TOKENS: "3000"}, LONG)
    second = _gen({}, {"messages": [{"role": "user", "content": "x" * 400}]})  # ~100 tokens
    b.enter(first)
    b.enter(second)
    b.enter(second)  # once only
    assert (b.tokens, first.backlog_ahead, second.backlog_ahead) == (3100, 0, 3000)
    b.leave(first)
    b.leave(first)  # once only
    assert b.tokens == 100
    b.leave(second)
    assert b.tokens == 0


@pytest.mark.unit
def test_the_backlog_is_worked_off_in_order_at_the_engines_learned_speed() -> None:
    """A prompt part-way through its prefill counts only what is left of it: the backlog
    works itself off first come, first computed, at the learned speed, and a prompt that
    leaves takes only its own remainder with it (nothing is worked off while the speed is
    not known)."""
    from bus_schemas import headers as H
    from engine_worker.backlog import PrefillBacklog

    now = [100.0]
    b = PrefillBacklog(clock=lambda: now[0])
    first = _gen({H.PREFILL_TOKENS: "3000"}, LONG)
    second = _gen({H.PREFILL_TOKENS: "1000"}, LONG)
    b.enter(first)
    now[0] += 1.0
    assert b.tokens == 3000  # no speed learned yet: nothing worked off
    now[0] += 1.0  # still not known: this second is not worked off either
    b.set_speed(0.5)  # 2 000 tokens a second from now
    assert b.tokens == 3000
    now[0] += 0.5
    b.enter(second)
    assert (b.tokens, second.backlog_ahead) == (3000, 2000)  # the first is a third done
    now[0] += 1.5  # 3 000 more: what was left of the first (2 000), then the second
    assert b.tokens == 0
    b.leave(first)
    b.leave(second)
    assert b.tokens == 0
    third, fourth = _gen({H.PREFILL_TOKENS: "800"}, LONG), _gen({H.PREFILL_TOKENS: "400"}, LONG)
    b.enter(third)
    b.enter(fourth)
    now[0] += 0.2  # 400 of the third's 800
    b.leave(fourth)  # ended early (its caller left): only its own 400 go
    assert b.tokens == 400
    b.leave(third)
    assert b.tokens == 0


@pytest.mark.unit
def test_what_a_replica_learns_sets_the_speed_its_backlog_is_worked_off_at() -> None:
    """engine_worker/accounting.py: each finished request teaches the latency model, and the
    backlog is worked off at the prefill speed it now has."""
    from types import SimpleNamespace

    from engine_worker.accounting import Accounting
    from engine_worker.backlog import PrefillBacklog

    backlog = PrefillBacklog()
    stats = SimpleNamespace(stats=lambda: {"running": 1})
    acc = Accounting(SimpleNamespace(perf=EnginePerf(), backlog=backlog, backend=stats))  # type: ignore[arg-type]
    rnd = random.Random(3)
    for n in range(12):
        assert backlog.ms_per_token == 0.0 or n >= 8  # nothing before the model is announced
        gen, tokens = _gen({}, {}), rnd.randint(100, 4000)
        gen.t_start, gen.first_ns = 1, 1 + int((15 + 0.2 * tokens) * 1e6)
        gen.prompt_tokens, gen.completion = tokens, 1
        acc.learn(gen, gen.first_ns)
    assert abs(backlog.ms_per_token - 0.2) < 0.01


@pytest.mark.unit
@pytest.mark.parametrize("forged", ["9" * 40, "-5", "1e9", "", " 12", "0x10", "²", "١٢"])
def test_a_forged_prefill_count_is_bounded_or_ignored(forged: str) -> None:
    """Hostile input: a header that is no count a router writes (Unicode digits among them)
    falls back to the prompt's own size; a count past what the prompt could be is held to
    its characters (and a chat template's few), and to the model's context."""
    from bus_schemas import headers as H
    from bus_schemas.messages import envelope_chars
    from engine_worker.backlog import TEMPLATE_TOKENS, expected_tokens

    env = {"messages": [{"role": "user", "content": "y" * 80}]}
    assert expected_tokens(_gen({H.PREFILL_TOKENS: forged}, env), 4096) == 20
    most = envelope_chars(env) + TEMPLATE_TOKENS
    assert expected_tokens(_gen({H.PREFILL_TOKENS: "99999999"}, env), 4096) == most
    assert expected_tokens(_gen({H.PREFILL_TOKENS: "100"}, env), 4096) == 100  # a router's
    big = {"messages": [{"role": "user", "content": "y" * 10_000}]}
    assert expected_tokens(_gen({H.PREFILL_TOKENS: "99999999"}, big), 4096) == 4096


@pytest.mark.unit
def test_the_replica_with_less_prefill_ahead_answers_first() -> None:
    """Two replicas, the same queue by count (none waiting): the one whose engine has 2 000
    prompt tokens still to compute is predicted 2 000 x its cost per token later; as time
    passes its engine works the backlog off, and a send adds to it until the ack says (the
    predictions are read while both have a backlog too: when_behind="latency")"""
    import time as _time

    idx = KVIndex()
    _synced(idx, "a", "b")
    policy = PredictedLatency(idx, when_behind="latency")
    text = render_prompt([{"role": "user", "content": "z" * 400}])
    req = RouteRequest("m", rendered=text, env={})
    a, b = _replica("a"), _replica("b")
    a.perf["backlog_ms_per_token"] = b.perf["backlog_ms_per_token"] = 0.5

    def ahead_ms(told: float) -> tuple[float, float, float]:
        """a's predicted wait over b's, with the least and most a's 2 000 tokens at 0.5 ms
        less what its engine worked off since ``told`` can be (the policy reads the clock
        between the two readings here: a loaded machine may take any time)."""
        before = _time.monotonic()
        policy.choose([a, b], req)
        after = _time.monotonic()
        diff = policy.predictions["a"][0] - policy.predictions["b"][0]
        return diff, 1000 - (after - told) * 1000 - 1e-6, 1000 - (before - told) * 1000 + 1e-6

    told = _time.monotonic()
    a.told_backlog(2000, told)
    assert policy.choose([a, b], req) is b
    diff, least, most = ahead_ms(told)
    assert max(0.0, least) <= diff <= most
    told = _time.monotonic() - 0.5  # told 500 ms ago: 500 ms of it left, less since
    a.told_backlog(2000, told)
    diff, least, most = ahead_ms(told)
    assert max(0.0, least) <= diff <= most <= 500
    b.add_backlog(1500, _time.monotonic())  # this router just sent b 1 500 tokens: 750 ms
    assert policy.choose([a, b], req) is a
    b.told_backlog(0, _time.monotonic())  # its ack: already through
    assert policy.choose([a, b], req) is b


@pytest.mark.bus
async def test_a_replica_reports_the_prefill_it_has_ahead_and_works_it_off(
    nats_server: NatsServer, model: str, client: Client
) -> None:
    """A long prompt on a slow replica: while it prefills, the router knows (from the ack,
    then heartbeats) the replica's backlog of prompt tokens; after its first token the
    backlog is empty again."""
    import asyncio

    from engine_worker.worker import Worker
    from tests.support.inprocess import settings

    sim = {"kv_cache_blocks": 4096, "block_size": BS, "decode_ms": 1.0}
    slow = {**sim, "prefill_ms_per_token": 4.0, "chunked_prefill_tokens": 64}
    w = {"model": model, "heartbeat_interval_s": 0.2, "replica": f"{model}-s", "sim": slow}
    router = {"policy": "predicted_latency"}
    async with (
        stack(nats_server.url, model, workers=0, router=router) as svcs,
        Worker(settings(nats_server.url, worker=w)) as worker,
    ):
        registry = svcs["router"].registry
        await wait_for(lambda: registry.live(model), what="replica not seen")
        text = "a long question to prefill " * 100  # ~500 sim tokens: about two seconds
        ask = asyncio.create_task(
            client.chat_completion(model, [{"role": "user", "content": text}], max_tokens=2)
        )
        await wait_for(
            lambda: registry.get(worker.replica).backlog_tokens >= 400,
            what="the backlog never reached the router",
        )
        await ask
        assert worker.backlog.tokens == 0
        await wait_for(
            lambda: registry.get(worker.replica).backlog_tokens == 0,
            what="the worked-off backlog was never announced",
        )


@pytest.mark.unit
def test_telemetry_exports_the_backlog_and_its_learned_cost_from_heartbeats() -> None:
    """The dashboard's inputs: a heartbeat's prefill backlog and learned cost per backlog
    token become gauges; a hostile or older heartbeat's (negative, absent) exports 0."""
    from prometheus_client import CollectorRegistry, generate_latest

    from telemetry.metrics import ReplicaLoad

    load = ReplicaLoad()
    reg = CollectorRegistry()
    reg.register(load)
    perf = {**PERF, "backlog_ms_per_token": 0.25}
    load.heartbeat({"replica": "r1", "model": "m", "prefill_backlog": 1234, "perf": perf})
    text = generate_latest(reg).decode()
    assert 'tokenbus_replica_prefill_backlog_tokens{model="m",replica="r1"} 1234.0' in text
    assert 'tokenbus_replica_backlog_ms_per_token{model="m",replica="r1"} 0.25' in text
    load.heartbeat({"replica": "r1", "model": "m", "prefill_backlog": -7})
    text = generate_latest(reg).decode()
    assert 'tokenbus_replica_prefill_backlog_tokens{model="m",replica="r1"} 0.0' in text
    assert "tokenbus_replica_backlog_ms_per_token{" not in text


@pytest.mark.unit
def test_a_cached_prefix_is_kept_unless_another_replica_answers_sooner_by_more_than_its_cost() -> (
    None
):
    """work_weight (default 1): a replica's score is the predicted TTFT plus the prefill the
    request would make it compute. b holds the whole prompt (~100 tokens, ~100 ms of prefill
    on a) but has 150 ms of others' prompts ahead: by TTFT alone a is sooner (~110 against
    ~160 ms), yet moving there adds a's ~100 ms of prefill for whoever comes next, so b
    keeps it; with 250 ms ahead on b, a takes it."""
    import time as _time

    idx, _, req = _held_by_b()
    a, b = _replica("a"), _replica("b")
    a.perf["backlog_ms_per_token"] = b.perf["backlog_ms_per_token"] = 1.0
    ttft_only = PredictedLatency(idx, work_weight=0.0)
    default = make_load_policy("predicted_latency", bound=1.25, block_chars=256, kv_index=idx)
    b.told_backlog(150, _time.monotonic())  # ~150 ms of others' prompts ahead on b
    assert ttft_only.choose([a, b], req) is a
    assert default.choose([a, b], req) is b
    b.told_backlog(250, _time.monotonic())
    assert default.choose([a, b], req) is a


@pytest.mark.unit
@pytest.mark.parametrize("when_behind", ["work", "latency"])
def test_while_every_replica_is_behind_the_least_prefill_routes(when_behind: str) -> None:
    """Past capacity (every candidate has others' prompt tokens still to compute) the
    prefill a request makes any replica compute delays requests already there, so the
    fleet's throughput decides (when_behind = "work", the default): the least prefill, times
    (1 + the backlog it joins / the target), without the predicted TTFT. b holds the prompt
    but has 3 s more backlog than a and c: by latency a or c wins, by the fleet's work b.
    Among equal work the soonest start: with the prompt cached nowhere, a or c (3 s less
    backlog than b). One replica with nothing ahead, or steps short of the class's time per
    output token (a backlog the fleet works off between tokens), and latency decides again."""
    idx = KVIndex()
    _synced(idx, "a", "b", "c")
    text = render_prompt([{"role": "user", "content": "x" * 400}])  # ~100 tokens
    _stored(idx, "b", K.text_block_hashes(text, BS))
    req = RouteRequest("m", rendered=text, env={})
    policy = _configured(idx, when_behind=when_behind)
    a, b, c = _replica("a"), _replica("b"), _replica("c")
    # Long steps: 80 running, each step 10 + 81 ms (PERF), beyond 75 % of the default
    # class's 100 ms per output token.
    a.running = b.running = c.running = 80
    now = time.monotonic()
    a.told_backlog(3000, now)  # tokens, at 1 ms each (PERF)
    b.told_backlog(6000, now)
    c.told_backlog(3000, now)
    chosen = policy.choose([a, b, c], req)
    if when_behind == "work":
        assert chosen is b
        assert idx.behind_decisions == 1
    else:
        assert chosen in (a, c)
        assert idx.behind_decisions == 0
    other = RouteRequest("m", rendered=render_prompt([{"role": "user", "content": "q" * 400}]))
    assert policy.choose([a, b, c], other) in (a, c)  # cached nowhere: the soonest start
    c.running = 20  # c's steps are short (31 ms): the fleet keeps up between tokens
    assert policy.choose([a, b, c], req) in (a, c)
    assert idx.behind_decisions == (2 if when_behind == "work" else 0)
    c.running = 80
    c.told_backlog(0, time.monotonic())  # c has nothing ahead: the fleet is not behind
    assert policy.choose([a, b, c], req) is c
    assert idx.behind_decisions == (2 if when_behind == "work" else 0)


@pytest.mark.unit
def test_a_wait_near_the_class_target_counts_more_than_its_share() -> None:
    """tail_weight (default 3): a replica's predicted TTFT is scored as TTFT x (1 + 3 x TTFT /
    the class's 2 s target). a computes a prompt 4x faster than b but has others' prompts
    ahead; the prompt (~1 000 tokens) is cached nowhere. With 1 s ahead on a, both meet the
    target (a ~1 260 ms, b ~1 010 ms) and a linear score sends it to a, whose fast prefill
    is worth the wait; scored for the tail it goes to b, which answers sooner. With 0.3 s
    ahead, a keeps it; with neither meeting the target, the linear score decides."""
    idx = KVIndex()
    _synced(idx, "a", "b")
    req = RouteRequest("m", rendered=render_prompt([{"role": "user", "content": "x" * 4000}]))
    linear, default = _configured(idx, tail_weight=0.0), _configured(idx)
    a, b = _replica("a"), _replica("b")
    a.perf["prefill_ms_per_token"] = 0.25
    a.perf["backlog_ms_per_token"] = 1.0
    a.told_backlog(1000, time.monotonic())  # 1 s of others' prompts ahead on a
    assert linear.choose([a, b], req) is a
    assert default.choose([a, b], req) is b
    assert default.predictions["a"][0] > default.predictions["b"][0]
    a.told_backlog(300, time.monotonic())
    assert default.choose([a, b], req) is a
    # Neither meets the target (a ~2.4 s, b ~2.05 s): the request's target is lost either
    # way, and the linear score, the fleet's least work, decides (past capacity, goodput).
    b.perf["backlog_ms_per_token"] = 1.0
    a.told_backlog(2140, time.monotonic())
    b.told_backlog(1040, time.monotonic())
    assert default.choose([a, b], req) is a
    assert default.predictions["a"][0] > default.predictions["b"][0] > 2000


@pytest.mark.unit
def test_a_session_stays_where_its_prefix_is_while_its_wait_there_is_short() -> None:
    """stay_ms: a request whose prefix one replica holds deeper than any other goes there
    while its predicted TTFT there is at most stay_ms (and meets the class's target), even
    where the scores move it; past it, the scores decide. b holds the whole prompt (~100
    tokens, ~100 ms of prefill on a): with 300 ms of others' prompts ahead on b the scores
    send it to a, stay_ms 600 keeps it on b; with 900 ms ahead, a. A prefix that both hold
    makes no home."""
    idx, chain, req = _held_by_b()
    scored, sticky = _configured(idx), _configured(idx, stay_ms=600.0)
    a, b = _replica("a"), _replica("b")
    a.perf["backlog_ms_per_token"] = b.perf["backlog_ms_per_token"] = 1.0
    b.told_backlog(300, time.monotonic())
    assert scored.choose([a, b], req) is a
    assert sticky.choose([a, b], req) is b
    assert sticky.predictions["b"][0] <= 600
    b.told_backlog(900, time.monotonic())  # past stay_ms: the scores decide
    assert sticky.choose([a, b], req) is a
    # Within stay_ms but past the class's 2 s target: not met at home, the scores decide.
    b.told_backlog(2500, time.monotonic())
    assert _configured(idx, stay_ms=5000.0).choose([b, a], req) is a
    _stored(idx, "a", chain)  # both hold it: no home
    b.told_backlog(300, time.monotonic())
    assert sticky.choose([b, a], req) is a


@pytest.mark.unit
def test_a_new_session_starts_where_fewer_sessions_live() -> None:
    """neighbour_weight: a new session's first request also counts, on each replica, the
    weight x the prompt tokens a turn adds (learned) x the replica's prefill speed, for every
    session this router sent there lately. Three sessions live on a (b had 2 s of others'
    prompts ahead when they came); with 50 ms ahead on b now, a new session goes to a
    without the setting and to b with it. A session this router knows is not charged (it
    goes home to a), and another key's request naming one of those session ids is a new
    session: an id names nothing of another key's."""
    idx = KVIndex()
    _synced(idx, "a", "b")
    policy, plain = _configured(idx, neighbour_weight=0.5), _configured(idx)
    a, b = _replica("a"), _replica("b")
    a.perf["backlog_ms_per_token"] = b.perf["backlog_ms_per_token"] = 1.0

    def turn(session: str, words: int, tenant: str = "k1") -> RouteRequest:
        text = render_prompt([{"role": "user", "content": "word " * words}])
        return RouteRequest("m", session=session, rendered=text, env={}, tenant=tenant)

    b.told_backlog(2000, time.monotonic())
    assert [policy.choose([a, b], turn(s, 100)).replica for s in ("s1", "s2", "s3")] == ["a"] * 3
    assert policy.recent.growth == 0  # nothing learned: no session came back yet
    assert policy.choose([a, b], turn("s1", 400)) is a
    assert policy.recent.growth > 0  # s1's second turn added its tokens
    b.told_backlog(50, time.monotonic())
    assert plain.choose([a, b], turn("s9", 100)) is a
    assert policy.choose([a, b], turn("s9", 100)) is b
    assert policy.predictions["a"][0] < policy.predictions["b"][0]  # a answers it sooner
    assert policy.choose([a, b], turn("s2", 300)) is a  # known: goes home, not charged
    assert policy.choose([a, b], turn("s3", 100, tenant="k2")) is b
    assert policy.recent.neighbours("a", time.monotonic()) == 3
    assert policy.recent.neighbours("b", time.monotonic()) == 2


@pytest.mark.bus
async def test_each_key_s_sessions_are_its_own_on_the_router(
    nats_server: NatsServer, model: str, keys: KeyStore, client: Client
) -> None:
    """neighbour_weight over the bus, the auth stage in the pipeline: the router keeps each
    session under its key's principal, learns a turn's growth from the sessions' second
    turns, and two keys naming the same session id are two sessions (neither is charged as
    the other's, nor moves the other's count). A bad setting is refused at configuration."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        ModelRouting(policy="predicted_latency", kv={"neighbour_weight": -1})
    k1, rec1 = await keys.create("neighbours-1")
    k2, rec2 = await keys.create("neighbours-2")
    router = {"policy": "predicted_latency", "kv": {"neighbour_weight": 0.5}}
    async with stack(nats_server.url, model, workers=2, auths=1, router=router) as svcs:
        await wait_for_key(svcs, rec1.id)
        await wait_for_key(svcs, rec2.id)
        for key in (k1, k2):
            history = [{"role": "user", "content": "a first question " * 20}]
            out = await client.chat_completion(
                model, history, max_tokens=8, api_key=key, session="shared"
            )
            history += [
                {"role": "assistant", "content": out.text},
                {"role": "user", "content": "and a second one " * 30},
            ]
            await client.chat_completion(
                model, history, max_tokens=8, api_key=key, session="shared"
            )
        policy = svcs["router"].routing.route(model).policy
        assert isinstance(policy, PredictedLatency)
        now = time.monotonic()
        recent = policy.recent
        assert recent.known((rec1.id, "shared"), now) and recent.known((rec2.id, "shared"), now)
        assert not recent.known(("", "shared"), now)
        assert len(recent) == 2
        assert recent.growth > 0
        assert sum(recent.neighbours(r.replica, now) for r in svcs["workers"]) == 2
