"""A calibrated performance model of a continuous-batching engine; no GPU, deterministic text.

The model: at most ``max_running`` sequences run at once, the rest wait in a FIFO queue. An
admitted sequence's first token comes after its prefill, ``prefill_ms + prefill_ms_per_token
* uncached prompt tokens``: with ``kv_cache_blocks`` set (the default), the engine keeps a
paged prefix cache (:mod:`engine_worker.kvcache`, as vLLM's prefix caching) and a prompt's
tokens already in it are not prefilled again; the cache reports what it stores and evicts as
KV events (:meth:`SimBackend.kv_events`). Running sequences advance together in decode steps
of ``decode_ms + decode_ms_per_seq * batch``, one token each. Tensor parallelism divides both
by ``1 + (tp - 1) * tp_efficiency`` and adds ``tp_comm_ms`` per step. One event-loop timer
drives the whole engine, so 1000 sequences cost 1/step_time wake-ups a second, not 1000 of
them.

The text is a pure function of the prompt and seed: :func:`expected_text` tells tests what a
request will produce. Requests that ask for more (tool calls, structured output, logprobs;
see :mod:`engine_worker.backends.sim_outputs`) get exact outputs too:
:func:`expected_tool_call`, :func:`expected_structured`, :func:`expected_embedding`. They go
through the same batching and timing, and only they pay for it: a plain request takes the
plain path.
"""

from __future__ import annotations

import asyncio
import json
import math
import signal
import time
import uuid
import zlib
from collections import deque
from collections.abc import Callable
from pathlib import Path
from statistics import NormalDist
from typing import Any

from bus_schemas import errors as E
from engine_worker.backends.base import (
    Delta,
    Embeddings,
    GenerationRequest,
    asks_handover,
    kv_handover,
    kv_transfer_s,
    reads_remote_prompt,
)
from engine_worker.backends.sim_outputs import (
    MAX_EMBEDDING_DIM,
    chat_logprobs,
    completion_logprobs,
    expected_embedding,
    expected_tool_call,
    instance,
    json_tokens,
    logprob_mode,
    response_schema,
    schema_text,
)
from engine_worker.kvcache import KVCache, Lease
from services.config import SimSettings, WorkerSettings

__all__ = [
    "JSON_OBJECT_TOKENS",
    "VOCAB",
    "SimBackend",
    "SimEngine",
    "SimExtraStream",
    "SimStream",
    "count_tokens",
    "expected_embedding",
    "expected_structured",
    "expected_text",
    "expected_tool_call",
    "instance",
    "resume_point",
    "token_text",
]

# The text inside a ``json_object`` answer: this many tokens of the prompt's usual text.
JSON_OBJECT_TOKENS = 8

VOCAB = (
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "tokens",
    "stream",
    "through",
    "nats",
    "subjects",
    "to",
    "many",
    "concurrent",
    "users",
    "and",
    "every",
    "replica",
    "reports",
    "its",
    "load",
    "so",
    "routers",
    "choose",
    "well",
    "under",
    "pressure",
    "with",
    "low",
    "latency",
    "and",
    "high",
    "throughput",
    "engines",
    "batch",
    "sequences",
    "prefill",
    "decode",
    "cache",
    "memory",
    "model",
    "serving",
    "gateway",
)


def take_chunk(prefilling: list[Any], budget: int) -> tuple[int, list[Any]]:
    """One engine step's chunked prefill, as vLLM's scheduler takes it: the next chunk of each
    prefilling prompt in turn while ``budget`` tokens last, a prompt read from a prefill replica
    (``remote``) or cancelled passed over. Lowers each prompt's ``left`` (its tokens still to
    compute) and returns the chunk's tokens and the prompts whose last chunk it is."""
    chunk = 0
    done: list[Any] = []
    for s in prefilling:
        if budget <= 0:
            break
        if s.remote or s.cancelled:
            continue
        take = min(s.left, budget)
        s.left -= take
        budget -= take
        chunk += take
        if s.left == 0:
            done.append(s)
    return chunk, done


def fit_context(req: GenerationRequest, prompt_tokens: int, max_model_len: int) -> None:
    """Refuse a request whose prompt and ``max_tokens`` exceed the context, in vLLM's words;
    lower a default (not the client's) ``max_tokens`` to what fits."""
    room = max_model_len - prompt_tokens
    if not req.max_tokens_set and room >= 1:
        req.max_tokens = min(req.max_tokens, room)
    if prompt_tokens + req.max_tokens > max_model_len:
        raise E.ContextLengthExceeded.of(max_model_len, req.max_tokens, prompt_tokens)


