"""A request's block hashes as each replica's engine computes them, for the KV index.

Replicas say how they hash (``hashing`` in their snapshots, :mod:`bus_schemas.kv_events`):

- the sim (no ``hashing``, or ``kind: text``): :func:`kv_events.text_block_hashes` of the
  prompt as :func:`bus_schemas.messages.render_prompt` renders it;
- vLLM (``kind: vllm``): the model's tokenizer and chat template, as vLLM's chat and
  completion handlers apply them, then :func:`vllm_block_hashes` with the engine's
  algorithm and seed. This needs ``transformers`` in the router's environment and the
  tokenizer where the replica says it is (a local path or a name in the Hugging Face cache:
  the router never downloads). Without them, or when the engine's seed is random, the
  replicas of that scheme cannot be matched: the policy falls back to approximate affinity
  (:class:`router.policies.KVAware`), and :attr:`PromptHashers.unavailable` says why.

What the vLLM rendering follows of vLLM's request handling (0.33): text content parts joined
with a newline, an assistant's tool-call arguments given to the template as objects, tools as
``{"type": "function", "function": {"name", "description", "parameters"}}``, the generation
prompt added unless the request continues its last message, chat prompts tokenised without
special tokens and completion prompts with them. What it does not: multimodal parts,
``chat_template_kwargs``, a chat template the request or the engine's options replace, LoRA
and ``cache_salt`` keys. A prompt rendered differently from the engine only costs hits: its
hashes match nothing from the first differing block on.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import pickle  # vLLM's "sha256" block hash hashes a pickle; nothing pickled is ever sent
import re
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from bus_schemas import kv_events as kv
from bus_schemas.messages import message_text

__all__ = [
    "PromptEncoder",
    "PromptHashers",
    "scheme_key",
    "vllm_block_hashes",
    "vllm_prompt_ids",
]

# Characters of text pieces whose token ids a PromptEncoder keeps (about 4 bytes a
# character as str plus ids: a few hundred MB at most).
ENCODER_CACHE_CHARS = 32_000_000


def _vllm_hash_fn(algo: str) -> Any:
    if algo == "sha256":
        # vLLM's "sha256": SHA-256 of the pickled tuple (pickle builds the bytes to hash;
        # nothing pickled is ever sent or read back).
        def sha256(obj: Any) -> bytes:
            return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()

        return sha256
    if algo == "sha256_cbor":
        import cbor2  # vLLM's dependency; only a router matching such engines needs it

        def sha256_cbor(obj: Any) -> bytes:
            return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()

        return sha256_cbor
    raise ValueError(f"unsupported vLLM hash algorithm {algo!r}")


def vllm_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    algo: str = "sha256",
    seed: str = kv.VLLM_DEFAULT_SEED,
    int_hashes: bool = True,
) -> list[Any]:
    """The block hashes vLLM's prefix cache gives ``token_ids`` (no LoRA, multimodal or
    ``cache_salt`` keys), as its KV events carry them: ``hash_i = H((hash_{i-1}, tuple of
    block i's ids, None))`` with ``hash_{-1} = H(seed)`` (``NONE_HASH``), each cut to its
    low 64 bits when ``int_hashes`` (vLLM's default for events). Checked against vLLM's own
    ``hash_block_tokens`` in tests/test_vllm_kv.py."""
    if block_size < 1:
        raise ValueError("block_size must be at least 1")
    fn = _vllm_hash_fn(algo)
    parent = fn(seed)
    out: list[Any] = []
    ids = list(token_ids)
    for start in range(0, len(ids) - block_size + 1, block_size):
        parent = fn((parent, tuple(ids[start : start + block_size]), None))
        out.append(int.from_bytes(parent, "big") & ((1 << 64) - 1) if int_hashes else parent)
    return out


def scheme_key(hashing: dict[str, Any] | None, block_size: int) -> tuple[Any, ...]:
    """A hashable name for a replica's hashing (replicas with equal keys share hashes)."""
    if not hashing or hashing.get("kind") == kv.SCHEME_TEXT:
        return (kv.SCHEME_TEXT, block_size)
    return tuple(sorted(hashing.items()))


class PromptHashers:
    """Computes a request's block hashes per scheme; keeps one tokenizer per name."""

    def __init__(self) -> None:
        self._tokenizers: dict[str, Any] = {}
        # Why a scheme cannot be matched (scheme key -> reason), for status and logs.
        self.unavailable: dict[tuple[Any, ...], str] = {}
        # The prompt's tokens as the last call's engine counts them (what a cache hit is
        # capped by: an engine always computes the last prompt token).
        self.tokens = 0

    def hashes(
        self,
        key: tuple[Any, ...],
        hashing: dict[str, Any] | None,
        block_size: int,
        rendered: str,
        env: dict[str, Any] | None,
        seed: str = "",
    ) -> list[Any] | None:
        """The request's hashes under ``hashing`` (the sim's text scheme with ``seed``, this
        router's); None when this router cannot compute them."""
        if key[0] == kv.SCHEME_TEXT:
            self.tokens = max(1, -(-len(rendered) // 4))  # the sim's four characters a token
            return kv.text_block_hashes(rendered, block_size, seed) if block_size else []
        if key in self.unavailable:
            return None
        hashing = hashing or {}
        if hashing.get("kind") != kv.SCHEME_VLLM:
            self.unavailable[key] = f"unknown hashing {hashing.get('kind')!r}"
            return None
        if hashing.get("seed") is None:
            self.unavailable[key] = "the engine's hash seed is random (set PYTHONHASHSEED)"
            return None
        enc = self._tokenizer(key, str(hashing.get("tokenizer") or ""))
        if enc is None or env is None:
            return None
        try:
            ids = vllm_prompt_ids(enc, env)
            self.tokens = len(ids)
            return vllm_block_hashes(
                ids,
                int(hashing.get("block_size") or block_size),
                algo=str(hashing.get("algo")),
                seed=str(hashing["seed"]),
                int_hashes=bool(hashing.get("int_hashes", True)),
            )
        except ValueError as exc:  # an algorithm this router does not implement
            self.unavailable[key] = str(exc)
            return None
        except Exception:  # this request does not render (the engine will say why)
            return []

    def _tokenizer(self, key: tuple[Any, ...], name: str) -> Any:
        if name in self._tokenizers:
            return self._tokenizers[name]
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(name, local_files_only=True)
        except ImportError:
            self.unavailable[key] = "transformers is not installed in the router's environment"
            return None
        except Exception as exc:
            self.unavailable[key] = f"tokenizer {name!r} not found here ({type(exc).__name__})"
            return None
        enc = self._tokenizers[name] = PromptEncoder(tok)
        return enc


class PromptEncoder:
    """A tokenizer that remembers the pieces it encoded.

    An agent's conversation comes back every turn with everything before grown by a message
    or two, and encoding it whole costs about 1.5 µs a token (22 ms for 14 000 tokens, in the
    router's event loop). A fast tokenizer cuts the text at its added tokens first (the chat
    template's ``<|im_start|>``...) and encodes the pieces between them independently, so the
    ids of the whole are those of the pieces in order: this encoder splits the same way and
    keeps each piece's ids (least recently used out past :data:`ENCODER_CACHE_CHARS`), so a
    turn encodes only its new messages. Where that equivalence is not certain (an added token
    that strips spaces, matches single words or is normalised first) it encodes whole."""

    def __init__(self, tokenizer: Any, max_chars: int = ENCODER_CACHE_CHARS) -> None:
        self.tokenizer = tokenizer
        self.max_chars = max_chars
        self._cache: OrderedDict[str, list[int]] = OrderedDict()
        self._chars = 0
        self.hits = self.misses = 0
        added = dict(getattr(tokenizer, "added_tokens_decoder", None) or {})
        plain = all(
            not (t.lstrip or t.rstrip or t.single_word or t.normalized) for t in added.values()
        )
        self._ids = {str(t.content): int(i) for i, t in added.items()}
        self._split = (
            re.compile("(" + "|".join(map(re.escape, sorted(self._ids, key=len)[::-1])) + ")")
            if added and plain and getattr(tokenizer, "is_fast", False)
            else None
        )

    def encode(self, text: str) -> list[int]:
        """``tokenizer.encode(text, add_special_tokens=False)``, from pieces seen before
        where it can."""
        split = self._split
        if split is None:
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        out: list[int] = []
        cache = self._cache
        for i, piece in enumerate(split.split(text)):
            if i % 2:
                out.append(self._ids[piece])
                continue
            if not piece:
                continue
            ids = cache.get(piece)
            if ids is None:
                self.misses += 1
                ids = list(self.tokenizer.encode(piece, add_special_tokens=False))
                cache[piece] = ids
                self._chars += len(piece)
                while self._chars > self.max_chars and cache:
                    old, _ = cache.popitem(last=False)
                    self._chars -= len(old)
            else:
                self.hits += 1
                cache.move_to_end(piece)
            out.extend(ids)
        return out


def _message(m: dict[str, Any]) -> dict[str, Any]:
    """A message as vLLM hands it to the chat template."""
    out = dict(m)
    content = m.get("content")
    if isinstance(content, list):
        out["content"] = "\n".join(
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    elif content is None and m.get("role") == "assistant":
        out["content"] = None
    elif not isinstance(content, str):
        out["content"] = message_text(content)
    calls = m.get("tool_calls")
    if isinstance(calls, list):
        fixed = []
        for call in calls:
            if isinstance(call, dict) and isinstance(call.get("function"), dict):
                fn = dict(call["function"])
                if isinstance(fn.get("arguments"), str):
                    with contextlib.suppress(ValueError):
                        fn["arguments"] = json.loads(fn["arguments"])
                call = {**call, "function": fn}
            fixed.append(call)
        out["tool_calls"] = fixed
    return out


def _tool(t: Any) -> Any:
    if not isinstance(t, dict) or not isinstance(t.get("function"), dict):
        return t
    fn = t["function"]
    return {
        "type": "function",
        "function": {
            "name": fn.get("name"),
            "description": fn.get("description"),
            "parameters": fn.get("parameters"),
        },
    }


def vllm_prompt_ids(enc: PromptEncoder, env: dict[str, Any]) -> list[int]:
    """The prompt's token ids as vLLM's OpenAI handlers make them (see the module
    docstring for what is followed)."""
    tokenizer = enc.tokenizer
    messages = env.get("messages")
    if messages is None:
        prompt = env.get("prompt")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)  # a completion prompt given as token ids
        return list(tokenizer.encode(prompt if isinstance(prompt, str) else ""))
    raw = env.get("extra")
    extra: dict[str, Any] = raw if isinstance(raw, dict) else {}
    conversation = [_message(m) for m in messages if isinstance(m, dict)]
    tools = env.get("tools") or extra.get("tools")
    cont = bool(extra.get("continue_final_message", False))
    text = tokenizer.apply_chat_template(
        conversation,
        tools=[_tool(t) for t in tools] if isinstance(tools, list) and tools else None,
        add_generation_prompt=bool(extra.get("add_generation_prompt", not cont)),
        continue_final_message=cont,
        tokenize=False,
    )
    return enc.encode(text)
