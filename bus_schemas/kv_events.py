"""KV-cache events on the bus: which prompt prefixes a replica's engine holds, exactly.

A replica whose engine keeps a paged prefix cache (the sim, :mod:`engine_worker.kvcache`;
vLLM later) tells routers every change to it, so a router can send a request to the replica
that already holds the longest prefix of its prompt. Plain msgpack dicts (:mod:`codec`),
built and checked here; never pickle.

**Blocks and their hashes.** A prompt's tokens are cut into blocks of ``block_size`` tokens;
only full blocks are cached. Block ``i``'s hash chains the one before it:
``hash_i = H(hash_{i-1}, tokens of block i)`` (:func:`block_hash`), so one hash names a whole
prefix and two prompts share a block only if they share everything up to its end. A hash is
an unsigned 64-bit integer (vLLM's default, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``) or bytes
(vLLM's full digests); a consumer compares them and never looks inside.

**Subjects** (:mod:`bus_schemas.subjects`): a replica publishes batches on
``tb.v1.kv.<model>.<replica>`` (``kv_events``; routers subscribe to ``tb.v1.kv.*.*``), and
answers snapshot requests on ``tb.v1.engine.<model>.<replica>.kv_snapshot``
(``kv_snapshot``): a replica-specific request subject beside its ``generate`` one, so only
the roles that may dispatch to a worker (router, bridge) may ask it.

**A batch** (one message; an engine step stores and evicts many blocks at once)::

    {"type": "kv_events", "replica": str, "model": str, "boot": str, "block_size": int,
     "seq_first": int, "seq_last": int, "ts_ms": int, "events": [event, ...]}

Every event has a sequence number, per replica (per ``boot``), starting at 1 and increasing
by one per event with no gaps: the batch's events are ``seq_first..seq_last`` in order. A
consumer that sees ``seq_first`` other than the last one it applied plus one (or a new
``boot``) missed some and asks for a snapshot. Events:

- ``{"type": "stored", "hashes": [h, ...], "parent": h | None, "block_size": int,
  "medium": "gpu"}``, optionally ``"token_ids"`` (the blocks' tokens, ``block_size`` per
  block, in order), ``"lora"`` (adapter name), ``"group"`` (KV-cache group): full blocks
  now cached, a chain: ``hashes[0]``'s parent is ``parent`` (None: the prompt's first
  block), each next one's parent the one before it.
- ``{"type": "removed", "hashes": [h, ...], "medium": "gpu"}`` (optionally ``"group"``):
  blocks evicted. Their children may stay cached but no lookup reaches them any more.
- ``{"type": "all_cleared"}``: the whole cache was dropped (a reset, or the replica stopped).

**A snapshot** answers a request (any body) on the replica's snapshot subject: one message or
more (``pages``; each at most :data:`SNAPSHOT_PAGE_BLOCKS` blocks, all built at one instant)::

    {"type": "kv_snapshot", "replica", "model", "boot", "block_size", "medium": "gpu",
     "capacity_blocks": int, "seq": int, "page": int, "pages": int,
     "blocks": [[h, parent | None], ...], "stats": {...}}  # stats on page 0 only

``seq`` is the last event the snapshot includes (0: none yet): a consumer subscribes to the
events first, loads the snapshot, then applies only events after ``seq``. ``stats`` is the
cache's own account (:meth:`engine_worker.kvcache.KVCache.stats`: usage, hit tokens...).
With one page, a plain NATS request gets it; with more, the asker reads its reply inbox until
it has them all (:func:`assemble_snapshot`).

**From vLLM's events** (``vllm.distributed.kv_events``), one for one: ``BlockStored``
(``block_hashes`` → ``hashes``, ``parent_block_hash`` → ``parent``, ``block_size``,
``token_ids``, ``lora_name`` (or ``lora_id``) → ``lora``, ``group_idx`` → ``group``,
``medium`` lower-cased) → ``stored``; ``BlockRemoved`` (``block_hashes``, ``medium``,
``group_idx``) → ``removed``; ``AllBlocksCleared`` → ``all_cleared``. vLLM numbers batches
(its ZMQ publisher's ``seq``), tokenbus numbers events: an adapter gives each event of a
``KVEventBatch`` the next number, and the batch's ``ts`` (seconds) becomes ``ts_ms``. vLLM's
``extra_keys``, ``session_id``, ``locality`` and lookahead fields have no place here yet.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from bus_schemas import codec
from bus_schemas import errors as E

__all__ = [
    "ALL_CLEARED",
    "BATCH",
    "MAX_BATCH_HASHES",
    "MAX_EVENT_HASHES",
    "MEDIUM_GPU",
    "REMOVED",
    "SNAPSHOT",
    "SNAPSHOT_PAGE_BLOCKS",
    "STORED",
    "all_cleared",
    "apply_event",
    "assemble_snapshot",
    "batches",
    "block_hash",
    "chain_hashes",
    "check_batch",
    "check_event",
    "check_scheme",
    "check_snapshot",
    "decode_batch",
    "decode_snapshot",
    "removed",
    "snapshot_pages",
    "stored",
    "text_block_hashes",
    "text_scheme",
    "text_token_ids",
    "vllm_scheme",
]

BATCH = "kv_events"
SNAPSHOT = "kv_snapshot"
STORED = "stored"
REMOVED = "removed"
ALL_CLEARED = "all_cleared"
EVENT_TYPES = (STORED, REMOVED, ALL_CLEARED)
MEDIUM_GPU = "gpu"

# Bounds on one message, far under nats-server's 1 MB default payload: a u64 hash takes 9
# bytes of msgpack, so a batch of MAX_BATCH_HASHES hashes is about 150 kB and a snapshot page
# (two hashes a block) about the same.
MAX_EVENT_HASHES = 4096  # hashes in one stored/removed event (a longer chain: several)
MAX_BATCH_HASHES = 16384  # hashes in one batch message (more events: several messages)
SNAPSHOT_PAGE_BLOCKS = 8192  # blocks in one snapshot message

# The largest hash given as bytes (vLLM's sha256 digests are 32).
MAX_HASH_BYTES = 64
_U64 = 1 << 64

BlockHash = int | bytes

# -- tokens and hashes ----------------------------------------------------------------------

# The parent of a prompt's first block (vLLM's NONE_HASH): fixed, so every process agrees.
_ROOT = hashlib.blake2b(b"tokenbus.kv.v1.root", digest_size=8).digest()
# A token id on the wire of the hash: 16 bytes, little-endian (any vocabulary fits).
_ID_BYTES = 16
_CHARS = 4  # the sim's characters a token


def _utf32(text: str) -> bytes:
    """``text`` as UTF-32-LE (surrogatepass: the lone surrogates a JSON string may hold),
    padded with 0xFF bytes (never part of a UTF-32 character) to whole tokens: the bytes of
    its token ids. An empty text is one token of padding."""
    raw = text.encode("utf-32-le", "surrogatepass")
    return raw + b"\xff" * (-len(raw) % _ID_BYTES or (0 if raw else _ID_BYTES))


def text_token_ids(text: str) -> list[int]:
    """The sim's token ids of ``text``: one token per four characters (the last may be
    shorter; an empty text is one token), its id those characters' UTF-32 code units padded
    with 0xFF bytes, read as a 128-bit little-endian integer. So ``len(text_token_ids(t))``
    is the sim's ``count_tokens(t)``, two texts share a token prefix exactly where they share
    a character prefix (cut at multiples of four), and distinct tokens have distinct ids."""
    raw = _utf32(text)
    return [int.from_bytes(raw[i : i + _ID_BYTES], "little") for i in range(0, len(raw), _ID_BYTES)]


def block_hash(parent: int | None, token_ids: Sequence[int]) -> int:
    """The 64-bit hash of a block of ``token_ids`` (each below 2**128) after the block whose
    hash is ``parent`` (None: the prompt's first block): the first 8 bytes, big-endian, of a
    BLAKE2b of the parent's hash (8 bytes, big-endian) and each token id (16 bytes,
    little-endian). Stable across processes and machines (unlike Python's salted
    ``hash()``)."""
    p = _ROOT if parent is None else parent.to_bytes(8, "big")
    data = p + b"".join(t.to_bytes(_ID_BYTES, "little") for t in token_ids)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def text_root(seed: str = "") -> bytes:
    """The parent of a prompt's first block under ``seed`` (as vLLM's ``NONE_HASH`` follows
    PYTHONHASHSEED): the fixed root without one. Hashes under two seeds never match."""
    if not seed:
        return _ROOT
    return hashlib.blake2b(b"tokenbus.kv.v1.root\x00" + seed.encode(), digest_size=8).digest()


def _chain(raw: bytes, block_size: int, parent: int | None, root: bytes = _ROOT) -> list[int]:
    """:func:`chain_hashes` of token ids given as their packed bytes."""
    if block_size < 1:
        raise ValueError("block_size must be at least 1")
    step = block_size * _ID_BYTES
    blake = hashlib.blake2b
    prev = root if parent is None else parent.to_bytes(8, "big")
    out: list[int] = []
    for start in range(0, len(raw) - step + 1, step):
        prev = blake(prev + raw[start : start + step], digest_size=8).digest()
        out.append(int.from_bytes(prev, "big"))
    return out


def chain_hashes(token_ids: Sequence[int], block_size: int, parent: int | None = None) -> list[int]:
    """The hashes of every full block of ``token_ids`` (a partial last block has none), each
    chained to the one before, the first to ``parent``: :func:`block_hash` block by block."""
    raw = b"".join(t.to_bytes(_ID_BYTES, "little") for t in token_ids)
    return _chain(raw, block_size, parent)


def text_block_hashes(text: str, block_size: int, seed: str = "") -> list[int]:
    """The block hashes the sim gives a prompt rendered as ``text``: those of
    :func:`text_token_ids`, without making the ids (one hash call a block); the first
    block's parent is :func:`text_root` of ``seed``."""
    return _chain(_utf32(text), block_size, None, text_root(seed))


