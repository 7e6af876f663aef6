"""What a limiter admitted while cut off from its store, on local disk until written into it.

In cut-off mode (``ratelimit.cut_off_share``: a site's bridge whose link to the hub is cut)
the limiter admits from a share of each limit and holds spend in its own book; both are
written into the store once it answers again (auth/limits.py, auth/budgets.py). Until then
they live in the process, and a process that dies loses them: its requests' counts never
reach the key's window, and their spend is never charged (a report settles only a hold the
store has). With ``ratelimit.cut_off_dir`` set, each change is also written to a file of the
process's own (replaced whole: a JSON object, a few hundred bytes per key), and a limiter
starting with the same directory takes over the files of processes that are gone (each
process holds an ``flock`` on a lock file of its own while it runs), so the next bridge at
the site writes them into the store as its own.

Nothing is written while the store answers: the file changes only while something is owed,
and then at most every :data:`SAVE_EVERY_S` (a file of thousands of holds is not rewritten per
request), so a process killed loses at most that last moment's admissions. The file is
replaced without an ``fsync``: it survives the process, not the machine's power.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import uuid
from pathlib import Path
from typing import Any

from services import lockfiles
from services import logging as tlog

log = tlog.get("ratelimit")

SAVE_EVERY_S = 0.1


def _name(owner: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in owner) or "limiter"


class CutOffState:
    """This process's file in ``directory``: ``windows`` (principal -> [window, admitted
    requests, admitted tokens, requests owed, tokens owed]) and ``holds`` (hold name ->
    [[budget entry, amount, deadline], ...])."""

    def __init__(self, directory: str | Path, owner: str) -> None:
        self.dir = Path(directory)
        stem = f"{_name(owner)}-{uuid.uuid4().hex[:8]}"
        self.path = self.dir / f"{stem}.json"
        self.lock_path = self.dir / f"{stem}.lock"
        self._fd = -1
        self._timer: asyncio.TimerHandle | None = None
        self.windows: dict[str, list[int]] = {}
        self.holds: dict[str, list[list[Any]]] = {}

    def open(self) -> CutOffState:
        """Take this process's lock; take over what gone processes left (merged into this
        process's file before theirs are removed, so a crash now loses nothing)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self._fd = lockfiles.hold(self.lock_path)
        taken: list[Path] = []
        for lock, _ in lockfiles.gone(self.dir, "*.lock", self.lock_path):
            state = lock.with_suffix(".json")
            self._merge(state)
            self.save()
            for path in (state, lock):
                with contextlib.suppress(OSError):
                    path.unlink()
            taken.append(state)
        if taken:
            log.info(
                "cut_off_state_taken_over",
                files=len(taken),
                keys=len(self.windows),
                holds=len(self.holds),
            )
        return self

    def _merge(self, path: Path) -> None:
        try:
            got = json.loads(path.read_text())
        except (OSError, ValueError):
            return
        if not isinstance(got, dict):
            return
        for principal, w in (got.get("windows") or {}).items():
            if not (isinstance(w, list) and len(w) == 5 and all(isinstance(x, int) for x in w)):
                continue
            mine = self.windows.get(principal)
            if mine is None or mine[0] < w[0]:
                self.windows[principal] = list(w)
            elif mine[0] == w[0]:
                self.windows[principal] = [
                    w[0],
                    *(a + b for a, b in zip(mine[1:], w[1:], strict=True)),
                ]
        for name, items in (got.get("holds") or {}).items():
            good = [
                [str(e), int(a), float(d)]
                for e, a, d in (i for i in items if isinstance(i, list) and len(i) == 3)
                if isinstance(a, int) and isinstance(d, int | float)
            ]
            if good:
                self.holds.setdefault(str(name), good)

    def save_soon(self) -> None:
        """:meth:`save` within :data:`SAVE_EVERY_S` (the changes meanwhile with it)."""
        if self._timer is None and self._fd >= 0:
            self._timer = asyncio.get_running_loop().call_later(SAVE_EVERY_S, self.save)

    def save(self) -> None:
        """This process's file written anew (removed when nothing is owed)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._fd < 0:
            return
        try:
            if not self.windows and not self.holds:
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
                return
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"windows": self.windows, "holds": self.holds}))
            os.replace(tmp, self.path)
        except OSError as exc:  # a full disk: what is owed is still in memory
            log.warning("cut_off_state_write_failed", error=repr(exc)[:200])

    def close(self) -> None:
        """Closed; the file is left for the next process while anything is owed."""
        if self._fd < 0:
            return
        self.save()
        if not self.windows and not self.holds:
            for path in (self.path, self.lock_path):
                with contextlib.suppress(OSError):
                    path.unlink()
        os.close(self._fd)
        self._fd = -1
