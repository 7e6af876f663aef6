"""A scripted vLLM engine core: vLLM's own front end on a machine without a GPU.

``AsyncLLM`` talks to its engine core through one object, the engine-core client that
``EngineCoreClient.make_async_mp_client`` returns (normally a ZMQ link to the engine-core
process that schedules and runs the model). :func:`install` replaces that factory with
:class:`ScriptedCoreClient`, which takes vLLM's real ``EngineCoreRequest`` objects and answers
with real ``EngineCoreOutputs`` on a clock. Everything on the other side of that boundary is
vLLM's own code: the serve argument parser, ``AsyncEngineArgs``, the renderer and chat
templates, tokenisation, sampling-parameter validation, the output processor
(detokenisation, stop strings, logprobs), the tool and reasoning parsers and the OpenAI
serving classes. Only the GPU's work (scheduling and sampling) is scripted.

The clock is the sim's (:mod:`engine_worker.backends.sim`): at most ``max_running``
sequences run at once; an admitted one's first token comes after ``prefill_ms +
prefill_ms_per_token * uncached prompt tokens``; running ones advance together, one token each, in
steps of ``decode_ms + decode_ms_per_seq * batch`` (tensor parallelism scales both as the sim
does). Tokens are drawn deterministically from the tokenizer's vocabulary (only ids that
decode to printable text on their own): each is a hash of the request's seed and the last
:data:`TAIL_CHARS` characters of the text so far (prompt, then output), so a request resumed
on another replica with the text already sent at the end of its prompt goes on with the same
tokens. A :class:`Script` whose marker occurs in the decoded prompt names the exact text to
emit instead (a ``<tool_call>`` for vLLM's hermes parser, a ``<think>`` block for a reasoning
parser), which then ends with the end-of-sequence token. A request finishes as vLLM's
scheduler finishes it: end-of-sequence (unless ``ignore_eos``), a stop token id,
``max_tokens``, the model's context, or an abort.

With vLLM's prefix caching on (its default) and ``kv_cache_blocks`` above 0, the core keeps
a paged prefix cache (:class:`engine_worker.kvcache.KVCache`, the sim's model of vLLM's
``BlockPool``) whose blocks are named by vLLM's own block hashes (``hash_block_tokens`` with
the configured ``prefix_caching_hash_algo``, after ``init_none_hash`` as the engine core
does), reports a prompt's cached tokens as vLLM's scheduler does (``prefill_stats``, so
``usage.prompt_tokens_details.cached_tokens``), and, with ``kv_events_config`` on, publishes
``BlockStored``/``BlockRemoved``/``AllBlocksCleared`` through vLLM's own
``EventPublisherFactory`` (its ZMQ publisher): what a tokenbus vllm worker subscribes to.

It lives in the project, not under ``tests/``, because ``tokenbus serve worker --backend
vllm`` must be able to use it: the deployment-shape benchmark runs vLLM's front end on it,
and users without a GPU can try the vllm path with it. :func:`build_checkpoint` writes the
tiny local checkpoint it runs on (a config and a tokenizer, no weights).

vLLM (and ``tokenizers``) are imported only when a client is built or a checkpoint written,
so importing this module needs neither. docs/vllm.md says how to run it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import time
import uuid
import zlib
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from statistics import NormalDist
from typing import Any

from pydantic import BaseModel, Field

from engine_worker.backends.base import (
    asks_handover,
    kv_handover,
    kv_transfer_s,
    reads_remote_prompt,
)

__all__ = [
    "ENV",
    "Script",
    "ScriptedCoreClient",
    "ScriptedCoreSettings",
    "build_checkpoint",
    "install",
    "installed",
    "register",
    "uninstall",
]

# JSON of ScriptedCoreSettings: when set, register() (a vLLM general plugin) installs the core.
ENV = "TOKENBUS_VLLM_SCRIPTED_CORE"

# Special tokens of the tiny checkpoint. The tool-call and think markers are not "special"
# (vLLM must not skip them when detokenising: its parsers look for them in the text).
_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_MARKERS = ("<tool_call>", "</tool_call>", "<think>", "</think>")

# A Qwen-style chat template with tools (what hermes-format models ship).
CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call tools:\n<tools>\n"
    "{%- for t in tools %}{{ t | tojson }}\n{%- endfor %}</tools><|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{%- if m['content'] is string %}{{ m['content'] }}{%- endif %}"
    "{%- if m.tool_calls is defined and m.tool_calls %}{%- for tc in m.tool_calls %}"
    "<tool_call>\n{{ {'name': tc.function.name, 'arguments': tc.function.arguments} | tojson }}"
    "\n</tool_call>{%- endfor %}{%- endif %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)

_CORPUS = (
    "Hello world, the quick brown fox jumps over the lazy dog while tokens stream through nats.",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    "system user assistant tool You are a helpful assistant. Let me think about it.",
)

_NORMAL = NormalDist()

# How much of the text so far chooses the next unscripted token.
TAIL_CHARS = 16


class Script(BaseModel):
    """Fixed output for prompts that contain ``marker`` (in their decoded text)."""

    marker: str = Field(description="A substring of the decoded prompt that selects this script.")
    text: str = Field(description="The exact text to emit, tokenised with the model's tokenizer.")


class ScriptedCoreSettings(BaseModel):
    """The scripted core's clock (the sim's parameters, same names) and its scripts."""

    prefill_ms: float = Field(default=20.0, ge=0, description="Base prefill (first token) time.")
    prefill_ms_per_token: float = Field(default=0.0, ge=0, description="Per prompt token.")
    decode_ms: float = Field(default=10.0, ge=0, description="Decode step time at batch 1.")
    decode_ms_per_seq: float = Field(default=0.0, ge=0, description="Per running sequence.")
    max_running: int = Field(default=256, ge=1, description="Max sequences in the batch.")
    tp_comm_ms: float = Field(default=0.0, ge=0, description="All-reduce cost per step (tp>1).")
    tp_efficiency: float = Field(default=0.9, gt=0, le=1, description="Scaling per extra GPU.")
    answer_tokens_median: int = Field(
        default=0,
        ge=0,
        description="Unscripted answers end with end-of-sequence after a log-normal length "
        "with this median (per prompt and seed, as the sim draws it); 0: run to max_tokens.",
    )
    answer_tokens_sigma: float = Field(default=0.9, ge=0, description="Spread (natural log).")
    answer_tokens_min: int = Field(default=8, ge=1, description="Shortest natural answer.")
    kv_cache_blocks: int = Field(
        default=16384,
        ge=0,
        description="Blocks in the prefix cache (vLLM's block size); 0: no prefix cache.",
    )
    kv_bytes_per_token: int = Field(
        default=131072, ge=1, description="KV cache bytes a prompt token takes (the sim's)."
    )
    kv_link_gb_per_s: float = Field(
        default=25.0, gt=0, description="The KV transfer's bandwidth (prefill/decode)."
    )
    scripts: list[Script] = Field(default_factory=list, description="First match wins.")

    @classmethod
    def from_env(cls) -> ScriptedCoreSettings | None:
        """The settings in ``$TOKENBUS_VLLM_SCRIPTED_CORE`` (JSON; ``1``: defaults), or None."""
        raw = os.environ.get(ENV, "").strip()
        if not raw or raw == "0":
            return None
        return cls() if raw == "1" else cls.model_validate_json(raw)


@dataclass
class _Seq:
    """One request in the scripted core."""

    rid: str
    prompt_len: int
    max_tokens: int
    eos: int | None
    stops: frozenset[int]
    min_tokens: int
    logprobs: int | None
    seed: str
    tail: str
    script: list[int] | None
    natural: int | None
    # A pooling (embedding) request: answered once, after its prefill, with a vector.
    pool: list[int] | None = None
    # The prompt's ids and its full blocks' vLLM hashes (prefix cache on), its blocks.
    ids: list[int] = field(default_factory=list)
    hashes: list[Any] = field(default_factory=list)
    lease: Any = None
    cached: int = 0  # prompt tokens read from the cache
    emitted: int = 0
    ready_at: float = 0.0
    done: bool = False
    # vLLM's kv_transfer_params (prefill/decode disaggregation), as a KV connector reads them
    # from the request: hand the prompt's blocks over at the end, or read them from there.
    kvt: dict[str, Any] | None = None


@dataclass
class _Record:
    """What the core saw, for tests: requests added and aborted (vLLM's internal ids), and
    the LoRA adapters vLLM added (its ``LoRARequest`` objects; a request's adapter is its
    ``lora_request``)."""

    added: list[Any] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    loras: list[Any] = field(default_factory=list)


class ScriptedCoreClient:
    """Stands where vLLM's ``AsyncMPClient`` stands and answers ``AsyncLLM`` on a clock.

    ``added`` holds the ``EngineCoreRequest`` objects received, ``aborted`` the request ids
    vLLM aborted (a client that went away, a stop string matched in the front end).
    """

    def __init__(
        self, vllm_config: Any, settings: ScriptedCoreSettings, *, log_stats: bool = False
    ) -> None:
        from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason

        self._Output = EngineCoreOutput
        self.engine_id = uuid.uuid4().hex[:16]  # a prefill's hand-over names it
        self._Outputs = EngineCoreOutputs
        self._Finish = FinishReason
        self.vllm_config = vllm_config
        self.settings = settings
        self.log_stats = log_stats
        self.engine_ranks_managed = [0]
        self.resources = _Resources()
        self.record = _Record()
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        tp = int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)
        self._speedup = 1.0 + (tp - 1) * settings.tp_efficiency
        self._comm_s = settings.tp_comm_ms / 1000.0 if tp > 1 else 0.0
        self.tokenizer = _load_tokenizer(vllm_config)
        self.texts = printable_tokens(self.tokenizer)
        self.vocab = sorted(self.texts)
        self._scripts = [
            (s.marker, list(self.tokenizer.encode(s.text, add_special_tokens=False)))
            for s in settings.scripts
        ]
        self.waiting: deque[_Seq] = deque()
        self.prefilling: list[_Seq] = []
        self.cache = _PrefixCache.build(vllm_config, settings)
        self.running: list[_Seq] = []
        self._next_decode = 0.0
        self._queue: asyncio.Queue[Any] | None = None
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def added(self) -> list[Any]:
        """The ``EngineCoreRequest`` objects received, in order."""
        return self.record.added

    @property
    def aborted(self) -> list[str]:
        """The request ids vLLM aborted, in order."""
        return self.record.aborted

    # -- the clock (the sim's cost model) ----------------------------------------------------
    def prefill_s(self, prompt_tokens: int) -> float:
        """Time to the first token of a prompt of ``prompt_tokens`` tokens."""
        s = self.settings
        ms = s.prefill_ms + s.prefill_ms_per_token * prompt_tokens
        return ms / 1000.0 / self._speedup + self._comm_s

    def step_s(self, batch: int) -> float:
        """One decode step of ``batch`` running sequences."""
        s = self.settings
        return (s.decode_ms + s.decode_ms_per_seq * batch) / 1000.0 / self._speedup + self._comm_s

    def _ensure_loop(self) -> None:
        if self._task is None:
            self._queue = asyncio.Queue()
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        assert self._wake is not None and self._queue is not None
        try:
            while True:
                at = self._next_event()
                timeout = None if at is None else max(0.0, at - time.monotonic())
                if timeout is None or timeout > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), timeout)
                self._wake.clear()
                outputs = self._step(time.monotonic())
                if outputs:
                    self._queue.put_nowait(self._outputs(outputs))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # the front end must learn the core died
            self.resources.engine_dead = True
            self._queue.put_nowait(exc)
            raise

    def _next_event(self) -> float | None:
        at = math.inf
        if self.running:
            at = self._next_decode
        for s in self.prefilling:
            at = min(at, s.ready_at)
        return None if at == math.inf else at

    def _admit(self, now: float) -> None:
        while self.waiting and len(self.running) + len(self.prefilling) < self.settings.max_running:
            s = self.waiting.popleft()
            uncached = s.prompt_len
            if self.cache is not None and s.pool is None:
                s.lease = self.cache.acquire(s.hashes, s.prompt_len)
                s.cached = s.lease.cached_tokens
                uncached -= s.cached
            if reads_remote_prompt(s.kvt):
                # Read from the prefill replica over the link, not computed (NixlConnector).
                st = self.settings
                s.ready_at = now + kv_transfer_s(
                    uncached, st.kv_bytes_per_token, st.kv_link_gb_per_s
                )
            else:
                s.ready_at = now + self.prefill_s(uncached)
            self.prefilling.append(s)

    def _step(self, now: float) -> list[Any]:
        out: list[Any] = []
        cache = self.cache
        if self.running and now >= self._next_decode - 1e-4:
            for s in self.running:
                out.append(self._emit(s))
                if cache is not None and s.lease is not None:
                    cache.grow(s, s.prompt_len + s.emitted)
            self._release([s for s in self.running if s.done])
            self.running = [s for s in self.running if not s.done]
            self._next_decode = now + self.step_s(len(self.running))
        still: list[_Seq] = []
        for s in self.prefilling:
            if s.ready_at <= now + 1e-4:
                if cache is not None and s.lease is not None:
                    cache.commit(s)
                out.append(self._emit(s))
                if s.done:
                    self._release([s])
                else:
                    if not self.running:
                        self._next_decode = now + self.step_s(1)
                    self.running.append(s)
            else:
                still.append(s)
        self.prefilling = still
        self._admit(now)
        if cache is not None:
            cache.publish()
        return out

    def _release(self, done: list[_Seq]) -> None:
        """Finished or aborted sequences give their blocks back (cached ones stay cached)."""
        if self.cache is None:
            return
        for s in done:
            if s.lease is not None:
                self.cache.release(s.lease)
                s.lease = None

    def _outputs(self, outputs: list[Any]) -> Any:
        stats = None
        if self.log_stats:
            from vllm.v1.metrics.stats import SchedulerStats

            active = len(self.running) + len(self.prefilling)
            stats = SchedulerStats(
                num_running_reqs=active,
                num_waiting_reqs=len(self.waiting),
                kv_cache_usage=active / self.settings.max_running,
            )
        return self._Outputs(outputs=outputs, scheduler_stats=stats)

    # -- tokens ------------------------------------------------------------------------------
    def _next_token(self, s: _Seq) -> int:
        """What the sampler would pick: the script's next token; end-of-sequence once the
        script or the natural answer is over (not before ``min_tokens``, which vLLM's
        sampler enforces); else a token chosen by the seed and the text so far."""
        i = s.emitted
        if s.script is not None and i < len(s.script):
            return s.script[i]
        ended = s.script is not None or (s.natural is not None and i >= s.natural)
        if ended and s.eos is not None and i >= s.min_tokens:
            return s.eos
        return self.vocab[zlib.crc32((s.seed + s.tail).encode()) % len(self.vocab)]

    def output_ids(self, request: Any, n: int) -> list[int]:
        """The first ``n`` token ids this core emits for ``request`` (an
        ``EngineCoreRequest``), ignoring when it would finish (for tests)."""
        s = self._seq(request)
        out: list[int] = []
        for _ in range(n):
            tid = self._next_token(s)
            self._advance(s, tid)
            out.append(tid)
        return out

    def _advance(self, s: _Seq, tid: int) -> None:
        s.emitted += 1
        s.tail = (s.tail + self.texts.get(tid, ""))[-TAIL_CHARS:]

    def _emit(self, s: _Seq) -> Any:
        """The next token of ``s`` as an ``EngineCoreOutput``; finishes it as vLLM's
        scheduler would (its ``check_stop``). A pooling request's one output is its vector."""
        if s.pool is not None:
            s.done = True
            return self._Output(
                request_id=s.rid,
                new_token_ids=[],
                pooling_output=self._embedding(s.pool),
                finish_reason=self._Finish.STOP,
            )
        tid = self._next_token(s)
        self._advance(s, tid)
        finish = stop = None
        if s.eos is not None and tid == s.eos:
            finish = self._Finish.STOP
        elif tid in s.stops:
            finish, stop = self._Finish.STOP, tid
        if finish is None and (
            s.emitted >= s.max_tokens or s.prompt_len + s.emitted >= self.max_model_len
        ):
            finish = self._Finish.LENGTH
        handover = None
        if finish is not None:
            s.done = True
            if asks_handover(s.kvt):
                block = getattr(self.cache, "block_size", 16)
                handover = kv_handover(self.engine_id, s.prompt_len, block, 1, "scripted")
        return self._Output(
            request_id=s.rid,
            new_token_ids=[tid],
            new_logprobs=self._logprobs(tid, s.logprobs),
            finish_reason=finish,
            stop_reason=stop,
            kv_transfer_params=handover,
            prefill_stats=self._prefill_stats(s) if s.emitted == 1 else None,
        )

    def _prefill_stats(self, s: _Seq) -> Any:
        """What vLLM's scheduler reports of a prefill: its cached tokens become the usage's
        ``prompt_tokens_details.cached_tokens``."""
        if self.cache is None:
            return None
        from vllm.v1.metrics.stats import PrefillStats

        return PrefillStats(
            num_prompt_tokens=s.prompt_len,
            num_computed_tokens=s.prompt_len - s.cached,
            num_cached_tokens=s.cached,
            num_local_cached_tokens=s.cached,
        )

    def _embedding(self, ids: list[int]) -> Any:
        """A unit vector of ``hidden_size`` floats, a pure function of the prompt's ids (the
        pooled, normalised hidden state a model would give; equal prompts, equal vectors)."""
        import torch

        dim = int(self.vllm_config.model_config.get_hidden_size())
        seed = zlib.crc32(json.dumps(ids).encode())
        values = [math.sin(seed % 9973 + (i + 1) * (seed % 97 + 1) * 0.37) for i in range(dim)]
        norm = math.sqrt(sum(v * v for v in values)) or 1.0
        return torch.tensor([v / norm for v in values], dtype=torch.float32)

    def _logprobs(self, tid: int, k: int | None) -> Any:
        if k is None:
            return None
        import numpy as np
        from vllm.v1.outputs import LogprobsLists

        k = max(0, min(k, 20))
        others = [v for v in self.vocab[:64] if v != tid][:k]
        ids = np.array([[tid, *others]], dtype=np.int32)
        lps = np.array([[-0.25] + [-1.5 - j for j in range(len(others))]], dtype=np.float32)
        return LogprobsLists(ids, lps, np.array([1], dtype=np.int32))

    # -- what AsyncLLM calls -----------------------------------------------------------------
    async def add_request_async(self, request: Any) -> None:
        """Queue vLLM's ``EngineCoreRequest`` (generation, or pooling for embeddings)."""
        self._ensure_loop()
        self.record.added.append(request)
        self.waiting.append(self._seq(request))
        self._admit(time.monotonic())
        assert self._wake is not None
        self._wake.set()

    def _seq(self, request: Any) -> _Seq:
        sp = request.sampling_params
        ids = list(request.prompt_token_ids or ())
        if sp is None:
            if getattr(request, "pooling_params", None) is None:
                raise ValueError("a request with neither sampling nor pooling parameters")
            return _Seq(
                rid=request.request_id,
                prompt_len=len(ids),
                max_tokens=1,
                eos=None,
                stops=frozenset(),
                min_tokens=0,
                logprobs=None,
                seed="",
                tail="",
                script=None,
                natural=None,
                pool=ids,
            )
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        hashes = self.cache.hashes(ids) if self.cache is not None else []
        script = next((toks for marker, toks in self._scripts if marker in text), None)
        seed, tail = f"{sp.seed}|", text[-TAIL_CHARS:]
        natural = None
        if script is None and not sp.ignore_eos:
            natural = self._natural(zlib.crc32((seed + text).encode()))
        max_tokens = sp.max_tokens if sp.max_tokens is not None else self.max_model_len
        return _Seq(
            rid=request.request_id,
            prompt_len=len(ids),
            max_tokens=max(1, int(max_tokens)),
            eos=None if sp.ignore_eos else sp.eos_token_id,
            stops=frozenset(sp.stop_token_ids or ()),
            min_tokens=int(sp.min_tokens or 0),
            logprobs=sp.logprobs,
            seed=seed,
            tail=tail,
            script=script,
            natural=natural,
            ids=ids,
            hashes=hashes,
            kvt=(getattr(sp, "extra_args", None) or {}).get("kv_transfer_params"),
        )

    def _natural(self, start: int) -> int | None:
        s = self.settings
        if not s.answer_tokens_median:
            return None
        u = (zlib.crc32(start.to_bytes(4, "little") + b"len") + 0.5) / 2**32
        n = s.answer_tokens_median * math.exp(s.answer_tokens_sigma * _NORMAL.inv_cdf(u))
        return max(s.answer_tokens_min, round(n))

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        """Drop the requests; recorded in :attr:`aborted`."""
        gone = set(request_ids)
        self.record.aborted.extend(request_ids)
        self._release([s for s in (*self.prefilling, *self.running) if s.rid in gone])
        self.waiting = deque(s for s in self.waiting if s.rid not in gone)
        self.prefilling = [s for s in self.prefilling if s.rid not in gone]
        self.running = [s for s in self.running if s.rid not in gone]

    async def get_output_async(self) -> Any:
        """The next step's ``EngineCoreOutputs`` (waits for one)."""
        self._ensure_loop()
        assert self._queue is not None
        item = await self._queue.get()
        if isinstance(item, BaseException):
            from vllm.v1.engine.exceptions import EngineDeadError

            raise EngineDeadError() from item
        return item

    async def get_supported_tasks_async(self) -> tuple[str, ...]:
        """``embed`` for a pooling model (``runner=pooling``), else ``generate``."""
        if getattr(self.vllm_config.model_config, "runner_type", "generate") == "pooling":
            return ("embed",)
        return ("generate",)

    async def reset_mm_cache_async(self) -> None:
        """Nothing cached."""

    async def reset_prefix_cache_async(self, *args: Any, **kwargs: Any) -> bool:
        """Drop the prefix cache (False while a running sequence holds blocks, as vLLM)."""
        if self.cache is None:
            return True
        ok = self.cache.clear()
        self.cache.publish()
        return ok

    async def reset_encoder_cache_async(self) -> None:
        """Nothing cached."""

    async def is_sleeping_async(self) -> bool:
        """Never asleep."""
        return False

    async def list_loras_async(self) -> set[int]:
        """The adapters added and not removed. Their weights are never loaded: the output
        does not depend on the adapter."""
        return {lora.lora_int_id for lora in self.record.loras}

    async def add_lora_async(self, lora_request: Any) -> bool:
        """Recorded in ``record.loras`` (weights not loaded)."""
        self.record.loras = [
            lora for lora in self.record.loras if lora.lora_int_id != lora_request.lora_int_id
        ]
        self.record.loras.append(lora_request)
        return True

    async def remove_lora_async(self, lora_id: int) -> bool:
        """Forgotten."""
        before = len(self.record.loras)
        self.record.loras = [lora for lora in self.record.loras if lora.lora_int_id != lora_id]
        return len(self.record.loras) < before

    async def pin_lora_async(self, lora_id: int) -> bool:
        """Accepted and ignored."""
        return True

    async def collective_rpc_async(self, *args: Any, **kwargs: Any) -> list[Any]:
        """No workers to call."""
        return [None]

    def get_kv_event_sources(self) -> dict[int, Any]:
        """The KV-event publisher's config (its endpoints), as vLLM's engine reports it."""
        config = self.cache.publisher_config() if self.cache is not None else None
        return {} if config is None else {0: config}

    def dp_engines_running(self) -> bool:
        """No data parallelism."""
        return False

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the clock (and the KV-event publisher)."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if self.cache is not None:
            self.cache.shutdown()


class _PrefixCache:
    """The core's prefix cache: :class:`engine_worker.kvcache.KVCache` over vLLM's block
    hashes, and vLLM's KV-event publisher fed from its events."""

    def __init__(self, vllm_config: Any, capacity: int) -> None:
        from vllm.distributed.kv_events import EventPublisherFactory
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core import kv_cache_utils as U

        from engine_worker.kvcache import KVCache

        cc = vllm_config.cache_config
        self.block_size = int(cc.block_size)
        self._hash_fn = get_hash_fn_by_name(cc.prefix_caching_hash_algo)
        U.init_none_hash(self._hash_fn)  # as the engine core does at start
        self._U = U
        self.kv = KVCache(capacity, self.block_size, medium="GPU")
        self.kv.on_events(lambda: None)  # keep its events: published each step
        # Every cached block's token ids (BlockStored carries them).
        self._tokens: dict[Any, list[int]] = {}
        self._publisher = EventPublisherFactory.create(vllm_config.kv_events_config, 0)
        self._on = vllm_config.kv_events_config is not None and bool(
            vllm_config.kv_events_config.enable_kv_cache_events
        )

    @classmethod
    def build(cls, vllm_config: Any, settings: ScriptedCoreSettings) -> _PrefixCache | None:
        """One for a generating model with prefix caching on and cache blocks to spare."""
        cc = vllm_config.cache_config
        pooling = getattr(vllm_config.model_config, "runner_type", "generate") == "pooling"
        if pooling or not cc.enable_prefix_caching or settings.kv_cache_blocks < 1:
            return None
        return cls(vllm_config, settings.kv_cache_blocks)

    def hashes(self, ids: list[int]) -> list[Any]:
        """vLLM's hashes of the full blocks of prompt ``ids`` (no LoRA or multimodal keys)."""
        bs, fn, hb = self.block_size, self._hash_fn, self._U.hash_block_tokens
        out: list[Any] = []
        parent = None
        for i in range(0, len(ids) - bs + 1, bs):
            parent = hb(fn, parent, ids[i : i + bs], None)
            out.append(parent)
        return out

    def acquire(self, hashes: list[Any], tokens: int) -> Any:
        return self.kv.acquire(hashes, tokens)

    def commit(self, s: _Seq) -> None:
        """``s``'s prefill is done: its new full blocks are cached."""
        bs = self.block_size
        for i, h in enumerate(s.hashes):
            if h not in self.kv:
                self._tokens[h] = s.ids[i * bs : (i + 1) * bs]
        self.kv.commit(s.lease)

    def grow(self, s: _Seq, tokens: int) -> None:
        while s.lease.tokens < tokens:
            self.kv.grow(s.lease)

    def release(self, lease: Any) -> None:
        self.kv.release(lease)

    def clear(self) -> bool:
        return self.kv.clear()

    def publish(self) -> None:
        """Send this step's events as one ``KVEventBatch`` (or drop them: events off)."""
        _, events = self.kv.drain_events()
        if not events:
            return
        from vllm.distributed.kv_events import (
            AllBlocksCleared,
            BlockRemoved,
            BlockStored,
            KVEventBatch,
        )

        ext = self._U.maybe_convert_block_hash
        out: list[Any] = []
        for ev in events:
            kind = ev["type"]
            if kind == "stored":
                hashes = ev["hashes"]
                parent = ev.get("parent")
                out.append(
                    BlockStored(
                        block_hashes=[ext(h) for h in hashes],
                        parent_block_hash=None if parent is None else ext(parent),
                        token_ids=[t for h in hashes for t in self._tokens.get(h, ())],
                        block_size=self.block_size,
                        lora_id=None,
                        medium="GPU",
                        lora_name=None,
                    )
                )
            elif kind == "removed":
                for h in ev["hashes"]:
                    self._tokens.pop(h, None)
                out.append(BlockRemoved(block_hashes=[ext(h) for h in ev["hashes"]], medium="GPU"))
            else:
                self._tokens.clear()
                out.append(AllBlocksCleared())
        if self._on and self._publisher is not None:
            self._publisher.publish(KVEventBatch(ts=time.time(), events=out))

    def publisher_config(self) -> Any:
        if not self._on or self._publisher is None:
            return None
        return self._publisher.get_publisher_config()

    def shutdown(self) -> None:
        publisher, self._publisher = self._publisher, None
        if publisher is not None:
            with contextlib.suppress(Exception):
                publisher.shutdown()


@dataclass
class _Resources:
    """What ``AsyncLLM.errored`` reads."""

    engine_dead: bool = False


def _load_tokenizer(vllm_config: Any) -> Any:
    from transformers import AutoTokenizer

    mc = vllm_config.model_config
    return AutoTokenizer.from_pretrained(
        mc.tokenizer, revision=mc.tokenizer_revision, trust_remote_code=mc.trust_remote_code
    )


def printable_tokens(tokenizer: Any) -> dict[int, str]:
    """Ids that decode, alone, to printable text, with that text: no special or added
    token, no partial UTF-8 sequence, no angle bracket (random output must not spell a
    parser's marker)."""
    special = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
    out: dict[int, str] = {}
    for i in range(len(tokenizer)):
        if i in special:
            continue
        text = tokenizer.decode([i])
        if text and text.isprintable() and "\ufffd" not in text and not {"<", ">"} & set(text):
            out[i] = text
    if not out:
        raise ValueError("the tokenizer has no token that decodes to printable text")
    return out


# -- installing it ---------------------------------------------------------------------------
_ORIGINAL: list[Any] = []
_CLIENTS: list[ScriptedCoreClient] = []


def clients() -> list[ScriptedCoreClient]:
    """The scripted clients built in this process, oldest first (for tests)."""
    return list(_CLIENTS)


def install(settings: ScriptedCoreSettings | None = None) -> None:
    """Make every ``AsyncLLM`` built after this in this process use a scripted core.

    Replaces ``EngineCoreClient.make_async_mp_client`` (the one factory ``AsyncLLM`` calls);
    :func:`uninstall` puts it back. Installing again replaces the settings.
    """
    from vllm.v1.engine import core_client as cc

    chosen = settings or ScriptedCoreSettings()
    if not _ORIGINAL:
        _ORIGINAL.append(cc.EngineCoreClient.__dict__["make_async_mp_client"])

    def make_async_mp_client(
        vllm_config: Any, executor_class: Any = None, log_stats: bool = False, **_: Any
    ) -> ScriptedCoreClient:
        client = ScriptedCoreClient(vllm_config, chosen, log_stats=log_stats)
        _CLIENTS.append(client)
        return client

    cc.EngineCoreClient.make_async_mp_client = staticmethod(make_async_mp_client)


def uninstall() -> None:
    """Give vLLM its own engine-core client factory back."""
    if not _ORIGINAL:
        return
    from vllm.v1.engine import core_client as cc

    cc.EngineCoreClient.make_async_mp_client = _ORIGINAL.pop()


@contextlib.contextmanager
def installed(settings: ScriptedCoreSettings | None = None) -> Iterator[None]:
    """:func:`install` for the duration of a ``with`` block."""
    install(settings)
    try:
        yield
    finally:
        uninstall()


def register() -> None:
    """A vLLM general plugin (group ``vllm.general_plugins``): installs the scripted core
    when ``$TOKENBUS_VLLM_SCRIPTED_CORE`` is set, and does nothing otherwise. vLLM calls
    general plugins when it parses engine arguments, in ``vllm serve`` and in a tokenbus
    vllm worker alike."""
    settings = ScriptedCoreSettings.from_env()
    if settings is not None:
        install(settings)


# -- the tiny checkpoint ---------------------------------------------------------------------
def build_checkpoint(path: str | Path, *, max_position_embeddings: int = 2048) -> Path:
    """Write a tiny Qwen2-shaped checkpoint to ``path``: ``config.json``, a byte-level BPE
    ``tokenizer.json`` trained here with ``tokenizers`` (a few hundred tokens, the hermes and
    think markers as added tokens), ``tokenizer_config.json`` with a chat template that takes
    tools, and ``generation_config.json`` (without sampling values, so vLLM's defaults rule).
    No weights: the scripted core never loads any. Returns the path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=[*_SPECIALS, *_MARKERS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(_CORPUS) * 50, trainer)
    tok.save(str(out / "tokenizer.json"))
    eos = tok.token_to_id("<|im_end|>")
    added = {
        str(tok.token_to_id(s)): {
            "content": s,
            "special": s in _SPECIALS,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "single_word": False,
        }
        for s in (*_SPECIALS, *_MARKERS)
    }
    files: dict[str, dict[str, Any]] = {
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "model_max_length": max_position_embeddings,
            "chat_template": CHAT_TEMPLATE,
            "added_tokens_decoder": added,
        },
        "config.json": {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "vocab_size": tok.get_vocab_size(),
            "max_position_embeddings": max_position_embeddings,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "tie_word_embeddings": True,
            "torch_dtype": "bfloat16",
            "eos_token_id": eos,
            "bos_token_id": None,
        },
        "generation_config.json": {"eos_token_id": eos},
    }
    for name, body in files.items():
        (out / name).write_text(json.dumps(body, indent=1))
    return out


if __name__ == "__main__":  # python -m engine_worker.backends.scripted_core DIR
    import sys

    print(build_checkpoint(sys.argv[1] if len(sys.argv) > 1 else "tiny-checkpoint"))