def text_block_hash_slices(
    text: str, block_size: int, seed: str = "", slice_blocks: int = 1024
) -> Iterator[list[int]]:
    """:func:`text_block_hashes` of ``text`` in slices of at most ``slice_blocks`` hashes,
    in order (joined, the same list), each made when asked for: a caller on an event loop
    yields to it between slices, so a long prompt's hashing (262 144 blocks for 16 MiB, some
    0.3 s) does not hold the loop. Only one slice of the text is encoded at a time."""
    if block_size < 1 or slice_blocks < 1:
        raise ValueError("block_size and slice_blocks must be at least 1")
    step = block_size * _CHARS * slice_blocks  # characters of whole tokens and whole blocks
    prev = text_root(seed)
    whole = len(text) // step
    for k in range(whole):
        out = _chain(
            text[k * step : (k + 1) * step].encode("utf-32-le", "surrogatepass"),
            block_size,
            None,
            prev,
        )
        if out:
            prev = out[-1].to_bytes(8, "big")
        yield out
    tail = text[whole * step :]
    if tail or not text:  # the rest, padded to whole tokens as text_block_hashes pads
        yield _chain(_utf32(tail), block_size, None, prev)


# -- hashing schemes --------------------------------------------------------------------------
#
# How a replica's engine tokenises and hashes a prompt, sent with its snapshots ("hashing"),
# so a router knows how to compute the hashes it looks up. A snapshot without one is the
# sim's (text_block_hashes of the rendered prompt).

