"""One measured request of ``tokenbus bench``: a streamed chat completion, Responses or
Messages API request over HTTP or over NATS, timed token by token (:class:`Result`), and the
thing measured (:class:`Target`)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Result:
    ok: bool
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    tbt_s: float | None = None
    tokens: int = 0
    error: str = ""
    text: str = ""  # the answer (kept for multi-turn sessions only)
    t_end: float = 0.0  # time.time() when it ended
    # Seconds between consecutive events that carried text (the inter-token latency as a
    # client sees it: an event holding several tokens is one arrival).
    gaps_s: list[float] = field(default_factory=list)
    # Over HTTP: the replica that served (``x-tokenbus-replica``), and the usage's prompt
    # tokens and cached prompt tokens (0 when the answer carried no usage).
    replica: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class Target:
    """One thing to measure: an HTTP base URL or the NATS client."""

    name: str
    mode: str  # http | nats
    url: str
    pids: dict[str, int] = field(default_factory=dict)
    api_key: str | None = None
    login: dict[str, Any] = field(default_factory=dict)


# -- one request ------------------------------------------------------------------------------
# Marks a body of the Messages API (RequestMaker), taken off before it is sent.
MESSAGES_API = "__messages_api"

# What one SSE event's data says: (text of a token or None, the answer's output tokens or
# None, an error code or None, whether the answer is over).
Event = tuple[str | None, int | None, str | None, bool]


def _chat_event(obj: dict[str, Any]) -> Event:
    if "error" in obj:
        return None, None, str(obj["error"].get("code")), True
    usage = obj.get("usage")
    tokens = int(usage.get("completion_tokens", 0)) if usage else None
    text = "".join((ch.get("delta") or {}).get("content") or "" for ch in obj.get("choices") or ())
    return text or None, tokens, None, False


def _responses_event(obj: dict[str, Any]) -> Event:
    kind = obj.get("type")
    if kind == "response.output_text.delta":
        return obj.get("delta") or "", None, None, False
    if kind in ("response.completed", "response.incomplete", "response.failed"):
        resp = obj["response"]
        if kind == "response.failed":
            return None, None, str((resp.get("error") or {}).get("code")), True
        return None, int((resp.get("usage") or {}).get("output_tokens", 0)), None, True
    return None, None, None, False


def _messages_event(obj: dict[str, Any]) -> Event:
    kind = obj.get("type")
    delta = obj.get("delta") or {}
    if kind == "content_block_delta" and delta.get("type") == "text_delta":
        return delta.get("text") or "", None, None, False
    if kind == "message_delta":
        return None, int((obj.get("usage") or {}).get("output_tokens", 0)), None, False
    if kind == "error":
        return None, None, str((obj.get("error") or {}).get("type")), True
    return None, None, None, kind == "message_stop"


class _Timing:
    """A streamed answer's tokens as they come: the first's and last's times, the text."""

    def __init__(self, keep_text: bool) -> None:
        self.t0 = time.perf_counter()
        self.first = self.last = 0.0
        self.tokens = self.chunks = 0
        self.keep_text = keep_text
        self.parts: list[str] = []
        self.gaps: list[float] = []
        self.prompt = self.cached = 0  # the usage's prompt tokens and cached ones
        self.replica = ""  # the replica that served (``x-tokenbus-replica``)

    def event(self, ev: Event) -> str | None:
        """Take one event; its error, if any."""
        piece, n, error, _ = ev
        if n is not None:
            self.tokens = n
        if piece:
            if self.keep_text:
                self.parts.append(piece)
            now = time.perf_counter()
            if self.last:
                self.gaps.append(now - self.last)
            self.first = self.first or now
            self.last = now
            self.chunks += 1
        return error

    def usage(self, obj: dict[str, Any]) -> None:
        """Take the prompt tokens and cached ones of a chat chunk's usage, if it has one."""
        usage = obj.get("usage")
        if isinstance(usage, dict) and "prompt_tokens" in usage:
            details = usage.get("prompt_tokens_details") or {}
            self.prompt = int(usage.get("prompt_tokens") or 0)
            self.cached = int(details.get("cached_tokens") or 0)

    def result(self) -> Result:
        end = time.perf_counter()
        if not self.first:
            return Result(False, error="no_tokens")
        tokens = self.tokens or self.chunks
        tbt = (self.last - self.first) / (tokens - 1) if tokens > 1 else None
        return Result(
            True,
            self.first - self.t0,
            end - self.t0,
            tbt,
            tokens,
            text="".join(self.parts),
            t_end=time.time(),
            gaps_s=self.gaps,
            replica=self.replica,
            prompt_tokens=self.prompt,
            cached_tokens=self.cached,
        )


