"""vLLM's own KV events on the bus, and a router matching them (docs/kv-events.md).

vLLM 0.33 on CPU behind the scripted engine core (engine_worker/backends/scripted_core.py),
whose prefix cache names its blocks with vLLM's ``hash_block_tokens`` and publishes through
vLLM's own ``ZmqEventPublisher``; the vllm worker subscribes to it and forwards the events
(engine_worker/backends/vllm_kv.py). A real nats-server; workers and the router in this
process so the test can see the engine core and the router's index.

Skipped unless vLLM is importable (``make test-vllm``).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from bus_schemas import kv_events as K
from bus_schemas import subjects
from engine_worker.backends import scripted_core as sc
from router.kv_hashing import vllm_block_hashes
from tests.support.inprocess import stack
from tests.support.natsserver import NatsServer
from tests.support.waits import wait_for
from tests.test_vllm_real import WEATHER
from tokenbus import Client

pytestmark = pytest.mark.bus

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (make test-vllm)", allow_module_level=True)

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

KV_ROUTER = {"policy": "kv_aware"}
SYSTEM = "You are a helpful assistant. " + "The quick brown fox jumps over the lazy dog. " * 12


def test_our_vllm_hash_is_vllms_own() -> None:
    """kv_hashing.vllm_block_hashes == vLLM's hash_block_tokens chain, for both algorithms
    a router can compute, in the 64-bit form events carry and in full."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as U

    ids = [*range(3, 90), 151643, 7, 100_000]
    for algo in K.VLLM_HASH_ALGOS:
        fn = get_hash_fn_by_name(algo)
        U.init_none_hash(fn)
        parent = None
        theirs = []
        for i in range(0, len(ids) - 15, 16):
            parent = U.hash_block_tokens(fn, parent, ids[i : i + 16], None)
            theirs.append(parent)
        assert vllm_block_hashes(ids, 16, algo=algo, int_hashes=False) == theirs
        assert vllm_block_hashes(ids, 16, algo=algo) == [
            U.maybe_convert_block_hash(h) for h in theirs
        ]
    with pytest.raises(ValueError):
        vllm_block_hashes(ids, 16, algo="xxhash")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sc.build_checkpoint(tmp_path_factory.mktemp("ckpt"))


def vllm_worker(ckpt: Path, **core: Any) -> dict[str, Any]:
    settings = sc.ScriptedCoreSettings(
        prefill_ms=1, prefill_ms_per_token=0.02, decode_ms=2, kv_cache_blocks=4096, **core
    )
    return {
        "backend": "vllm",
        "vllm": {
            "engine_args": {
                "model": str(ckpt),
                "max_model_len": 2048,
                "dtype": "bfloat16",
                "enable_auto_tool_choice": True,
                "tool_call_parser": "hermes",
            },
            "scripted_core": settings.model_dump(),
        },
    }


@pytest.fixture
async def vstack(nats_server: NatsServer, model: str, ckpt: Path) -> AsyncIterator[dict[str, Any]]:
    async with stack(
        nats_server.url, model, workers=2, worker=vllm_worker(ckpt), router=KV_ROUTER
    ) as svcs:
        index = svcs["router"].kv.index
        await wait_for(lambda: index.stats()["synced"] == 2, 30, what="router not synced")
        yield svcs


