"""A calibrated performance model of a continuous-batching engine; no GPU, deterministic text.

The model: at most ``max_running`` sequences run at once, the rest wait in a FIFO queue. An
admitted sequence's first token comes after its prefill, ``prefill_ms + prefill_ms_per_token
* prompt_tokens``. Running sequences advance together in decode steps of ``decode_ms +
decode_ms_per_seq * batch``, one token each. Tensor parallelism divides both by ``1 + (tp - 1)
* tp_efficiency`` and adds ``tp_comm_ms`` per step. One event-loop timer drives the whole
engine, so 1000 sequences cost 1/step_time wake-ups a second, not 1000 of them.

The text is a pure function of the prompt and seed: :func:`expected_text` tells tests what a
request will produce.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections import deque
from typing import Any

from bus_schemas import errors as E
from engine_worker.backends.base import Delta, GenerationRequest
from services.config import SimSettings, WorkerSettings

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


def count_tokens(text: str) -> int:
    """The simulator's tokenizer: about four characters a token."""
    return max(1, (len(text) + 3) // 4)


def _start(prompt: str, seed: int | None) -> int:
    return zlib.crc32(f"{seed}|{prompt}".encode())


def token_text(start: int, i: int) -> str:
    """The ``i``-th output token (0-based) for a prompt whose hash is ``start``."""
    word = VOCAB[(start + i * 7919) % len(VOCAB)]
    return word if i == 0 else " " + word


def expected_text(
    prompt: str, max_tokens: int, seed: int | None = None, stop: list[str] | None = None
) -> tuple[str, str]:
    """(text, finish_reason) the simulator produces for ``prompt`` (as rendered by
    :meth:`GenerationRequest.prompt_text`)."""
    start = _start(prompt, seed)
    text = ""
    for i in range(max_tokens):
        text += token_text(start, i)
        hit = _find_stop(text, stop or [])
        if hit is not None:
            return text[:hit], "stop"
    return text, "length"


def resume_point(start: int, req: GenerationRequest) -> tuple[int, str]:
    """Where a migrated request continues: (whole tokens already delivered, their text).

    The text the caller received is the authority: the tokens it holds in full are counted
    from it, so a token delivered only in part (held back by an output filter) is produced
    again and its missing end sent. Text that is not the sequence's own (redacted by an
    output filter) falls back to the token count the caller reports."""
    if not req.resume_text and not req.resume_tokens:
        return 0, ""
    text, n = "", 0
    while n < req.max_tokens:
        nxt = token_text(start, n)
        if not req.resume_text.startswith(nxt, len(text)):
            break
        text += nxt
        n += 1
    if len(text) < len(req.resume_text) and not (
        n < req.max_tokens and token_text(start, n).startswith(req.resume_text[len(text) :])
    ):
        # Not our text (redacted): trust the count.
        n = min(req.resume_tokens, req.max_tokens)
        return n, req.resume_text
    return n, text


def _find_stop(text: str, stops: list[str]) -> int | None:
    best: int | None = None
    for s in stops:
        k = text.find(s)
        if k >= 0 and (best is None or k < best):
            best = k
    return best


class _Seq:
    __slots__ = (
        "buf",
        "cancelled",
        "done",
        "emitted",
        "max_tokens",
        "prompt_tokens",
        "ready_at",
        "start",
        "waiter",
    )

    def __init__(self, start: int, prompt_tokens: int, max_tokens: int) -> None:
        self.start = start
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.emitted = 0
        self.buf: list[str] = []
        self.waiter: asyncio.Future[None] | None = None
        self.ready_at = 0.0
        self.done = False
        self.cancelled = False

    def push(self, text: str) -> None:
        self.buf.append(text)
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)


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
        self._next_decode = 0.0
        self.steps = 0

    # -- cost model -------------------------------------------------------------------------
    def prefill_s(self, prompt_tokens: int) -> float:
        ms = self.cfg.prefill_ms + self.cfg.prefill_ms_per_token * prompt_tokens
        return ms / 1000.0 / self.speedup + self.comm_s

    def step_s(self, batch: int) -> float:
        ms = self.cfg.decode_ms + self.cfg.decode_ms_per_seq * batch
        return ms / 1000.0 / self.speedup + self.comm_s

    # -- scheduling -------------------------------------------------------------------------
    def submit(self, seq: _Seq) -> None:
        self.waiting.append(seq)
        self._admit(time.monotonic())
        self._schedule()

    def _admit(self, now: float) -> None:
        while self.waiting and len(self.running) + len(self.prefilling) < self.cfg.max_running:
            s = self.waiting.popleft()
            if s.cancelled:
                continue
            s.ready_at = now + self.prefill_s(s.prompt_tokens)
            self.prefilling.append(s)

    def _schedule(self) -> None:
        at = float("inf")
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
        s.push(token_text(s.start, s.emitted))
        s.emitted += 1
        if s.emitted >= s.max_tokens:
            s.done = True

    def _tick(self) -> None:
        self._timer = None
        now = time.monotonic()
        if self.running and now >= self._next_decode - 1e-4:
            for s in self.running:
                self._emit(s)
            self.steps += 1
            self.running = [s for s in self.running if not s.done]
            self._next_decode = now + self.step_s(len(self.running))
        if self.prefilling:
            still: list[_Seq] = []
            joined = False
            for s in self.prefilling:
                if s.ready_at <= now + 1e-4:
                    self._emit(s)
                    if not s.done:
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
        if s in self.prefilling:
            self.prefilling.remove(s)
        elif s in self.running:
            self.running.remove(s)
        self._admit(time.monotonic())
        self._schedule()

    def stats(self) -> dict[str, Any]:
        active = len(self.running) + len(self.prefilling)
        return {
            "running": active,
            "waiting": len(self.waiting),
            "kv_usage": active / self.cfg.max_running,
        }

    def generate(self, req: GenerationRequest) -> SimStream:
        """Submit now (prefill starts at once) and return the stream of deltas."""
        return SimStream(self, req)


