"""A stand-in for the parts of vLLM 0.33 that the ``vllm`` backend uses, without GPU or torch.

:class:`FakeVLLM` carries the names listed in ``engine_worker.backends.vllm_serving.VLLM_NAMES``
with vLLM's signatures and the behaviour the backend relies on, modelled on vLLM's source
(the paths below are vLLM 0.33's):

* ``vllm serve``'s command line (``utils/argparse_utils.py``, ``entrypoints/common/cli_args.py``,
  ``engine/arg_utils.py``): ``FlexibleArgumentParser`` accepts ``_`` or ``-`` in option names,
  ``make_arg_parser`` registers engine and front-end options in one parser (booleans as
  ``--x/--no-x``, ``-tp`` for ``--tensor-parallel-size``, ``32k`` for sizes, ``--lora-modules``
  as ``name=path`` or JSON); ``validate_parsed_serve_args`` refuses
  ``--enable-auto-tool-choice`` without ``--tool-call-parser``; ``validate_api_server_args``
  refuses unknown parsers.
* ``AsyncEngineArgs.from_cli_args`` takes the engine fields from that namespace and
  ``create_engine_config(usage_context)`` fills ``max_num_seqs``/``max_num_batched_tokens``
  by usage context as vLLM does on an H100 (API server 1024/8192, otherwise vLLM's scheduler
  defaults 128/2048); a model's ``generation_config`` defaults apply unless
  ``--generation-config vllm``.
* ``AsyncLLM`` (``v1/engine/async_llm.py``): ``generate`` gives each request an internal id
  (the caller's id plus a random suffix: ids may repeat), validates the prompt length with a
  ``VLLMValidationError`` (a ``VLLMClientError``, not a ``ValueError``: ``exceptions.py``),
  streams DELTA ``RequestOutput`` objects, and aborts its own internal id when closed or
  cancelled; ``abort(external_id)`` aborts every request sharing that id
  (``output_processor.py``); ``encode`` for pooling models; ``errored`` once dead.
* the OpenAI serving layer (``entrypoints/openai/.../serving.py``,
  ``entrypoints/pooling/embed/serving.py``, ``launchers/api_server/app_state.py``):
  ``init_app_state`` builds the serving objects for the supported tasks;
  ``create_chat_completion`` / ``create_completion`` check the model name (404), render
  (ErrorResponse 400 for ``tool_choice`` without a tool parser, or a model without a chat
  template), build ``SamplingParams`` with ``to_sampling_params`` (request values, else the
  model's defaults) and return an async generator of ``data: <chunk JSON>`` server-sent
  events with the shapes vLLM's pydantic models serialise to (role chunk, content / tool-call
  / reasoning deltas, logprobs, a finish chunk, a usage chunk, ``data: [DONE]``); errors inside
  the stream become an error event. The nested generators are not closed explicitly: as in
  vLLM, the engine request is aborted when the abandoned generators are finalised.
* tool parser ``hermes`` (``<tool_call>{json}</tool_call>``), reasoning parser
  ``deepseek_r1`` (text up to ``</think>`` is reasoning), structured output (a JSON schema
  makes the engine emit a JSON object), logprobs, LoRA modules by name.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import threading
import time
import uuid
import zlib
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import AsyncGenerator, Iterable
from dataclasses import dataclass, field, fields, replace
from enum import Enum, StrEnum
from http import HTTPStatus
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

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


# -- vllm/exceptions.py, vllm/v1/engine/exceptions.py ---------------------------------------
class VLLMError(Exception):
    pass


class VLLMClientError(VLLMError):
    pass


class VLLMServerError(VLLMError):
    pass


class VLLMValidationError(VLLMClientError):
    def __init__(self, message: str, *, parameter: str | None = None, value: Any = None):
        super().__init__(message)
        self.parameter = parameter
        self.value = value


class VLLMNotFoundError(VLLMClientError):
    pass


class ChatTemplateResolutionError(VLLMClientError):
    pass


class GenerationError(VLLMServerError):
    def __init__(self, message: str = "Internal server error"):
        super().__init__(message)
        self.status_code = HTTPStatus.INTERNAL_SERVER_ERROR


class GracefulHTTPError(VLLMError):
    def __init__(self, message: str, http_status: HTTPStatus):
        super().__init__(message)
        self.message = message
        self.http_status = http_status


class QueueOverflowError(GracefulHTTPError):
    def __init__(self) -> None:
        super().__init__(
            "The engine is currently busy and cannot accept new requests.",
            HTTPStatus.SERVICE_UNAVAILABLE,
        )


class EngineGenerateError(VLLMServerError):
    """Raised by ``AsyncLLM.generate`` for an unexpected failure (recoverable)."""


class EngineDeadError(VLLMServerError):
    CLIENT_MESSAGE = "The server had an error while processing your request."

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__("EngineCore encountered an issue.")


# -- vllm/sampling_params.py, vllm/pooling_params.py ----------------------------------------
class RequestOutputKind(Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        n = sum(
            v is not None
            for v in (self.json, self.regex, self.choice, self.grammar, self.json_object)
        )
        if n != 1:
            raise VLLMValidationError(
                "You must use exactly one kind of structured outputs constraint"
            )


@dataclass
class SamplingParams:
    """The fields of vLLM's ``SamplingParams`` the serving layer sets from a request."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if not 0.0 < self.top_p <= 1.0:
            raise VLLMValidationError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise VLLMValidationError(f"max_tokens must be at least 1, got {self.max_tokens}.")


@dataclass
class PoolingParams:
    task: str = "embed"
    dimensions: int | None = None


# -- vllm/outputs.py, vllm/logprobs.py ------------------------------------------------------
@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: Any
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int | None = None


@dataclass
class PoolingRequestOutput:
    request_id: str
    outputs: list[float]
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""


# -- vllm/v1/metrics -----------------------------------------------------------------------
@dataclass
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_skipped_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0


class StatLoggerBase(ABC):
    @abstractmethod
    def __init__(self, vllm_config: Any, engine_index: int = 0): ...

    @abstractmethod
    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None: ...

    @abstractmethod
    def log_engine_initialized(self) -> None: ...

    def log(self) -> None:  # noqa: B027 - vLLM's base has this no-op too
        pass


# -- vllm/usage/usage_lib.py ----------------------------------------------------------------
class UsageContext(StrEnum):
    UNKNOWN_CONTEXT = "UNKNOWN_CONTEXT"
    LLM_CLASS = "LLM_CLASS"
    API_SERVER = "API_SERVER"
    OPENAI_API_SERVER = "OPENAI_API_SERVER"
    OPENAI_BATCH_RUNNER = "OPENAI_BATCH_RUNNER"
    ENGINE_CONTEXT = "ENGINE_CONTEXT"