def conversation(n: int, turns: int) -> list[dict[str, Any]]:
    """Conversation ``n`` after ``turns`` earlier turns (a tool call among them)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": f"{n}: {SYSTEM}"}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"question {t} of {n}: the lazy dog"})
        if t == 0:
            call = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
            messages.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "c1", "type": "function", "function": call}],
                }
            )
            messages.append({"role": "tool", "tool_call_id": "c1", "content": "sunny"})
        messages.append({"role": "assistant", "content": f"answer {t}: hello world"})
    messages.append({"role": "user", "content": f"question {turns} of {n}: the quick fox"})
    return messages


def core_of(worker: Any) -> sc.ScriptedCoreClient:
    core = worker.backend.engine.engine_core
    assert isinstance(core, sc.ScriptedCoreClient)
    return core


async def test_events_carry_vllms_hashes_and_the_router_matches_them(
    vstack: dict[str, Any], model: str, client: Client, nats_server: NatsServer
) -> None:
    """A worker forwards what vLLM's publisher sent: the stored hashes are vLLM's hashes of
    the prompt ids vLLM's renderer made; the router renders and hashes the same request to
    the same hashes; a snapshot carries them and the engine's hashing; and each later turn
    of a conversation lands on the replica holding its prefix, with cached tokens in its
    usage."""
    from router.kv_hashing import PromptEncoder, vllm_prompt_ids

    router = vstack["router"]
    index = router.kv.index
    got: list[dict[str, Any]] = []

    async def on_batch(msg: Any) -> None:
        got.append(K.decode_batch(msg.data))

    sub = await client.nc.subscribe(subjects.kv_events_wildcard(model), cb=on_batch)
    try:
        first = await client.chat_completion(
            model, conversation(0, 1), max_tokens=4, tools=[WEATHER]
        )
        served = next(w for w in vstack["workers"] if w.replica == first.replica)
        added = core_of(served).added[-1]
        ids = list(added.prompt_token_ids)
        scheme = served.backend.kv_events().hashing
        assert scheme["kind"] == "vllm" and scheme["algo"] == "sha256"
        bs = int(scheme["block_size"])
        expected = vllm_block_hashes(ids, bs)
        assert len(expected) >= 10
        await wait_for(
            lambda: (
                sum(len(e.get("hashes", ())) for b in got for e in b["events"]) >= len(expected)
            ),
            what="no stored events",
        )
        stored = [h for b in got for e in b["events"] if e["type"] == "stored" for h in e["hashes"]]
        assert stored[: len(expected)] == expected
        assert {b["replica"] for b in got} == {first.replica}
        # The router renders the request as vLLM did: the same ids, so the same hashes.
        enc = PromptEncoder(router_tokenizer(scheme))
        env = {"messages": conversation(0, 1), "extra": {"tools": [WEATHER]}}
        assert vllm_prompt_ids(enc, env) == ids
        assert vllm_prompt_ids(enc, env) == ids and enc.hits > 0  # its pieces, remembered
        await wait_for(
            lambda: index.lookup(expected).get(first.replica) == len(expected),
            what="router index does not hold the prefix",
        )
        # A snapshot: the same blocks, and how to hash.
        reply = await client.nc.request(subjects.kv_snapshot(model, first.replica), b"", 5)
        snap = K.decode_snapshot(reply.data)
        assert snap["hashing"] == scheme
        assert set(expected) <= {h for h, _ in snap["blocks"]}
    finally:
        await sub.unsubscribe()

    # Conversations: every later turn goes where its first turn's prefix is.
    homes = {}
    for n in range(1, 5):
        out = await client.chat_completion(model, conversation(n, 0), max_tokens=4, tools=[WEATHER])
        homes[n] = out.replica
    await asyncio.sleep(0.1)
    for turns in (1, 2):
        for n, home in homes.items():
            out = await client.chat_completion(
                model, conversation(n, turns), max_tokens=4, tools=[WEATHER]
            )
            assert out.replica == home
            cached = (out.usage.prompt_tokens_details or {}).get("cached_tokens", 0)
            assert cached >= 16 * 10, out.usage
    assert index.hit_decisions >= 8


def test_a_remembering_encoder_gives_the_tokenizers_own_ids(ckpt: Path) -> None:
    """Pieces between added tokens encode alone as they do in the whole text, so the
    encoder that remembers them gives exactly the tokenizer's ids, for texts with and
    without the chat template's tokens, partial markers and odd spacing."""
    import random

    from router.kv_hashing import PromptEncoder

    tok = router_tokenizer({"tokenizer": str(ckpt)})
    enc = PromptEncoder(tok)
    assert enc._split is not None
    rng = random.Random(5)
    words = [
        "<|im_start|>",
        "<|im_end|>",
        "<tool_call>",
        "<think>",
        "<|im",
        "end|>",
        " ",
        "\n",
        "  ",
        "Hello",
        " world",
        "fox",
        '{"a": 1}',
        "é",
        "日本",
        "\t",
    ]
    for _ in range(300):
        text = "".join(rng.choice(words) for _ in range(rng.randrange(0, 30)))
        assert enc.encode(text) == tok.encode(text, add_special_tokens=False), text
    assert enc.hits > 0


