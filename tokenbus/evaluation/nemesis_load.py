"""The nemesis run's load: streamed chat completions over NATS and over HTTP, a batch, a
background response and keys created as it runs; each answer's text checked against the
simulator's (no gap, no repeat)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from typing import Any

from tokenbus.evaluation.nemesis_cluster import quiet_errors
from tokenbus.evaluation.nemesis_config import PRICE_IN, PRICE_OUT
from tokenbus.evaluation.nemesis_stack import create_key, retrying
from tokenbus.evaluation.nemesis_state import Outcome, Run


def expected(content: str, max_tokens: int) -> str:
    from engine_worker.backends.sim import expected_text

    return expected_text(f"<|user|>{content}\n", max_tokens)[0]


def _check_text(o: Outcome, text: str, want: str) -> None:
    """An answer must be the expected text; a cut one, a prefix of it (no gap, no repeat)."""
    if o.status == "ok" and text != want:
        o.text_ok = False
        o.text_problem = f"got {text[:80]!r}..., want {want[:80]!r}..."
    elif o.status != "ok" and not want.startswith(text):
        o.text_ok = False
        o.text_problem = f"cut answer {text[:80]!r} is not a prefix of {want[:80]!r}"


async def nats_client_loop(run: Run, key_name: str, node: int) -> None:
    from bus_schemas.errors import TokenbusError
    from tokenbus import Client

    cfg = run.cfg
    secret = run.keys[key_name][0]
    c = await Client.connect(
        run.stack.cluster.urls(node), api_key=secret, reconnect_time_wait=0.2, error_cb=quiet_errors
    )
    try:
        while time.monotonic() < run.stop_at:
            mt = run.rng.randint(8, 40)
            o = run.new("nats", key_name)
            content = f"nemesis {o.rid}"
            o.max_cost = 64 * PRICE_IN + mt * PRICE_OUT
            parts: list[str] = []
            stream = c.chat(
                cfg.model,
                [{"role": "user", "content": content}],
                max_tokens=mt,
                timeout=cfg.deadline_s,
                request_id=o.rid,
            )
            try:
                async with asyncio.timeout(cfg.deadline_s + 5):
                    try:
                        async for ch in stream:
                            parts.append(ch.text or "")
                        o.status = "ok"
                    except TokenbusError as exc:
                        o.status, o.error = "error", exc.code
                    finally:
                        with contextlib.suppress(Exception):
                            await stream.aclose()
            except TimeoutError:
                o.status, o.error = "hung", "no end within the deadline"
            o.t1 = run.now()
            if stream.usage is not None:
                o.prompt_tokens = stream.usage.prompt_tokens
                o.completion_tokens = stream.usage.completion_tokens
            _check_text(o, "".join(parts), expected(content, mt))
            # A refused connection (a killed bridge) fails at once: not a tight loop of them.
            await asyncio.sleep(0.02 if o.status == "ok" else 0.2)
    finally:
        with contextlib.suppress(Exception):
            await c.close()


async def http_client_loop(run: Run, key_name: str, bridge: int) -> None:
    import httpx

    cfg = run.cfg
    secret = run.keys[key_name][0]
    bases = run.http_bases or run.stack.bases
    i = bridge
    # The bridge ends a request at its deadline with an error of its own: the client waits
    # past that (as the invariant's 5 s of grace does), or it races the bridge's clock.
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.deadline_s + 5, connect=5)) as h:
        while time.monotonic() < run.stop_at:
            base = bases[i % len(bases)]
            i += 1
            mt = run.rng.randint(8, 40)
            o = run.new("http", key_name)
            content = f"nemesis {o.rid}"
            o.max_cost = 64 * PRICE_IN + mt * PRICE_OUT
            parts: list[str] = []
            body = {
                "model": cfg.model,
                "messages": [{"role": "user", "content": content}],
                "max_tokens": mt,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            headers = {"Authorization": f"Bearer {secret}", "X-Request-Id": o.rid}
            try:
                async with asyncio.timeout(cfg.deadline_s + 5):
                    async with h.stream(
                        "POST", f"{base}/v1/chat/completions", json=body, headers=headers
                    ) as r:
                        if r.status_code != 200:
                            raw = await r.aread()
                            try:
                                code = json.loads(raw)["error"].get("code") or r.status_code
                            except (ValueError, KeyError, TypeError, AttributeError):
                                code = r.status_code
                            o.status, o.error = "error", f"http_{r.status_code}:{code}"
                        else:
                            o.status = "error"
                            o.error = "stream ended without [DONE]"
                            async for line in r.aiter_lines():
                                if not line.startswith("data: "):
                                    continue
                                data = line[6:].strip()
                                if data == "[DONE]":
                                    if not o.error.startswith("sse_error"):
                                        o.status, o.error = "ok", ""
                                    break
                                obj = json.loads(data)
                                if "error" in obj:
                                    o.error = f"sse_error:{obj['error'].get('code')}"
                                    continue
                                for ch in obj.get("choices") or ():
                                    parts.append((ch.get("delta") or {}).get("content") or "")
                                if obj.get("usage"):
                                    o.prompt_tokens = int(obj["usage"]["prompt_tokens"])
                                    o.completion_tokens = int(obj["usage"]["completion_tokens"])
            except (TimeoutError, httpx.TimeoutException) as exc:
                if isinstance(exc, httpx.ConnectTimeout):
                    o.status, o.error = "error", "connect_timeout"
                else:
                    o.status, o.error = "hung", f"no end within the deadline ({type(exc).__name__})"
            except httpx.HTTPError as exc:
                o.status, o.error = "error", type(exc).__name__
            o.t1 = run.now()
            _check_text(o, "".join(parts), expected(content, mt))
            # A refused connection (a killed bridge) fails at once: not a tight loop of them.
            await asyncio.sleep(0.02 if o.status == "ok" else 0.2)


async def batch_job(run: Run, key_name: str) -> dict[str, Any]:
    """A batch of ``batch_lines`` lines through the NATS client; every line answered once."""
    from tokenbus import Client

    cfg = run.cfg
    secret = run.keys[key_name][0]
    lines = {f"line-{i}": (f"batch line {i}", 8 + i % 16) for i in range(cfg.batch_lines)}
    data = "".join(
        json.dumps(
            {
                "custom_id": cid,
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": cfg.model,
                    "messages": [{"role": "user", "content": content}],
                    "max_tokens": mt,
                },
            }
        )
        + "\n"
        for cid, (content, mt) in lines.items()
    ).encode()
    o = run.new("batch", key_name)
    o.max_cost = sum(64 * PRICE_IN + mt * PRICE_OUT for _, mt in lines.values())
    res: dict[str, Any] = {"lines": len(lines)}
    c = await Client.connect(
        run.stack.cluster.urls(0), api_key=secret, reconnect_time_wait=0.2, error_cb=quiet_errors
    )
    try:
        f = await retrying("batch file", lambda: c.files_create(data), 60)
        b = await retrying("batch create", lambda: c.batches_create(f["id"]), 60)
        res["id"] = b["id"]
        done = await c.wait_batch(b["id"], timeout=cfg.duration_s + 180, poll_s=1.0)
        res["status"] = done["status"]
        res["request_counts"] = done.get("request_counts")
        seen: Counter[str] = Counter()
        bad_text: list[str] = []
        for fid in (done.get("output_file_id"), done.get("error_file_id")):
            if not fid:
                continue
            content = await retrying("batch file content", lambda fid=fid: c.file_content(fid))
            for raw in bytes(content).decode().splitlines():
                if not raw.strip():
                    continue
                line = json.loads(raw)
                cid = line.get("custom_id")
                seen[cid] += 1
                body = ((line.get("response") or {}).get("body")) or {}
                if line.get("error") is None and body.get("choices"):
                    prompt, mt = lines.get(cid, ("", 0))
                    text = body["choices"][0]["message"].get("content") or ""
                    if text != expected(prompt, mt):
                        bad_text.append(cid)
                    usage = body.get("usage") or {}
                    o.prompt_tokens += int(usage.get("prompt_tokens", 0))
                    o.completion_tokens += int(usage.get("completion_tokens", 0))
        res["missing"] = sorted(set(lines) - set(seen))
        res["repeated"] = sorted(k for k, v in seen.items() if v > 1)
        res["unknown"] = sorted(set(seen) - set(lines))
        res["bad_text"] = bad_text
        o.status = "ok" if done["status"] == "completed" else "error"
        o.error = "" if o.status == "ok" else done["status"]
    except Exception as exc:
        res["error"] = repr(exc)
        o.status, o.error = "error", repr(exc)[:200]
    finally:
        o.t1 = run.now()
        with contextlib.suppress(Exception):
            await c.close()
    return res


async def background_job(run: Run, key_name: str) -> dict[str, Any]:
    """A background response, followed to its end."""
    from tokenbus import Client

    cfg = run.cfg
    secret = run.keys[key_name][0]
    o = run.new("background", key_name)
    o.max_cost = 64 * PRICE_IN + 200 * PRICE_OUT
    res: dict[str, Any] = {}
    c = await Client.connect(
        run.stack.cluster.urls(1 % cfg.nodes), api_key=secret, error_cb=quiet_errors
    )
    try:
        r = await retrying(
            "background create",
            lambda: c.background_response(cfg.model, "nemesis background", max_output_tokens=200),
        )
        res["id"] = r["id"]
        deadline = time.monotonic() + cfg.duration_s + 180
        while True:
            try:
                cur = await c.get_response(r["id"])
            except Exception as exc:
                if not getattr(exc, "retryable", False) or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
                continue
            if cur["status"] not in ("queued", "in_progress"):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"still {cur['status']}")
            await asyncio.sleep(0.5)
        res["status"] = cur["status"]
        usage = cur.get("usage") or {}
        o.prompt_tokens = int(usage.get("input_tokens", 0))
        o.completion_tokens = int(usage.get("output_tokens", 0))
        # incomplete: it ended at max_output_tokens, an answer like any other.
        o.status = "ok" if cur["status"] in ("completed", "incomplete") else "error"
        o.error = "" if o.status == "ok" else str(cur.get("error") or cur["status"])
    except Exception as exc:
        res["error"] = repr(exc)
        o.status, o.error = "error", repr(exc)[:200]
    finally:
        o.t1 = run.now()
        with contextlib.suppress(Exception):
            await c.close()
    return res


async def key_creator(run: Run) -> None:
    """A key created every second or so; the ids of those acknowledged are kept."""
    i = 0
    while time.monotonic() < run.stop_at:
        i += 1
        try:
            async with asyncio.timeout(10):
                _, key_id = await create_key(run.stack.cluster, f"nemesis-made-{i}")
            run.acked_keys.append(key_id)
        except Exception:
            pass  # not acknowledged: nothing is promised about it
        await asyncio.sleep(1.0)