async def http_request(
    session: Any, url: str, body: dict[str, Any], timeout: float, keep_text: bool = False
) -> Result:
    """One streamed request: a chat completion, a Responses request (a body with
    ``input``: a token is an ``output_text.delta`` event) or a Messages API one (marked
    :data:`MESSAGES_API`: a token is a ``text_delta``)."""
    if "input" in body:
        path, read = "/responses", _responses_event
    elif body.get(MESSAGES_API):
        path, read = "/messages", _messages_event
        body = {k: v for k, v in body.items() if k != MESSAGES_API}
    else:
        path, read = "/chat/completions", _chat_event
    timing = _Timing(keep_text)
    try:
        async with asyncio.timeout(timeout):
            async with session.post(url + path, json=body) as resp:
                if resp.status != 200:
                    text = await resp.text()
                    return Result(False, error=f"http_{resp.status}:{text[:120]}")
                timing.replica = resp.headers.get("x-tokenbus-replica", "")
                async for raw in resp.content:
                    if not raw.startswith(b"data: "):
                        continue
                    payload = raw[6:].strip()
                    if payload == b"[DONE]":
                        break
                    obj = json.loads(payload)
                    ev = read(obj)
                    if (error := timing.event(ev)) is not None:
                        return Result(False, error=error)
                    timing.usage(obj)
                    if ev[3]:
                        break
    except TimeoutError:
        return Result(False, error="timeout")
    except Exception as exc:
        return Result(False, error=type(exc).__name__)
    return timing.result()


async def nats_request(
    client: Any,
    body: dict[str, Any],
    timeout: float,
    api_key: str | None = None,
    keep_text: bool = False,
) -> Result:
    from bus_schemas.errors import TokenbusError

    if "input" in body or body.get(MESSAGES_API):
        return await nats_events_request(client, body, timeout, api_key, keep_text)
    t0 = time.perf_counter()
    first = last = 0.0
    parts: list[str] = []
    gaps: list[float] = []
    stream = client.submit("chat", body, timeout=timeout, api_key=api_key)
    try:
        async for ch in stream:
            if keep_text:
                parts.append(ch.text)
            now = time.perf_counter()
            if not first:
                first = now
            elif ch.text:
                gaps.append(now - last)
            last = now
    except TokenbusError as exc:
        return Result(False, error=exc.code)
    finally:
        await stream.aclose()
    end = time.perf_counter()
    if not first:
        return Result(False, error="no_tokens")
    tokens = stream.usage.completion_tokens if stream.usage else 0
    tbt = (last - first) / (tokens - 1) if tokens > 1 else None
    return Result(
        True, first - t0, end - t0, tbt, tokens, text="".join(parts), t_end=time.time(), gaps_s=gaps
    )


async def nats_events_request(
    client: Any,
    body: dict[str, Any],
    timeout: float,
    api_key: str | None = None,
    keep_text: bool = False,
) -> Result:
    """One Responses (``Client.responses``) or Messages API (``Client.messages``) request
    over NATS: the same events as over HTTP."""
    from bus_schemas.errors import TokenbusError

    timing = _Timing(keep_text)
    given = "input" if "input" in body else "messages"
    params = {k: v for k, v in body.items() if k not in ("model", given, "stream", MESSAGES_API)}
    call, read = (
        (client.responses, _responses_event)
        if given == "input"
        else (client.messages, _messages_event)
    )
    try:
        events = call(body["model"], body[given], timeout=timeout, api_key=api_key, **params)
        async for ev in events:
            if (error := timing.event(read(ev))) is not None:
                return Result(False, error=error)
    except TokenbusError as exc:
        return Result(False, error=exc.code)
    return timing.result()