def count_tokens(text: str) -> int:
    """The simulator's tokenizer: about four characters a token."""
    return max(1, (len(text) + 3) // 4)


def _start(prompt: str, seed: int | None) -> int:
    return zlib.crc32(f"{seed}|{prompt}".encode())


def token_text(start: int, i: int) -> str:
    """The ``i``-th output token (0-based) for a prompt whose hash is ``start``."""
    word = VOCAB[(start + i * 7919) % len(VOCAB)]
    return word if i == 0 else " " + word


_DEFAULTS = SimSettings()
# A prompt of this many characters or more (64 KiB of UTF-32 per 4096 blocks of 16 tokens) is
# hashed for the prefix cache before it is submitted, a slice per turn of the event loop:
# hashed at admission, a 16 MiB prompt held the worker's loop 0.3-0.4 s, and eight of them
# made it miss its heartbeats (docs/large-requests.md). Shorter ones are hashed at admission.
PREHASH_CHARS = 256 * 1024
_NORMAL = NormalDist()


def answer_tokens(start: int, cfg: SimSettings = _DEFAULTS) -> int | None:
    """How many tokens the answer to a prompt whose hash is ``start`` has before the model
    would stop on its own: log-normal, median ``answer_tokens_median``, spread
    ``answer_tokens_sigma``, at least ``answer_tokens_min``; the same for the same prompt
    and seed. None when answers never end on their own (median 0)."""
    if not cfg.answer_tokens_median:
        return None
    # A hash of the prompt's own hash: the length is not tied to its first word.
    u = (zlib.crc32(start.to_bytes(4, "little") + b"len") + 0.5) / 2**32
    n = cfg.answer_tokens_median * math.exp(cfg.answer_tokens_sigma * _NORMAL.inv_cdf(u))
    return max(cfg.answer_tokens_min, round(n))


def answer_budget(
    start: int, max_tokens: int, extra: dict[str, Any], cfg: SimSettings = _DEFAULTS
) -> tuple[int, str]:
    """(tokens the answer runs to, its finish reason): its natural length with ``stop``
    when that comes before ``max_tokens``, else ``max_tokens`` with ``length``. vLLM's
    ``ignore_eos`` (what benchmarks send for answers of a fixed length) turns the natural
    stop off."""
    natural = None if extra.get("ignore_eos") is True else answer_tokens(start, cfg)
    if natural is not None and natural < max_tokens:
        return natural, "stop"
    return max_tokens, "length"


def expected_text(
    prompt: str,
    max_tokens: int,
    seed: int | None = None,
    stop: list[str] | None = None,
    *,
    ignore_eos: bool = False,
    cfg: SimSettings = _DEFAULTS,
) -> tuple[str, str]:
    """(text, finish_reason) the simulator produces for ``prompt`` (as rendered by
    :meth:`GenerationRequest.prompt_text`): ``length`` at ``max_tokens``, or ``stop`` at a
    stop sequence or where the answer ends on its own (:func:`answer_budget`)."""
    start = _start(prompt, seed)
    limit, finish = answer_budget(start, max_tokens, {"ignore_eos": ignore_eos}, cfg)
    text = ""
    for i in range(limit):
        text += token_text(start, i)
        hit = _find_stop(text, stop or [])
        if hit is not None:
            return text[: hit[0]], "stop"
    return text, finish


def resume_point(start: int, req: GenerationRequest, limit: int) -> tuple[int, str]:
    """Where a migrated request continues: (tokens done, their text), of an answer of at
    most ``limit`` tokens.

    The tokens the caller counted are not produced again: an output filter holds back
    text of tokens the caller already counted (their frames carry the count, the text
    follows once it is safe), so the caller may hold fewer tokens' text than it counts.
    When what it holds is the start of the sequence's first ``resume_tokens`` tokens, those
    are done and the returned text is theirs: the part the caller lacks is sent first.
    Otherwise the whole tokens in its text are done (a token it holds in part is produced
    again and its missing end sent). Text that is not the sequence's own (redacted by an
    output filter) falls back to the token count the caller reports."""
    return _resume(lambda n: token_text(start, n), limit, req)


def _resume(token: Callable[[int], str], limit: int, req: GenerationRequest) -> tuple[int, str]:
    """:func:`resume_point` for the output whose ``n``-th token is ``token(n)`` and whose
    length is at most ``limit`` tokens."""
    if not req.resume_text and not req.resume_tokens:
        return 0, ""
    have = req.resume_text
    text, n = "", 0
    while n < limit:
        nxt = token(n)
        if not have.startswith(nxt, len(text)):
            break
        text += nxt
        n += 1
    # The tokens counted whose text the caller holds only in part, or not at all.
    counted, whole, m = min(req.resume_tokens, limit), text, n
    while m < counted:
        whole += token(m)
        m += 1
    if m > n and whole.startswith(have):
        return m, whole
    if len(text) < len(have) and not (n < limit and token(n).startswith(have[len(text) :])):
        # Not our text (redacted): trust the count.
        return counted, have
    return n, text


def _structured(req: GenerationRequest, prompt: str) -> str | None:
    rs = response_schema(req.extra)
    if rs is None:
        return None
    kind, schema = rs
    if kind == "json_schema":
        return schema_text(schema)
    return json.dumps({"answer": expected_text(prompt, JSON_OBJECT_TOKENS, req.seed)[0]})


def expected_structured(req: GenerationRequest) -> str:
    """The whole JSON text the simulator answers a ``response_format`` request with:
    ``json.dumps(instance(schema))`` for ``json_schema``, ``{"answer": <the prompt's first
    JSON_OBJECT_TOKENS tokens of text>}`` for ``json_object``. It streams in
    :func:`~engine_worker.backends.sim_outputs.json_tokens` (four characters each): finish
    ``stop`` when whole, ``length`` (and only the first ``max_tokens`` tokens) when cut.
    Raises ValueError for a request without a JSON response format."""
    text = _structured(req, req.prompt_text())
    if text is None:
        raise ValueError("the request asks for no JSON response format")
    return text


def _find_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """(where, which) of the earliest stop sequence in ``text`` (the first one listed of
    those that start there), or None."""
    best: tuple[int, str] | None = None
    for s in stops:
        k = text.find(s)
        if k >= 0 and (best is None or k < best[0]):
            best = (k, s)
    return best


class _Seq:
    __slots__ = (
        "buf",
        "cached",
        "cancelled",
        "done",
        "emitted",
        "hashes",
        "lease",
        "left",
        "listener",
        "looked_up",
        "lora",
        "max_tokens",
        "prefill_s",
        "prompt",
        "prompt_tokens",
        "ready_at",
        "remote",
        "reported_cached",
        "start",
        "toks",
        "waiter",
    )

    def __init__(
        self,
        start: int,
        prompt_tokens: int,
        max_tokens: int,
        toks: list[str] | None = None,
        prompt: str = "",
    ) -> None:
        self.start = start
        # The prompt as rendered: what the prefix cache hashes (its tokens, not the resumed
        # output a migrated request prefills after it).
        self.prompt = prompt
        # Its prompt's block hashes, made before it was submitted (a long prompt: see
        # SimEngine.hash_then_submit); None: made at admission.
        self.hashes: list[int] | None = None
        # Its blocks in the prefix cache (None: no cache, or not admitted yet / released).
        self.lease: Lease | None = None
        self.cached = 0  # prompt tokens read from the cache at admission
        self.reported_cached = 0  # what its usage says of them (sim.fault_cached_scale)
        self.looked_up = False  # whether the prefix cache was asked (it is on)
        self.prefill_s = 0.0  # the prefill time the engine gave it
        # Chunked prefill: prompt tokens still to compute. ``remote``: its prompt's KV cache
        # comes from a prefill replica (prefill/decode disaggregation), not computed here.
        self.left = 0
        self.remote = False
        # A fixed output (JSON text, tool-call arguments); None: the prompt's text tokens.
        self.toks = toks
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.emitted = 0
        # The LoRA adapter it runs on (None: the base model): at most ``max_loras`` of them
        # in the batch at once.
        self.lora: str | None = None
        self.buf: list[str] = []
        self.waiter: asyncio.Future[None] | None = None
        self.ready_at = 0.0
        self.done = False
        self.cancelled = False
        # Set while a stream pushes (SimStream.push): each token goes to it from the step.
        self.listener: Callable[[str], None] | None = None

    def push(self, text: str) -> None:
        if self.listener is not None:
            self.listener(text)
            return
        self.buf.append(text)
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)


