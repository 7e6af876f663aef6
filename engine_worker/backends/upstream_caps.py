"""What an OpenAI-compatible upstream can do, found out by asking it, never by its name.

The ``openai`` backend sits in front of vLLM, SGLang, llama.cpp, TGI, Ollama, LiteLLM or
OpenAI itself. They differ where tokenbus depends on them:

* **usage on streams** (``stream_options.include_usage``): without it, the prompt's tokens
  must be counted here, or limits, budgets and telemetry would count zero input;
* **continuing a final assistant message** (``continue_final_message`` with
  ``add_generation_prompt: false``, vLLM's extension; llama.cpp's server continues a last
  assistant message of its own accord): request migration resumes a chat stream on another
  replica only where the upstream continues the text exactly, never where it starts over;
* **a tokenize endpoint** (vLLM's and llama.cpp's ``/tokenize``, llama-cpp-python's
  ``/extras/tokenize``, TGI's ``/tokenize``), which counts prompt tokens exactly;
* **logprobs** on streams.

:func:`probe` finds each out with a few tiny requests (``max_tokens`` 1) when the worker
starts and again after the upstream was unreachable. How continuation is told apart from
starting over: the upstream's own prompt count of ``[user, assistant "Hello"]`` left open
exceeds that of ``[user]`` with the generation prompt by exactly the tokens of "Hello" (the
difference "Hello Hello" adds again) only when it continues the message; a server that
closes the message and opens a new turn adds its end-of-turn and header tokens too.

:class:`PromptCounter` counts a request's prompt when the upstream sends no usage: the
messages' text through the tokenize endpoint plus the chat template's own tokens for that
sequence of roles, measured once against the upstream's count (``usage_source``
``tokenized``); or, with no tokenizer to ask, the text's pre-tokens (words, numbers,
punctuation runs) times the tokens per pre-token the probe measured (``estimate``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bus_schemas.messages import is_token_ids
from services import logging as tlog

log = tlog.get("worker")

# Where a request's prompt token count came from (telemetry's ``usage_source``).
USAGE_UPSTREAM = "upstream"  # the upstream said (its usage)
USAGE_TOKENIZED = "tokenized"  # the upstream's tokenizer counted it, the template measured
USAGE_ESTIMATE = "estimate"  # estimated: no tokenizer to ask, or parts it cannot count

# Tokenize dialects (:func:`_tokenize_request`).
TOKENIZE_VLLM = "vllm"  # POST /tokenize {model, prompt | messages} -> {count, tokens}
TOKENIZE_LLAMA_CPP = "llama.cpp"  # POST /tokenize {content} -> {tokens}
TOKENIZE_LLAMA_CPP_PYTHON = "llama-cpp-python"  # POST /extras/tokenize {input} -> {tokens}
TOKENIZE_TGI = "tgi"  # POST /tokenize {inputs} -> [{id, text, ...}]
TOKENIZE_DIALECTS = (TOKENIZE_VLLM, TOKENIZE_LLAMA_CPP, TOKENIZE_LLAMA_CPP_PYTHON, TOKENIZE_TGI)

# The probes' texts: one short word and a sentence of ordinary English (the characters-per-
# token ratio, where there is no tokenizer to ask).
WORD = "Hello"
SENTENCE = (
    "The quick brown fox jumps over the lazy dog while the farmer counts his sheep, "
    "and a small bird sings on the old wooden fence beside the river at dawn."
)
PROBE_TIMEOUT_S = 10.0
# Role sequences whose template tokens are measured at start; others the first time seen.
COMMON_SHAPES: tuple[tuple[str, ...], ...] = (
    ("user",),
    ("user", "assistant", "user"),
    ("system", "user"),
    ("system", "user", "assistant", "user"),
    ("completions",),
)
MAX_SHAPES = 256
TOKENIZE_AT_ONCE = 8  # tokenize requests of one count in flight at once
IDLE_WAIT_S = 120.0  # how long a role sequence waits for an idle moment to be measured


def api_root(base: str) -> str:
    """The server's root URL from its OpenAI base (``http://h:8000/v1`` -> ``http://h:8000``),
    where vLLM, llama.cpp and TGI serve ``/tokenize``."""
    base = base.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


@dataclass(slots=True)
class Caps:
    """What the upstream does; None: not known (not probed yet, or the probe could not tell).
    ``overridden`` names the fields the operator set (``stream_usage``, ``continue_message``,
    ``logprobs`` in config), which probes leave alone."""

    stream_usage: bool | None = None
    continue_message: bool | None = None
    logprobs: bool | None = None
    tokenize: str = ""  # the dialect of its tokenize endpoint, "" when it has none
    tokenize_url: str = ""
    stream_options: bool = True  # False: it refuses ``stream_options`` (it is left out)
    word_tokens: int = 1  # the tokens of :data:`WORD` alone (its tokenizer's count, else 1)
    probed: bool = False
    overridden: frozenset[str] = frozenset()
    # The chat template's own tokens (beyond the messages' text) per sequence of roles and
    # continuation flags, measured against the upstream's count; None: could not be.
    overhead: dict[tuple[Any, ...], int | None] = field(default_factory=dict)
    # Tokens per pre-token (:func:`pretokens`) of English text, measured where there is no
    # tokenizer to ask (1.0: what byte-pair tokenizers give for common English words).
    tokens_per_pretoken: float = 1.0

    def to_dict(self) -> dict[str, Any]:
        """What the log, heartbeats and ``tokenbus status`` show."""
        return {
            "probed": self.probed,
            "stream_usage": self.stream_usage,
            "continue_message": self.continue_message,
            "logprobs": self.logprobs,
            "tokenize": self.tokenize or None,
            **({"overridden": sorted(self.overridden)} if self.overridden else {}),
        }


class Prober:
    """Asks one upstream what it can do (tiny requests, each bounded)."""

    def __init__(self, session: aiohttp.ClientSession, base: str, model: str) -> None:
        self.session = session
        self.base = base.rstrip("/")
        self.root = api_root(self.base)
        self.model = model

    async def _once(self, url: str, body: dict[str, Any]) -> tuple[int, bytes] | None:
        """(status, body) of one POST; None when its connection failed or timed out."""
        try:
            async with self.session.post(
                url, json=body, timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
            ) as r:
                return r.status, await r.read()
        except (TimeoutError, aiohttp.ClientError, OSError):
            return None

    async def post(self, url: str, body: dict[str, Any]) -> tuple[int, Any]:
        """(status, JSON body or None); status 0 when the upstream could not be reached, after
        a few tries (each probe request is retried when its connection fails)."""
        for attempt in range(PROBE_TRIES):
            answer = await self._once(url, body)
            if answer is None:
                await _backoff(attempt)
                continue
            status, raw = answer
            try:
                return status, json.loads(raw)
            except ValueError:  # not JSON, or not UTF-8
                return status, None
        return 0, None

    async def prompt_tokens(self, messages: list[dict[str, Any]], **extra: Any) -> int | None:
        """The upstream's own count of a chat prompt (a whole answer of one token)."""
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": 1,
            "temperature": 0,
            "stream": False,
            **extra,
        }
        status, obj = await self.post(self.base + "/chat/completions", body)
        return _prompt_tokens(obj) if status == 200 else None

    async def completion_prompt_tokens(self, prompt: str) -> int | None:
        body = {"model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        status, obj = await self.post(self.base + "/completions", body)
        return _prompt_tokens(obj) if status == 200 else None

    async def stream(self) -> tuple[bool | None, bool | None, bool]:
        """(usage on streams, logprobs on streams, whether it takes ``stream_options``) from
        one streamed answer of one token; usage and logprobs None when it refuses every
        streamed request asked of it (then nothing can be told from streams)."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": WORD}],
            "max_tokens": 1,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "logprobs": True,
            "top_logprobs": 1,
        }
        events = await self._events(body)
        logprobs: bool | None = None
        if events is None:  # logprobs refused (OpenAI's reasoning models, some servers)
            body.pop("logprobs")
            body.pop("top_logprobs")
            events = await self._events(body)
            logprobs = False
        options = True
        if events is None:  # stream_options (or temperature) refused too: the bare request
            for k in ("stream_options", "temperature"):
                body.pop(k)
            events = await self._events(body)
            options = events is None
        if events is None:
            return None, None, options
        usage = any(_prompt_tokens(e) is not None for e in events)
        if logprobs is None:
            logprobs = any(
                isinstance(ch, dict)
                and isinstance(ch.get("logprobs"), dict)
                and bool(ch["logprobs"].get("content"))
                for ch in _choices(events)
            )
        return usage, logprobs, options

    async def _events(self, body: dict[str, Any]) -> list[dict[str, Any]] | None:
        """The events of a streamed answer that ended with a finish reason; None when the
        upstream refused it. One cut short (a connection lost; llama-cpp-python's server
        ends an answer early, with no finish reason, when another request arrives) is asked
        again, a few times."""
        for attempt in range(PROBE_TRIES):
            answer = await self._once(self.base + "/chat/completions", body)
            if answer is not None:
                status, raw = answer
                if status != 200:
                    return None
                events = _sse_objects(raw)
                if any(isinstance(ch, dict) and ch.get("finish_reason") for ch in _choices(events)):
                    return events
            await _backoff(attempt)
        raise ProbeCut("the upstream cut every streamed probe short")

    async def find_tokenizer(self, url: str = "") -> tuple[str, str]:
        """(dialect, URL) of a tokenize endpoint that counts ``WORD`` (``url``: the one the
        operator named, whatever its dialect), or ("", "")."""
        candidates = (
            [(d, url) for d in TOKENIZE_DIALECTS]
            if url
            else [
                (TOKENIZE_VLLM, self.root + "/tokenize"),
                (TOKENIZE_LLAMA_CPP, self.root + "/tokenize"),
                (TOKENIZE_LLAMA_CPP_PYTHON, self.root + "/extras/tokenize"),
                (TOKENIZE_TGI, self.root + "/tokenize"),
            ]
        )
        for dialect, u in candidates:
            n = await self.tokens(dialect, u, WORD)
            if n is not None and n > 0:
                return dialect, u
        return "", ""

    async def tokens(self, dialect: str, url: str, text: str) -> int | None:
        """The tokens of ``text`` by a tokenize endpoint of ``dialect``; None: no answer."""
        body, read = _tokenize_request(dialect, self.model, text)
        status, obj = await self.post(url, body)
        return read(obj) if status == 200 else None


class ProbeCut(Exception):
    """A probe could not be completed (the upstream kept cutting it): try again later."""


PROBE_TRIES = 4


async def _backoff(attempt: int) -> None:
    """A short, jittered wait before a probe request is tried again (another worker may be
    probing the same upstream, which a one-request-at-a-time server answers in turn)."""
    await asyncio.sleep(random.uniform(0.05, 0.2) * (attempt + 1))


def _sse_objects(raw: bytes) -> list[dict[str, Any]]:
    """The JSON objects of a server-sent event stream's ``data:`` lines."""
    events: list[dict[str, Any]] = []
    for line in raw.splitlines():
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            continue
        with contextlib.suppress(ValueError):
            obj = json.loads(payload)
            if isinstance(obj, dict):
                events.append(obj)
    return events


def _choices(events: list[dict[str, Any]]) -> list[Any]:
    """Every choice of every event (an event whose ``choices`` is not a list has none)."""
    out: list[Any] = []
    for e in events:
        choices = e.get("choices")
        if isinstance(choices, list):
            out.extend(choices)
    return out


def _prompt_tokens(obj: Any) -> int | None:
    """``usage.prompt_tokens`` of an answer or event, when it is a positive integer."""
    usage = obj.get("usage") if isinstance(obj, dict) else None
    n = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    return n if isinstance(n, int) and n > 0 else None


def _tokenize_request(
    dialect: str, model: str, text: str
) -> tuple[dict[str, Any], Callable[[Any], int | None]]:
    """The body a tokenize endpoint of ``dialect`` takes, and how to read its count."""

    def tokens_list(obj: Any) -> int | None:
        toks = obj.get("tokens") if isinstance(obj, dict) else None
        return len(toks) if isinstance(toks, list) else None

    if dialect == TOKENIZE_VLLM:

        def count(obj: Any) -> int | None:
            n = obj.get("count") if isinstance(obj, dict) else None
            return n if isinstance(n, int) else None

        return {"model": model, "prompt": text, "add_special_tokens": False}, count
    if dialect == TOKENIZE_LLAMA_CPP:
        return {"content": text}, tokens_list
    if dialect == TOKENIZE_LLAMA_CPP_PYTHON:
        return {"input": text, "model": model}, tokens_list

    def tgi(obj: Any) -> int | None:
        return len(obj) if isinstance(obj, list) and all(isinstance(t, dict) for t in obj) else None

    return {"inputs": text}, tgi


async def probe(prober: Prober, caps: Caps, tokenize_url: str = "") -> Caps:
    """Find out what the upstream does; the fields in ``caps.overridden`` keep their value.
    Returns a new :class:`Caps` (``probed`` False when the upstream did not answer)."""
    new = Caps(
        overridden=caps.overridden,
        **{k: getattr(caps, k) for k in caps.overridden},
    )
    try:
        stream_usage, logprobs, new.stream_options = await prober.stream()
    except ProbeCut:
        return new  # unreachable, or cut short again and again: try again later
    if "stream_usage" not in caps.overridden:
        new.stream_usage = stream_usage
    if "logprobs" not in caps.overridden:
        new.logprobs = logprobs
    new.tokenize, new.tokenize_url = await prober.find_tokenizer(tokenize_url)
    if new.tokenize:
        new.word_tokens = await prober.tokens(new.tokenize, new.tokenize_url, WORD) or 1
    p_gen = await prober.prompt_tokens([{"role": "user", "content": WORD}])
    if "continue_message" not in caps.overridden:
        new.continue_message = await _continues(prober, p_gen, new.word_tokens)
    new.probed = True
    if new.stream_usage:
        return new  # it counts: nothing to measure for counting here
    # The template's own tokens for the common role sequences (``[user]``'s is p_gen's),
    # and tokens per pre-token.
    if p_gen is not None:
        new.overhead[("user", False)] = max(0, p_gen - new.word_tokens)
    counter = PromptCounter(prober, new)
    for shape in COMMON_SHAPES:
        if (*shape, False) not in new.overhead:
            await counter.learn((*shape, False))
    if not new.tokenize and p_gen is not None:
        long = await prober.prompt_tokens([{"role": "user", "content": SENTENCE}])
        if long is not None and long > p_gen:
            new.tokens_per_pretoken = (long - p_gen + 1) / pretokens(SENTENCE)
    return new


async def _continues(prober: Prober, p_gen: int | None, word: int) -> bool:
    """Whether the upstream continues a final assistant message left open (``word``: the
    tokens of :data:`WORD` alone)."""
    if p_gen is None or p_gen < word + 2:
        # No usage on whole answers, or a count without the template's tokens (role markers
        # at least: some proxies count the messages' text alone): nothing to tell it by, so
        # never resume.
        return False

    async def left_open(text: str) -> int | None:
        return await prober.prompt_tokens(
            [{"role": "user", "content": WORD}, {"role": "assistant", "content": text}],
            continue_final_message=True,
            add_generation_prompt=False,
        )

    once = await left_open(WORD)
    twice = await left_open(f"{WORD} {WORD}")
    if once is None or twice is None:
        return False  # the fields refused (OpenAI's API), or no usage
    word = twice - once
    return word > 0 and once - p_gen == word


# Pieces a byte-pair tokenizer never merges across (GPT-2's pre-tokenizer, near enough):
# a word with its leading space, up to three digits, a run of punctuation, whitespace.
_PRETOKEN = re.compile(r"'(?:s|t|re|ve|m|ll|d)| ?[^\W\d_]+| ?\d{1,3}| ?[^\s\w]+|\s+(?!\S)|\s+")


def pretokens(text: str) -> int:
    """The pre-tokens of ``text``: a lower bound of its tokens in any BPE tokenizer, and near
    them for English prose and code (a long or rare word is split further)."""
    return len(_PRETOKEN.findall(text))


def estimate(text: str, caps: Caps) -> int:
    """Tokens of ``text`` with no tokenizer to ask: pre-tokens times the ratio the probe
    measured against the upstream's own count (docs/deploy.md has its error measured)."""
    return round(pretokens(text) * max(0.1, caps.tokens_per_pretoken))


def _text(content: Any) -> tuple[str, bool]:
    """A message content's text, and whether that is all of it (no image, audio, file)."""
    if content is None:
        return "", True
    if isinstance(content, str):
        return content, True
    if isinstance(content, list):
        texts, whole = [], True
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                whole = False
        return "\n".join(texts), whole
    return json.dumps(content), False


class PromptCounter:
    """Counts a request's prompt tokens for an upstream that does not say (see the module)."""

    def __init__(
        self,
        prober: Prober,
        caps: Caps,
        *,
        learn: bool = True,
        busy: Callable[[], bool] | None = None,
    ) -> None:
        self.prober = prober
        self.caps = caps
        self.learn_shapes = learn  # False: the operator turned probing off
        # Whether requests are in flight: a role sequence is measured only when none is (a
        # server that answers one request at a time may cut the answer it is writing).
        self.busy = busy or (lambda: False)
        self._learning: set[tuple[Any, ...]] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._asking = asyncio.Semaphore(TOKENIZE_AT_ONCE)

    async def _tokens(self, text: str) -> int | None:
        c = self.caps
        if not text:
            return 0
        if not c.tokenize:
            return None
        async with self._asking:
            return await self.prober.tokens(c.tokenize, c.tokenize_url, text)

    async def learn(self, shape: tuple[Any, ...]) -> None:
        """Measure the template's own tokens for ``shape`` (roles, then whether the last
        message is left open) against the upstream's count of the same shape."""
        caps = self.caps
        if len(caps.overhead) >= MAX_SHAPES:
            return
        *roles, left_open = shape
        messages = [{"role": r, "content": WORD} for r in roles]
        extra = (
            {"continue_final_message": True, "add_generation_prompt": False} if left_open else {}
        )
        if roles == ["completions"]:
            n = await self.prober.completion_prompt_tokens(WORD)
        else:
            n = await self.prober.prompt_tokens(messages, **extra)
        caps.overhead[shape] = None if n is None else max(0, n - caps.word_tokens * len(roles))

    def _learn_later(self, shape: tuple[Any, ...]) -> None:
        if not self.learn_shapes or shape in self._learning or len(self._learning) >= MAX_SHAPES:
            return
        self._learning.add(shape)
        task = asyncio.get_running_loop().create_task(self._learn_when_idle(shape))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _learn_when_idle(self, shape: tuple[Any, ...]) -> None:
        """Measure ``shape`` once no request is in flight (within :data:`IDLE_WAIT_S`; else
        it may be tried again when seen next)."""
        deadline = time.monotonic() + IDLE_WAIT_S
        while self.busy():
            if time.monotonic() > deadline:
                self._learning.discard(shape)
                return
            await asyncio.sleep(0.05)
        try:
            await self.learn(shape)
        except Exception as exc:  # a malformed answer: that sequence stays estimated
            log.warning("prompt_template_unmeasured", shape=list(shape), error=repr(exc))
            self.caps.overhead[shape] = None

    def _overhead(self, shape: tuple[Any, ...]) -> tuple[int, bool]:
        """(template tokens for ``shape``, whether measured for it)."""
        known = self.caps.overhead
        measured = known.get(shape)
        if measured is not None:
            return measured, True
        if shape not in known:
            self._learn_later(shape)
        n = len(shape) - 1
        # Not measured (yet): from the measured chat shapes that start alike (with a system
        # message or without: a template may add one of its own), the nearest in messages
        # plus what a message adds between them (an estimate).
        chat = sorted(
            (len(s) - 1, v, s[:1] == ("system",))
            for s, v in known.items()
            if v is not None and s[0] != "completions"
        )
        alike = [(k, v) for k, v, system in chat if system == (shape[:1] == ("system",))]
        alike = alike or [(k, v) for k, v, _ in chat]
        if not alike:
            return 4 * n, False
        (n1, v1), (n2, v2) = alike[0], alike[-1]
        per = (v2 - v1) / (n2 - n1) if n2 != n1 else v2 / max(1, n2)
        near, v = min(alike, key=lambda x: abs(x[0] - n))
        return max(0, round(v + per * (n - near))), False

    async def count(self, path: str, body: dict[str, Any]) -> tuple[int, str]:
        """(prompt tokens, usage source) of the request ``body`` sent to ``path``."""
        exact = True
        if path == "/completions":
            prompt: Any = body.get("prompt")
            if is_token_ids(prompt):  # token ids: counted as they are
                return len(prompt), USAGE_TOKENIZED
            texts = [prompt if isinstance(prompt, str) else json.dumps(prompt)]
            exact = isinstance(prompt, str)
            shape: tuple[Any, ...] = ("completions", False)
        else:
            messages = body.get("messages") or []
            texts, roles = [], []
            for m in messages:
                if not isinstance(m, dict):
                    exact = False
                    continue
                text, whole = _text(m.get("content"))
                roles.append(str(m.get("role", "user")))
                if m.get("tool_calls") is not None:
                    text += json.dumps(m["tool_calls"])
                    exact = False
                texts.append(text)
                exact = exact and whole
            if body.get("tools"):  # rendered by the template in its own way
                texts.append(json.dumps(body["tools"]))
                exact = False
            left_open = bool(body.get("continue_final_message"))
            shape = (*roles, left_open)
        overhead, measured = self._overhead(shape)
        counted = await asyncio.gather(*(self._tokens(t) for t in texts))
        total = overhead
        for t, n in zip(texts, counted, strict=True):
            if n is None:
                exact = False
                n = estimate(t, self.caps)
            total += n
        source = USAGE_TOKENIZED if exact and measured else USAGE_ESTIMATE
        return max(1, total), source

    async def settled(self) -> None:
        """Wait for the role sequences being measured now."""
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def close(self) -> None:
        for t in self._tasks:
            t.cancel()


class Refresh:
    """When to probe again: after the upstream could not be reached (at start, or a request
    that failed to connect), at most once every ``every_s`` seconds, doubled after each
    probe that failed up to ``max_s``."""

    def __init__(self, every_s: float = 5.0, max_s: float = 60.0) -> None:
        self.base_s = self.every_s = every_s
        self.max_s = max_s
        self.stale = True
        self.running = False
        self._last = -1e9

    def due(self) -> bool:
        return self.stale and not self.running and time.monotonic() - self._last >= self.every_s

    def begin(self) -> None:
        self.running = True
        self._last = time.monotonic()

    def end(self, probed: bool) -> None:
        self.running = False
        self.stale = not probed
        self.every_s = self.base_s if probed else min(self.max_s, self.every_s * 2)
