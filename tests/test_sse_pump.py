"""gateway.sse.pump: a stream's chunks as server-sent events, in order, whichever way they
go out (the pump's coalesced writes, or the stream's sink while the pump waits)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from gateway.sse import Progress, pump
from services.chunks import Chunk

pytestmark = pytest.mark.unit


class MovingStream:
    """A stream whose reader is behind by one chunk ("b"), followed by a frame that is not
    text (the one that moves the stream to another replica): the read after it waits for
    the next attempt's text ("c"), which arrives through the sink when one is set, as the
    caller's stream hands text to a waiting reader (services.caller.Stream.push_to)."""

    def __init__(self) -> None:
        self.sink: Callable[[str], bool] | None = None
        self.reads = 0
        self.queued: list[str] = []

    def push_to(self, sink: Callable[[str], bool] | None) -> None:
        self.sink = sink

    def pending(self) -> int:
        return 1 if self.reads == 1 else len(self.queued)

    def __aiter__(self) -> MovingStream:
        return self

    async def __anext__(self) -> Chunk:
        self.reads += 1
        if self.reads == 1:
            return Chunk("b", 1, 1)
        # The move (read 2): nothing to read until the next attempt's text, which comes
        # through the sink when one is set (written past whatever the reader holds).
        if self.reads == 2 and (self.sink is None or not self.sink("c")):
            self.queued.append("c")
        if self.queued:
            return Chunk(self.queued.pop(0), 1, 2)
        raise StopAsyncIteration


async def test_text_a_stream_hands_its_sink_never_overtakes_what_the_pump_holds() -> None:
    written: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        written.append(message["body"])

    def events(c: Chunk, buf: list[str]) -> None:
        buf.append(c.text)

    def sink(text: str) -> bool:
        written.append(text.encode())
        return True

    await pump(send, MovingStream(), Chunk("a", 1, 0), events, [], Progress(t1_ns=0), sink)
    assert b"".join(written) == b"abc"


class EndingStream:
    """A stream whose last chunk ("b") and end arrived together (one NATS message carried
    the last chunk and the final frame): both are pending when the pump reads "b"."""

    def __init__(self) -> None:
        self.left = ["b"]

    def push_to(self, sink: Callable[[str], bool] | None) -> None:
        pass

    def pending(self) -> int:
        return 1  # the end is here too

    def __aiter__(self) -> EndingStream:
        return self

    async def __anext__(self) -> Chunk:
        if self.left:
            return Chunk(self.left.pop(0), 1, 1)
        raise StopAsyncIteration


async def test_a_last_chunk_that_came_with_the_end_is_left_for_the_closing_write() -> None:
    """Issue 70: the last text and the answer's end leave in one write (the caller's closing
    events follow ``buf``), not one write for the text and another for the end."""
    written: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        written.append(message["body"])

    def events(c: Chunk, buf: list[str]) -> None:
        buf.append(c.text)

    buf: list[str] = []
    await pump(send, EndingStream(), Chunk("a", 1, 0), events, buf, Progress(t1_ns=0))
    assert written == [b"a"] and buf == ["b"]
