"""The prompt tokens a replica's engine has still to compute before a request sent now gets
its first token: its *prefill backlog*, for the ``predicted_latency`` routing policy
(docs/routing.md). A count of waiting sequences says nothing of a queue that holds one
8 000-token prompt; the tokens do.

A request counts from the moment it enters the engine until its first token (or its end,
whichever comes first), for what is left of the prompt tokens the router expected it to
compute: the ``Tb-Prefill-Tokens`` header (its prompt less the prefix the router's KV index
said this replica holds), bounded by the model's context and by its prompt's own length (a
token is at least a character, beside a chat template's few); without one (no router
predicted, or a client sent the request straight here), about four characters a token of its
prompt. The
total goes back in every ack and heartbeat; what was ahead of each request when it
entered teaches the replica's latency model what a token of backlog costs
(engine_worker/perf.py).

A prompt part-way through its prefill has only its last chunks left to compute. The engine
does not say how far it got, so the backlog works itself off as the engine does: first come,
first computed, at the engine's prefill speed as the replica learned it
(:attr:`PrefillBacklog.ms_per_token`; nothing is worked off while it is not known). Counted
whole until its first token, a prompt half done made the backlog twice what was left, and a
token of backlog seemed to cost half what it does: a replica in the middle of a burst looked
half as far behind as it was (docs/routing.md, "The backlog")."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from bus_schemas import headers as H
from engine_worker.generation import Generation

# The most one request may add (its prompt cannot be longer than any model's context).
MAX_TOKENS = 1 << 21
# A chat template's own tokens beside the prompt's characters (roles, separators).
TEMPLATE_TOKENS = 64


def expected_tokens(gen: Generation, max_model_len: int = 0) -> int:
    """The prompt tokens ``gen``'s engine should compute (see the module docstring)."""
    cap = max_model_len or MAX_TOKENS
    chars = gen.prompt_chars()
    raw = gen.headers.get(H.PREFILL_TOKENS, "")
    if raw.isascii() and raw.isdigit() and len(raw) <= 8:
        # Never more than the prompt could be: a count that claims more would stand for a
        # queue that is not there, and teach the replica's speed from it (perf.py).
        return min(int(raw), chars + TEMPLATE_TOKENS, cap)
    return min((chars + 3) // 4, cap)


class PrefillBacklog:
    """The replica's backlog: what is left of the prompts in the engine without a first
    token, worked off in order of entry at :attr:`ms_per_token`."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        # Each prompt's tokens still to compute, in order of entry (first computed first).
        self._left: OrderedDict[int, float] = OrderedDict()
        self._total = 0.0
        self._at = clock()
        self._next = 0
        # The engine's prefill speed as the replica learned it (0: not known, nothing is
        # worked off); engine_worker/accounting.py keeps it current (:meth:`set_speed`).
        self.ms_per_token = 0.0

    def set_speed(self, ms_per_token: float) -> None:
        """The engine's prefill speed as now learned: the time since last asked is worked
        off at the speed it had then."""
        self._work_off(self._clock())
        self.ms_per_token = max(0.0, ms_per_token)

    @property
    def tokens(self) -> int:
        """The prompt tokens the engine has still to compute now."""
        self._work_off(self._clock())
        return round(self._total)

    def enter(self, gen: Generation, max_model_len: int = 0) -> None:
        """``gen`` entered the engine now: what was ahead of it is noted on it, and its
        own prompt tokens join the backlog (once)."""
        if gen.prefill_tokens:
            return
        gen.backlog_ahead = self.tokens
        gen.prefill_tokens = max(1, expected_tokens(gen, max_model_len))
        self._next += 1
        gen.backlog_key = self._next
        self._left[self._next] = float(gen.prefill_tokens)
        self._total += gen.prefill_tokens

    def leave(self, gen: Generation) -> None:
        """``gen`` has its first token, or ended without one: what is left of it leaves the
        backlog (once)."""
        if gen.prefill_tokens:
            self._work_off(self._clock())
            self._total = max(0.0, self._total - self._left.pop(gen.backlog_key, 0.0))
            if not self._left:
                self._total = 0.0
        gen.prefill_tokens = 0

    def _work_off(self, now: float) -> None:
        """What the engine computed since last asked, taken from the oldest prompts first."""
        budget = (now - self._at) * 1000.0 / self.ms_per_token if self.ms_per_token > 0 else 0.0
        self._at = now
        while budget > 0 and self._left:
            key, left = next(iter(self._left.items()))
            if left > budget:
                self._left[key] = left - budget
                self._total -= budget
                return
            budget -= left
            self._total -= left
            del self._left[key]  # computed: what stays is its first token's wait
        if not self._left:
            self._total = 0.0