class SimStream:
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
        # A migrated request prefills its prompt and the text already sent, then goes on
        # with the very tokens the first replica would have produced next.
        done, text = resume_point(start, req)
        self.seq = _Seq(start, self.ptoks + done, req.max_tokens)
        self.seq.emitted = done
        self.hold = max((len(s) for s in req.stop), default=1) - 1
        self.text = text
        # What the caller already has is not sent again (a token may have been cut).
        self.sent = max(len(text), len(req.resume_text)) if req.resume_text else 0
        self.produced = 0
        self.finished = False
        if done >= req.max_tokens:  # everything was sent; only the end was lost
            self.seq.done = True
        else:
            engine.submit(self.seq)

    def __aiter__(self) -> SimStream:
        return self

    async def __anext__(self) -> Delta:
        seq = self.seq
        while not self.finished:
            if not seq.buf:
                if seq.done:
                    self.finished = True
                    if self.sent < len(self.text):
                        tail, self.sent = self.text[self.sent :], len(self.text)
                        return Delta(tail, 0, "length", self.ptoks, self.produced)
                    return Delta("", 0, "length", self.ptoks, self.produced)
                seq.waiter = asyncio.get_running_loop().create_future()
                try:
                    await seq.waiter
                finally:
                    seq.waiter = None
                continue
            pieces, seq.buf = seq.buf, []
            self.produced += len(pieces)
            self.text += "".join(pieces)
            safe = len(self.text)
            if self.stop:
                hit = _find_stop(self.text, self.stop)
                if hit is not None:
                    self.finished = True
                    self.engine.cancel(seq)
                    out, self.sent = self.text[self.sent : hit], hit
                    return Delta(out, len(pieces), "stop", self.ptoks, self.produced)
                if not seq.done:
                    safe = max(self.sent, len(self.text) - self.hold)
            if safe > self.sent:
                out, self.sent = self.text[self.sent : safe], safe
                return Delta(out, len(pieces))
        raise StopAsyncIteration

    async def aclose(self) -> None:
        self.finished = True
        if not self.seq.done:
            self.engine.cancel(self.seq)


class SimBackend:
    """The ``sim`` backend for the worker."""

    name = "sim"

    def __init__(self, cfg: WorkerSettings) -> None:
        self.engine = SimEngine(cfg.sim, cfg.tp)

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def generate(self, req: GenerationRequest) -> SimStream:
        if req.max_tokens < 1:
            raise E.InvalidRequest("max_tokens must be at least 1", param="max_tokens")
        return self.engine.generate(req)
