"""The output filter on one generated stream (the worker runs it where the stream is
produced): what of the engine's text the caller may see and when, and the output beside the
text scanned whole at the end."""

from __future__ import annotations

from typing import Any, Protocol

from bus_schemas.side_outputs import LOGPROBS, REASONING, REFUSAL, TOOL_CALLS
from filter.policy import FilterPolicy
from filter.scanner import Scanner, StreamOutput, StreamScanner
from services.caller import Assembled, Chunk


class SideOutput(Protocol):
    """An engine's delta as far as the gate reads it: its output beside the text."""

    @property
    def tool_calls(self) -> list[dict[str, Any]] | None: ...
    @property
    def logprobs(self) -> dict[str, Any] | None: ...
    @property
    def refusal(self) -> str | None: ...
    @property
    def reasoning(self) -> str | None: ...


def output_scanner(policy: FilterPolicy | None, window: int | None) -> StreamScanner | None:
    """A stream scanner for the policy the filter stage put in the envelope (checked when
    the worker admits the request), if any.

    It runs only the detectors that change the text (block, redact) and holds back only what
    could still grow into one of their matches, so the first token is not delayed for a
    detector that would merely flag; flags are found by one whole-text scan at the end
    (:func:`output_flags`).
    """
    if policy is None:
        return None
    return StreamScanner(policy, window=window, changes_only=True)


def output_flags(scan: StreamScanner, text: str) -> list[str]:
    """Ids of the detectors the policy flags (not blocks or redacts) that ``text`` triggers."""
    if not text:
        return []
    found = Scanner(scan.policy).scan(text).findings
    return sorted({f.detector for f in found if f.action == "flag"})


class OutputGate:
    """The output filter on one stream: what of the engine's text the caller may see, when.

    It holds back what could still grow into a block or redact match, stops at a block, and
    on a migrated request cuts what the caller already has.
    """

    __slots__ = ("_already", "_changed", "_held", "_raw", "blocked", "scan")

    def __init__(self, scan: StreamScanner, resume_text: str) -> None:
        self.scan = scan
        self.blocked = False
        self._raw: list[str] = []  # the engine's text, for the flag scan at the end
        # Output beside the text (tool calls, refusal, reasoning, logprobs), held to the end
        # and scanned whole there.
        self._held = Assembled()
        self._changed = False  # the policy redacted some of the held output
        self._already = 0  # output the caller already has (a migrated request), not resent
        if resume_text:
            # The scanner needs what came before; what it holds of it was sent already.
            self._already = len(resume_text) - len(scan.feed(resume_text).text_to_emit)

    @classmethod
    def for_policy(
        cls, policy: FilterPolicy | None, window: int | None, resume_text: str
    ) -> OutputGate | None:
        """A gate for the policy the filter stage put in the envelope, if any."""
        scan = output_scanner(policy, window)
        return None if scan is None else cls(scan, resume_text)

    def release(self, text: str, finish: str | None) -> str:
        """What may go to the caller now of the engine's next ``text`` (the held tail too when
        ``finish`` ends the stream); sets ``blocked`` when the policy stops the stream."""
        self._raw.append(text)
        scan = self.scan
        out = scan.feed(text) if text else None
        if finish is not None and (out is None or out.blocked_by is None):
            tail = scan.finish()
            out = StreamOutput(
                (out.text_to_emit if out else "") + tail.text_to_emit, tail.blocked_by
            )
        if out is None:
            return ""
        text = out.text_to_emit
        if self._already and text:
            cut = min(self._already, len(text))
            text = text[cut:]
            self._already -= cut
        if out.blocked_by is not None:
            self.blocked = True
        return text

    def hold(self, d: SideOutput) -> None:
        """Keep ``d``'s output beside the text until :meth:`release_held`."""
        self._held.add(Chunk("", 0, 0, d.tool_calls, d.logprobs, d.refusal, d.reasoning))

    def release_held(self) -> dict[str, Any] | None:
        """The held output, scanned: tool-call arguments, refusal and reasoning text are
        redacted or stop the stream (``blocked``) as the policy says; logprobs go out only
        when the filter changed none of the output (their tokens would show what it
        removed)."""
        held = self._held
        side: dict[str, Any] = {}
        scanner = Scanner(self.scan.policy)
        calls = held.tool_calls
        for call in calls or ():
            fn = call["function"]
            fn["arguments"] = self._scan_whole(scanner, fn["arguments"])
        if calls and not self.blocked:
            side[TOOL_CALLS.wire] = [{"index": i, **c} for i, c in enumerate(calls)]
        for key, text in ((REFUSAL.wire, held.refusal), (REASONING.wire, held.reasoning)):
            if text and not self.blocked:
                side[key] = self._scan_whole(scanner, text)
        if self.blocked:
            return None
        if held.logprobs is not None and not self.scan.findings and not self._changed:
            side[LOGPROBS.wire] = held.logprobs
        return side or None

    def _scan_whole(self, scanner: Scanner, text: str) -> str:
        res = scanner.scan(text)
        if res.blocked:
            self.blocked = True
            return ""
        if res.redacted:
            self._changed = True
            return res.redacted_text
        return text

    def flags(self) -> list[str]:
        """Ids of the detectors the policy flags that the whole output triggers."""
        return output_flags(self.scan, "".join(self._raw))
