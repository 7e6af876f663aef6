"""Reading prompt files: JSON Lines, or plain text with one item per line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def read_lines(path: str | Path) -> Iterator[tuple[int, dict[str, Any] | str]]:
    """The file's non-empty lines as (line number, the JSON object or the text). A line that
    starts with ``{`` must be valid JSON (ValueError naming the line otherwise)."""
    for n, raw in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not JSON: {exc.msg}") from None
            yield n, obj if isinstance(obj, dict) else {}
        else:
            yield n, line