# -- vllm serve's command line --------------------------------------------------------------
def human_readable_int(value: str) -> int:
    """``32k`` -> 32000, ``32K`` -> 32768 (vLLM's rule: lower case decimal, upper binary)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgG])", value.strip())
    if m is None:
        return int(value)
    number, unit = m.groups()
    power = {"k": 1, "m": 2, "g": 3}[unit.lower()]
    base = 1000 if unit.islower() else 1024
    return int(float(number) * base**power)


@dataclass
class LoRAModulePath:
    name: str
    path: str
    base_model_name: str | None = None


class LoRAParserAction(argparse.Action):
    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None):
        out: list[LoRAModulePath] = []
        for item in values or ():
            if "=" in item and "," not in item:
                name, path = item.split("=", 1)
                out.append(LoRAModulePath(name, path))
            else:
                try:
                    out.append(LoRAModulePath(**json.loads(item)))
                except (ValueError, TypeError):
                    parser.error(f"Invalid JSON format for --lora-modules: {item}")
        setattr(namespace, self.dest, out)


class EnableDisableAction(argparse.BooleanOptionalAction):
    """``--enable-x`` paired with ``--disable-x`` (``--no-enable-x`` still accepted); the
    negative strings are listed in ``negative_option_strings``, the visible ones in
    ``option_strings`` (vLLM's ``utils/argparse_utils.py``)."""

    def __init__(self, option_strings: Any, dest: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, *args, **kwargs)
        inverses = [
            ("--disable-" + o.removeprefix("--enable-"))
            for o in option_strings
            if o.startswith("--enable-")
        ]
        self.negative_option_strings = {
            o for o in self.option_strings if o not in option_strings
        } | set(inverses)
        self.all_option_strings = [*self.option_strings, *inverses]
        # what the parser registers (hidden --no-enable-x included), then what help shows
        self.option_strings = self.all_option_strings

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None):
        setattr(namespace, self.dest, option_string not in self.negative_option_strings)


class FlexibleArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser that allows both underscore and dash in names."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register("action", argparse.BooleanOptionalAction, EnableDisableAction)

    def add_argument(self, *args: Any, **kwargs: Any) -> Any:
        action = super().add_argument(*args, **kwargs)
        if isinstance(action, EnableDisableAction):
            # --no-enable-x stays registered but leaves the action's visible strings
            action.option_strings = [
                o for o in action.all_option_strings if not o.startswith("--no-")
            ]
        return action

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:  # type: ignore[override]
        processed: list[str] = []
        for arg in args or ():
            if arg.startswith("--"):
                key, eq, value = arg.partition("=")
                processed.append(key.replace("_", "-") + eq + value)
            else:
                processed.append(arg)
        return super().parse_args(processed, namespace)


def _json(value: str) -> Any:
    return json.loads(value)


TOOL_PARSERS = ("hermes", "llama3_json", "mistral")
REASONING_PARSERS = ("deepseek_r1", "qwen3")

_BOOL: Any = argparse.BooleanOptionalAction  # the parser maps it to EnableDisableAction