async def _next_tokens(seq: _Seq) -> None:
    """Wait until the engine gives ``seq`` more tokens (or ends it)."""
    seq.waiter = asyncio.get_running_loop().create_future()
    try:
        await seq.waiter
    finally:
        seq.waiter = None


class SimEngine:
    """The batching model itself (usable without NATS, e.g. by the direct HTTP server)."""

    def __init__(self, cfg: SimSettings, tp: int = 1) -> None:
        self.cfg = cfg
        self.tp = tp
        self.speedup = 1.0 + (tp - 1) * cfg.tp_efficiency
        self.comm_s = (cfg.tp_comm_ms / 1000.0) if tp > 1 else 0.0
        self.waiting: deque[_Seq] = deque()
        self.prefilling: list[_Seq] = []
        self.running: list[_Seq] = []
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        # A fault made on purpose (SimBackend's signals): "died" or "hung"; its engine then
        # takes no more steps, as a vLLM engine core that died or hangs.
        self.fault: str | None = None
        self._next_decode = 0.0
        self.steps = 0
        self._ticking = False  # in a step, whose lists a cancel must not change
        # The paged prefix cache (None: prefix caching off).
        self.cache = (
            KVCache(cfg.kv_cache_blocks, cfg.block_size, seed=cfg.hash_seed)
            if cfg.kv_cache_blocks > 0
            else None
        )
        # LoRA adapters loaded at run time: name -> the path it was loaded from.
        self.adapters: dict[str, str] = {}
        # Chunked prefill (cfg.chunked_prefill_tokens): the step in progress ends at
        # ``_step_end`` (0: none), with the prompts whose last chunk it computes.
        self._step_end = 0.0
        self._finishing: list[_Seq] = []
        # Who hands a decode replica its KV cache (prefill/decode disaggregation).
        self.engine_id = uuid.uuid4().hex[:16]

    def lora_of(self, req: GenerationRequest) -> str | None:
        """The run-time adapter ``req`` asks for (None: the base model)."""
        return req.model if req.model in self.adapters else None

    # -- cost model -------------------------------------------------------------------------
    def prefill_s(self, prompt_tokens: int) -> float:
        ms = self.cfg.prefill_ms + self.cfg.prefill_ms_per_token * prompt_tokens
        return ms / 1000.0 / self.speedup + self.comm_s

    def step_s(self, batch: int) -> float:
        ms = self.cfg.decode_ms + self.cfg.decode_ms_per_seq * batch
        return ms / 1000.0 / self.speedup + self.comm_s

    def transfer_s(self, tokens: int) -> float:
        """How long ``tokens`` of a prompt's KV cache take from a prefill replica."""
        return kv_transfer_s(tokens, self.cfg.kv_bytes_per_token, self.cfg.kv_link_gb_per_s)

    def handover(self, prompt_tokens: int) -> dict[str, Any]:
        """What a prefill replica returns for a decode replica."""
        return kv_handover(self.engine_id, prompt_tokens, self.cfg.block_size, self.tp, "sim")

    # -- scheduling -------------------------------------------------------------------------
    def must_hash(self, seq: _Seq) -> bool:
        """Whether ``seq``'s prompt is hashed before it is submitted (:meth:`hash_then_submit`):
        a prompt of :data:`PREHASH_CHARS` or more that the prefix cache will look up."""
        return self.cache is not None and seq.lora is None and len(seq.prompt) >= PREHASH_CHARS

    async def hash_then_submit(self, seq: _Seq) -> None:
        """Hash ``seq``'s prompt a slice of blocks per turn of the event loop, then submit it
        (not when it was cancelled meanwhile). What its admission looks up and what its
        prefill stores are the same hashes; only the loop is not held while they are made."""
        cache = self.cache
        assert cache is not None
        hashes: list[int] = []
        for part in cache.hash_slices(seq.prompt):
            hashes += part
            await asyncio.sleep(0)
            if seq.cancelled:
                return
        seq.hashes = hashes
        self.submit(seq)

    def submit(self, seq: _Seq) -> None:
        self.waiting.append(seq)
        self._admit(time.monotonic())
        self._schedule()

    def _admit(self, now: float) -> None:
        cache = self.cache
        room = self.cfg.max_running - len(self.running) - len(self.prefilling)
        # The adapters in the batch, counted once a queued request on one is met.
        loras: set[str] | None = None
        held: deque[_Seq] = deque()  # on an adapter the batch has no room for: they wait
        while self.waiting and room > 0:
            s = self.waiting.popleft()
            if s.cancelled:
                continue
            if s.lora is not None:
                # vLLM's scheduler under max_loras: a request on an adapter the batch does
                # not hold, while it holds max_loras adapters, waits (behind it the queue
                # goes on) until one of them leaves the batch.
                if loras is None:
                    loras = {q.lora for q in (*self.running, *self.prefilling) if q.lora}
                if s.lora not in loras and len(loras) >= self.cfg.max_loras:
                    held.append(s)
                    continue
                loras.add(s.lora)
            elif cache is not None:
                # vLLM keys an adapter's blocks by the adapter; the sim keeps a prefix cache
                # for the base model's requests only (docs/adapters.md).
                hashes = s.hashes if s.hashes is not None else cache.hashes_of(s.prompt)
                lease = s.lease = cache.acquire(hashes, s.prompt_tokens)
                s.cached = lease.cached_tokens
                # What it reports: the real count unless a test makes it disagree.
                s.reported_cached = int(lease.cached_tokens * self.cfg.fault_cached_scale)
                s.looked_up = True
            uncached = s.prompt_tokens - s.cached
            if s.remote:  # read from the prefill replica, beside the steps
                s.prefill_s = self.transfer_s(uncached)
            elif self.cfg.chunked_prefill_tokens:
                s.left = max(1, uncached)  # computed by the steps, in chunks
                s.prefill_s = 0.0
            else:
                s.prefill_s = self.prefill_s(uncached)
            s.ready_at = now + s.prefill_s
            self.prefilling.append(s)
            room -= 1
        if held:
            held.extend(self.waiting)
            self.waiting = held

    def _release(self, s: _Seq) -> None:
        """Give the sequence's blocks back to the prefix cache (once)."""
        lease = s.lease
        if lease is not None and self.cache is not None:
            s.lease = None
            self.cache.release(lease)

    def _schedule(self) -> None:
        if self.fault is not None:
            return
        at = float("inf")
        if self.cfg.chunked_prefill_tokens:
            # The step in progress ends, or one starts now for what there is to compute; a
            # prompt read from a prefill replica joins when its transfer is done.
            if self._step_end:
                at = self._step_end
            elif self.running or any(not s.remote for s in self.prefilling):
                at = time.monotonic()
            for s in self.prefilling:
                if s.remote:
                    at = min(at, s.ready_at)
        else:
            if self.running:
                at = self._next_decode
            for s in self.prefilling:
                at = min(at, s.ready_at)
        if at == float("inf"):
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            return
        if self._timer is not None:
            if self._timer_at <= at:
                return
            self._timer.cancel()
        loop = asyncio.get_running_loop()
        # loop.time() and time.monotonic() share a clock on CPython's event loops and uvloop.
        self._timer = loop.call_at(at, self._tick)
        self._timer_at = at

    def _emit(self, s: _Seq) -> None:
        if s.cancelled:
            s.done = True
            return
        toks = s.toks
        text = token_text(s.start, s.emitted) if toks is None else toks[s.emitted]
        s.emitted += 1
        lease = s.lease
        if lease is not None and s.prompt_tokens + s.emitted > lease.tokens:
            assert self.cache is not None
            self.cache.grow(lease)  # the output filled its last block
        if s.emitted >= s.max_tokens:
            s.done = True
        s.push(text)

    def _tick(self) -> None:
        self._ticking = True
        try:
            if self.cfg.chunked_prefill_tokens:
                self._step_chunked()
            else:
                self._step()
        finally:
            self._ticking = False

    def _step_chunked(self) -> None:
        """vLLM's scheduler with chunked prefill: one step computes a token for every
        running sequence and, in what is left of ``chunked_prefill_tokens``, the next chunk
        of each prefilling prompt in turn; its time grows with both. A prompt whose last
        chunk a step computes gives its first token at the step's end and runs from then.
        A prompt read from a prefill replica joins the running ones once its transfer is
        done, without taking the steps' time."""
        self._timer = None
        now = time.monotonic()
        cache = self.cache
        if self._step_end and now >= self._step_end - 1e-4:
            self._step_end = 0.0
            for s in self.running:
                self._emit(s)
            self.steps += 1
            finishing, self._finishing = self._finishing, []
            for s in finishing:
                if s.cancelled:
                    continue
                if s.lease is not None:
                    assert cache is not None
                    cache.commit(s.lease)  # its prompt's blocks are computed
                self._emit(s)
                self.running.append(s)
            for s in self.running:
                if s.done:
                    self._release(s)
            self.running = [s for s in self.running if not s.done]
        # Transfers done: their sequences run from the next step.
        arrived = [s for s in self.prefilling if s.remote and s.ready_at <= now + 1e-4]
        if arrived:
            self.prefilling = [s for s in self.prefilling if s not in arrived]
            for s in arrived:
                if s.lease is not None and not s.cancelled:
                    assert cache is not None
                    cache.commit(s.lease)
                self.running.append(s)
        self._admit(now)
        if not self._step_end:
            self._plan_step(now)
        self._schedule()

    def _plan_step(self, now: float) -> None:
        """Start the next step: what it computes, and when it ends."""
        cfg = self.cfg
        chunk, done = take_chunk(self.prefilling, cfg.chunked_prefill_tokens - len(self.running))
        if not self.running and not chunk:
            return
        if done:
            self.prefilling = [s for s in self.prefilling if s not in done]
        self._finishing = done
        # One forward pass over every token of the step: its fixed cost (decode_ms), each
        # running sequence's token, each prompt token of the chunk. (prefill_ms, the fixed
        # cost of a prefill of its own, has no place in a step that batches them.)
        ms = (
            cfg.decode_ms
            + cfg.decode_ms_per_seq * len(self.running)
            + cfg.prefill_ms_per_token * chunk
        )
        self._step_end = now + ms / 1000.0 / self.speedup + self.comm_s

    def _step(self) -> None:
        self._timer = None
        now = time.monotonic()
        cache = self.cache
        if self.running and now >= self._next_decode - 1e-4:
            for s in self.running:
                self._emit(s)
            self.steps += 1
            if cache is not None:
                for s in self.running:
                    if s.done:
                        self._release(s)
            self.running = [s for s in self.running if not s.done]
            self._next_decode = now + self.step_s(len(self.running))
        if self.prefilling:
            still: list[_Seq] = []
            joined = False
            for s in self.prefilling:
                if s.ready_at <= now + 1e-4:
                    if s.lease is not None and not s.cancelled:
                        assert cache is not None
                        cache.commit(s.lease)  # its prompt's blocks are computed
                    self._emit(s)
                    if s.done:
                        self._release(s)
                    else:
                        if not self.running and not joined:
                            self._next_decode = now + self.step_s(1)
                        self.running.append(s)
                        joined = True
                else:
                    still.append(s)
            self.prefilling = still
        self._admit(now)
        self._schedule()

    def cancel(self, s: _Seq) -> None:
        s.cancelled = True
        s.done = True
        if self._ticking:
            # From a pushing stream's callback in the step: the step drops it (it is done),
            # the rest after it.
            asyncio.get_running_loop().call_soon(self._drop, s)
            return
        self._drop(s)

    def _drop(self, s: _Seq) -> None:
        if s in self._finishing:
            self._finishing.remove(s)
        if s in self.prefilling:
            self.prefilling.remove(s)
        elif s in self.running:
            self.running.remove(s)
        self._release(s)
        self._admit(time.monotonic())
        self._schedule()

    def stats(self) -> dict[str, Any]:
        active = len(self.running) + len(self.prefilling) + len(self._finishing)
        return {
            "running": active,
            "waiting": len(self.waiting),
            "kv_usage": active / self.cfg.max_running,
        }

    def kv_cache_stats(self) -> dict[str, Any] | None:
        """The prefix cache's usage and hit ratio (:meth:`KVCache.stats`); None when off.
        Apart from :meth:`stats`, whose ``kv_usage`` (the batch's fill) heartbeats carry."""
        return None if self.cache is None else self.cache.stats()

    def generate(self, req: GenerationRequest) -> SimStream | SimExtraStream:
        """Submit now (prefill starts at once) and return the stream of deltas."""
        if req.extra:
            plan = _plan(req)
            if plan is not None:
                return SimExtraStream(self, req, plan)
        return SimStream(self, req)


