"""The request bodies of a ``tokenbus bench`` run (``--prompt``, ``--prompts FILE``,
``--prompt-words``, ``--prompt-bytes``, ``--max-tokens[-std]``, ``--extra-body``, ``--api``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tokenbus.evaluation.bench_requests import MESSAGES_API

_WORDS = [
    "engine", "batch", "token", "latency", "request", "replica", "router", "stream", "queue",
    "cache", "prefix", "model", "gateway", "throughput", "schedule", "sequence", "decode",
    "prefill", "tensor", "parallel", "memory",
]  # fmt: skip


class RequestMaker:
    """Request bodies for a run: a fixed prompt, prompts from a file in turn, or generated
    prompts of a sampled length; output length fixed or sampled."""

    def __init__(self, a: argparse.Namespace) -> None:
        import random

        self.a = a
        self.rng = random.Random(getattr(a, "seed", 0))
        self.items: list[dict[str, Any]] = []
        if getattr(a, "prompts", None):
            self.items = load_prompts(a.prompts)
        self.i = 0
        self.extra = extra_body(getattr(a, "extra_body", None))
        self._sized = ""

    def _messages(self) -> list[dict[str, Any]]:
        a = self.a
        size = getattr(a, "prompt_bytes_now", 0)
        if size:  # the prompt-size axis: words up to exactly ``size`` bytes, made once
            if len(self._sized) != size:
                words = " ".join(self.rng.choice(_WORDS) for _ in range(size // 4 + 1))
                self._sized = words[:size]
            return [{"role": "user", "content": self._sized}]
        if self.items:
            item = self.items[self.i % len(self.items)]
            self.i += 1
            if "messages" in item:
                return list(item["messages"])
            return [{"role": "user", "content": str(item["prompt"])}]
        if getattr(a, "prompt_words", None):
            mean, _, std = str(a.prompt_words).partition(":")
            n = max(1, round(self.rng.gauss(float(mean), float(std or 0))))
            words = " ".join(self.rng.choice(_WORDS) for _ in range(n))
            return [{"role": "user", "content": words}]
        return [{"role": "user", "content": a.prompt}]

    def next(self) -> dict[str, Any]:
        a = self.a
        max_tokens = a.max_tokens
        if getattr(a, "max_tokens_std", 0):
            max_tokens = max(1, round(self.rng.gauss(a.max_tokens, a.max_tokens_std)))
        # Every answer runs to its length (vLLM's ignore_eos, which the sim honours too), so
        # a level's tokens are what it asked for; --extra-body '{"ignore_eos": false}' lets
        # answers end on their own.
        fixed = {"ignore_eos": True}
        if getattr(a, "api", "chat") == "messages":
            return {
                **fixed,
                **self.extra,
                MESSAGES_API: True,
                "model": a.model,
                "messages": self._messages(),
                "max_tokens": max_tokens,
                "stream": True,
            }
        if getattr(a, "api", "chat") == "responses":
            return {
                **fixed,
                **self.extra,
                "model": a.model,
                "input": self._messages(),
                "max_output_tokens": max_tokens,
                "stream": True,
            }
        return {
            **fixed,
            **self.extra,
            "model": a.model,
            "messages": self._messages(),
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }


def extra_body(value: str | None) -> dict[str, Any]:
    """``--extra-body``: a JSON object given inline or as ``@FILE``."""
    if not value:
        return {}
    text = Path(value[1:]).read_text() if value.startswith("@") else value
    obj = json.loads(text)
    if not isinstance(obj, dict):
        raise SystemExit("--extra-body must be a JSON object")
    return obj


def load_prompts(path: str) -> list[dict[str, Any]]:
    from services.datafiles import read_lines

    items: list[dict[str, Any]] = []
    try:
        for n, row in read_lines(path):
            if isinstance(row, str):
                items.append({"prompt": row})
            elif isinstance(row.get("messages"), list) or isinstance(row.get("prompt"), str):
                items.append(row)
            else:
                raise SystemExit(f'{path}:{n}: needs "prompt" or "messages"')
    except (OSError, ValueError) as exc:
        raise SystemExit(str(exc)) from None
    if not items:
        raise SystemExit(f"{path}: no prompts")
    return items


def prompt_sizes(a: argparse.Namespace) -> list[int]:
    """The sizes of ``--prompt-bytes``, or none."""
    raw = getattr(a, "prompt_bytes", None) or ""
    return [int(x) for x in str(raw).split(",") if x.strip()]