def make_arg_parser(parser: FlexibleArgumentParser) -> FlexibleArgumentParser:
    parser.add_argument("model_tag", type=str, nargs="?")
    parser.add_argument("--headless", action="store_true", default=False)
    # front-end options (FrontendArgs)
    parser.add_argument("--lora-modules", type=str, nargs="+", action=LoRAParserAction)
    parser.add_argument("--chat-template", type=str, default=None)
    parser.add_argument("--response-role", type=str, default="assistant")
    parser.add_argument("--enable-auto-tool-choice", action=_BOOL, default=False)
    parser.add_argument("--tool-call-parser", type=str, default=None)
    parser.add_argument("--tool-parser-plugin", type=str, default="")
    parser.add_argument("--reasoning-parser", type=str, default=None)
    parser.add_argument("--reasoning-parser-plugin", type=str, default="")
    parser.add_argument("--default-chat-template-kwargs", type=_json, default=None)
    parser.add_argument("--enable-prompt-tokens-details", action=_BOOL, default=False)
    parser.add_argument("--enable-force-include-usage", action=_BOOL, default=False)
    # engine options (EngineArgs)
    parser.add_argument("--model", type=str, default="Qwen/Qwen3-0.6B")
    parser.add_argument("--served-model-name", type=str, nargs="+", default=None)
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    parser.add_argument("--max-model-len", type=human_readable_int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=human_readable_int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--enforce-eager", action=_BOOL, default=False)
    parser.add_argument("--enable-prefix-caching", action=_BOOL, default=None)
    parser.add_argument("--trust-remote-code", action=_BOOL, default=False)
    parser.add_argument("--dtype", type=str, default="auto")
    parser.add_argument("--quantization", "-q", type=str, default=None)
    parser.add_argument("--runner", choices=["auto", "generate", "pooling"], default="auto")
    parser.add_argument("--convert", choices=["auto", "none", "embed", "classify"], default="auto")
    parser.add_argument("--generation-config", type=str, default="auto")
    parser.add_argument("--enable-lora", action=_BOOL, default=None)
    parser.add_argument("--max-lora-rank", type=int, default=16)
    parser.add_argument("--limit-mm-per-prompt", type=_json, default=None)
    parser.add_argument("--enable-log-requests", action=_BOOL, default=False)
    parser.add_argument("--disable-log-stats", action="store_true", default=False)
    parser.add_argument("--aggregate-engine-logging", action="store_true", default=False)
    # observability options (ObservabilityConfig)
    parser.add_argument("--otlp-traces-endpoint", type=str, default=None)
    return parser


def validate_parsed_serve_args(args: argparse.Namespace) -> None:
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise TypeError("Error: --enable-auto-tool-choice requires --tool-call-parser")


def init_parser_plugin(args: argparse.Namespace) -> None:
    args.plugins_initialised = True


def validate_api_server_args(args: argparse.Namespace) -> None:
    if args.enable_auto_tool_choice and args.tool_call_parser not in TOOL_PARSERS:
        raise KeyError(f"invalid tool call parser: {args.tool_call_parser}")
    if args.reasoning_parser and args.reasoning_parser not in REASONING_PARSERS:
        raise KeyError(f"invalid reasoning parser: {args.reasoning_parser}")


# -- vllm/config ----------------------------------------------------------------------------
# Models the fake knows: name -> (max_model_len, generation_config defaults, chat template).
MODEL_GENERATION_CONFIG = {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
NO_TEMPLATE_MODELS = {"base-model-no-template"}


@dataclass
class ModelConfig:
    model: str
    served_model_name: str
    max_model_len: int
    runner_type: str
    generation_config: str
    chat_template: str | None

    def get_diff_sampling_param(self) -> dict[str, Any]:
        return dict(MODEL_GENERATION_CONFIG) if self.generation_config == "auto" else {}


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int


@dataclass
class ParallelConfig:
    tensor_parallel_size: int
    pipeline_parallel_size: int


@dataclass
class ObservabilityConfig:
    otlp_traces_endpoint: str | None = None


@dataclass
class VllmConfig:
    model_config: ModelConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    usage_context: UsageContext | None
    lora_modules_enabled: bool = False
    observability_config: ObservabilityConfig = field(default_factory=ObservabilityConfig)


DEFAULT_MAX_NUM_SEQS = 128  # vLLM's SchedulerConfig defaults
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# get_batch_defaults on a 80 GiB H100: only the LLM class and the API server get more.
H100_BATCH_DEFAULTS = {
    UsageContext.LLM_CLASS: (1024, 16384),
    UsageContext.OPENAI_API_SERVER: (1024, 8192),
}


@dataclass
class AsyncEngineArgs:
    model: str = "Qwen/Qwen3-0.6B"
    served_model_name: list[str] | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    enable_prefix_caching: bool | None = None
    trust_remote_code: bool = False
    dtype: str = "auto"
    quantization: str | None = None
    runner: str = "auto"
    convert: str = "auto"
    generation_config: str = "auto"
    enable_lora: bool | None = None
    max_lora_rank: int = 16
    limit_mm_per_prompt: dict[str, int] | None = None
    enable_log_requests: bool = False
    disable_log_stats: bool = False
    aggregate_engine_logging: bool = False
    otlp_traces_endpoint: str | None = None

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> AsyncEngineArgs:
        attrs = [f.name for f in fields(cls)]
        return cls(**{a: getattr(args, a) for a in attrs if hasattr(args, a)})

    def create_engine_config(
        self, usage_context: UsageContext | None = None, headless: bool = False
    ) -> VllmConfig:
        seqs, tokens = H100_BATCH_DEFAULTS.get(
            usage_context,  # type: ignore[arg-type]
            (DEFAULT_MAX_NUM_SEQS, DEFAULT_MAX_NUM_BATCHED_TOKENS),
        )
        pooling = self.runner == "pooling" or self.convert == "embed"
        names = self.served_model_name or [self.model]
        return VllmConfig(
            model_config=ModelConfig(
                model=self.model,
                served_model_name=names[0],
                max_model_len=self.max_model_len or 4096,
                runner_type="pooling" if pooling else "generate",
                generation_config=self.generation_config,
                chat_template=None if self.model in NO_TEMPLATE_MODELS else "fake-template",
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs or seqs,
                max_num_batched_tokens=self.max_num_batched_tokens or tokens,
            ),
            parallel_config=ParallelConfig(self.tensor_parallel_size, self.pipeline_parallel_size),
            usage_context=usage_context,
            lora_modules_enabled=bool(self.enable_lora),
            observability_config=ObservabilityConfig(self.otlp_traces_endpoint),
        )


# -- tokenizer and renderer -----------------------------------------------------------------
BOS_ID = 1


def token_id(piece: str) -> int:
    return 2 + zlib.crc32(piece.encode()) % 31_000


class FakeTokenizer:
    """A whitespace tokenizer."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [token_id(p) for p in re.findall(r"\S+\s*", text)]
        return [BOS_ID, *ids] if add_special_tokens else ids


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    out: list[str] = []
    for part in content:
        kind = part.get("type")
        if kind == "text":
            out.append(part.get("text") or "")
        elif kind in ("image_url", "input_audio", "file", "video_url"):
            out.append(f"<{kind}>")
    return "".join(out)


def render_conversation(
    messages: list[dict[str, Any]], add_generation_prompt: bool, continue_final: bool
) -> str:
    """The fake chat template: ``<s>[role] text\\n`` per message, ``[assistant]`` to prompt;
    a continued final message is left open (no newline)."""
    out = "<s>"
    for i, m in enumerate(messages):
        text = _content_text(m.get("content"))
        for call in m.get("tool_calls") or ():
            fn = call.get("function") or {}
            text += f"<tool_call>{fn.get('name')}:{fn.get('arguments')}</tool_call>"
        last = i == len(messages) - 1
        out += f"[{m.get('role')}] {text}" + ("" if last and continue_final else "\n")
    if add_generation_prompt:
        out += "[assistant]"
    return out


# -- vllm/v1/engine/async_llm.py ------------------------------------------------------------
def expected_words(prompt_token_ids: list[int], seed: int | None, n: int) -> list[str]:
    """The pieces the fake engine generates for a prompt (tests use it to predict text)."""
    start = zlib.crc32(f"{seed}|{prompt_token_ids}".encode())
    return [" " + WORDS[(start + i * 7) % len(WORDS)] for i in range(n)]


class AsyncLLM:
    """Generates deterministic words one token per step, with AsyncLLM's interface.

    Behaviour knobs (``FakeVLLM(**engine_options)`` sets them on every engine it builds):
    ``token_delay``; ``script`` (pieces to emit instead of words); ``fail_after`` + ``error``
    (raise after that many tokens); ``finish_with`` (force the final finish reason);
    ``build_delay`` (seconds ``from_vllm_config`` blocks, as weight loading does).
    """

    options: dict[str, Any] = {}

    def __init__(self, vllm_config: VllmConfig, **kw: Any) -> None:
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.construct_kwargs = kw
        self.tokenizer = FakeTokenizer()
        self.token_delay: float = 0.0005
        self.script: list[str] | None = None
        self.fail_after: int | None = None
        self.error: BaseException | None = None
        self.finish_with: str | None = None
        self.dead = False
        self.shut_down = False
        self.built_in_thread = threading.current_thread().name
        for k, v in self.options.items():
            setattr(self, k, v)
        # external id -> internal ids (output_processor.external_req_ids)
        self.external_req_ids: dict[str, list[str]] = defaultdict(list)
        self.running: set[str] = set()
        self.aborted: list[str] = []  # internal ids
        self.external_aborts: list[str] = []  # ids passed to abort(internal=False)
        self.requests: list[dict[str, Any]] = []
        self.encodes: list[dict[str, Any]] = []
        self.mm_cache_resets = 0

    @classmethod
    def from_vllm_config(
        cls,
        vllm_config: VllmConfig,
        start_engine_loop: bool = True,
        usage_context: UsageContext = UsageContext.ENGINE_CONTEXT,
        stat_loggers: list[Any] | None = None,
        enable_log_requests: bool = False,
        aggregate_engine_logging: bool = False,
        disable_log_stats: bool = False,
        client_addresses: dict[str, Any] | None = None,
        client_count: int = 1,
        client_index: int = 0,
    ) -> AsyncLLM:
        delay = float(cls.options.get("build_delay", 0.0))
        if delay:
            time.sleep(delay)  # blocking, like waiting for the engine core to load
        engine = cls(
            vllm_config,
            usage_context=usage_context,
            enable_log_requests=enable_log_requests,
            disable_log_stats=disable_log_stats,
        )
        engine.stat_loggers = [f(vllm_config, 0) for f in stat_loggers or ()]
        return engine

    @property
    def errored(self) -> bool:
        return self.dead

    async def is_tracing_enabled(self) -> bool:
        return self.vllm_config.observability_config.otlp_traces_endpoint is not None

    async def get_supported_tasks(self) -> tuple[str, ...]:
        if self.model_config.runner_type == "pooling":
            return ("embed", "token_embed")
        return ("generate",)

    async def reset_mm_cache(self) -> None:
        self.mm_cache_resets += 1

    def shutdown(self, timeout: float | None = None) -> None:
        self.shut_down = True

    async def abort(self, request_id: str | Iterable[str], internal: bool = False) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        targets: list[str] = []
        for rid in ids:
            if internal:
                targets.append(rid)
            else:
                self.external_aborts.append(rid)
                targets += self.external_req_ids.pop(rid, [])
        for rid in targets:
            if rid in self.running:
                self.running.discard(rid)
                self.aborted.append(rid)

    def _pieces(self, prompt_ids: list[int], sp: SamplingParams) -> list[str]:
        so = sp.structured_outputs
        if so is not None and so.json is not None:
            schema = so.json if isinstance(so.json, dict) else json.loads(so.json)
            obj = {k: WORDS[i % len(WORDS)] for i, k in enumerate(schema.get("properties", {}))}
            text = json.dumps(obj)
            return [text[i : i + 4] for i in range(0, len(text), 4)]
        if so is not None and so.choice:
            return [so.choice[0]]
        if self.script is not None:
            return list(self.script)
        return expected_words(prompt_ids, sp.seed, sp.max_tokens or 16)

    async def generate(
        self,
        prompt: Any,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        prompt_text: str | None = None,
        lora_request: LoRARequest | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        trace_headers: Any = None,
        priority: int = 0,
        data_parallel_rank: int | None = None,
        session_id: str | None = None,
        kv_hints: Any = None,
        reasoning_ended: bool | None = None,
        reasoning_parser_kwargs: dict[str, Any] | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        internal: str | None = None
        try:
            if self.dead:
                raise EngineDeadError()
            prompt_ids = list(prompt["prompt_token_ids"])
            max_len = self.model_config.max_model_len
            if len(prompt_ids) >= max_len:
                raise VLLMValidationError(
                    f"This model's maximum context length is {max_len} tokens. However, your "
                    f"request has {len(prompt_ids)} input tokens.",
                    parameter="input_tokens",
                    value=len(prompt_ids),
                )
            internal = f"{request_id}-{uuid.uuid4().hex[:8]}"
            self.external_req_ids[request_id].append(internal)
            self.running.add(internal)
            self.requests.append(
                {
                    "prompt": prompt,
                    "params": sampling_params,
                    "request_id": request_id,
                    "internal_id": internal,
                    "lora_request": lora_request,
                    "trace_headers": trace_headers,
                }
            )
            sp = sampling_params
            pieces = self._pieces(prompt_ids, sp)
            limit = min(sp.max_tokens or 16, max_len - len(prompt_ids))
            text = ""
            for i, piece in enumerate(pieces):
                n = i + 1
                await asyncio.sleep(self.token_delay)
                if internal not in self.running:
                    # Aborted by someone else: the request ends with finish_reason "abort".
                    yield self._output(request_id, prompt_ids, "", [], "abort", None, None)
                    return
                if self.fail_after is not None and i >= self.fail_after:
                    raise self.error or RuntimeError("boom")
                text += piece
                reason: str | None = None
                stop_reason: str | None = None
                out_text = piece
                for s in sp.stop:
                    k = text.find(s)
                    if k >= 0:
                        cut = len(text) - k
                        out_text = piece[: max(0, len(piece) - cut)]
                        reason, stop_reason = "stop", s
                        break
                if reason is None and (n >= limit or i == len(pieces) - 1):
                    reason = "length" if n >= limit else "stop"
                if reason is not None and self.finish_with is not None:
                    reason = self.finish_with
                lps = None
                if sp.logprobs is not None:
                    lps = [self._logprobs(piece, i, sp.logprobs)]
                yield self._output(
                    request_id, prompt_ids, out_text, [token_id(piece)], reason, stop_reason, lps
                )
                if reason is not None:
                    return
        except (asyncio.CancelledError, GeneratorExit):
            # vLLM aborts its own internal id when its consumer leaves.
            if internal is not None:
                await self.abort(internal, internal=True)
            raise
        except (VLLMClientError, GracefulHTTPError, GenerationError, EngineDeadError):
            raise
        except Exception as exc:
            raise EngineGenerateError() from exc
        finally:
            if internal is not None:
                self.running.discard(internal)
                ids = self.external_req_ids.get(request_id)
                if ids and internal in ids:
                    ids.remove(internal)
                    if not ids:
                        del self.external_req_ids[request_id]

    @staticmethod
    def _logprobs(piece: str, i: int, top: int) -> dict[int, Logprob]:
        out = {token_id(piece): Logprob(-0.25 * (i % 3 + 1), 1, piece)}
        for k in range(max(top, 1) - 1):
            alt = f" {WORDS[(i + k + 3) % len(WORDS)]}"
            out.setdefault(token_id(alt), Logprob(-1.5 - k, k + 2, alt))
        return out

    @staticmethod
    def _output(
        request_id: str,
        prompt_ids: list[int],
        text: str,
        ids: list[int],
        reason: str | None,
        stop_reason: str | None,
        logprobs: list[dict[int, Logprob]] | None,
    ) -> RequestOutput:
        return RequestOutput(
            request_id=request_id,
            prompt=None,
            prompt_token_ids=prompt_ids,
            prompt_logprobs=None,
            outputs=[
                CompletionOutput(
                    index=0,
                    text=text,
                    token_ids=ids,
                    logprobs=logprobs,
                    finish_reason=reason,
                    stop_reason=stop_reason,
                )
            ],
            finished=reason is not None,
        )

    async def encode(
        self,
        prompt: Any,
        pooling_params: PoolingParams,
        request_id: str,
        lora_request: LoRARequest | None = None,
        trace_headers: Any = None,
        priority: int = 0,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        if self.dead:
            raise EngineDeadError()
        ids = list(prompt["prompt_token_ids"])
        self.encodes.append({"prompt": prompt, "params": pooling_params, "request_id": request_id})
        await asyncio.sleep(self.token_delay)
        dim = pooling_params.dimensions or 8
        vec = [((zlib.crc32(f"{ids}|{k}".encode()) % 2000) - 1000) / 1000.0 for k in range(dim)]
        yield PoolingRequestOutput(request_id, vec, ids)


# -- vllm/entrypoints/.../protocol.py -------------------------------------------------------
class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


def create_error_response(
    message: str | Exception,
    err_type: str = "BadRequestError",
    status_code: HTTPStatus = HTTPStatus.BAD_REQUEST,
    param: str | None = None,
) -> ErrorResponse:
    """vLLM's classification of exceptions into HTTP answers (error_response.py)."""
    if isinstance(message, Exception):
        exc = message
        message = str(exc)
        if isinstance(exc, GracefulHTTPError):
            err_type, status_code, param = "ServiceUnavailable", exc.http_status, None
        elif isinstance(exc, VLLMValidationError):
            err_type, status_code, param = "BadRequestError", HTTPStatus.BAD_REQUEST, exc.parameter
        elif isinstance(exc, VLLMNotFoundError):
            err_type, status_code, param = "NotFoundError", HTTPStatus.NOT_FOUND, None
        elif isinstance(exc, VLLMClientError):
            err_type, status_code, param = "BadRequestError", HTTPStatus.BAD_REQUEST, None
        elif isinstance(exc, GenerationError):
            err_type, status_code, param = "InternalServerError", exc.status_code, None
        elif isinstance(exc, EngineDeadError):
            err_type, status_code = "InternalServerError", HTTPStatus.INTERNAL_SERVER_ERROR
            message, param = exc.CLIENT_MESSAGE, None
        elif isinstance(exc, VLLMServerError):
            err_type, status_code = "InternalServerError", HTTPStatus.INTERNAL_SERVER_ERROR
            param = None
        elif isinstance(exc, (ValueError, TypeError, OverflowError)):
            err_type, status_code, param = "BadRequestError", HTTPStatus.BAD_REQUEST, None
        elif isinstance(exc, NotImplementedError):
            err_type, status_code = "NotImplementedError", HTTPStatus.NOT_IMPLEMENTED
            param = None
        else:
            err_type, status_code = "InternalServerError", HTTPStatus.INTERNAL_SERVER_ERROR
            param = None
    return ErrorResponse(
        error=ErrorInfo(message=str(message), type=err_type, code=int(status_code), param=param)
    )


def _structured(structured: Any, response_format: Any) -> StructuredOutputsParams | None:
    """structured_outputs_from_response_format."""
    if response_format is None or response_format.get("type") == "text":
        return structured
    if response_format.get("type") == "json_object":
        overrides: dict[str, Any] = {"json_object": True}
    else:
        overrides = {"json": (response_format.get("json_schema") or {}).get("schema")}
    if structured is None:
        return StructuredOutputsParams(**overrides)
    return replace(structured, **overrides)


_DEFAULT_SAMPLING_PARAMS = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
}


class _SamplingRequest(OpenAIBaseModel):
    model: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = Field(default_factory=list)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = 0
    n: int | None = 1
    user: str | None = None
    echo: bool | None = False
    response_format: dict[str, Any] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    request_id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    include_stop_str_in_output: bool = False

    @model_validator(mode="before")
    @classmethod
    def validate_stream_options(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("stream_options") and not data.get("stream"):
            raise VLLMValidationError(
                "Stream options can only be defined when `stream=True`.",
                parameter="stream_options",
            )
        return data

    def _common_sampling(
        self, max_tokens: int, defaults: dict[str, Any], logprobs: int | None
    ) -> SamplingParams:
        values = {
            name: (value if (value := getattr(self, name)) is not None else defaults.get(name, d))
            for name, d in _DEFAULT_SAMPLING_PARAMS.items()
        }
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n or 1,
            **values,
            seed=self.seed,
            stop=stop,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            structured_outputs=_structured(self.structured_outputs, self.response_format),
            include_stop_str_in_output=self.include_stop_str_in_output,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
        )


class ChatCompletionRequest(_SamplingRequest):
    messages: list[dict[str, Any]]
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = "none"
    parallel_tool_calls: bool | None = True
    reasoning_effort: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def check_logprobs(cls, data: Any) -> Any:
        if isinstance(data, dict):
            top = data.get("top_logprobs")
            if top is not None and top > 0 and not data.get("logprobs"):
                raise VLLMValidationError(
                    "when using `top_logprobs`, `logprobs` must be set to true.",
                    parameter="top_logprobs",
                )
        return data

    @model_validator(mode="before")
    @classmethod
    def check_tool_usage(cls, data: Any) -> Any:
        if isinstance(data, dict) and "tool_choice" not in data and data.get("tools"):
            data["tool_choice"] = "auto"
        return data

    @model_validator(mode="before")
    @classmethod
    def check_generation_prompt(cls, data: Any) -> Any:
        if (
            isinstance(data, dict)
            and data.get("continue_final_message")
            and data.get("add_generation_prompt")
        ):
            raise VLLMValidationError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
            )
        return data

    def to_sampling_params(self, max_tokens: int, default_sampling_params: dict) -> SamplingParams:
        return self._common_sampling(
            max_tokens, default_sampling_params, self.top_logprobs if self.logprobs else None
        )


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | None = None
    logprobs: int | None = None
    max_tokens: int | None = 16
    suffix: str | None = None

    def to_sampling_params(self, max_tokens: int, default_sampling_params: dict) -> SamplingParams:
        return self._common_sampling(max_tokens, default_sampling_params, self.logprobs)


