"""vLLM's own KV-cache events, forwarded onto the bus in vLLM's hashing.

vLLM publishes its prefix cache's changes (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared`` in a ``KVEventBatch`` per engine step) on a ZMQ PUB socket when
``kv_events_config`` turns them on (``vllm.distributed.kv_events``: frames ``topic``,
8-byte big-endian batch number, msgpack body; a ROUTER socket replays recent batches from a
number). The vllm backend turns them on (:func:`events_config`, unless the operator set
``kv_events_config`` already), and :class:`VLLMKVEvents` subscribes to them and is the
worker's :class:`engine_worker.backends.base.KVEventSource`:

- each vLLM event becomes the tokenbus event it maps to (:mod:`bus_schemas.kv_events`),
  numbered per event, without the blocks' token ids (no router reads them; they would
  multiply the bytes on the bus); vLLM's hashes are kept as they are, so a router that
  hashes a prompt as vLLM does (:func:`router.kv_hashing.vllm_block_hashes` over
  vLLM's tokenizer and chat template) matches them exactly;
- a mirror of the cache (hash -> parent) built from those events answers snapshots: vLLM
  keeps no snapshot of its own;
- a gap in vLLM's batch numbers (a message lost between the engine core and this process)
  is filled from vLLM's replay socket; when that fails too the mirror no longer matches the
  engine, so it is dropped with an ``all_cleared`` event and rebuilt from the events that
  follow (routers then under-estimate this replica's cache, never over-estimate it);
- only the GPU tier and the first KV-cache group are followed: offloaded (CPU, disk) blocks
  and the other groups of hybrid models are counted and skipped.

Imports ``zmq`` and ``msgspec`` (vLLM's dependencies) only when started.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
from typing import Any

from bus_schemas import kv_events as K
from engine_worker.kvcache import EventLog

__all__ = ["VLLMKVEvents", "connect_endpoint", "events_config", "hashing_of"]

TOPIC = "kv"
# vLLM's replay socket answers a start number with every batch it still has, then this.
_END_SEQ = (-1).to_bytes(8, "big", signed=True)
REPLAY_TIMEOUT_S = 1.0


def events_config(folder: str) -> dict[str, Any]:
    """``kv_events_config`` for vLLM: events on, its ZMQ publisher on IPC sockets in
    ``folder`` (private to this worker), replay on."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"ipc://{folder}/events",
        "replay_endpoint": f"ipc://{folder}/replay",
        "topic": TOPIC,
    }


def connect_endpoint(endpoint: str) -> str:
    """Where a subscriber connects to reach a publisher bound at ``endpoint``
    (``tcp://*:5557`` binds every interface; this process reaches it on loopback)."""
    if endpoint.startswith("tcp://*:"):
        return "tcp://127.0.0.1:" + endpoint.rsplit(":", 1)[1]
    return endpoint.replace("tcp://[::]:", "tcp://[::1]:")