class _TextOut:
    """What both sim streams do with the text of new tokens: release it, holding back what
    could still be the start of a stop sequence, and stop the sequence at one. Closing the
    stream early cancels the sequence in the engine."""

    engine: SimEngine
    seq: _Seq
    stop: list[str]
    hold: int
    text: str
    sent: int
    finished: bool
    # A long prompt to hash before the sequence is submitted, at the stream's first read.
    hashing = False

    def _enter(self) -> None:
        """Submit the sequence now, or, when its long prompt is hashed first
        (:meth:`SimEngine.must_hash`), at the stream's first read (:meth:`_entered`)."""
        if self.engine.must_hash(self.seq):
            self.hashing = True
        else:
            self.engine.submit(self.seq)

    async def _entered(self) -> None:
        """Hash the prompt and submit the sequence if that waits for this first read."""
        if self.hashing:
            self.hashing = False
            await self.engine.hash_then_submit(self.seq)

    def _release(self, new: str) -> tuple[str, str | None] | None:
        """(text to send now, the stop sequence that ended it or None) for ``new`` text, or
        None when all of it is held back."""
        self.text += new
        safe = len(self.text)
        if self.stop:
            hit = _find_stop(self.text, self.stop)
            if hit is not None:
                self.finished = True
                self.engine.cancel(self.seq)
                at, matched = hit
                out, self.sent = self.text[self.sent : at], at
                return out, matched
            if not self.seq.done:
                safe = max(self.sent, len(self.text) - self.hold)
        if safe > self.sent:
            out, self.sent = self.text[self.sent : safe], safe
            return out, None
        return None

    async def aclose(self) -> None:
        self.finished = True
        if not self.seq.done:
            self.engine.cancel(self.seq)


