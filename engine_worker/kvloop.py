"""The worker's side of the router's closed loop on KV-cache hits (docs/routing.md,
"Checking the KV index"): what a router predicted the engine would read from its prefix
cache (the ``Tb-Kv-Predicted`` header), beside what the engine reported (its usage's
``cached_tokens``), summed for the heartbeats; and what makes this replica's block hashes
comparable, announced in them too."""

from __future__ import annotations

from typing import Any

from bus_schemas import headers as H
from bus_schemas import kv_events as KV

# Longest router id kept from the header (a router's instance id is 12 hex digits).
_MAX_ROUTER = 64


def predicted(hdrs: dict[str, str] | None) -> tuple[int, str] | None:
    """(predicted cached prompt tokens, the router's id) from the request's headers, or None
    when no router predicted (or the value is not one a router writes)."""
    raw = (hdrs or {}).get(H.KV_PREDICTED)
    if not raw:
        return None
    tokens, _, router = raw.partition(",")
    if not tokens.isdigit() or len(tokens) > 12:
        return None
    return int(tokens), router[:_MAX_ROUTER]


class KVLoop:
    """Totals since this process started of the requests that carried a prediction and
    whose engine reported its cached tokens."""

    def __init__(self) -> None:
        self.requests = 0
        self.predicted = 0
        self.reported = 0

    def observe(self, predicted_tokens: int, reported_tokens: int) -> None:
        self.requests += 1
        self.predicted += predicted_tokens
        self.reported += reported_tokens

    def heartbeat(self) -> dict[str, int]:
        """The totals as heartbeats carry them (``kv_check``)."""
        return {"requests": self.requests, "predicted": self.predicted, "reported": self.reported}


def hashing(kv: Any, model: str, revision: str | None = None) -> dict[str, Any]:
    """What a router needs to compute this replica's block hashes, as heartbeats announce it
    (``kv_hashing``): the scheme (``text``: the sim's, with its seed; ``vllm``: its
    algorithm, seed and tokenizer), the block size, the model and its revision when known."""
    scheme = getattr(kv, "hashing", None)
    if isinstance(scheme, dict):
        out = dict(scheme)
    else:
        out = KV.text_scheme(seed=str(getattr(kv, "seed", "") or ""))
        out.setdefault("seed", "")
    out["block_size"] = int(out.get("block_size") or kv.block_size)
    out["model"] = model
    if revision:
        out["revision"] = revision
    return out