def hashing_of(vllm_config: Any) -> dict[str, Any]:
    """How this engine hashes prompts (:func:`bus_schemas.kv_events.vllm_scheme`): what a
    router needs to compute the same hashes."""
    cc, mc = vllm_config.cache_config, vllm_config.model_config
    algo = str(cc.prefix_caching_hash_algo)
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is None and algo in K.VLLM_HASH_ALGOS:
        seed = K.VLLM_DEFAULT_SEED
    try:
        from vllm import envs

        int_hashes = bool(envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
    except Exception:
        int_hashes = True
    return K.vllm_scheme(
        algo=algo,
        seed=seed,
        int_hashes=int_hashes,
        tokenizer=str(mc.tokenizer),
        block_size=int(cc.block_size),
    )


class VLLMKVEvents(EventLog):
    """vLLM's KV events from its ZMQ publisher, as a worker's KV event source (see the
    module docstring). :meth:`feed` takes one decoded ``KVEventBatch`` (tests call it
    directly); :meth:`start` reads them from the publisher."""

    medium = K.MEDIUM_GPU

    def __init__(
        self,
        *,
        block_size: int,
        capacity: int,
        hashing: dict[str, Any],
        endpoint: str | None = None,
        replay_endpoint: str | None = None,
        topic: str = TOPIC,
        folder: str | None = None,
        log: Any = None,
    ) -> None:
        self.block_size = block_size
        self.capacity = capacity
        self.hashing = hashing
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self._folder = folder  # removed on close (the IPC sockets' folder)
        self.log = log
        super().__init__()
        self.blocks: dict[Any, Any] = {}  # the mirror: hash -> parent
        self._vllm_seq = -1  # vLLM's number of the last batch taken
        self._task: asyncio.Task[None] | None = None
        self._ctx: Any = None
        self._decoder: Any = None
        # Counters (stats and tests).
        self.batches = 0
        self.replayed = 0
        self.resets = 0
        self.skipped = 0  # events of other tiers or groups

    # -- the KVEventSource side (events: EventLog's) ------------------------------------------
    def snapshot(self) -> tuple[int, list[tuple[Any, Any]]]:
        return self.seq, list(self.blocks.items())

    def stats(self) -> dict[str, Any]:
        return {
            "capacity_blocks": self.capacity,
            "block_size": self.block_size,
            "cached_blocks": len(self.blocks),
            "usage": min(1.0, len(self.blocks) / self.capacity) if self.capacity else 0.0,
            "vllm_batches": self.batches,
            "replayed_batches": self.replayed,
            "resets": self.resets,
            "skipped_events": self.skipped,
        }

    # -- vLLM's events ------------------------------------------------------------------------
    def feed(self, batch: Any) -> None:
        """Take one ``KVEventBatch``: map, apply to the mirror and queue its events."""
        self.batches += 1
        for ev in getattr(batch, "events", ()) or ():
            mapped = self._map(ev)
            if mapped is None:
                self.skipped += 1
                continue
            self._event(mapped)

    def _map(self, ev: Any) -> dict[str, Any] | None:
        name = type(ev).__name__
        if name == "AllBlocksCleared":
            return K.all_cleared()
        medium = getattr(ev, "medium", None)
        group = getattr(ev, "group_idx", None)
        if (medium is not None and str(medium).upper() != "GPU") or group not in (None, 0):
            return None
        if name == "BlockStored":
            hashes = list(ev.block_hashes)
            if not hashes:
                return None
            return K.stored(
                hashes,
                ev.parent_block_hash,
                int(ev.block_size),
                medium=self.medium,
                lora=getattr(ev, "lora_name", None),
            )
        if name == "BlockRemoved":
            hashes = list(ev.block_hashes)
            return K.removed(hashes, medium=self.medium) if hashes else None
        return None

    def _event(self, ev: dict[str, Any]) -> None:
        K.apply_event(self.blocks, ev)
        self._log(ev)

    def _reset(self) -> None:
        """The mirror no longer matches the engine: drop it (routers learn it is empty)."""
        self.resets += 1
        self._event(K.all_cleared())

    # -- reading the publisher ----------------------------------------------------------------
    async def start(self) -> None:
        """Subscribe to the publisher and follow it until :meth:`close`."""
        if self.endpoint is None or self._task is not None:
            return
        import zmq
        import zmq.asyncio
        from msgspec.msgpack import Decoder
        from vllm.distributed.kv_events import KVEventBatch

        self._decoder = Decoder(type=KVEventBatch)
        self._ctx = zmq.asyncio.Context()
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        sub.connect(connect_endpoint(self.endpoint))
        self._task = asyncio.get_running_loop().create_task(self._read(sub))

    async def _read(self, sub: Any) -> None:
        try:
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    continue
                self._take(int.from_bytes(frames[1], "big"), frames[2])
                if self._missed is not None:
                    await self._replay(*self._missed)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the engine's socket went away: the worker stops anyway
            if self.log is not None:
                self.log.warning("vllm_kv_events_stopped", error=type(exc).__name__)
        finally:
            sub.close(linger=0)

    _missed: tuple[int, int] | None = None

    def _take(self, seq: int, payload: bytes) -> None:
        """One batch numbered ``seq``: applied if it is the next; a later one first has
        the missing ones replayed (:meth:`_replay`); an old one is ignored."""
        expected = self._vllm_seq + 1  # vLLM numbers from 0
        if seq < expected:
            return
        if seq > expected:
            self._missed = (expected, seq)
            self._held = (seq, payload)
            return
        self._vllm_seq = seq
        try:
            batch = self._decoder.decode(payload)
        except Exception:
            self._reset()
            return
        self.feed(batch)

    _held: tuple[int, bytes] | None = None

    async def _replay(self, first: int, upto: int) -> None:
        """Ask vLLM's replay socket for batches ``first``..``upto - 1``; apply them, then the
        batch held back. If they cannot all be had, reset the mirror."""
        self._missed = None
        held, self._held = self._held, None
        got: dict[int, bytes] = {}
        if self.replay_endpoint is not None:
            with contextlib.suppress(Exception):
                got = await asyncio.wait_for(self._fetch(first), REPLAY_TIMEOUT_S)
        if all(n in got for n in range(first, upto)):
            for n in range(first, upto):
                self.replayed += 1
                self._take(n, got[n])
        else:
            self._reset()
            self._vllm_seq = upto - 1
        if held is not None:
            self._take(*held)

    async def _fetch(self, first: int) -> dict[int, bytes]:
        import zmq

        sock = self._ctx.socket(zmq.DEALER)
        try:
            sock.connect(connect_endpoint(str(self.replay_endpoint)))
            await sock.send_multipart((b"", first.to_bytes(8, "big")))
            out: dict[int, bytes] = {}
            while True:
                frames = await sock.recv_multipart()
                # (empty delimiter, topic, seq, payload); the end: seq -1, empty payload
                if len(frames) < 4 or frames[2] == _END_SEQ:
                    return out
                out[int.from_bytes(frames[2], "big")] = frames[3]
        finally:
            sock.close(linger=0)

    async def close(self) -> None:
        """Stop reading; the engine is gone, so its cache is too (``all_cleared``)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self.blocks:
            self._event(K.all_cleared())
        if self._folder:
            shutil.rmtree(self._folder, ignore_errors=True)


def private_folder() -> str:
    """A folder for this worker's IPC sockets (removed when its events stop)."""
    return tempfile.mkdtemp(prefix="tokenbus-kv-")
