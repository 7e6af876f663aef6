"""A stand-in for vLLM's v1 ``AsyncLLM`` that runs without a GPU, torch or vllm.

It mirrors the parts of vLLM's public interface that :mod:`engine_worker.backends.vllm_backend`
uses, with vLLM's own names, so a test that passes here exercises the same calls the real
engine receives:

* ``vllm/v1/engine/async_llm.py``: ``AsyncLLM.generate(prompt, sampling_params, request_id)``
  is an async generator of ``RequestOutput``; ``abort(request_id, internal=False)`` is a
  coroutine; ``shutdown()`` and ``get_tokenizer()`` are plain methods (older releases made
  ``get_tokenizer`` a coroutine: ``async_get_tokenizer=True`` imitates them). Like the real
  one, ``generate`` aborts the request itself when it is closed or cancelled (``internal=True``).
* ``vllm/outputs.py``: ``RequestOutput`` (request_id, prompt, prompt_token_ids, outputs,
  finished, ...) and ``CompletionOutput`` (index, text, token_ids, cumulative_logprob,
  logprobs, finish_reason, stop_reason).
* ``vllm/sampling_params.py``: ``SamplingParams`` (n, temperature, top_p, seed, stop,
  max_tokens, include_stop_str_in_output, output_kind) and ``RequestOutputKind``
  (CUMULATIVE, DELTA, FINAL_ONLY).
* ``vllm/v1/engine/__init__.py``: finish reasons are "stop", "length", "abort", "error".
* ``vllm/v1/metrics/stats.py``: ``SchedulerStats`` (num_running_reqs, num_waiting_reqs,
  kv_cache_usage).

Behaviour copied on purpose: stop strings end the request with finish_reason "stop", the
stop string is left out of the text, and text that could still become a stop string is held
back (vLLM's ``output_text_buffer_length``); DELTA outputs carry only new text and token ids.
"""

from __future__ import annotations

import asyncio
import re
import zlib
from collections.abc import AsyncGenerator, Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

WORDS = (
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
    "november",
    "oscar",
    "papa",
    "quebec",
    "romeo",
    "sierra",
    "tango",
    "uniform",
    "victor",
    "whiskey",
    "xray",
    "yankee",
    "zulu",
)

BOS_ID = 1


# -- vllm/sampling_params.py ----------------------------------------------------------------
class RequestOutputKind(Enum):
    """How much of the output each ``RequestOutput`` carries (same members as vLLM)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """The subset of vLLM's ``SamplingParams`` fields the backend sets, with its defaults."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    max_tokens: int | None = 16
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        # vLLM normalises ``stop`` to a list and rejects bad values with ValueError.
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")

    @property
    def output_text_buffer_length(self) -> int:
        """Characters held back so a partial stop string is never sent (as vLLM does)."""
        if self.stop and not self.include_stop_str_in_output:
            return max(len(s) for s in self.stop) - 1
        return 0


# -- vllm/outputs.py ------------------------------------------------------------------------
@dataclass
class CompletionOutput:
    """One completion of a request (vLLM's field names and order)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: Any = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One step of a request's output (vLLM's attribute names)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: Any
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int | None = None


# -- vllm/v1/metrics/stats.py ---------------------------------------------------------------
@dataclass
class SchedulerStats:
    """What vLLM's stat loggers receive each engine step (subset)."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0


# -- vllm/v1/engine/exceptions.py -----------------------------------------------------------
class EngineGenerateError(Exception):
    """Raised by ``AsyncLLM.generate`` for an unexpected failure (recoverable)."""


class EngineDeadError(Exception):
    """Raised when the engine core process has died (unrecoverable)."""


# -- tokenizer ------------------------------------------------------------------------------
class FakeTokenizer:
    """A whitespace tokenizer with an HF-style ``apply_chat_template``."""

    bos_token = "<s>"

    def __init__(self, chat_template: str | None = "fake-template") -> None:
        self.chat_template = chat_template
        self.template_calls: list[dict[str, Any]] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [2 + zlib.crc32(piece.encode()) % 31_000 for piece in re.findall(r"\S+\s*", text)]
        return [BOS_ID, *ids] if add_special_tokens else ids

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        if self.chat_template is None:
            # transformers raises ValueError when there is no template.
            raise ValueError("tokenizer.chat_template is not set")
        self.template_calls.append(
            {
                "conversation": conversation,
                "tokenize": tokenize,
                "add_generation_prompt": add_generation_prompt,
            }
        )
        text = self.bos_token + "".join(
            f"[{m['role']}] {m.get('content') or ''}\n" for m in conversation
        )
        if add_generation_prompt:
            text += "[assistant]"
        return self.encode(text, add_special_tokens=False) if tokenize else text


def expected_words(prompt_token_ids: list[int], seed: int | None, n: int) -> list[str]:
    """The pieces the fake engine generates for a prompt (tests use it to predict text)."""
    start = zlib.crc32(f"{seed}|{prompt_token_ids}".encode())
    return [" " + WORDS[(start + i * 7) % len(WORDS)] for i in range(n)]