class EmbeddingCompletionRequest(OpenAIBaseModel):
    model: str | None = None
    input: list[int] | list[list[int]] | str | list[str]
    user: str | None = None
    dimensions: int | None = None
    encoding_format: str = "float"
    truncate_prompt_tokens: int | None = None
    request_id: str = Field(default_factory=lambda: uuid.uuid4().hex)


EmbeddingRequest = EmbeddingCompletionRequest


# -- the serving layer ----------------------------------------------------------------------
@dataclass
class BaseModelPath:
    name: str
    model_path: str


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str
    load_inplace: bool = False
    is_3d_lora_weight: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


class OpenAIServingModels:
    def __init__(
        self, engine_client: AsyncLLM, base_model_paths: list[BaseModelPath], lora_modules: Any
    ) -> None:
        self.engine_client = engine_client
        self.base_model_paths = base_model_paths
        self.lora_requests: dict[str, LoRARequest] = {
            m.name: LoRARequest(m.name, i + 1, m.path) for i, m in enumerate(lora_modules or ())
        }

    def is_base_model(self, name: str) -> bool:
        return any(m.name == name for m in self.base_model_paths)

    async def load_lora_adapter(self, request: LoadLoRAAdapterRequest) -> ErrorResponse | str:
        """vLLM's checks (models/serving.py), then the engine's load: an adapter folder
        that does not exist is vLLM's LoRAAdapterNotFoundError (404)."""
        name, path = request.lora_name, request.lora_path
        if not name or not path:
            return create_error_response("Both 'lora_name' and 'lora_path' must be provided.")
        if self.is_base_model(name):
            return create_error_response(
                f"The lora adapter '{name}' conflicts with a served base model."
            )
        if not request.load_inplace and name in self.lora_requests:
            return create_error_response(f"The lora adapter '{name}' has already been loaded.")
        if not Path(path).exists():
            return create_error_response(
                f"Loading lora {name} failed: No adapter found for {path}",
                err_type="NotFoundError",
                status_code=HTTPStatus.NOT_FOUND,
            )
        old = self.lora_requests.get(name)
        lora_id = old.lora_int_id if old else len(self.lora_requests) + 100
        self.lora_requests[name] = LoRARequest(name, lora_id, path)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload_lora_adapter(self, request: UnloadLoRAAdapterRequest) -> ErrorResponse | str:
        if request.lora_name not in self.lora_requests:
            return create_error_response(
                f"The lora adapter '{request.lora_name}' cannot be found.",
                err_type="NotFoundError",
                status_code=HTTPStatus.NOT_FOUND,
            )
        del self.lora_requests[request.lora_name]
        return f"Success: LoRA adapter '{request.lora_name}' removed successfully."

    def model_name(self, lora: LoRARequest | None) -> str:
        return lora.lora_name if lora is not None else self.base_model_paths[0].name


