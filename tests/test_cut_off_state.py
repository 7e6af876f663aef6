"""auth/cut_off_state.py: a limiter's admissions while cut off, kept on disk for the next
process; a live process's file is never taken."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from auth.cut_off_state import CutOffState

pytestmark = pytest.mark.unit


def test_a_gone_processs_state_is_taken_over_and_a_live_ones_is_not(tmp_path: Path) -> None:
    gone = CutOffState(tmp_path, "bridge-1").open()
    live = CutOffState(tmp_path, "bridge-2").open()
    gone.windows["k.a"] = [100, 2, 40, 2, 40]
    gone.holds["req-1"] = [["b.k.a.total", 7, 1e12]]
    gone.save()
    gone.close()  # what it owes is left behind
    assert json.loads(gone.path.read_text())["holds"]["req-1"] == [["b.k.a.total", 7, 1e12]]
    live.windows["k.a"] = [100, 1, 10, 1, 10]
    live.save()
    # A third process takes the gone one's (merged with nothing of its own), not the live one's.
    nxt = CutOffState(tmp_path, "bridge-3").open()
    assert nxt.windows == {"k.a": [100, 2, 40, 2, 40]}
    assert nxt.holds == {"req-1": [["b.k.a.total", 7, 1e12]]}
    assert not gone.path.exists() and not gone.lock_path.exists()
    assert live.path.exists()
    # Its own file has them now: killed here, the next one would take them again.
    assert json.loads(nxt.path.read_text())["windows"] == {"k.a": [100, 2, 40, 2, 40]}
    # The live one closes with its counts owed; one more process merges them (same window).
    live.close()
    nxt.close()
    last = CutOffState(tmp_path, "bridge-4").open()
    assert last.windows == {"k.a": [100, 3, 50, 3, 50]}
    # Nothing owed any more: nothing left on disk once closed.
    last.windows.clear()
    last.holds.clear()
    last.close()
    assert list(tmp_path.iterdir()) == []


def test_a_damaged_file_is_skipped(tmp_path: Path) -> None:
    gone = CutOffState(tmp_path, "bridge-1").open()
    gone.windows["k.a"] = [100, 1, 1, 1, 1]
    gone.save()
    gone.close()
    gone.path.write_text('{"windows": {"k.a": [1, "x"], "k.b": [5, 1, 1, 1, 1]}, "holds": 3')
    other = CutOffState(tmp_path, "bridge-x").open()
    other.close()
    gone2 = tmp_path / "bridge-y-00000000.json"
    (tmp_path / "bridge-y-00000000.lock").write_text("")
    gone2.write_text('{"windows": {"k.a": [1, "x"], "k.b": [5, 1, 1, 1, 1]}, "holds": {"r": [1]}}')
    nxt = CutOffState(tmp_path, "bridge-z").open()
    assert nxt.windows == {"k.b": [5, 1, 1, 1, 1]}
    assert nxt.holds == {}
