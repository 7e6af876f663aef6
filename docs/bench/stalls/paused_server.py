"""`tokenbus up` (its defaults: the locked bus, every stage, 2 sim workers), 8 closed-loop
streaming HTTP clients, and the embedded nats-server paused (SIGSTOP) for a while under them.
Prints one JSON line: the outcomes (``ok``: the whole answer, the same as before the pause),
the longest wait between two chunks of any stream, and the first errors.

    .venv/bin/python docs/bench/stalls/paused_server.py /tmp/stall-data 18123 18124 8
    (data folder, bridge port, nats port, pause in seconds)
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import openai


async def _until(cond: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            got = await cond()
            if got:
                return got
        except Exception:  # not up yet
            pass
        await asyncio.sleep(0.2)
    raise TimeoutError("the stack did not come up")


def start(data: Path, port: int, nats_port: int) -> subprocess.Popen[bytes]:
    args = ["up", "--port", str(port), "--nats-port", str(nats_port), "--data-dir", str(data)]
    with open(data.parent / f"{data.name}-up.log", "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "tokenbus.cli", *args, "--workers", "2"],
            stdout=log,
            stderr=subprocess.STDOUT,
        )


async def main(up: subprocess.Popen[bytes], data: Path, port: int, pause_s: float) -> None:
    try:
        key_file = data / "dev-key"

        async def key() -> str:
            return key_file.read_text().strip() if key_file.exists() else ""

        oai = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key=await _until(key, 60), max_retries=0
        )

        async def models() -> list[str]:
            return [m.id async for m in oai.models.list()]

        model = (await _until(models, 60))[0]
        msgs: Any = [{"role": "user", "content": "stall"}]
        ref = await oai.chat.completions.create(model=model, messages=msgs, max_tokens=64)
        want = ref.choices[0].message.content
        outcomes: Counter[str] = Counter()
        errors: list[str] = []
        gaps: list[float] = []
        stop_at = time.monotonic() + 10 + pause_s

        async def client() -> None:
            while time.monotonic() < stop_at:
                last, gap, parts = time.monotonic(), 0.0, []
                try:
                    stream: Any = await oai.chat.completions.create(
                        model=model, messages=msgs, max_tokens=64, stream=True, timeout=120
                    )
                    async for c in stream:
                        now = time.monotonic()
                        gap, last = max(gap, now - last), now
                        if c.choices:
                            parts.append(c.choices[0].delta.content or "")
                except openai.APIError as exc:
                    outcomes[type(exc).__name__] += 1
                    errors.append(repr(exc)[:200])
                    continue
                outcomes["ok" if "".join(parts) == want else "wrong_text"] += 1
                gaps.append(gap)

        load = asyncio.gather(*(client() for _ in range(8)))
        await asyncio.sleep(4)
        found = subprocess.check_output(["pgrep", "-f", f"nats-server.*{data}"]).split()
        nats_pid = int(found[0])
        os.kill(nats_pid, signal.SIGSTOP)
        await asyncio.sleep(pause_s)
        os.kill(nats_pid, signal.SIGCONT)
        await load
        print(
            json.dumps(
                {
                    "paused_s": pause_s,
                    "outcomes": dict(outcomes),
                    "longest_gap_s": round(max(gaps), 2),
                    "errors": errors[:3],
                }
            )
        )
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(60)


if __name__ == "__main__":
    d, p, n, s = sys.argv[1:5]
    asyncio.run(main(start(Path(d), int(p), int(n)), Path(d), int(p), float(s)))
