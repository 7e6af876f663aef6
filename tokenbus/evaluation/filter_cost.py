"""What scanning costs: microseconds per KB of text and per streamed token.

``measure()`` is called by the CLI benchmark; the samples double as the test suite's
false-positive corpus (prose and code contain nothing any detector should report).
"""

from __future__ import annotations

import time
from typing import Any

from filter.policy import FilterPolicy
from filter.scanner import Scanner, StreamScanner

PROSE = """\
The quarterly report covers 2023 and the first half of 2024. Revenue grew 12.5% to
$4,210,000 while headcount rose from 118 to 131 people across 7 offices. Our release
cadence moved to version 3.14.2 in March, and the on-call rotation now spans 24 hours in
3 time zones. At 09:30 on 2024-06-01 the team met in room 4B to review 1,024 open tickets;
order 100245 shipped on 15/06/2024 and invoice INV-2024-0457 was paid on time. The server
at 192.168.10.24 handled 35,000 requests per second at peak, with p99 latency of 41 ms.
Please ignore the noise in last week's graphs: the new dashboard shows the previous
quarter for comparison. You are welcome to forward this to anyone in the developer
relations group. The system prompt designers will share their guidelines next month.
Flight BA 117 departs at 18:45 from terminal 5; gate changes are posted 40 minutes before.
"""

CODE = """\
import uuid
from dataclasses import dataclass

PALETTE = {"primary": "#1a73e8", "danger": "#d93025", "muted": "#5f6368"}
VERSION = "2.31.0"
BUILD_SHA = "9fceb02d0ae598e95dc970b74767f19372d61af8"
REQUEST_ID = uuid.UUID("550e8400-e29b-41d4-a716-446655440000")
ORDER_NUMBERS = ["ORD-2024-000123", "#555-0142-8891", "PO 7788-1122-3344"]
RELEASED = "2024-03-15T12:30:45Z"
LOCALHOST = "127.0.0.1:8080"


@dataclass
class RequestContext:
    request_id: str
    max_new_tokens: int = 4096
    temperature: float = 0.7

    def process_incoming_request_batch(self, items: list[int]) -> int:
        total_prompt_tokens = sum(items) * 1000003 % 2147483647
        return total_prompt_tokens + len(self.request_id)


def convert_utf8_to_utf16_string(data: bytes) -> str:
    return data.decode("utf-8").encode("utf-16-le").decode("utf-16-le")


class HTTPRequestHandlerV2:
    timeout_seconds = 30
    retry_backoff_ms = (100, 250, 500, 1000)
"""

MIXED = (
    PROSE[:500]
    + "\nReach me at jane.roe@example.org or +1 (415) 555-0123 for the card 4111 1111 1111 1111.\n"
    + CODE[:600]
    + "\nAWS_ACCESS_KEY_ID=AKIAIOSFODNN7EXAMPLE\n"
)

SAMPLES = {"prose": PROSE, "code": CODE, "mixed": MIXED}


def _best_of(runs: int, fn: Any) -> float:
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(
    policy: FilterPolicy | None = None,
    *,
    repeat: int = 8,
    runs: int = 5,
    token_chars: int = 4,
) -> dict[str, Any]:
    """Scanner cost per KB of each sample (whole-text scan) and per streamed token.

    Each sample is repeated ``repeat`` times; the best of ``runs`` timings is kept. Tokens
    are ``token_chars``-character slices fed to a :class:`StreamScanner`.
    """
    policy = policy if policy is not None else FilterPolicy()
    scanner = Scanner(policy)
    scan: dict[str, float] = {}
    stream_token: dict[str, float] = {}
    stream_kb: dict[str, float] = {}
    for name, sample in SAMPLES.items():
        text = sample * repeat
        kb = len(text.encode()) / 1024
        scan[name] = round(_best_of(runs, lambda t=text: scanner.scan(t)) * 1e6 / kb, 1)
        tokens = [text[i : i + token_chars] for i in range(0, len(text), token_chars)]

        def stream(tokens: list[str] = tokens) -> None:
            s = StreamScanner(policy)
            for tok in tokens:
                s.feed(tok)
            s.finish()

        elapsed = _best_of(runs, stream)
        stream_token[name] = round(elapsed * 1e6 / len(tokens), 2)
        stream_kb[name] = round(elapsed * 1e6 / kb, 1)
    return {
        "policy": policy.preset,
        "scan_us_per_kb": scan,
        "stream_us_per_token": stream_token,
        "stream_us_per_kb": stream_kb,
        "token_chars": token_chars,
    }


if __name__ == "__main__":
    import json

    print(json.dumps(measure(), indent=2))
