"""The paged prefix-cache model (engine_worker/kvcache.py), its events and their wire shapes
(bus_schemas/kv_events.py), and what the cache does to the sim's prefill time."""

from __future__ import annotations

import random
from typing import Any

import pytest

from bus_schemas import codec
from bus_schemas import errors as E
from bus_schemas import kv_events as K
from engine_worker.backends.base import GenerationRequest, kv_event_source
from engine_worker.backends.sim import SimBackend, SimEngine, count_tokens
from engine_worker.kvcache import KVCache, Lease
from services.config import SimSettings, WorkerSettings

pytestmark = pytest.mark.unit

BS = 4  # tokens per block in these tests: 16 characters of prompt a block


class Log:
    """The events of a cache as a consumer gets them, applied to its own copy."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self.events: list[dict[str, Any]] = []
        self.seqs: list[int] = []
        self.blocks: dict[Any, Any] = {}
        self.notified = 0
        cache.on_events(self._notify)

    def _notify(self) -> None:
        self.notified += 1

    def sync(self) -> list[dict[str, Any]]:
        """Drain, check, apply; the new events."""
        first, evs = self.cache.drain_events()
        for i, ev in enumerate(evs):
            K.check_event(ev)
            self.seqs.append(first + i)
            K.apply_event(self.blocks, ev)
        self.events += evs
        return evs

    def match(self, hashes: list[int]) -> int:
        """The consumer's exact prefix lookup: from the first block, up to the first one it
        does not know of."""
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n


def text(i: int, blocks: float) -> str:
    """A prompt of its own (``i``) of ``blocks`` blocks of BS tokens (4 characters each)."""
    return "".join(f"{i:03d}{j % 10}" for j in range(int(blocks * BS)))


def run(cache: KVCache, prompt: str) -> Lease:
    """A sequence through admission and prefill (not released)."""
    lease = cache.acquire(cache.hashes_of(prompt), count_tokens(prompt))
    cache.commit(lease)
    return lease


# -- tokens and hashes ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "s", ["", "a", "abcd", "abcde", "x" * 1001, "é漢字🙂 mixed", "lone \ud800 surrogate"]
)
def test_token_ids_count_as_the_sim_counts(s: str) -> None:
    assert len(K.text_token_ids(s)) == count_tokens(s)


def test_token_ids_follow_the_text_four_characters_a_token() -> None:
    a, b = K.text_token_ids("abcdefgh" + "X" * 8), K.text_token_ids("abcdefgh" + "Y" * 8)
    assert a[:2] == b[:2] and a[2:] != b[2:]
    assert K.text_token_ids("abcd") == [int.from_bytes("abcd".encode("utf-32-le"), "little")]
    # A short last token is not the same as a full one that ends in NUL.
    assert K.text_token_ids("abc") != K.text_token_ids("abc\0")
    assert len(set(K.text_token_ids("".join(chr(c) for c in range(2000))))) == 500


@pytest.mark.parametrize("s", ["", "a", "abcd", "abcde" * 20, "é漢字🙂 mixed" * 9, "\ud800 x" * 7])
@pytest.mark.parametrize("bs", [1, 2, 4, 16])
def test_a_texts_block_hashes_are_those_of_its_token_ids(s: str, bs: int) -> None:
    assert K.text_block_hashes(s, bs) == K.chain_hashes(K.text_token_ids(s), bs)


def test_block_hashes_chain_and_only_full_blocks_count() -> None:
    toks = list(range(100, 111))  # two full blocks of 4 and a partial one of 3
    hs = K.chain_hashes(toks, BS)
    assert hs == [K.block_hash(None, toks[:4]), K.block_hash(hs[0], toks[4:8])]
    # Part of the contract (routers compute the same): the value never changes.
    assert K.block_hash(None, [1, 2, 3, 4]) == 12993444675552658020
    # A change in block 1 changes its hash and every later one, never an earlier one.
    other = [*toks[:5], 999, *toks[6:]]
    ho = K.chain_hashes(other, BS)
    assert ho[0] == hs[0] and ho[1] != hs[1]
    longer = K.chain_hashes([*toks, 1, 2, 3, 4, 5], BS)
    assert longer[:2] == hs and len(longer) == 4
    # The same tokens after another parent: another hash (a hash names the whole prefix).
    assert K.chain_hashes(toks[4:8], BS, parent=hs[0]) == hs[1:]
    assert K.chain_hashes(toks[4:8], BS) != hs[1:]
    assert all(0 <= h < 2**64 for h in hs)


# -- the cache --------------------------------------------------------------------------------


def test_a_prompt_seen_before_is_read_from_the_cache_up_to_its_last_token() -> None:
    cache = KVCache(64, BS)
    log = Log(cache)
    p = text(1, 3.5)  # 3 full blocks and half a block
    first = run(cache, p)
    assert first.cached_tokens == 0
    (ev,) = log.sync()
    hs = cache.hashes_of(p)
    assert ev == K.stored(hs, None, BS)
    cache.release(first)
    again = run(cache, p)
    assert again.cached_tokens == 3 * BS and log.sync() == []  # nothing new to store
    cache.release(again)
    # Exactly 3 full blocks: the last token is computed anyway (its logits start the answer).
    exact = text(1, 3)
    assert cache.hashes_of(exact) == hs
    lease = cache.acquire(hs, 3 * BS)
    assert lease.cached_tokens == 2 * BS
    cache.release(lease)
    # A longer prompt with the same start: the shared blocks hit, the new ones are stored
    # after them.
    longer = text(1, 5)
    lease = run(cache, longer)
    assert lease.cached_tokens == 3 * BS
    (ev,) = log.sync()
    assert ev == K.stored(cache.hashes_of(longer)[3:], hs[2], BS)
    st = cache.stats()
    assert st["hit_tokens"] == 3 * BS + 2 * BS + 3 * BS
    assert st["query_tokens"] == 14 + 14 + 12 + 20
    assert st["hit_ratio"] == pytest.approx(st["hit_tokens"] / st["query_tokens"])
    assert log.seqs == [1, 2]


def test_lru_eviction_frees_the_least_recent_blocks_tail_first() -> None:
    cache = KVCache(8, BS)
    log = Log(cache)
    a, b, c = text(1, 3.25), text(2, 3.25), text(3, 4.25)
    ha, hb = cache.hashes_of(a), cache.hashes_of(b)
    for p in (a, b):
        cache.release(run(cache, p))
    assert cache.used_blocks == 6  # 3 cached blocks each; their partial blocks freed
    cache.release(run(cache, a))  # a used again: b is now the least recent
    log.sync()
    lease_c = run(cache, c)  # 5 blocks, room for 2: 3 evicted
    removed, stored = log.sync()
    # b's blocks, its last first (a sequence frees its blocks in reverse, as vLLM does).
    assert removed == K.removed(list(reversed(hb)))
    assert stored["hashes"] == cache.hashes_of(c)
    assert cache.match(hb) == 0 and cache.match(ha) == 3
    assert cache.used_blocks == 8 and cache.stats()["evicted_blocks"] == 3
    cache.release(lease_c)
    # Now a's blocks are the least recent, its tail first: evicting two leaves a's first
    # block, and a lookup of a stops at the first block missing.
    lease = cache.acquire(cache.hashes_of(text(4, 2.5)), 10)
    (removed,) = log.sync()
    assert removed["hashes"] == [ha[2], ha[1]]
    assert cache.match(ha) == 1 and log.match(ha) == 1
    cache.release(lease)


def test_blocks_a_running_sequence_holds_are_never_evicted() -> None:
    cache = KVCache(6, BS)
    log = Log(cache)
    held = run(cache, text(1, 3))  # 3 blocks held (the last token's block is its 3rd)
    log.sync()
    other = cache.acquire(cache.hashes_of(text(2, 5)), 20)  # 5 more: overcommitted
    assert log.sync() == []  # nothing was free to evict
    assert cache.used_blocks == 8 and cache.stats()["usage"] == 1.0
    assert cache.match(held.hashes) == 3
    cache.release(other)
    cache.release(held)
    assert cache.used_blocks == 3


def test_output_fills_blocks_that_count_against_the_capacity() -> None:
    cache = KVCache(64, BS)
    lease = run(cache, text(1, 2.5))  # 10 tokens: 3 blocks, room for 12
    assert cache.used_blocks == 3
    for total in range(11, 30):  # tokens so far, as the sim's decode adds them
        if total > lease.tokens:
            cache.grow(lease)
    assert lease.tokens == 32 and cache.used_blocks == 8
    cache.release(lease)
    assert cache.used_blocks == 2  # the two full prompt blocks stay cached, unheld


def test_two_sequences_prefilling_the_same_blocks_store_them_once() -> None:
    cache = KVCache(64, BS)
    log = Log(cache)
    p = text(1, 3)
    one = cache.acquire(cache.hashes_of(p), 12)
    two = cache.acquire(cache.hashes_of(p), 12)
    cache.commit(one)
    cache.commit(two)
    (ev,) = log.sync()
    assert ev["hashes"] == cache.hashes_of(p)
    assert cache.used_blocks == 3  # the second shares them
    cache.release(one)
    assert not cache.clear()  # the second still holds them
    cache.release(two)
    assert cache.clear()
    assert log.sync() == [K.all_cleared()] and cache.used_blocks == 0 and not log.blocks


def test_events_replayed_by_a_consumer_give_the_cache_and_its_lookups_exactly() -> None:
    """A seeded random workload on a small cache (shared prefixes, eviction, sequences
    cancelled before their prefill completes): after every step a consumer that applied
    the events has exactly the snapshot's blocks and finds the same prefixes."""
    rng = random.Random(7)
    cache = KVCache(40, BS)
    log = Log(cache)
    stems = [text(i, 3) for i in range(4)]
    prompts = [s + text(10 + j, rng.choice([0.5, 1, 2.25, 4])) for s in stems for j in range(4)]
    live: list[tuple[Lease, bool]] = []
    for _ in range(400):
        r = rng.random()
        if r < 0.45 or not live:
            p = rng.choice(prompts)
            lease = cache.acquire(cache.hashes_of(p), count_tokens(p))
            live.append((lease, False))
        elif r < 0.75:
            i = rng.randrange(len(live))
            lease, committed = live[i]
            if not committed:
                cache.commit(lease)
                live[i] = (lease, True)
        else:
            lease, _ = live.pop(rng.randrange(len(live)))
            cache.release(lease)  # done, or cancelled before its prefill completed
        log.sync()
        seq, blocks = cache.snapshot()
        assert seq == cache.seq == (log.seqs[-1] if log.seqs else 0)
        assert dict(blocks) == log.blocks
        for p in prompts:
            hs = cache.hashes_of(p)
            assert cache.match(hs) == log.match(hs)
    assert log.seqs == list(range(1, len(log.seqs) + 1))
    kinds = {ev["type"] for ev in log.events}
    assert kinds == {K.STORED, K.REMOVED}
    assert cache.stats()["hit_tokens"] > 0