class SimStream(_TextOut):
    """Deltas of one sequence; tokens produced while the consumer was busy are coalesced.

    Text that could still be the start of a stop sequence is held back until it cannot.
    Closing the stream early cancels the sequence in the engine.
    """

    def __init__(self, engine: SimEngine, req: GenerationRequest) -> None:
        prompt = req.prompt_text()
        self.engine = engine
        self.stop = req.stop
        self.ptoks = count_tokens(prompt)
        start = _start(prompt, req.seed)
        limit, self.finish = answer_budget(start, req.max_tokens, req.extra, engine.cfg)
        # A migrated request prefills its prompt and the text already sent, then goes on
        # with the very tokens the first replica would have produced next.
        done, text = resume_point(start, req, limit)
        self.seq = _Seq(start, self.ptoks + done, limit, prompt=prompt)
        self.seq.lora = engine.lora_of(req)
        # Prefill/decode disaggregation (vLLM's kv_transfer_params): a prefill replica's
        # request hands its prompt's KV cache over at its end; a decode replica's reads it.
        kvt = req.extra.get("kv_transfer_params") if req.extra else None
        self.handover = asks_handover(kvt)
        self.seq.remote = reads_remote_prompt(kvt)
        self.seq.emitted = done
        self.hold = max((len(s) for s in req.stop), default=1) - 1
        self.text = text
        # What the caller already has is not sent again (it may end inside a token).
        self.sent = len(req.resume_text)
        self.produced = 0
        self.finished = False
        if done >= limit:  # everything was sent; only the end was lost
            self.seq.done = True
        else:
            self._enter()

    def __aiter__(self) -> SimStream:
        return self

    async def __anext__(self) -> Delta:
        await self._entered()
        seq = self.seq
        while not self.finished:
            if not seq.buf:
                if seq.done:
                    return self._last()
                await _next_tokens(seq)
                continue
            pieces, seq.buf = seq.buf, []
            d = self._take("".join(pieces), len(pieces))
            if d is not None:
                return d
        raise StopAsyncIteration

    def _take(self, new: str, n: int) -> Delta | None:
        """The delta for ``n`` new tokens of text ``new``, if any of it may go out."""
        self.produced += n
        released = self._release(new)
        if released is None:
            return None
        out, matched = released
        if matched is not None:
            return Delta(
                out,
                n,
                "stop",
                self.ptoks,
                self.produced,
                stop_sequence=matched,
                usage=cached_details(self.seq),
            )
        return Delta(out, n)

    def _last(self) -> Delta:
        """The final delta once the sequence is done: what is still held, and why it ended
        (``length``, or ``stop`` where the answer ended on its own)."""
        self.finished = True
        tail, self.sent = self.text[self.sent :], len(self.text)
        d = Delta(tail, 0, self.finish, self.ptoks, self.produced, usage=cached_details(self.seq))
        if self.handover:
            d.kv_transfer_params = self.engine.handover(self.ptoks)
        return d

    async def push(self, sink: Callable[[Delta], object]) -> None:
        """Every delta to ``sink`` from the engine's step itself, not through a task per
        token (see :class:`~engine_worker.backends.base.DeltaStream`); a true answer from
        ``sink`` ends the stream (the sequence is cancelled)."""
        seq = self.seq
        ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        try:
            await self._entered()
        except BaseException:
            await self.aclose()
            raise

        def give(d: Delta | None) -> None:
            if d is not None and not ended.done() and (sink(d) or d.finish_reason):
                ended.set_result(None)

        def on_token(text: str) -> None:
            try:
                give(self._take(text, 1))
                if seq.done and not ended.done():
                    give(self._last())
            except Exception as exc:  # the engine's step must go on for the others
                seq.listener = None
                if not ended.done():
                    ended.set_exception(exc)

        try:
            # Tokens that came before (a resumed request) first, as one delta.
            if seq.buf:
                pieces, seq.buf = seq.buf, []
                give(self._take("".join(pieces), len(pieces)))
            if not ended.done() and seq.done and not self.finished:
                give(self._last())
            if not ended.done() and not self.finished:
                seq.listener = on_token
                await ended
        finally:
            seq.listener = None
            if not seq.done:
                await self.aclose()


