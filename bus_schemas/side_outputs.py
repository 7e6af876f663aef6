"""Output a generation carries beside its text, in one table: tool calls, logprobs, refusal,
reasoning, and an embeddings request's vectors.

Each row says what the output is called (the field of a backend's delta, of a caller's chunk
and of an assembled answer), its key and type in a chunk frame
(:class:`bus_schemas.messages.ChunkFrame`), how a whole answer puts its pieces together, and
how each API writes it. A new engine output is a row here, its field on the chunk frame, the
backend's :class:`Delta` and the caller's :class:`Chunk` (``tests/test_contract.py`` checks
they agree), and what each API's writer does with it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter
from typing import Literal

# How a whole answer puts an output's pieces together:
#   text      the pieces are text fragments, joined in order
#   calls     tool-call deltas, merged by their ``index`` (id and name from the first that
#             has them, ``function.arguments`` fragments joined)
#   lists     logprobs objects whose lists (``content``, ``tokens``...) are extended
#   by_index  whole values (``{"index", "embedding"}``), kept by index, in index order
Merge = Literal["text", "calls", "lists", "by_index"]


@dataclass(frozen=True, slots=True)
class SideOutput:
    """One output beside the text, and how each part of tokenbus carries it."""

    name: str  # the field of a delta, a chunk, an assembled answer (``embeddings`` there)
    wire: str  # its key in a chunk frame
    type: type  # its type there
    merge: Merge
    # A stream that delivered some of it may still move to another replica (resuming after
    # the text): a tool call, refusal or reasoning half sent cannot be continued elsewhere.
    resumable: bool
    # How each API writes it; "" where that API has no place for it.
    # OpenAI chat: its field in a streamed ``delta`` and in a whole ``message``.
    chat: str = ""
    # Other names an OpenAI-shaped upstream may send it under in a delta (read, not written).
    chat_aliases: tuple[str, ...] = ()
    # OpenAI chat and text completions alike: its field on the ``choice`` itself.
    choice: str = ""
    # OpenAI Responses: the streamed event that carries it.
    responses: str = ""
    # Anthropic Messages: the type of the content block it goes out in.
    anthropic: str = ""


TOOL_CALLS = SideOutput(
    "tool_calls",
    "tc",
    list,
    "calls",
    resumable=False,
    chat="tool_calls",
    responses="response.function_call_arguments.delta",
    anthropic="tool_use",
)
LOGPROBS = SideOutput(
    "logprobs",
    "lp",
    dict,
    "lists",
    resumable=True,
    choice="logprobs",
    responses="response.output_text.delta",  # its ``logprobs``, beside the text delta
)
REFUSAL = SideOutput(
    "refusal",
    "rf",
    str,
    "text",
    resumable=False,
    chat="refusal",
    responses="response.refusal.delta",
    anthropic="text",
)
REASONING = SideOutput(
    "reasoning",
    "rs",
    str,
    "text",
    resumable=False,
    chat="reasoning_content",
    chat_aliases=("reasoning",),  # vLLM's newer name
    responses="response.reasoning_text.delta",
    anthropic="thinking",
)
# Not a generation's: an embeddings request's answer, one vector per chunk frame.
EMBEDDING = SideOutput("embedding", "em", dict, "by_index", resumable=True)

# Every side output, in the order of the fields and of a chunk frame's keys.
SIDE_OUTPUTS = (TOOL_CALLS, LOGPROBS, REFUSAL, REASONING, EMBEDDING)
# What a generation's delta may carry (all but the embedding).
GENERATION = (TOOL_CALLS, LOGPROBS, REFUSAL, REASONING)
# The chunk frame's keys of the side outputs, in order.
WIRE_KEYS = tuple(s.wire for s in SIDE_OUTPUTS)
# The outputs of an OpenAI chat ``delta`` after its ``content``, in the order OpenAI (and
# vLLM) write them.
CHAT_DELTA = (REASONING, REFUSAL, TOOL_CALLS)


def carries(outputs: tuple[SideOutput, ...]) -> Callable[[object], bool]:
    """A test of whether an object (a delta, a chunk) holds any of ``outputs`` (not None):
    one C call per object, for the hot path."""
    values = attrgetter(*(s.name for s in outputs))
    nothing = (None,) * len(outputs)
    return lambda obj: values(obj) != nothing
