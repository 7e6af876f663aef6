"""CPU per request of carrying a body's fields through tokenbus: parse the JSON, validate it,
build the envelope, msgpack-encode it (the bridge) and decode it (the worker), for the
foundation benchmark's request and for the same request with 20 tools (8 KB of schema).

    .venv/bin/python docs/bench/openai-api/carry_cost.py
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from bus_schemas import codec
from gateway import validation

HERE = Path(__file__).parent
PLAIN = {
    "model": "tokenbus-sim",
    "messages": [
        {"role": "user", "content": "Explain how a continuous batching engine schedules sequences."}
    ],
    "max_tokens": 64,
    "stream": True,
    "stream_options": {"include_usage": True},
}


def per_request_us(body: dict[str, Any], n: int = 3000) -> dict[str, float]:
    raw = json.dumps(body).encode()
    parsed = json.loads(raw)
    req = validation.parse("chat", parsed)
    env = validation.envelope("chat", req, parsed, "rid", default_max_tokens=256, deadline_ms=None)
    data = codec.encode(env)
    steps = {
        "json": lambda: json.loads(raw),
        "validate": lambda: validation.parse("chat", parsed),
        "envelope": lambda: validation.envelope(
            "chat", req, parsed, "rid", default_max_tokens=256, deadline_ms=None
        ),
        "encode": lambda: codec.encode(env),
        "decode": lambda: codec.decode_map(data),
    }
    out: dict[str, float] = {"body_bytes": len(raw), "envelope_bytes": len(data)}
    for name, step in steps.items():
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            for _ in range(n):
                step()
            best = min(best, (time.perf_counter() - t) / n * 1e6)
        out[name] = round(best, 1)
    out["total"] = round(sum(out[k] for k in steps), 1)
    return out


def main() -> None:
    tools = json.loads((HERE / "tools-20.json").read_text())
    result = {"plain": per_request_us(PLAIN), "tools_20": per_request_us({**PLAIN, **tools})}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
