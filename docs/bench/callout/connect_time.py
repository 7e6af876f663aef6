"""Connect time on the locked bus: a NATS client logging in with its API key (the server asks
the auth service over the auth callout) against a role login with a password (no callout).

    .venv/bin/python docs/bench/callout/connect_time.py [N]

Starts a nats-server on the generated config and `tokenbus serve auth` (the responder),
creates a key, then opens and closes N connections each way; prints JSON (ms).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nats

from auth.store import KeyStore
from services.natsconf import generate, role_env, role_login
from tokenbus.launcher import nats_server_binary, port_open


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _times(n: int, **login: str) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        nc = await nats.connect(URL, allow_reconnect=False, **login)
        out.append((time.perf_counter() - t) * 1000)
        await nc.close()
    return out


def _summary(ms: list[float]) -> dict[str, float]:
    ms = sorted(ms)
    return {"p50": round(statistics.median(ms), 2), "p99": round(ms[int(len(ms) * 0.99) - 1], 2)}


async def main(n: int) -> None:
    nc = await nats.connect(URL, **role_login(USERS, "admin"))
    store = await KeyStore(nc).open(watch=False)
    key, _ = await store.create("connect-time")
    await nc.drain()
    for _ in range(100):  # until the auth service's watched store has the key
        try:
            await (await nats.connect(URL, token=key, allow_reconnect=False)).close()
            break
        except Exception:
            await asyncio.sleep(0.1)
    role = role_login(USERS, "worker")
    result = {
        "connections": n,
        "api_key_via_callout_ms": _summary(await _times(n, token=key)),
        "role_password_ms": _summary(await _times(n, **role)),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    N = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    tmp = Path(tempfile.mkdtemp(prefix="tokenbus-connect-"))
    port = _free_port()
    URL = f"nats://127.0.0.1:{port}"
    conf, USERS = generate(tmp, port=port, callout=True)
    server = subprocess.Popen(
        [nats_server_binary(), "-c", str(conf)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    env = {
        **os.environ,
        **role_env(USERS, "auth"),
        "TOKENBUS_NATS_URL": URL,
        "TOKENBUS_LOG_LEVEL": "warning",
    }
    while not port_open("127.0.0.1", port):
        time.sleep(0.05)
    auth = subprocess.Popen([sys.executable, "-m", "tokenbus.cli", "serve", "auth"], env=env)
    try:
        asyncio.run(main(N))
    finally:
        auth.terminate()
        auth.wait(10)
        server.terminate()
        server.wait(10)