def test_events_are_kept_only_while_someone_listens() -> None:
    cache = KVCache(64, BS)
    run(cache, text(1, 2))
    assert cache.seq == 1 and cache.drain_events() == (2, [])
    log = Log(cache)
    run(cache, text(2, 2))
    assert log.notified == 1
    run(cache, text(3, 2))
    assert log.notified == 1  # once per drain, not per event
    first, evs = cache.drain_events()
    assert first == 2 and len(evs) == 2 and cache.seq == 3
    run(cache, text(4, 2))
    assert log.notified == 2


def test_a_chain_longer_than_an_event_holds_is_several_events_in_order() -> None:
    cache = KVCache(20_000, 1)
    log = Log(cache)
    n = K.MAX_EVENT_HASHES + 10
    hs = K.chain_hashes(list(range(n)), 1)
    cache.commit(cache.acquire(hs, n + 1))
    one, two = log.sync()
    assert one == K.stored(hs[: K.MAX_EVENT_HASHES], None, 1)
    assert two == K.stored(hs[K.MAX_EVENT_HASHES :], hs[K.MAX_EVENT_HASHES - 1], 1)


# -- the wire ---------------------------------------------------------------------------------


def test_batches_number_every_event_and_split_by_hashes() -> None:
    evs = [K.stored([i, i + 1], None, 16) for i in range(0, 10, 2)] + [K.all_cleared()]
    out = K.batches(
        replica="r",
        model="m",
        boot="b",
        block_size=16,
        seq_first=41,
        events=evs,
        ts_ms=5,
        max_hashes=4,
    )
    assert [(b["seq_first"], b["seq_last"]) for b in out] == [(41, 42), (43, 44), (45, 46)]
    assert [ev for b in out for ev in b["events"]] == evs
    for b in out:
        assert K.decode_batch(codec.encode(b)) == b


