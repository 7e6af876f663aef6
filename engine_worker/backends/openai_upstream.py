"""The ``openai`` backend: forwards to an OpenAI-compatible server (vllm serve, SGLang, TGI,
llama.cpp server, Ollama, or tokenbus' own ``serve openai-http``) and streams its answer.

Closing the stream closes the upstream HTTP response, which is how those servers learn that
the client went away and abort the generation.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from typing import Any

import aiohttp

from bus_schemas import errors as E
from engine_worker.backends.base import Delta, GenerationRequest
from services.config import WorkerSettings


class OpenAIUpstreamBackend:
    """Streams from ``upstream_url`` with the OpenAI API."""

    name = "openai"

    def __init__(self, cfg: WorkerSettings) -> None:
        up = cfg.openai
        if not up.upstream_url:
            raise ValueError("the openai backend needs --upstream-url (e.g. http://host:8000/v1)")
        self.base = up.upstream_url.rstrip("/")
        self.model = up.upstream_model or cfg.model
        self.api_key = up.api_key
        self.timeout = up.timeout_s
        self.session: aiohttp.ClientSession | None = None
        self.in_flight = 0

    async def start(self) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self.session = aiohttp.ClientSession(
            headers=headers,
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=self.timeout, sock_connect=10),
        )

    async def stop(self) -> None:
        if self.session is not None:
            await self.session.close()

    def stats(self) -> dict[str, Any]:
        return {"running": self.in_flight, "waiting": 0, "kv_usage": 0.0}

    def _body(self, req: GenerationRequest) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": max(1, req.remaining_tokens),
            "temperature": req.temperature,
            "top_p": req.top_p,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if req.seed is not None:
            body["seed"] = req.seed
        if req.stop:
            body["stop"] = req.stop
        if req.messages is not None:
            body["messages"] = req.messages
            if req.resume_text:
                # Migration: continue the assistant's reply (vLLM's and others' extension).
                body["messages"] = [
                    *req.messages,
                    {"role": "assistant", "content": req.resume_text},
                ]
                body["continue_final_message"] = True
                body["add_generation_prompt"] = False
            return "/chat/completions", body
        body["prompt"] = (req.prompt or "") + req.resume_text
        return "/completions", body

    def generate(self, req: GenerationRequest) -> AsyncGenerator[Delta, None]:
        return self._generate(req)

    async def _generate(self, req: GenerationRequest) -> AsyncGenerator[Delta, None]:
        if self.session is None:
            raise E.EngineError("the openai backend is not started")
        path, body = self._body(req)
        self.in_flight += 1
        finish: str | None = None
        usage: dict[str, Any] = {}
        produced = 0
        try:
            async with self.session.post(self.base + path, json=body) as resp:
                if resp.status != 200:
                    text = (await resp.text())[:300]
                    if resp.status in (400, 404, 413, 422):
                        raise E.InvalidRequest(f"the upstream refused the request: {text}")
                    raise E.EngineError(f"the upstream answered {resp.status}: {text}")
                async for raw in resp.content:
                    if not raw.startswith(b"data:"):
                        continue
                    payload = raw[5:].strip()
                    if payload == b"[DONE]":
                        break
                    obj = json.loads(payload)
                    if obj.get("usage"):
                        usage = obj["usage"]
                    for ch in obj.get("choices") or ():
                        text = ch.get("text")
                        if text is None:
                            text = (ch.get("delta") or {}).get("content") or ""
                        if ch.get("finish_reason"):
                            finish = ch["finish_reason"]
                        if text:
                            produced += 1
                            yield Delta(text, 1)
        except aiohttp.ClientError as exc:
            raise E.EngineError(f"the upstream failed: {type(exc).__name__}: {exc}") from None
        finally:
            self.in_flight -= 1
        completion = int(usage.get("completion_tokens") or produced)
        reason = finish if finish in ("stop", "length", "content_filter") else "stop"
        yield Delta("", 0, reason, int(usage.get("prompt_tokens") or 0), completion)
