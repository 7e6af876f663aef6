"""What a caller's stream delivered to its reader across its attempts (:class:`ResumePoint`):
the text and tokens so far, the chunk index expected next, and whether the stream may still
move to another replica and resume after that text."""

from __future__ import annotations

from typing import Any

from bus_schemas.side_outputs import GENERATION
from services.chunks import Chunk, side_chunk

# Output a stream cannot be resumed after once some of it was delivered.
_UNRESUMABLE = tuple(s.name for s in GENERATION if not s.resumable)


class ResumePoint:
    """The delivered text of a stream, where its next attempt resumes."""

    __slots__ = ("_echo", "_text", "next_index", "no_resume", "resume_refused", "resumed", "tokens")

    def __init__(self, echo: bool) -> None:
        # A request that echoes its prompt: its text cannot be continued elsewhere.
        self._echo = echo
        self._text: list[str] = []  # text received so far (the resume point)
        self.tokens = 0  # tokens received so far, every attempt's
        self.resumed = 0  # tokens delivered before the current attempt
        self.next_index = 0  # chunk index expected next (per attempt)
        # Output other than answer text reached the caller (a tool-call fragment, reasoning,
        # refusal, or an echoed prompt): the stream can no longer be resumed elsewhere.
        self.no_resume = False
        # The replica serving the current attempt cannot continue its answer elsewhere (an
        # upstream that starts over instead of continuing a message): once text arrived, a
        # cut-off stream ends with its error rather than a spliced answer.
        self.resume_refused = False

    @property
    def has_text(self) -> bool:
        """Whether any text was delivered (a next attempt continues it)."""
        return any(self._text)

    @property
    def movable(self) -> bool:
        """Whether another replica may continue the stream from here."""
        return not self.no_resume and not (self.resume_refused and self.has_text)

    def take(self, frame: dict[str, Any]) -> Chunk:
        """The chunk of ``frame``, the next in order, counted as delivered."""
        text, n, i = frame["d"], int(frame.get("n", 1)), self.next_index
        if len(frame) > 4:  # more than t, d, n, i: output beside the text
            self._count(text, n)
            c = side_chunk(frame, text, n, i)
            if any(getattr(c, name) for name in _UNRESUMABLE):
                self.no_resume = True
            return c
        self.plain(text, n)
        return Chunk(text, n, i)

    def plain(self, text: str, n: int) -> None:
        """A plain text chunk, the next in order, delivered."""
        self._count(text, n)
        if self._echo:
            self.no_resume = True

    def _count(self, text: str, n: int) -> None:
        self.next_index += 1
        self._text.append(text)
        self.tokens += n

    def next_attempt(self) -> dict[str, Any]:
        """A new attempt starts (chunk indexes from 0 again): the ``resume`` its request
        carries (``since``: what the attempt moved from began with, so its limiter charges it
        only what it delivered itself)."""
        self.next_index = 0
        since, self.resumed = self.resumed, self.tokens
        return {"text": "".join(self._text), "tokens": self.tokens, "since": since}