def _batch(**over: Any) -> dict[str, Any]:
    b = K.batches(
        replica="r",
        model="m",
        boot="b",
        block_size=16,
        seq_first=1,
        ts_ms=1,
        events=[K.stored([2**64 - 1, b"\x01" * 32], 7, 2, token_ids=[1, 2, 3, 4])],
    )[0]
    return {**b, **over}


@pytest.mark.parametrize(
    "bad",
    [
        {"type": "heartbeat"},
        {"replica": ""},
        {"seq_first": 0},
        {"seq_last": 5},  # one event, but numbers for five
        {"block_size": True},
        {"events": [{"type": "stored", "hashes": [2**64], "parent": None, "block_size": 16}]},
        {"events": [{"type": "stored", "hashes": [], "parent": None, "block_size": 16}]},
        {"events": [{"type": "stored", "hashes": [1], "parent": "x", "block_size": 16}]},
        {
            "events": [
                {"type": "stored", "hashes": [1], "parent": None, "block_size": 2, "token_ids": [1]}
            ]
        },
        {"events": [{"type": "removed", "hashes": [-1]}]},
        {"events": [{"type": "evicted", "hashes": [1]}]},
        {"events": ["stored"]},
    ],
)
def test_malformed_batches_are_refused(bad: dict[str, Any]) -> None:
    assert K.decode_batch(codec.encode(_batch())) == _batch()
    with pytest.raises(E.InvalidRequest):
        K.decode_batch(codec.encode(_batch(**bad)))


