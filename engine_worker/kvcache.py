"""A model of a paged prefix cache (vLLM's automatic prefix caching), and its events.

Pure bookkeeping, no NATS, no asyncio: the sim engine calls it, the worker publishes what
it reports (:mod:`bus_schemas.kv_events` has the wire shapes and the hash function).

What it models, after vLLM's ``BlockPool`` and ``KVCacheManager``:

- a pool of ``capacity`` blocks of ``block_size`` tokens; a sequence holds a block for
  every ``block_size`` tokens of its prompt and output (the last one partly filled);
- full prompt blocks are cached under chained hashes (``hash(parent hash, token ids)``), so
  a hash names the whole prefix up to the block's end;
- at admission a sequence looks its prompt up: the walk goes from the first block and stops
  at the first one not cached (a chain whose middle block was evicted is matched only up to
  it). At most ``prompt tokens - 1`` tokens are read from the cache: as in vLLM, the last
  token is always computed, since its logits give the first output token;
- the matched blocks are referenced (no longer evictable) and the rest of the prompt gets
  new blocks; when its prefill completes, the sequence's new full blocks enter the cache
  (``stored`` events); when it ends, its references go and its cached blocks become
  evictable, the prompt's last block first (vLLM frees a sequence's blocks in reverse);
- a new block comes from free room first, else by evicting the least recently used cached
  block no sequence holds (``removed`` events, one per allocation that evicted);
- ``clear()`` drops the cache when no sequence holds a block (vLLM's
  ``reset_prefix_cache``; ``all_cleared`` event).

What it does not model: output blocks are held (their memory counts) but never cached, so a
next turn matches only up to where its prompt repeats the earlier prompt (the sim's output
tokens and its prompt tokens are cut differently anyway); two sequences prefilling the same
new blocks at once are stored once (the second references the first's blocks and frees its
copies); no preemption or swapping (when running sequences need more blocks than the pool
has, the pool is overcommitted, as if the engine had room, and usage reads over 1 before
clamping); no host-memory or disk tier, no per-layer or per-head detail, no sliding-window
or hybrid (Mamba) groups, no LoRA, multimodal or ``cache_salt`` keys in the hashes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from bus_schemas import kv_events as K

__all__ = ["EventLog", "KVCache", "Lease"]

# Block hashes made per slice of a long prompt (:meth:`KVCache.hash_slices`): ~1.5 ms of CPU.
HASH_SLICE_BLOCKS = 1024


class _Block:
    __slots__ = ("parent", "refs")

    def __init__(self, parent: int | None, refs: int) -> None:
        self.parent = parent
        self.refs = refs


class Lease:
    """One sequence's blocks: the first ``held`` of its prompt's full blocks ``hashes`` it
    references in the cache, ``private`` more that are its own (the prompt's uncached rest,
    its partial last block, its output), room for ``tokens`` tokens in all."""

    __slots__ = ("cached_tokens", "hashes", "held", "private", "tokens")

    def __init__(self, hashes: list[int], held: int, private: int, tokens: int) -> None:
        self.hashes = hashes
        self.held = held
        self.private = private
        self.tokens = tokens
        # Prompt tokens read from the cache at admission (not prefilled again).
        self.cached_tokens = 0


class EventLog:
    """A cache's events as a worker reads them: numbered from 1, one number each, and kept
    for :meth:`drain_events` only while a listener is set (:meth:`on_events`), so a cache
    nobody listens to keeps none."""

    def __init__(self) -> None:
        self.seq = 0  # the number of the last event
        self._pending: list[dict[str, Any]] = []
        self._notify: Callable[[], None] | None = None

    def _log(self, ev: dict[str, Any]) -> None:
        self.seq += 1
        notify = self._notify
        if notify is None:
            return
        self._pending.append(ev)
        if len(self._pending) == 1:
            notify()

    def on_events(self, notify: Callable[[], None] | None) -> None:
        """Keep events from now on and call ``notify()`` whenever the first one is pending
        (None: keep none)."""
        self._notify = notify
        if notify is None:
            self._pending = []

    def drain_events(self) -> tuple[int, list[dict[str, Any]]]:
        """(number of the first, the events) kept since the last drain, in order."""
        out, self._pending = self._pending, []
        return self.seq - len(out) + 1, out


class KVCache(EventLog):
    """The prefix cache of one replica (see the module docstring), and its event log."""

    def __init__(
        self, capacity: int, block_size: int = 16, medium: str = K.MEDIUM_GPU, seed: str = ""
    ) -> None:
        if capacity < 1 or block_size < 1:
            raise ValueError("capacity and block_size must be at least 1")
        super().__init__()
        self.capacity = capacity
        self.block_size = block_size
        self.seed = seed  # of its block hashes (K.text_root): announced in heartbeats
        self.medium = medium
        self._blocks: dict[int, _Block] = {}  # every cached block, held or not
        self._free: OrderedDict[int, None] = OrderedDict()  # cached, unheld: LRU first
        self._private = 0  # blocks sequences hold that are not cached
        self.query_tokens = 0  # prompt tokens looked up
        self.hit_tokens = 0  # of those, read from the cache
        self.evicted_blocks = 0

    # -- lookups ----------------------------------------------------------------------------
    def hashes_of(self, text: str) -> list[int]:
        """The full-block hashes of a prompt rendered as ``text`` (the sim's tokens)."""
        return K.text_block_hashes(text, self.block_size, self.seed)

    def hash_slices(self, text: str) -> Iterator[list[int]]:
        """:meth:`hashes_of` ``text`` in slices of :data:`HASH_SLICE_BLOCKS`, each made when
        asked for (a caller yields to its event loop between them)."""
        return K.text_block_hash_slices(text, self.block_size, self.seed, HASH_SLICE_BLOCKS)

    def match(self, hashes: Sequence[int]) -> int:
        """How many of ``hashes``, from the first, are cached (no side effects)."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def __contains__(self, h: object) -> bool:
        return h in self._blocks

    @property
    def used_blocks(self) -> int:
        """Blocks in use: cached (held or evictable) and sequences' own."""
        return self._private + len(self._blocks)

    # -- a sequence's life --------------------------------------------------------------------
    def acquire(self, hashes: list[int], tokens: int) -> Lease:
        """Admit a sequence of ``tokens`` prompt tokens whose full blocks hash to ``hashes``
        (``tokens`` may exceed them: a migrated request prefills the text already sent):
        reference its cached prefix, allocate blocks for the rest. The lease's
        ``cached_tokens`` need no prefill."""
        bs = self.block_size
        tokens = max(tokens, len(hashes) * bs)
        limit = min(len(hashes), max(0, tokens - 1) // bs)
        blocks, free = self._blocks, self._free
        n = 0
        while n < limit:
            h = hashes[n]
            b = blocks.get(h)
            if b is None:
                break
            if not b.refs:
                del free[h]
            b.refs += 1
            n += 1
        need = max(0, -(-tokens // bs) - n)
        self._allocate(need)
        lease = Lease(hashes, n, need, (n + need) * bs)
        lease.cached_tokens = n * bs
        self.query_tokens += tokens
        self.hit_tokens += n * bs
        return lease

    def commit(self, lease: Lease) -> None:
        """The sequence's prefill is done: its prompt's full blocks not cached yet are now
        (``stored`` events, one per chain of new blocks)."""
        hashes = lease.hashes
        blocks, free = self._blocks, self._free
        run = -1  # where the current chain of new blocks starts
        for i in range(lease.held, len(hashes)):
            h = hashes[i]
            b = blocks.get(h)
            if b is None:
                blocks[h] = _Block(hashes[i - 1] if i else None, 1)
                if run < 0:
                    run = i
            else:
                # Stored meanwhile by another sequence: share it, free our copy.
                if not b.refs:
                    del free[h]
                b.refs += 1
                if run >= 0:
                    self._stored(hashes, run, i)
                    run = -1
        if run >= 0:
            self._stored(hashes, run, len(hashes))
        moved = len(hashes) - lease.held
        self._private -= moved
        lease.private -= moved
        lease.held = len(hashes)

    def grow(self, lease: Lease) -> None:
        """The sequence needs one more block (its output filled the last one)."""
        self._allocate(1)
        lease.private += 1
        lease.tokens += self.block_size

    def release(self, lease: Lease) -> None:
        """The sequence ended: its cached blocks become evictable (the last first), its own
        blocks are freed. Releasing twice does nothing."""
        blocks, free = self._blocks, self._free
        hashes = lease.hashes
        for i in range(lease.held - 1, -1, -1):
            h = hashes[i]
            b = blocks[h]
            b.refs -= 1
            if not b.refs:
                free[h] = None
        self._private -= lease.private
        lease.held = lease.private = 0

    def clear(self) -> bool:
        """Drop every cached block (``all_cleared``) when no sequence holds a block; False
        (and nothing changes) while one does."""
        if self._private or len(self._free) != len(self._blocks):
            return False
        self._blocks.clear()
        self._free.clear()
        self._event(K.all_cleared())
        return True

    def _allocate(self, n: int) -> None:
        room = self.capacity - self._private - len(self._blocks)
        if room < n and self._free:
            evicted: list[int] = []
            free, blocks = self._free, self._blocks
            while room < n and free:
                h, _ = free.popitem(last=False)
                del blocks[h]
                evicted.append(h)
                room += 1
            self.evicted_blocks += len(evicted)
            for i in range(0, len(evicted), K.MAX_EVENT_HASHES):
                self._event(K.removed(evicted[i : i + K.MAX_EVENT_HASHES], medium=self.medium))
        self._private += n

    # -- events -------------------------------------------------------------------------------
    def _stored(self, hashes: list[int], start: int, end: int) -> None:
        step = K.MAX_EVENT_HASHES
        for i in range(start, end, step):
            j = min(end, i + step)
            parent = hashes[i - 1] if i else None
            self._event(K.stored(hashes[i:j], parent, self.block_size, medium=self.medium))

    def _event(self, ev: dict[str, Any]) -> None:
        self._log(ev)

    def snapshot(self) -> tuple[int, list[tuple[int, int | None]]]:
        """(the last event's number, every cached block as (hash, parent hash))."""
        return self.seq, [(h, b.parent) for h, b in self._blocks.items()]

    def stats(self) -> dict[str, Any]:
        """The cache's usage and hit ratio (tokens read from it over tokens looked up)."""
        used = self.used_blocks
        return {
            "capacity_blocks": self.capacity,
            "block_size": self.block_size,
            "used_blocks": used,
            "cached_blocks": len(self._blocks),
            "usage": min(1.0, used / self.capacity),
            "query_tokens": self.query_tokens,
            "hit_tokens": self.hit_tokens,
            "hit_ratio": self.hit_tokens / self.query_tokens if self.query_tokens else 0.0,
            "evicted_blocks": self.evicted_blocks,
        }
