"""A generated routing trace with the shape of the published production traces (Mooncake's
and the agentic-session traces the KV-routing papers replay): a few system prompts shared by
many sessions (Zipf-popular), multi-turn sessions whose conversation grows every turn,
prompt lengths with a long tail (log-normal user turns), sessions arriving as a Poisson
process. ``tokenbus bench --routing-trace`` replays it (tokenbus.evaluation.routebench);
``python -m tokenbus.evaluation.trace --out trace.jsonl`` writes one.

A trace is JSON lines: the first ``{"type": "trace", ...}`` (its parameters and the shared
system prompts' lengths), then one ``{"type": "session", ...}`` per session: its arrival
offset, system prompt index, and per turn the user message's tokens, the answer's tokens and
the think time before the turn. Texts are made at replay from the seed: a trace is small.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class TraceShape:
    """What a generated trace looks like."""

    sessions: int = 64
    seed: int = 0
    system_prompts: int = 4  # shared by every session, Zipf-popular
    system_tokens: tuple[int, int] = (1000, 4000)  # each one's length, uniform
    zipf_s: float = 1.1
    turns: tuple[int, int] = (1, 8)  # per session, uniform
    user_median_tokens: int = 300  # each turn's new user tokens: log-normal
    user_sigma: float = 1.0
    user_max_tokens: int = 8000
    output_median_tokens: int = 64
    output_sigma: float = 0.6
    output_max_tokens: int = 512
    sessions_per_s: float = 4.0  # Poisson arrivals
    think_s: float = 0.5  # mean pause before a next turn (exponential)


@dataclass
class Session:
    """One session of a trace."""

    id: int
    arrival_s: float
    system: int
    turns: list[dict[str, Any]] = field(default_factory=list)


def _lognormal(rng: random.Random, median: int, sigma: float, cap: int) -> int:
    return max(1, min(cap, round(median * math.exp(rng.gauss(0.0, sigma)))))


def generate(shape: TraceShape) -> tuple[dict[str, Any], list[Session]]:
    """(the trace's header, its sessions), the same for the same shape."""
    rng = random.Random(shape.seed)
    systems = [rng.randint(*shape.system_tokens) for _ in range(shape.system_prompts)]
    weights = [1.0 / (i + 1) ** shape.zipf_s for i in range(shape.system_prompts)]
    sessions: list[Session] = []
    t = 0.0
    for i in range(shape.sessions):
        t += rng.expovariate(shape.sessions_per_s)
        s = Session(i, round(t, 4), rng.choices(range(shape.system_prompts), weights)[0])
        for n in range(rng.randint(*shape.turns)):
            s.turns.append(
                {
                    "user_tokens": _lognormal(
                        rng, shape.user_median_tokens, shape.user_sigma, shape.user_max_tokens
                    ),
                    "output_tokens": _lognormal(
                        rng, shape.output_median_tokens, shape.output_sigma, shape.output_max_tokens
                    ),
                    "think_s": round(rng.expovariate(1.0 / shape.think_s), 4) if n else 0.0,
                }
            )
        sessions.append(s)
    shape_dict = json.loads(json.dumps(asdict(shape)))  # as a saved trace holds it
    head = {"type": "trace", "shape": shape_dict, "system_tokens": systems}
    return head, sessions


def save(path: Path, head: dict[str, Any], sessions: list[Session]) -> None:
    lines = [json.dumps(head)] + [json.dumps({"type": "session", **asdict(s)}) for s in sessions]
    path.write_text("\n".join(lines) + "\n")


def load(path: Path) -> tuple[dict[str, Any], list[Session]]:
    head: dict[str, Any] = {}
    sessions: list[Session] = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        obj = json.loads(line)
        if obj.get("type") == "trace":
            head = obj
        elif obj.get("type") == "session":
            sessions.append(Session(obj["id"], obj["arrival_s"], obj["system"], obj["turns"]))
    if not head:
        raise ValueError(f"{path}: no trace header")
    return head, sessions


def main() -> int:
    p = argparse.ArgumentParser(description="write a generated routing trace (JSON lines)")
    p.add_argument("--out", required=True)
    p.add_argument("--sessions", type=int, default=TraceShape.sessions)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sessions-per-s", type=float, default=TraceShape.sessions_per_s)
    a = p.parse_args()
    shape = TraceShape(sessions=a.sessions, seed=a.seed, sessions_per_s=a.sessions_per_s)
    save(Path(a.out), *generate(shape))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