def test_a_snapshot_in_pages_is_the_cache_at_one_event() -> None:
    cache = KVCache(64, BS)
    Log(cache)
    for i in range(3):
        cache.release(run(cache, text(i, 4)))
    seq, blocks = cache.snapshot()
    pages = K.snapshot_pages(
        replica="r",
        model="m",
        boot="b",
        block_size=BS,
        capacity_blocks=64,
        seq=seq,
        blocks=blocks,
        stats=cache.stats(),
        page_blocks=5,
    )
    assert [p["page"] for p in pages] == [0, 1, 2] and {p["pages"] for p in pages} == {3}
    wire = [K.decode_snapshot(codec.encode(p)) for p in pages]
    assert "stats" in wire[0] and "stats" not in wire[1]
    assert K.assemble_snapshot(reversed(wire)) == (seq, dict(blocks)) and seq == 3
    with pytest.raises(E.InvalidRequest):
        K.assemble_snapshot(wire[:2])
    with pytest.raises(E.InvalidRequest):
        K.decode_snapshot(codec.encode({**pages[0], "blocks": [[1, 2, 3]]}))
    empty = K.snapshot_pages(
        replica="r", model="m", boot="b", block_size=BS, capacity_blocks=1, seq=0, blocks=[]
    )
    assert K.assemble_snapshot(empty) == (0, {})


def test_apply_event_stops_a_consumers_lookup_at_a_removed_middle_block() -> None:
    hs = K.chain_hashes(list(range(16)), BS)
    blocks: dict[Any, Any] = {}
    K.apply_event(blocks, K.stored(hs, None, BS))
    assert blocks == {hs[0]: None, hs[1]: hs[0], hs[2]: hs[1], hs[3]: hs[2]}
    K.apply_event(blocks, K.removed([hs[1]]))  # as another engine may evict
    walk = 0
    while walk < len(hs) and hs[walk] in blocks:
        walk += 1
    assert walk == 1 and hs[3] in blocks
    K.apply_event(blocks, K.all_cleared())
    assert blocks == {}


# -- the sim engine ---------------------------------------------------------------------------


def req(prompt: str, max_tokens: int = 3) -> GenerationRequest:
    return GenerationRequest(
        request_id="r", kind="completions", model="m", max_tokens=max_tokens, prompt=prompt
    )


def cfg(**kw: Any) -> SimSettings:
    base: dict[str, Any] = {"prefill_ms": 1.0, "decode_ms": 1.0, "prefill_ms_per_token": 0.5}
    return SimSettings(**{**base, "block_size": BS, "kv_cache_blocks": 256, **kw})


async def finish(engine: SimEngine, prompt: str, max_tokens: int = 3) -> tuple[int, float]:
    """Run a request to its end: (prompt tokens read from the cache, its prefill time)."""
    g = engine.generate(req(prompt, max_tokens))
    cached, prefill = g.seq.cached, g.seq.prefill_s
    async for _ in g:
        pass
    return cached, prefill


async def test_a_cached_prompt_prefills_only_its_uncached_tokens() -> None:
    e = SimEngine(cfg())
    p = text(1, 10.5)  # 42 tokens
    assert await finish(e, p) == (0, e.prefill_s(42))
    cached, again = await finish(e, p)
    assert cached == 40 and again == e.prefill_s(2) < e.prefill_s(42)
    # The same text after another start shares nothing.
    assert (await finish(e, "x" + p))[0] == 0
    st = e.kv_cache_stats()
    assert st is not None and st["hit_tokens"] == 40 and st["query_tokens"] == 42 * 2 + 43
    # Each sequence's blocks went back: only cached ones are left, none held.
    assert st["used_blocks"] == st["cached_blocks"] == 10 + 10
    assert e.stats() == {"running": 0, "waiting": 0, "kv_usage": 0.0}