def router_tokenizer(scheme: dict[str, Any]) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(scheme["tokenizer"], local_files_only=True)


async def test_a_router_that_cannot_tokenise_falls_back_and_says_why(
    nats_server: NatsServer, model: str, client: Client, ckpt: Path, tmp_path: Path
) -> None:
    """The engine's tokenizer is not where the router looks: its replicas cannot be
    matched, the router says why, and requests are still served (by affinity)."""
    async with stack(
        nats_server.url, model, workers=1, worker=vllm_worker(ckpt), router=KV_ROUTER
    ) as svcs:
        router = svcs["router"]
        index = router.kv.index
        await wait_for(lambda: index.stats()["synced"] == 1, 30, what="router not synced")
        policy = router.routing.route(model).policy
        w = svcs["workers"][0]
        scheme = dict(w.backend.kv_events().hashing)
        w.backend.kv_events().hashing = {**scheme, "tokenizer": str(tmp_path / "nowhere")}
        index.load(
            {
                "replica": w.replica,
                "boot": w.boot,
                "block_size": scheme["block_size"],
                "hashing": {**scheme, "tokenizer": str(tmp_path / "nowhere")},
                "seq": w.backend.kv_events().seq,
                "blocks": [],
            }
        )
        out = await client.chat_completion(model, conversation(9, 0), max_tokens=2)
        assert out.replica == w.replica
        reasons = list(policy.hashers.unavailable.values())
        assert reasons and "not found" in reasons[0]


async def test_missed_vllm_batches_are_replayed_or_the_mirror_reset(tmp_path: Path) -> None:
    """The worker's side of vLLM's publisher: batches published before it listened are
    fetched from vLLM's replay socket; with no replay socket the mirror is dropped
    (all_cleared) rather than left wrong."""
    events = await _follow_late(tmp_path, replay=True)
    assert [e["hashes"] for e in events] == [[1], [2], [3], [4]]
    events = await _follow_late(tmp_path, replay=False)
    assert [e["type"] for e in events] == ["all_cleared", "stored"]
    for ev in events:  # the bus's own shape
        K.check_event(ev)


async def _follow_late(tmp_path: Path, *, replay: bool) -> list[dict[str, Any]]:
    """Three batches published before the follower listens, then a fourth: what it makes
    of them (its events), after checking its mirror."""
    from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

    from engine_worker.backends.vllm_kv import VLLMKVEvents

    def stored(h: int, parent: int | None) -> Any:
        return BlockStored(
            block_hashes=[h],
            parent_block_hash=parent,
            token_ids=list(range(16)),
            block_size=16,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        )

    ep = f"ipc://{tmp_path}/ev-{replay}"
    rep = f"ipc://{tmp_path}/rep-{replay}" if replay else None
    pub = ZmqEventPublisher(0, endpoint=ep, replay_endpoint=rep, topic="kv")
    kv = VLLMKVEvents(
        block_size=16,
        capacity=100,
        hashing={"kind": "vllm"},
        endpoint=ep,
        replay_endpoint=rep,
        topic="kv",
    )
    kv.on_events(lambda: None)
    try:
        for i in range(3):  # nobody listens yet: lost to a subscriber
            pub.publish(KVEventBatch(ts=1.0, events=[stored(i + 1, i or None)]))
        await asyncio.sleep(0.3)
        await kv.start()
        await asyncio.sleep(0.3)  # the subscription reaches the publisher
        pub.publish(KVEventBatch(ts=1.0, events=[stored(4, 3)]))
        await wait_for(lambda: kv.batches + kv.resets >= (4 if replay else 2), 5)
        _, events = kv.drain_events()
        if replay:
            assert kv.replayed == 3 and kv.blocks == {1: None, 2: 1, 3: 2, 4: 3}
        else:
            assert kv.resets == 1 and kv.blocks == {4: 3}
        assert kv.seq == len(events)
        return events
    finally:
        await kv.close()
        pub.shutdown()