# -- vllm/v1/engine/async_llm.py ------------------------------------------------------------
@dataclass
class FakeAsyncLLM:
    """Generates deterministic words one token at a time, with AsyncLLM's interface.

    ``fail_after`` makes ``generate`` raise ``error`` (default :class:`EngineGenerateError`)
    after that many tokens; ``finish_with`` forces the final finish_reason (e.g. "error").
    """

    engine_args: dict[str, Any] = field(default_factory=dict)
    tokenizer: FakeTokenizer = field(default_factory=FakeTokenizer)
    token_delay: float = 0.001
    fail_after: int | None = None
    error: BaseException | None = None
    finish_with: str | None = None
    async_get_tokenizer: bool = False
    aborted: list[str] = field(default_factory=list)
    external_aborts: list[str] = field(default_factory=list)
    requests: list[tuple[Any, SamplingParams, str]] = field(default_factory=list)
    running: set[str] = field(default_factory=set)
    shut_down: bool = False

    @property
    def errored(self) -> bool:
        return self.shut_down

    def get_tokenizer(self) -> Any:
        if self.async_get_tokenizer:

            async def _tok() -> FakeTokenizer:
                return self.tokenizer

            return _tok()
        return self.tokenizer

    async def abort(self, request_id: str | Iterable[str], internal: bool = False) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self.aborted.extend(ids)
        if not internal:
            self.external_aborts.extend(ids)
        for rid in ids:
            self.running.discard(rid)

    def shutdown(self, timeout: float | None = None) -> None:
        self.shut_down = True

    async def generate(
        self, prompt: Any, sampling_params: SamplingParams, request_id: str, **kwargs: Any
    ) -> AsyncGenerator[RequestOutput, None]:
        if self.shut_down:
            raise EngineDeadError("EngineCore encountered an issue.")
        if request_id in self.running:
            raise ValueError(f"Request id {request_id} already running.")
        if isinstance(prompt, str):
            text_prompt: str | None = prompt
            prompt_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text_prompt = None
            prompt_ids = list(prompt["prompt_token_ids"])
        else:
            raise ValueError(f"unsupported prompt: {prompt!r}")
        self.requests.append((prompt, sampling_params, request_id))
        self.running.add(request_id)
        sp = sampling_params
        max_tokens = sp.max_tokens or 16
        stops = list(sp.stop or [])
        hold = sp.output_text_buffer_length
        kind = sp.output_kind
        words = expected_words(prompt_ids, sp.seed, max_tokens)
        text = ""
        ids: list[int] = []
        sent_chars = 0
        sent_ids = 0
        try:
            for i, word in enumerate(words):
                await asyncio.sleep(self.token_delay)
                if request_id not in self.running:
                    # Aborted by someone else: the request ends with finish_reason "abort".
                    yield self._output(
                        request_id,
                        text_prompt,
                        prompt_ids,
                        text[sent_chars:],
                        ids[sent_ids:],
                        "abort",
                        None,
                        kind,
                        text,
                        ids,
                    )
                    return
                if self.fail_after is not None and i >= self.fail_after:
                    raise self.error or EngineGenerateError()
                text += word
                ids.append(2 + zlib.crc32(word.encode()) % 31_000)
                reason: str | None = None
                stop_reason: str | None = None
                for s in stops:
                    k = text.find(s)
                    if k >= 0:
                        text = text if sp.include_stop_str_in_output else text[:k]
                        reason, stop_reason = "stop", s
                        break
                if reason is None and len(ids) >= max_tokens:
                    reason = "length"
                if reason is not None and self.finish_with is not None:
                    reason = self.finish_with
                finished = reason is not None
                upto = len(text) if finished else max(sent_chars, len(text) - hold)
                if kind is RequestOutputKind.FINAL_ONLY and not finished:
                    continue
                if kind is RequestOutputKind.DELTA:
                    out_text, out_ids = text[sent_chars:upto], ids[sent_ids:]
                else:
                    out_text, out_ids = text[:upto], list(ids)
                sent_chars, sent_ids = upto, len(ids)
                yield self._output(
                    request_id,
                    text_prompt,
                    prompt_ids,
                    out_text,
                    out_ids,
                    reason,
                    stop_reason,
                    kind,
                    text,
                    ids,
                )
                if finished:
                    return
        except (asyncio.CancelledError, GeneratorExit):
            # vLLM's AsyncLLM.generate aborts the request itself when its consumer leaves.
            await self.abort(request_id, internal=True)
            raise
        finally:
            self.running.discard(request_id)

    @staticmethod
    def _output(
        request_id: str,
        prompt: str | None,
        prompt_ids: list[int],
        text: str,
        ids: list[int],
        reason: str | None,
        stop_reason: str | None,
        kind: RequestOutputKind,
        full_text: str,
        full_ids: list[int],
    ) -> RequestOutput:
        if kind is RequestOutputKind.FINAL_ONLY:
            text, ids = full_text, list(full_ids)
        return RequestOutput(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_ids,
            prompt_logprobs=None,
            outputs=[
                CompletionOutput(
                    index=0, text=text, token_ids=ids, finish_reason=reason, stop_reason=stop_reason
                )
            ],
            finished=reason is not None,
        )