async def test_without_a_cache_or_a_per_token_cost_prefill_is_as_before() -> None:
    off = SimEngine(cfg(kv_cache_blocks=0))
    p = text(1, 10.5)
    assert await finish(off, p) == await finish(off, p) == (0, off.prefill_s(42))
    assert off.cache is None and off.kv_cache_stats() is None
    # The defaults: the cache is on but prefill has no per-token cost, so its time is
    # the same with or without hits.
    d = SimEngine(SimSettings())
    assert d.cache is not None and d.cache.block_size == 16
    first, second = await finish(d, text(1, 10)), await finish(d, text(1, 10))
    assert second[0] > 0 and first[1] == second[1] == d.prefill_s(0)


async def test_a_sequence_cancelled_in_prefill_stores_nothing_and_frees_its_blocks() -> None:
    e = SimEngine(cfg(prefill_ms=10_000))
    assert e.cache is not None
    log = Log(e.cache)
    g = e.generate(req(text(1, 6)))
    assert e.cache.used_blocks == 6  # 24 prompt tokens
    await g.aclose()
    assert log.sync() == [] and e.cache.used_blocks == 0


async def test_the_sim_backend_offers_its_cache_and_clears_it_when_it_stops() -> None:
    b = SimBackend(WorkerSettings(sim=cfg()))
    cache = b.engine.cache
    assert cache is not None
    log = Log(cache)
    assert kv_event_source(b) is cache
    g = b.generate(req(text(1, 3)))
    async for _ in g:
        pass
    await b.stop()
    assert [ev["type"] for ev in log.sync()] == [K.STORED, K.ALL_CLEARED]
    assert kv_event_source(SimBackend(WorkerSettings(sim=cfg(kv_cache_blocks=0)))) is None


@pytest.mark.parametrize("block_size", [1, 2, 16])
@pytest.mark.parametrize("per", [1, 3, 1024])
def test_a_prompt_hashed_in_slices_has_the_same_hashes(block_size: int, per: int) -> None:
    rng = random.Random(block_size * 100 + per)
    alphabet = ["a", " ", "é", "\U0001f600", "\ud800"]  # a lone surrogate, as JSON may hold
    step = block_size * 4 * per
    for n in {0, 1, 3, 4, 5, step - 1, step, step + 1, 2 * step + 3, 700}:
        text = "".join(rng.choice(alphabet) for _ in range(n))
        sliced = K.text_block_hash_slices(text, block_size, "seed", per)
        assert [h for part in sliced for h in part] == K.text_block_hashes(text, block_size, "seed")


async def test_a_long_prompt_is_hashed_while_the_event_loop_turns() -> None:
    """A multi-MiB prompt's block hashes are made a slice per turn of the event loop, not in
    one call that holds it (docs/large-requests.md: eight 16 MiB prompts held a worker past
    its heartbeats); its admission and what its prefill stores are the same as before."""
    import asyncio

    from engine_worker.backends import sim

    engine = SimEngine(SimSettings(prefill_ms=1.0, decode_ms=1.0, max_model_len=10**9))
    assert engine.cache is not None
    text = ("lorem ipsum dolor sit amet " * 100_000)[: 2 * 1024 * 1024]
    assert len(text) >= 4 * sim.PREHASH_CHARS
    r = GenerationRequest(request_id="r", kind="completions", model="m", max_tokens=4, prompt=text)
    stream = engine.generate(r)
    turns = 0  # turns of the loop before the prompt was looked up in the cache
    done = False

    async def ticker() -> None:
        nonlocal turns
        while not done:
            if not stream.seq.looked_up:
                turns += 1
            await asyncio.sleep(0)

    tick = asyncio.create_task(ticker())
    got = [d async for d in stream]
    done = True
    await tick
    assert got[-1].finish_reason == "length"
    # 2 MiB of prompt: 32 slices of 1024 blocks, each followed by a turn of the loop.
    assert turns >= 16, turns
    hashes = K.text_block_hashes(text, engine.cfg.block_size, engine.cfg.hash_seed)
    assert engine.cache.match(hashes) == len(hashes)  # stored what it always stored
    # The same prompt again reads every full block but the last token's from the cache.
    again = [d async for d in engine.generate(r)]
    cached = again[-1].usage["prompt_tokens_details"]["cached_tokens"]  # type: ignore[index]
    assert cached == min(len(hashes), (count_tokens(text) - 1) // engine.cfg.block_size) * (
        engine.cfg.block_size
    )
    assert "".join(d.text for d in again) == "".join(d.text for d in got)