SCHEME_TEXT = "text"  # the sim's: text_block_hashes(render_prompt(...))
SCHEME_VLLM = "vllm"  # vLLM's: its tokenizer and chat template, then vllm_block_hashes
VLLM_HASH_ALGOS = ("sha256", "sha256_cbor")
VLLM_DEFAULT_SEED = "vllm-none-hash"  # vLLM's NONE_HASH seed without PYTHONHASHSEED


def text_scheme(*, block_size: int = 0, seed: str = "") -> dict[str, Any]:
    """The sim's hashing (``text``), with its block size and seed where given."""
    out: dict[str, Any] = {"kind": SCHEME_TEXT}
    if block_size:
        out["block_size"] = block_size
    if seed:
        out["seed"] = seed
    return out


def vllm_scheme(
    *, algo: str, seed: str | None, int_hashes: bool, tokenizer: str, block_size: int
) -> dict[str, Any]:
    """vLLM's hashing as a router needs it (``router.kv_hashing.vllm_block_hashes``): the
    hash algorithm (``prefix_caching_hash_algo``), the seed of its ``NONE_HASH`` (None when
    it is random per process: nobody outside the engine can match its hashes), whether its
    events carry
    the 64-bit form (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``), the tokenizer (a path or a
    name ``transformers`` loads) and the hash block size."""
    return {
        "kind": SCHEME_VLLM,
        "algo": algo,
        "seed": seed,
        "int_hashes": int_hashes,
        "tokenizer": tokenizer,
        "block_size": block_size,
    }


