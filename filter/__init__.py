"""Content scanning for input and output streams (the safety module; see the issue tracker).

Input messages are scanned whole with :class:`Scanner`; generated output is scanned as it
streams with one :class:`StreamScanner` per stream. Both apply a :class:`FilterPolicy`::

    result = Scanner(FilterPolicy.strict(blocklist=["project x"])).scan(text)
    result.blocked, result.redacted_text, result.findings

    stream = StreamScanner(policy)
    out = stream.feed(delta)  # out.text_to_emit, out.blocked_by
    out = stream.finish()
"""

from filter.detectors import BUILTIN, INJECTION_RULES, iban_ok, looks_random, luhn_ok
from filter.policy import PRESETS, Action, FilterPolicy
from filter.scanner import (
    DEFAULT_WINDOW,
    Finding,
    Scanner,
    ScanResult,
    StreamOutput,
    StreamScanner,
    redaction_label,
)


def detector_ids() -> tuple[str, ...]:
    """Every id a policy can name: built-in detectors, ``blocklist`` and injection rules."""
    return (
        *(d.id for d in BUILTIN),
        "blocklist",
        *(r.id for r in INJECTION_RULES),
    )


__all__ = [
    "DEFAULT_WINDOW",
    "PRESETS",
    "Action",
    "FilterPolicy",
    "Finding",
    "ScanResult",
    "Scanner",
    "StreamOutput",
    "StreamScanner",
    "detector_ids",
    "iban_ok",
    "looks_random",
    "luhn_ok",
    "redaction_label",
]