class _Plan:
    """What a request that asks for more than text produces (decided once, at submission)."""

    __slots__ = ("call", "logprobs", "prompt", "toks", "top")

    def __init__(
        self,
        prompt: str,
        toks: list[str] | None,
        call: tuple[str, str, str] | None,
        logprobs: str | None,
        top: int,
    ) -> None:
        self.prompt = prompt
        self.toks = toks
        self.call = call
        self.logprobs = logprobs
        self.top = top


def _plan(req: GenerationRequest) -> _Plan | None:
    """The plan of a request with tools, a JSON response format or logprobs; None when the
    plain path serves it."""
    extra = req.extra
    if "tools" not in extra and "response_format" not in extra and "logprobs" not in extra:
        return None
    prompt = req.prompt_text()
    call = expected_tool_call(req)
    toks: list[str] | None = None
    if call is not None:
        toks = json_tokens(call[2])
    else:
        text = _structured(req, prompt)
        if text is not None:
            toks = json_tokens(text)
    mode = logprob_mode(req.kind, extra)
    if toks is None and mode is None:
        return None
    lp, top = mode if mode is not None else (None, 0)
    return _Plan(prompt, toks, call, lp, top)


class SimExtraStream(_TextOut):
    """Deltas of a request that asks for more than text: tool calls, JSON text, logprobs.

    The engine produces its tokens as it does text (one per decode step, coalesced while
    the consumer is busy). A tool call comes as OpenAI streams one: a delta with the call's
    id and name (no tokens) when the first token is ready, then deltas with argument
    fragments, then the finish ``tool_calls`` (``length`` when ``max_tokens`` cut it). JSON
    text streams as text (stop sequences apply) and finishes ``stop`` when whole. With
    logprobs every delta that carries tokens has the logprobs object of exactly those
    tokens.
    """

    def __init__(self, engine: SimEngine, req: GenerationRequest, plan: _Plan) -> None:
        self.engine = engine
        self.ptoks = count_tokens(plan.prompt)
        self.start = _start(plan.prompt, req.seed)
        self.toks = toks = plan.toks
        self.call = plan.call
        self.logprobs = plan.logprobs
        self.top = plan.top
        self.header: dict[str, Any] | None = None
        self.natural = "length"  # plain text (with logprobs): how its answer ends
        if self.call is not None and toks is not None:
            # A tool call is never resumed: it is made again from its start.
            call_id, name, _ = self.call
            self.header = {
                "index": 0,
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": ""},
            }
            self.stop = []
            limit = min(req.max_tokens, len(toks))
            done, text, sent = 0, "", 0
        else:
            self.stop = req.stop
            if toks is None:
                limit, self.natural = answer_budget(
                    self.start, req.max_tokens, req.extra, engine.cfg
                )
                done, text = resume_point(self.start, req, limit)
            else:
                limit = min(req.max_tokens, len(toks))
                done, text = _resume(toks.__getitem__, limit, req)
            sent = len(req.resume_text)
        self.seq = _Seq(self.start, self.ptoks + done, limit, toks, plan.prompt)
        self.seq.lora = engine.lora_of(req)
        self.seq.emitted = done
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = text
        self.sent = sent
        self.produced = 0
        # Tokens produced and not yet in a delta, the output position of the first of them
        # and its character offset in the completion.
        self.pending: list[str] = []
        self.pos = done
        self.offset = len(text)
        self.finished = False
        if done >= limit:
            self.seq.done = True
        else:
            self._enter()

    def __aiter__(self) -> SimExtraStream:
        return self

    async def __anext__(self) -> Delta:
        await self._entered()
        seq = self.seq
        while not self.finished:
            if not seq.buf:
                if seq.done:
                    self.finished = True
                    return self._last()
                await _next_tokens(seq)
                continue
            if self.header is not None:
                header, self.header = self.header, None
                return Delta("", 0, tool_calls=[header])
            pieces, seq.buf = seq.buf, []
            self.produced += len(pieces)
            self.pending += pieces
            if self.call is not None:
                return self._delta("", None, "".join(pieces))
            released = self._release("".join(pieces))
            if released is not None:
                out, matched = released
                if matched is None:
                    return self._delta(out)
                d = self._delta(out, "stop")
                d.stop_sequence = matched
                return d
        raise StopAsyncIteration

    def _last(self) -> Delta:
        """The final delta once the sequence is done: what was held back, and the finish."""
        whole = self.toks is not None and self.seq.emitted >= len(self.toks)
        finish = ("tool_calls" if self.call is not None else "stop") if whole else "length"
        if self.toks is None:
            finish = self.natural
        tail = ""
        if self.sent < len(self.text):
            tail, self.sent = self.text[self.sent :], len(self.text)
        d = self._delta(tail, finish)
        if self.header is not None:  # ended before its first token (cancelled)
            d.tool_calls, self.header = [self.header], None
        return d

    def _delta(self, text: str, finish: str | None = None, fragment: str | None = None) -> Delta:
        """A delta with ``text`` (or an arguments ``fragment``) and the pending tokens."""
        pending = self.pending
        n = len(pending)
        logprobs = None
        if self.logprobs is not None and n:
            if self.logprobs == "chat":
                logprobs = chat_logprobs(pending, self.start, self.pos, self.top)
            else:
                logprobs = completion_logprobs(pending, self.start, self.pos, self.top, self.offset)
            self.offset += sum(map(len, pending))
        self.pos += n
        self.pending = []
        calls = None if fragment is None else [{"index": 0, "function": {"arguments": fragment}}]
        if finish is None:
            return Delta(text, n, tool_calls=calls, logprobs=logprobs)
        return Delta(
            text,
            n,
            finish,
            self.ptoks,
            self.produced,
            tool_calls=calls,
            logprobs=logprobs,
            usage=cached_details(self.seq),
        )