class _GenerateServing:
    def __init__(self, engine_client: AsyncLLM, models: OpenAIServingModels, args: Any) -> None:
        self.engine_client = engine_client
        self.models = models
        self.model_config = engine_client.model_config
        self.default_sampling_params = self.model_config.get_diff_sampling_param()
        self.enable_force_include_usage = bool(args.enable_force_include_usage)

    def _check_model(self, request: Any) -> ErrorResponse | None:
        if not request.model or self.models.is_base_model(request.model):
            return None
        if request.model in self.models.lora_requests:
            return None
        return create_error_response(
            f"The model `{request.model}` does not exist.",
            err_type="NotFoundError",
            status_code=HTTPStatus.NOT_FOUND,
            param="model",
        )

    def _lora(self, request: Any) -> LoRARequest | None:
        return self.models.lora_requests.get(request.model or "")

    async def _get_trace_headers(self, headers: Any) -> dict[str, str] | None:
        # serve/engine/serving.py: the trace headers go to the engine only when its tracing
        # is on (otlp_traces_endpoint); otherwise vLLM warns once and drops them.
        if not contains_trace_headers(headers):
            return None
        if not await self.engine_client.is_tracing_enabled():
            self.tracing_disabled_warnings = getattr(self, "tracing_disabled_warnings", 0) + 1
            return None
        return extract_trace_headers(headers)

    def _usage(self, request: Any) -> tuple[bool, bool]:
        if self.enable_force_include_usage:
            return True, True
        opts = request.stream_options
        include = bool(opts and opts.include_usage)
        return include, include and bool(opts and opts.continuous_usage_stats)