def check_scheme(obj: object) -> dict[str, Any]:
    """``obj`` if it is a hashing scheme (a map with a string ``kind`` and scalar values)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("kind"), str):
        raise _bad("hashing must be a map with a string kind")
    for k, v in obj.items():
        if not isinstance(k, str) or not (v is None or isinstance(v, str | int | float | bool)):
            raise _bad("hashing values must be scalars")
    return obj


# -- events ---------------------------------------------------------------------------------


def stored(
    hashes: Sequence[BlockHash],
    parent: BlockHash | None,
    block_size: int,
    *,
    medium: str = MEDIUM_GPU,
    token_ids: Sequence[int] | None = None,
    lora: str | None = None,
    group: int | None = None,
) -> dict[str, Any]:
    """A ``stored`` event: the chain of full blocks ``hashes`` after ``parent`` is cached."""
    ev: dict[str, Any] = {
        "type": STORED,
        "hashes": list(hashes),
        "parent": parent,
        "block_size": block_size,
        "medium": medium,
    }
    if token_ids is not None:
        ev["token_ids"] = list(token_ids)
    if lora is not None:
        ev["lora"] = lora
    if group is not None:
        ev["group"] = group
    return ev


def removed(
    hashes: Sequence[BlockHash], *, medium: str = MEDIUM_GPU, group: int | None = None
) -> dict[str, Any]:
    """A ``removed`` event: the blocks ``hashes`` were evicted."""
    ev: dict[str, Any] = {"type": REMOVED, "hashes": list(hashes), "medium": medium}
    if group is not None:
        ev["group"] = group
    return ev


def all_cleared() -> dict[str, Any]:
    """An ``all_cleared`` event: the cache holds nothing any more."""
    return {"type": ALL_CLEARED}


def apply_event(blocks: dict[BlockHash, BlockHash | None], event: dict[str, Any]) -> None:
    """What an event means, as code: apply it to ``blocks`` (hash -> parent hash), a
    consumer's copy of one replica's cache (of one medium)."""
    kind = event["type"]
    if kind == STORED:
        parent = event["parent"]
        for h in event["hashes"]:
            blocks[h] = parent
            parent = h
    elif kind == REMOVED:
        for h in event["hashes"]:
            blocks.pop(h, None)
    else:
        blocks.clear()


def _event_hashes(ev: dict[str, Any]) -> int:
    return len(ev.get("hashes", ()))


def batches(
    *,
    replica: str,
    model: str,
    boot: str,
    block_size: int,
    seq_first: int,
    events: Sequence[dict[str, Any]],
    ts_ms: int,
    max_hashes: int = MAX_BATCH_HASHES,
) -> list[dict[str, Any]]:
    """The batch messages of ``events`` (numbered from ``seq_first``): as few as hold at
    most ``max_hashes`` hashes each (an event never split; one bigger alone)."""
    out: list[dict[str, Any]] = []
    i, n = 0, len(events)
    while i < n:
        j, hashes = i, 0
        while j < n and (j == i or hashes + _event_hashes(events[j]) <= max_hashes):
            hashes += _event_hashes(events[j])
            j += 1
        out.append(
            {
                "type": BATCH,
                "replica": replica,
                "model": model,
                "boot": boot,
                "block_size": block_size,
                "seq_first": seq_first + i,
                "seq_last": seq_first + j - 1,
                "ts_ms": ts_ms,
                "events": list(events[i:j]),
            }
        )
        i = j
    return out


# -- checks ---------------------------------------------------------------------------------


def _bad(what: str) -> E.InvalidRequest:
    return E.InvalidRequest(f"malformed KV event message: {what}")


def _int(obj: dict[str, Any], key: str, low: int) -> int:
    v = obj.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < low:
        raise _bad(f"{key} must be an integer of at least {low}")
    return v


def _str(obj: dict[str, Any], key: str, *, empty: bool = False) -> str:
    v = obj.get(key)
    if not isinstance(v, str) or (not empty and not v):
        raise _bad(f"{key} must be a{'' if empty else ' non-empty'} string")
    return v


def _is_hash(h: object) -> bool:
    if isinstance(h, bytes):
        return 0 < len(h) <= MAX_HASH_BYTES
    return isinstance(h, int) and not isinstance(h, bool) and 0 <= h < _U64


def _hashes(ev: dict[str, Any]) -> list[Any]:
    hs = ev.get("hashes")
    if not isinstance(hs, list) or not hs or not all(_is_hash(h) for h in hs):
        raise _bad("hashes must be a non-empty list of block hashes (u64 or bytes)")
    return hs


def check_event(ev: object) -> dict[str, Any]:
    """``ev`` if it is a well-formed event; raise :class:`errors.InvalidRequest` if not."""
    if not isinstance(ev, dict):
        raise _bad("an event must be a map")
    kind = ev.get("type")
    if kind not in EVENT_TYPES:
        raise _bad(f"event type must be one of {', '.join(EVENT_TYPES)}")
    if kind == ALL_CLEARED:
        return ev
    hashes = _hashes(ev)
    if "medium" in ev and not isinstance(ev["medium"], str):
        raise _bad("medium must be a string")
    if "group" in ev:
        _int(ev, "group", 0)
    if kind == STORED:
        parent = ev.get("parent")
        if parent is not None and not _is_hash(parent):
            raise _bad("parent must be a block hash or nil")
        size = _int(ev, "block_size", 1)
        toks = ev.get("token_ids")
        if toks is not None and (
            not isinstance(toks, list)
            or len(toks) != size * len(hashes)
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks)
        ):
            raise _bad("token_ids must be block_size integers per stored block")
        if ev.get("lora") is not None and not isinstance(ev["lora"], str):
            raise _bad("lora must be a string")
    return ev


def _check_head(obj: object, kind: str, what: str) -> dict[str, Any]:
    """``obj``, once what a batch and a snapshot page both carry is checked: their type,
    the replica, its model and boot, the block size."""
    if not isinstance(obj, dict) or obj.get("type") != kind:
        raise _bad(f"a {what} must be a map of type {kind!r}")
    _str(obj, "replica")
    _str(obj, "model")
    _str(obj, "boot", empty=True)
    _int(obj, "block_size", 1)
    return obj


def check_batch(obj: object) -> dict[str, Any]:
    """``obj`` if it is a well-formed batch (its events included); raise
    :class:`errors.InvalidRequest` if not."""
    obj = _check_head(obj, BATCH, "batch")
    _int(obj, "ts_ms", 0)
    first = _int(obj, "seq_first", 1)
    last = _int(obj, "seq_last", first)
    events = obj.get("events")
    if not isinstance(events, list) or len(events) != last - first + 1:
        raise _bad("events must be a list of seq_last - seq_first + 1 events")
    for ev in events:
        check_event(ev)
    return obj


def decode_batch(data: bytes) -> dict[str, Any]:
    """A batch from the bus, checked (:func:`check_batch`)."""
    return check_batch(codec.decode_map(data))


# -- snapshots ------------------------------------------------------------------------------


def snapshot_pages(
    *,
    replica: str,
    model: str,
    boot: str,
    block_size: int,
    capacity_blocks: int,
    seq: int,
    blocks: Sequence[tuple[BlockHash, BlockHash | None]],
    stats: dict[str, Any] | None = None,
    medium: str = MEDIUM_GPU,
    page_blocks: int = SNAPSHOT_PAGE_BLOCKS,
    hashing: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """The snapshot messages of ``blocks`` ((hash, parent) each), current to event ``seq``:
    at least one (an empty cache: one page with no blocks). ``hashing``: how the engine
    hashes prompts (:func:`vllm_scheme`; None: the sim's text scheme), on the first page."""
    n = max(1, -(-len(blocks) // page_blocks))
    pages = []
    for i in range(n):
        page: dict[str, Any] = {
            "type": SNAPSHOT,
            "replica": replica,
            "model": model,
            "boot": boot,
            "block_size": block_size,
            "medium": medium,
            "capacity_blocks": capacity_blocks,
            "seq": seq,
            "page": i,
            "pages": n,
            "blocks": [[h, p] for h, p in blocks[i * page_blocks : (i + 1) * page_blocks]],
        }
        if i == 0 and stats is not None:
            page["stats"] = stats
        if i == 0 and hashing is not None:
            page["hashing"] = hashing
        pages.append(page)
    return pages


def check_snapshot(obj: object) -> dict[str, Any]:
    """``obj`` if it is a well-formed snapshot page; raise :class:`errors.InvalidRequest`
    if not."""
    obj = _check_head(obj, SNAPSHOT, "snapshot")
    _int(obj, "capacity_blocks", 0)
    _int(obj, "seq", 0)
    pages = _int(obj, "pages", 1)
    if _int(obj, "page", 0) >= pages:
        raise _bad("page must be below pages")
    blocks = obj.get("blocks")
    if not isinstance(blocks, list) or not all(
        isinstance(b, list) and len(b) == 2 and _is_hash(b[0]) and (b[1] is None or _is_hash(b[1]))
        for b in blocks
    ):
        raise _bad("blocks must be a list of [hash, parent or nil]")
    if "stats" in obj and not isinstance(obj["stats"], dict):
        raise _bad("stats must be a map")
    if "hashing" in obj:
        check_scheme(obj["hashing"])
    return obj


def decode_snapshot(data: bytes) -> dict[str, Any]:
    """A snapshot page from the bus, checked (:func:`check_snapshot`)."""
    return check_snapshot(codec.decode_map(data))


def assemble_snapshot(
    pages: Iterable[dict[str, Any]],
) -> tuple[int, dict[BlockHash, BlockHash | None]]:
    """(seq, hash -> parent) of a whole snapshot from its checked pages (any order); raise
    :class:`errors.InvalidRequest` when pages are missing or come from different snapshots."""
    got = {int(p["page"]): p for p in pages}
    if not got:
        raise _bad("no snapshot pages")
    first = next(iter(got.values()))
    n, seq, boot = first["pages"], first["seq"], first["boot"]
    if sorted(got) != list(range(n)) or any(
        (p["pages"], p["seq"], p["boot"]) != (n, seq, boot) for p in got.values()
    ):
        raise _bad("snapshot pages missing or from different snapshots")
    blocks: dict[BlockHash, BlockHash | None] = {}
    for i in range(n):
        for h, parent in got[i]["blocks"]:
            blocks[h] = parent
    return seq, blocks