def cached_details(seq: _Seq) -> dict[str, Any] | None:
    """The usage's ``prompt_tokens_details`` (the prompt tokens read from the prefix cache),
    as vLLM reports them; None when the engine keeps no prefix cache."""
    if not seq.looked_up:
        return None
    return {"prompt_tokens_details": {"cached_tokens": seq.reported_cached}}


# The most numbers one embeddings request may ask of the sim (its vectors are pure Python).
MAX_EMBEDDING_FLOATS = 1 << 22


# The simulator's vocabulary for token id prompts: an id is read as its four hex digits
# (bus_schemas.messages.token_ids_text), one token each.
SIM_VOCAB_SIZE = 65_536


class SimBackend:
    """The ``sim`` backend for the worker."""

    name = "sim"
    # A migrated token id prompt continues here as any other: the text so far follows the
    # prompt's text.
    resumes_token_prompts = True

    def __init__(self, cfg: WorkerSettings) -> None:
        self.engine = SimEngine(cfg.sim, cfg.tp)
        self.model = cfg.model
        self.max_model_len = cfg.max_model_len or cfg.sim.max_model_len
        self.fault_signals = cfg.sim.fault_signals

    async def start(self) -> None:
        if self.fault_signals:  # tests of engine health: make the engine die or hang
            loop = asyncio.get_running_loop()
            loop.add_signal_handler(signal.SIGUSR1, self._fail, "died")
            loop.add_signal_handler(signal.SIGUSR2, self._fail, "hung")

    def _fail(self, fault: str) -> None:
        eng = self.engine
        eng.fault = fault
        if eng._timer is not None:
            eng._timer.cancel()
            eng._timer = None

    def health(self) -> str | None:
        """Why the engine cannot serve (None: it can): a dead one says so at once; a hung
        one says nothing, as a hung engine does (the worker sees no output)."""
        return (
            "died (the sim's engine, told to by SIGUSR1)" if self.engine.fault == "died" else None
        )

    async def stop(self) -> None:
        # The engine's memory goes with it: tell those who follow its cache.
        if self.engine.cache is not None:
            self.engine.cache.clear()

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def kv_events(self) -> KVCache | None:
        """The engine's prefix cache, whose KV events the worker publishes (None: off); see
        :class:`~engine_worker.backends.base.KVEventSource`."""
        return self.engine.cache

    def endpoints(self) -> list[str]:
        return ["chat", "completions", "embeddings"]

    # -- LoRA adapters at run time (docs/adapters.md) ------------------------------------------
    @property
    def served_models(self) -> list[str]:
        return [self.model, *self.engine.adapters]

    @property
    def adapters(self) -> dict[str, str]:
        return self.engine.adapters

    async def load_adapter(self, name: str, path: str) -> None:
        """What vLLM's runtime load checks, then the load's time: ``path`` must exist on
        this host, and an ``adapter_config.json`` in it may not ask for a rank above
        ``max_lora_rank``. Raises a 400 saying why not, as vLLM's load answers."""
        cfg = self.engine.cfg
        where = Path(path).expanduser()
        if not where.exists():
            raise E.InvalidRequest(f"no adapter at {path!r} on this host", param="path")
        conf = where / "adapter_config.json" if where.is_dir() else None
        if conf is not None and conf.is_file():
            try:
                rank = json.loads(conf.read_text()).get("r")
            except (OSError, ValueError, AttributeError) as exc:
                raise E.InvalidRequest(
                    f"{conf}: not an adapter config ({exc})", param="path"
                ) from None
            if isinstance(rank, int) and rank > cfg.max_lora_rank:
                raise E.InvalidRequest(
                    f"the adapter's rank {rank} is above max_lora_rank {cfg.max_lora_rank}",
                    param="path",
                )
        await asyncio.sleep(cfg.lora_load_ms / 1000.0)
        self.engine.adapters[name] = path

    async def unload_adapter(self, name: str) -> None:
        self.engine.adapters.pop(name, None)

    def generate(self, req: GenerationRequest) -> SimStream | SimExtraStream:
        if req.max_tokens < 1:
            raise E.InvalidRequest("max_tokens must be at least 1", param="max_tokens")
        req.check_vocabulary(SIM_VOCAB_SIZE)
        fit_context(req, count_tokens(req.prompt_text()), self.max_model_len)
        return self.engine.generate(req)

    async def embed(self, req: GenerationRequest) -> Embeddings:
        """One :func:`expected_embedding` per input, after the prefill time of all of them."""
        items = req.input
        if not items:
            raise E.InvalidRequest("input must not be empty", param="input")
        dims = req.extra.get("dimensions")
        if dims is None:
            dims = self.engine.cfg.embedding_dim
        if not isinstance(dims, int) or isinstance(dims, bool) or not 0 < dims <= MAX_EMBEDDING_DIM:
            raise E.InvalidRequest(
                f"dimensions must be an integer from 1 to {MAX_EMBEDDING_DIM}", param="dimensions"
            )
        if len(items) * dims > MAX_EMBEDDING_FLOATS:
            raise E.InvalidRequest(
                f"the sim embeds at most {MAX_EMBEDDING_FLOATS} numbers per request "
                f"({len(items)} inputs x {dims} dimensions asked)",
                param="input",
            )
        tokens = 0
        for item in items:
            if isinstance(item, str) and item:
                tokens += count_tokens(item)
            elif (
                isinstance(item, list)
                and item
                and all(isinstance(t, int) and not isinstance(t, bool) for t in item)
            ):
                tokens += len(item)
            else:
                raise E.InvalidRequest(
                    "each input must be a non-empty string or list of token ids", param="input"
                )
        await asyncio.sleep(self.engine.prefill_s(tokens))
        # In a thread: a million numbers made here would hold the worker's loop (and its
        # heartbeats, its other streams) for a second on a busy machine, and its callers
        # would take the replica for lost. A GPU engine computes them off the loop too.
        vectors = await asyncio.to_thread(lambda: [expected_embedding(i, dims) for i in items])
        return Embeddings(vectors, tokens)
