"""The shape of issue 65: `tokenbus up --workers 2 --bridge-processes 2` (locked bus, every
stage), 8 closed-loop streaming HTTP clients and 4 closed-loop `tokenbus.Client` NATS clients
(48-token answers, back to back), and the only nats-server paused (SIGSTOP) for ``pause_s``
once ``lead_s`` of load has run, then resumed. Prints one JSON line: outcomes per path
(``ok``: the whole answer, the same as before the pause), requests still running when the
load was told to stop (``hung``), each path's first completion after the server resumed, and
the first errors.

    .venv/bin/python docs/bench/stalls/paused_server_mixed.py /tmp/stall-data 18123 18124 8
    (data folder, bridge port, nats port, pause in seconds[, lead seconds])
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

from tokenbus import Client

MAX_TOKENS = 48


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
    args += ["--workers", "2", "--bridge-processes", "2"]
    with open(data.parent / f"{data.name}-up.log", "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "tokenbus.cli", *args], stdout=log, stderr=subprocess.STDOUT
        )


async def main(
    up: subprocess.Popen[bytes],
    data: Path,
    port: int,
    nats_port: int,
    pause_s: float,
    lead_s: float,
) -> dict[str, Any]:
    try:
        key_file = data / "dev-key"

        async def key() -> str:
            return key_file.read_text().strip() if key_file.exists() else ""

        api_key = await _until(key, 90)
        oai = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key=api_key, max_retries=0
        )

        async def models() -> list[str]:
            return [m.id async for m in oai.models.list()]

        model = (await _until(models, 90))[0]
        msgs: Any = [{"role": "user", "content": "stall"}]
        ref = await oai.chat.completions.create(model=model, messages=msgs, max_tokens=MAX_TOKENS)
        want = ref.choices[0].message.content
        outcomes: dict[str, Counter[str]] = {"http": Counter(), "nats": Counter()}
        errors: list[str] = []
        resumed_at: list[float] = []
        first_after: dict[str, float] = {}
        stop = asyncio.Event()

        def done(path: str, text: str) -> None:
            outcomes[path]["ok" if text == want else "wrong_text"] += 1
            if resumed_at and path in ("http", "nats") and path not in first_after:
                first_after[path] = round(time.monotonic() - resumed_at[0], 2)

        def failed(path: str, exc: BaseException) -> None:
            outcomes[path][type(exc).__name__] += 1
            errors.append(f"{path.replace('_', ' ')} {exc!r}"[:210])

        async def one_http(path: str) -> None:
            """One streamed chat completion over HTTP, its outcome under ``path``."""
            parts = []
            try:
                stream: Any = await oai.chat.completions.create(
                    model=model, messages=msgs, max_tokens=MAX_TOKENS, stream=True, timeout=120
                )
                async for c in stream:
                    if c.choices:
                        parts.append(c.choices[0].delta.content or "")
            except openai.APIError as exc:
                failed(path, exc)
                return
            done(path, "".join(parts))

        async def one_nats(tb: Client, path: str) -> None:
            """One streamed chat completion from a NATS client, its outcome under ``path``."""
            try:
                got = [
                    f.text async for f in tb.chat(model, msgs, max_tokens=MAX_TOKENS, timeout=120)
                ]
            except Exception as exc:
                failed(path, exc)
                return
            done(path, "".join(got))

        async def http_client() -> None:
            while not stop.is_set():
                await one_http("http")

        async def nats_client(tb: Client) -> None:
            while not stop.is_set():
                await one_nats(tb, "nats")

        outcomes["late_http"] = Counter()
        outcomes["late_nats"] = Counter()
        nats_url = f"nats://127.0.0.1:{nats_port}"
        tbs = [await Client.connect(nats_url, api_key=api_key) for _ in range(4)]
        tasks = [asyncio.create_task(http_client()) for _ in range(8)]
        tasks += [asyncio.create_task(nats_client(tb)) for tb in tbs]
        await asyncio.sleep(lead_s)
        found = subprocess.check_output(["pgrep", "-f", f"nats-server.*{data}"]).split()
        nats_pid = int(found[0])
        os.kill(nats_pid, signal.SIGSTOP)
        await asyncio.sleep(pause_s / 2)
        # Requests that start during the stall: 4 over HTTP (new connections to the bridges)
        # and 2 from NATS clients connected before it. Each should wait, not fail.
        late = [asyncio.create_task(one_http("late_http")) for _ in range(4)]
        late += [asyncio.create_task(one_nats(tb, "late_nats")) for tb in tbs[:2]]
        await asyncio.sleep(pause_s / 2)
        os.kill(nats_pid, signal.SIGCONT)
        resumed_at.append(time.monotonic())
        await asyncio.sleep(lead_s + 4)
        stop.set()
        _, pending = await asyncio.wait(tasks + late, timeout=130)
        for tb in tbs:
            await tb.close()
        out = {
            "paused_s": pause_s,
            "outcomes": {k: dict(v) for k, v in outcomes.items()},
            "hung": len(pending),
            "first_after_resume_s": first_after,
            "errors": errors[:6],
        }
        print(json.dumps(out), flush=True)
        return out
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(60)


if __name__ == "__main__":
    d, p, n, s = sys.argv[1:5]
    lead = float(sys.argv[5]) if len(sys.argv) > 5 else 8.0
    asyncio.run(main(start(Path(d), int(p), int(n)), Path(d), int(p), int(n), float(s), lead))