def _dump(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class OpenAIServingChat(_GenerateServing):
    def __init__(
        self, engine_client: AsyncLLM, models: OpenAIServingModels, args: Any, **kw: Any
    ) -> None:
        super().__init__(engine_client, models, args)
        self.response_role = args.response_role
        self.enable_auto_tools = bool(args.enable_auto_tool_choice)
        self.tool_parser = args.tool_call_parser
        self.reasoning_parser = args.reasoning_parser
        self.chat_template = args.chat_template or self.model_config.chat_template
        self.rendered: list[dict[str, Any]] = []

    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request: Any = None
    ) -> AsyncGenerator[str, None] | ErrorResponse:
        err = self._check_model(request)
        if err is not None:
            return err
        if self.tool_parser is None and request.tool_choice not in (None, "none"):
            return create_error_response(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set"
            )
        if self.chat_template is None and request.chat_template_kwargs is None:
            return create_error_response(
                ChatTemplateResolutionError(
                    "As of transformers v4.44, default chat template is no longer allowed, so "
                    "you must provide a chat template if the tokenizer does not define one."
                )
            )
        text = render_conversation(
            request.messages, request.add_generation_prompt, request.continue_final_message
        )
        ids = self.engine_client.tokenizer.encode(text, add_special_tokens=False)
        self.rendered.append({"messages": request.messages, "text": text})
        engine_input = {"prompt_token_ids": ids, "prompt": text}
        max_len = self.model_config.max_model_len
        room = max_len - len(ids)
        want = request.max_completion_tokens or request.max_tokens
        max_tokens = min(x for x in (room, want) if x is not None) if room > 0 else 1
        sp = request.to_sampling_params(max_tokens, self.default_sampling_params)
        request_id = f"chatcmpl-{request.request_id}"
        trace_headers = (
            None if raw_request is None else await self._get_trace_headers(raw_request.headers)
        )
        generator = self.engine_client.generate(
            engine_input,
            sp,
            request_id,
            lora_request=self._lora(request),
            trace_headers=trace_headers,
        )
        model_name = self.models.model_name(self._lora(request))
        return self.chat_completion_stream_generator(request, generator, request_id, model_name)

    async def chat_completion_stream_generator(
        self,
        request: ChatCompletionRequest,
        result_generator: AsyncGenerator[RequestOutput, None],
        request_id: str,
        model_name: str,
    ) -> AsyncGenerator[str, None]:
        # Not closed explicitly when this generator is: like vLLM's.
        async for chunk in self.chat_completion_stream_generator_raw(
            request, result_generator, request_id, model_name
        ):
            yield _dump(chunk)
        yield "data: [DONE]\n\n"

    async def chat_completion_stream_generator_raw(
        self,
        request: ChatCompletionRequest,
        result_generator: AsyncGenerator[RequestOutput, None],
        request_id: str,
        model_name: str,
    ) -> AsyncGenerator[dict[str, Any], None]:
        created = int(time.time())
        include_usage, continuous = self._usage(request)
        tools_on = bool(
            self.tool_parser and self.enable_auto_tools and request.tools
        ) and request.tool_choice not in (None, "none")
        reasoning = bool(self.reasoning_parser)
        num_prompt = 0
        num_output = 0
        first = True
        buffer = ""
        in_tool = False
        reasoning_done = False
        tool_calls_sent = 0

        def chunk(choice: dict[str, Any], usage: dict[str, Any] | None) -> dict[str, Any]:
            c: dict[str, Any] = {
                "id": request_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model_name,
                "choices": [choice],
            }
            if usage is not None:
                c["usage"] = usage
            return c

        def usage_now() -> dict[str, Any] | None:
            if not continuous:
                return None
            return {
                "prompt_tokens": num_prompt,
                "total_tokens": num_prompt + num_output,
                "completion_tokens": num_output,
            }

        try:
            async for res in result_generator:
                num_prompt = len(res.prompt_token_ids or ())
                if first:
                    first = False
                    yield chunk(
                        {
                            "index": 0,
                            "delta": {"role": self.response_role, "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        },
                        usage_now(),
                    )
                out = res.outputs[0]
                if out.finish_reason == "error":
                    raise GenerationError("Internal server error")
                num_output += len(out.token_ids)
                logprobs = None
                if request.logprobs and out.logprobs is not None:
                    logprobs = {
                        "content": [
                            self._chat_logprob(lp, out.token_ids[k], request.top_logprobs or 0)
                            for k, lp in enumerate(out.logprobs)
                        ]
                    }
                delta: dict[str, Any] | None = {}
                text = out.text
                if tools_on:
                    buffer += text
                    if "<tool_call>" in buffer:
                        in_tool = True
                    if in_tool:
                        delta = None
                        end = buffer.find("</tool_call>")
                        if end >= 0:
                            body = buffer[buffer.find("<tool_call>") + len("<tool_call>") : end]
                            call = json.loads(body)
                            name = call["name"]
                            args = json.dumps(call.get("arguments", {}))
                            # hermes streams the name first, then argument fragments.
                            yield chunk(
                                {
                                    "index": 0,
                                    "delta": {
                                        "tool_calls": [
                                            {
                                                "id": f"chatcmpl-tool-{uuid.uuid4().hex[:16]}",
                                                "type": "function",
                                                "index": tool_calls_sent,
                                                "function": {"name": name, "arguments": ""},
                                            }
                                        ]
                                    },
                                    "logprobs": None,
                                    "finish_reason": None,
                                    "token_ids": None,
                                },
                                usage_now(),
                            )
                            delta = {
                                "tool_calls": [
                                    {"index": tool_calls_sent, "function": {"arguments": args}}
                                ]
                            }
                            tool_calls_sent += 1
                            buffer = buffer[end + len("</tool_call>") :]
                            in_tool = "<tool_call>" in buffer
                    else:
                        delta = {"content": text}
                        buffer = ""
                elif reasoning and not reasoning_done:
                    # deepseek_r1: everything up to </think> is reasoning.
                    before, closed, after = text.partition("</think>")
                    delta = {}
                    if before.replace("<think>", ""):
                        delta["reasoning"] = before.replace("<think>", "")
                    if closed:
                        reasoning_done = True
                        if after:
                            delta["content"] = after
                else:
                    delta = {"content": text}
                finish = out.finish_reason
                if delta is None and finish is None and logprobs is None:
                    continue
                if delta is None:
                    delta = {}
                choice: dict[str, Any] = {
                    "index": 0,
                    "delta": delta,
                    "logprobs": logprobs,
                    "finish_reason": None,
                    "token_ids": None,
                }
                if finish is not None:
                    if tool_calls_sent and finish == "stop":
                        finish = "tool_calls"
                    choice["finish_reason"] = finish
                    choice["stop_reason"] = out.stop_reason
                    choice["weight_versions"] = None
                c = chunk(choice, usage_now())
                if finish is not None:
                    c["kv_transfer_params"] = None
                yield c
            if include_usage:
                yield {
                    "id": request_id,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model_name,
                    "choices": [],
                    "usage": {
                        "prompt_tokens": num_prompt,
                        "total_tokens": num_prompt + num_output,
                        "completion_tokens": num_output,
                    },
                }
        except GenerationError as e:
            yield create_error_response(
                str(e), err_type="InternalServerError", status_code=e.status_code
            ).model_dump()
        except Exception as e:
            yield create_error_response(e).model_dump()

    def _chat_logprob(self, lp: dict[int, Logprob], tid: int, top: int) -> dict[str, Any]:
        chosen = lp[tid]
        token = chosen.decoded_token or ""
        alts = sorted(lp.values(), key=lambda x: x.rank or 0)[:top]
        return {
            "token": token,
            "logprob": max(chosen.logprob, -9999.0),
            "bytes": list(token.encode()),
            "top_logprobs": [
                {
                    "token": a.decoded_token or "",
                    "logprob": max(a.logprob, -9999.0),
                    "bytes": list((a.decoded_token or "").encode()),
                }
                for a in alts
            ],
        }


class OpenAIServingCompletion(_GenerateServing):
    async def create_completion(
        self, request: CompletionRequest, raw_request: Any = None
    ) -> AsyncGenerator[str, None] | ErrorResponse:
        err = self._check_model(request)
        if err is not None:
            return err
        prompt = request.prompt or ""
        if isinstance(prompt, str):
            ids = self.engine_client.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        engine_input = {"prompt_token_ids": ids, "prompt": prompt}
        room = self.model_config.max_model_len - len(ids)
        max_tokens = min(room, request.max_tokens or 16) if room > 0 else 1
        sp = request.to_sampling_params(max_tokens, self.default_sampling_params)
        request_id = f"cmpl-{request.request_id}"
        trace_headers = (
            None if raw_request is None else await self._get_trace_headers(raw_request.headers)
        )
        generator = self.engine_client.generate(
            engine_input,
            sp,
            f"{request_id}-0",
            lora_request=self._lora(request),
            trace_headers=trace_headers,
        )
        model_name = self.models.model_name(self._lora(request))
        return self.completion_stream_generator(request, generator, request_id, model_name)

    async def completion_stream_generator(
        self,
        request: CompletionRequest,
        result_generator: AsyncGenerator[RequestOutput, None],
        request_id: str,
        model_name: str,
    ) -> AsyncGenerator[str, None]:
        created = int(time.time())
        include_usage, continuous = self._usage(request)
        num_prompt = 0
        num_output = 0
        offset = 0
        try:
            async for res in result_generator:
                num_prompt = len(res.prompt_token_ids or ())
                out = res.outputs[0]
                if out.finish_reason == "error":
                    raise GenerationError("Internal server error")
                num_output += len(out.token_ids)
                logprobs = None
                if request.logprobs is not None and out.logprobs is not None:
                    logprobs = {
                        "text_offset": [],
                        "token_logprobs": [],
                        "tokens": [],
                        "top_logprobs": [],
                    }
                    for k, lp in enumerate(out.logprobs):
                        chosen = lp[out.token_ids[k]]
                        logprobs["text_offset"].append(offset)
                        logprobs["token_logprobs"].append(chosen.logprob)
                        logprobs["tokens"].append(chosen.decoded_token)
                        alts = sorted(lp.values(), key=lambda x: x.rank or 0)[: request.logprobs]
                        logprobs["top_logprobs"].append({a.decoded_token: a.logprob for a in alts})
                offset += len(out.text)
                if not out.text and not out.token_ids and out.finish_reason is None:
                    continue
                c: dict[str, Any] = {
                    "id": request_id,
                    "object": "text_completion",
                    "created": created,
                    "model": model_name,
                    "choices": [
                        {
                            "index": 0,
                            "text": out.text,
                            "logprobs": logprobs,
                            "finish_reason": out.finish_reason,
                            "stop_reason": out.stop_reason,
                        }
                    ],
                }
                if continuous:
                    c["usage"] = {
                        "prompt_tokens": num_prompt,
                        "completion_tokens": num_output,
                        "total_tokens": num_prompt + num_output,
                    }
                yield _dump(c)
            if include_usage:
                yield _dump(
                    {
                        "id": request_id,
                        "object": "text_completion",
                        "created": created,
                        "model": model_name,
                        "choices": [],
                        "usage": {
                            "prompt_tokens": num_prompt,
                            "total_tokens": num_prompt + num_output,
                            "completion_tokens": num_output,
                        },
                    }
                )
        except GenerationError as e:
            yield f"data: {json.dumps(create_error_response(e).model_dump())}\n\n"
        except Exception as e:
            yield f"data: {json.dumps(create_error_response(e).model_dump())}\n\n"
        yield "data: [DONE]\n\n"


@dataclass
class JSONResponse:
    """starlette's JSONResponse as far as the backend reads it."""

    body: bytes
    status_code: int = 200


class ServingEmbedding:
    def __init__(self, engine_client: AsyncLLM, models: OpenAIServingModels) -> None:
        self.engine_client = engine_client
        self.models = models

    async def __call__(
        self, request: EmbeddingCompletionRequest, raw_request: Any = None
    ) -> JSONResponse:
        if request.model and not self.models.is_base_model(request.model):
            raise VLLMNotFoundError(f"The model `{request.model}` does not exist.")
        inputs = request.input
        if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
            inputs = [inputs]  # type: ignore[list-item]
        if not inputs:
            raise ValueError("You must pass at least one prompt")
        if request.dimensions is not None and request.dimensions > 8:
            raise VLLMValidationError(
                "dimensions is larger than the model's hidden size", parameter="dimensions"
            )
        tok = self.engine_client.tokenizer
        data: list[dict[str, Any]] = []
        total = 0
        for i, item in enumerate(inputs):
            ids = tok.encode(item) if isinstance(item, str) else list(item)
            total += len(ids)
            params = PoolingParams("embed", request.dimensions)
            async for res in self.engine_client.encode(
                {"prompt_token_ids": ids}, params, f"embd-{request.request_id}-{i}"
            ):
                data.append({"index": i, "object": "embedding", "embedding": res.outputs})
        body = {
            "id": f"embd-{request.request_id}",
            "object": "list",
            "created": int(time.time()),
            "model": self.models.model_name(None),
            "data": data,
            "usage": {"prompt_tokens": total, "total_tokens": total, "completion_tokens": 0},
        }
        return JSONResponse(json.dumps(body).encode())


# -- tracing/otel.py ------------------------------------------------------------------------
TRACE_HEADERS = ["traceparent", "tracestate"]


def contains_trace_headers(headers: Any) -> bool:
    return any(h in headers for h in TRACE_HEADERS)


def extract_trace_headers(headers: Any) -> dict[str, str]:
    return {h: headers[h] for h in TRACE_HEADERS if h in headers}


# -- starlette.datastructures.State, starlette.requests.Request, app_state.py ----------------
class State:
    pass


class _Headers(dict[str, str]):
    """starlette's Headers as the serving layer reads them: by lower-case name."""

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        super().__init__((k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in raw)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and super().__contains__(key.lower())

    def __getitem__(self, key: str) -> str:
        return super().__getitem__(key.lower())

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        return super().get(key.lower(), default)


class Request:
    """starlette's Request over an ASGI scope: the headers and the state vLLM's serving
    layer reads and writes."""

    def __init__(self, scope: dict[str, Any], receive: Any = None, send: Any = None) -> None:
        assert scope["type"] in ("http", "websocket")
        self.scope = scope
        self._receive = receive
        self.headers = _Headers(list(scope.get("headers") or ()))

    @property
    def state(self) -> State:
        return self.scope.setdefault("state", State())  # type: ignore[no-any-return]


async def init_app_state(
    engine_client: AsyncLLM, state: State, args: argparse.Namespace, supported_tasks: Any = None
) -> None:
    names = args.served_model_name or [args.model]
    state.engine_client = engine_client  # type: ignore[attr-defined]
    state.args = args  # type: ignore[attr-defined]
    models = OpenAIServingModels(
        engine_client, [BaseModelPath(n, args.model) for n in names], args.lora_modules
    )
    state.openai_serving_models = models  # type: ignore[attr-defined]
    tasks = supported_tasks or ()
    gen = "generate" in tasks
    state.openai_serving_chat = OpenAIServingChat(engine_client, models, args) if gen else None  # type: ignore[attr-defined]
    state.openai_serving_completion = (  # type: ignore[attr-defined]
        OpenAIServingCompletion(engine_client, models, args) if gen else None
    )
    state.serving_embedding = (  # type: ignore[attr-defined]
        ServingEmbedding(engine_client, models) if "embed" in tasks else None
    )


# -- the namespace the backend receives ------------------------------------------------------
class FakeVLLM:
    """The names the backend imports from vLLM (``vllm_serving.VLLM_NAMES``), faked.

    ``FakeVLLM(**engine_options)`` sets :class:`AsyncLLM` knobs on every engine it builds;
    ``engine`` is the last one built.
    """

    FlexibleArgumentParser = FlexibleArgumentParser
    make_arg_parser = staticmethod(make_arg_parser)
    validate_parsed_serve_args = staticmethod(validate_parsed_serve_args)
    init_parser_plugin = staticmethod(init_parser_plugin)
    validate_api_server_args = staticmethod(validate_api_server_args)
    AsyncEngineArgs = AsyncEngineArgs
    UsageContext = UsageContext
    EngineDeadError = EngineDeadError
    StatLoggerBase = StatLoggerBase
    init_app_state = staticmethod(init_app_state)
    State = State
    Request = Request
    ChatCompletionRequest = ChatCompletionRequest
    CompletionRequest = CompletionRequest
    EmbeddingRequest = EmbeddingRequest
    ErrorResponse = ErrorResponse
    create_error_response = staticmethod(create_error_response)
    LoadLoRAAdapterRequest = LoadLoRAAdapterRequest
    UnloadLoRAAdapterRequest = UnloadLoRAAdapterRequest

    def __init__(self, **engine_options: Any) -> None:
        outer = self
        self.engines: list[AsyncLLM] = []

        class _AsyncLLM(AsyncLLM):
            options = engine_options

            def __init__(self, vllm_config: VllmConfig, **kw: Any) -> None:
                super().__init__(vllm_config, **kw)
                outer.engines.append(self)

        self.AsyncLLM = _AsyncLLM

    @property
    def engine(self) -> AsyncLLM:
        return self.engines[-1]
