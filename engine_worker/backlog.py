"""The prompt tokens a replica's engine has still to compute before a request sent now gets
its first token: its *prefill backlog*, for the ``predicted_latency`` routing policy
(docs/routing.md). A count of waiting sequences says nothing of a queue that holds one
8 000-token prompt; the tokens do.

A request counts from the moment it enters the engine until its first token (or its end,
whichever comes first), for the prompt tokens the router expected it to compute: the
``Tb-Prefill-Tokens`` header (its prompt less the prefix the router's KV index said this
replica holds), bounded by the model's context; without one (no router predicted, or a
client sent the request straight here), about four characters a token of its prompt. The
total goes back in every ack and heartbeat; what was ahead of each request when it
entered teaches the replica's latency model what a token of backlog costs
(engine_worker/perf.py)."""

from __future__ import annotations

from bus_schemas import headers as H
from bus_schemas.messages import envelope_chars
from engine_worker.generation import Generation

# The most one request may add (its prompt cannot be longer than any model's context).
MAX_TOKENS = 1 << 21


def expected_tokens(gen: Generation, max_model_len: int = 0) -> int:
    """The prompt tokens ``gen``'s engine should compute (see the module docstring)."""
    cap = max_model_len or MAX_TOKENS
    raw = gen.headers.get(H.PREFILL_TOKENS, "")
    if raw.isdigit() and len(raw) <= 8:
        return min(int(raw), cap)
    return min((envelope_chars(gen.env) + 3) // 4, cap)


class PrefillBacklog:
    """The replica's backlog: the sum over requests in the engine without a first token."""

    def __init__(self) -> None:
        self.tokens = 0

    def enter(self, gen: Generation, max_model_len: int = 0) -> None:
        """``gen`` entered the engine now: what was ahead of it is noted on it, and its
        own prompt tokens join the backlog (once)."""
        if gen.prefill_tokens:
            return
        gen.backlog_ahead = self.tokens
        gen.prefill_tokens = max(1, expected_tokens(gen, max_model_len))
        self.tokens += gen.prefill_tokens

    def leave(self, gen: Generation) -> None:
        """``gen`` has its first token, or ended without one: it leaves the backlog (once)."""
        self.tokens = max(0, self.tokens - gen.prefill_tokens)
        gen.prefill_tokens = 0
