"""How the bridge's HTTP server was chosen: aiohttp vs uvicorn (httptools, raw ASGI).

Each server streams SSE responses of 64 events (the size of a 64-token completion) as fast
as it can; a client at fixed concurrency reads them. Reported: streamed events per second
and the server's CPU seconds per 1000 events (lower is better: on a 2-core machine every
CPU cycle the bridge spends is taken from the engine or the client).

    pip install uvicorn httptools   # not tokenbus dependencies
    python docs/bench/http_server_choice.py
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time

EVENTS = 64
CONCURRENCY = 64
REQUESTS = 2000
PIECE = b'data: {"choices":[{"index":0,"delta":{"content":" token"}}]}\n\n'

# Both servers do what the bridge needs: read the body, stream, and notice a client that
# disconnects (aiohttp: handler cancellation; ASGI: a task waiting for http.disconnect).
AIOHTTP_SERVER = f"""
import asyncio, uvloop
from aiohttp import web
async def h(request):
    await request.read()
    r = web.StreamResponse(headers={{"Content-Type": "text/event-stream"}})
    await r.prepare(request)
    for _ in range({EVENTS}):
        await r.write({PIECE!r})
    await r.write(b"data: [DONE]\\n\\n")
    return r
async def main():
    app = web.Application(); app.router.add_post("/s", h)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", int(__import__("sys").argv[1])).start()
    await asyncio.Event().wait()
uvloop.run(main())
"""

UVICORN_SERVER = f"""
import asyncio, uvicorn
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    task = asyncio.current_task()
    async def watch():
        while (await receive())["type"] != "http.disconnect":
            pass
        task.cancel()
    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        await send({{"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]}})
        for _ in range({EVENTS}):
            await send({{"type": "http.response.body", "body": {PIECE!r}, "more_body": True}})
        await send({{"type": "http.response.body", "body": b"data: [DONE]\\n\\n"}})
    finally:
        watcher.cancel()
uvicorn.run(app, host="127.0.0.1", port=int(__import__("sys").argv[1]), log_level="warning",
            access_log=False, loop="uvloop", http="httptools")
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        f = fh.read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


async def load(port: int) -> tuple[float, int]:
    import aiohttp

    remaining = REQUESTS
    events = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:

        async def worker() -> None:
            nonlocal remaining, events
            while remaining > 0:
                remaining -= 1
                async with s.post(f"http://127.0.0.1:{port}/s", data=b"{}") as r:
                    async for line in r.content:
                        if line.startswith(b"data: {"):
                            events += 1

        t = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
        return time.perf_counter() - t, events


def measure(name: str, code: str) -> dict[str, float]:
    port = free_port()
    p = subprocess.Popen([sys.executable, "-c", code, str(port)])
    try:
        for _ in range(100):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.05)
        c0 = cpu_s(p.pid)
        wall, events = asyncio.run(load(port))
        c1 = cpu_s(p.pid)
    finally:
        p.terminate()
        p.wait()
    return {
        "server": name,
        "events_per_s": round(events / wall),
        "server_cpu_ms_per_1000_events": round((c1 - c0) / events * 1e6, 1),
        "events": events,
    }


if __name__ == "__main__":
    print(
        json.dumps(
            [
                measure("aiohttp", AIOHTTP_SERVER),
                measure("uvicorn+httptools (raw ASGI)", UVICORN_SERVER),
            ],
            indent=2,
        )
    )
