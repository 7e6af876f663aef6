"""``tokenbus bench --cold-path`` as a user runs it: every in-process step of a chat request
timed warm and cold, written as JSON (docs/benchmarks.md, issue 50)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.repo import run_cli

pytestmark = pytest.mark.stack


def test_the_cold_path_report_times_every_step_warm_and_cold(tmp_path: Path) -> None:
    out = tmp_path / "cold.json"
    done = run_cli(
        "bench", "--cold-path", "--cold-trials", "3", "--cold-gap-ms", "1", "--out", str(out)
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["tool"] == "tokenbus bench --cold-path" and report["machine"]["cpus"] >= 1
    cold = report["cold_path"]
    names = [r["step"] for r in cold["steps"]]
    assert names[0].startswith("nothing") and len(names) == len(set(names)) == 12
    assert any(n.startswith("bridge:") for n in names) and any(
        n.startswith("worker:") for n in names
    )
    for row in cold["steps"][1:]:  # each step does work: it takes time, warm and cold
        assert row["warm_us"] > 0 and row["cold_us"] > 0, row
    assert cold["warm_steps_us"] == round(sum(r["warm_us"] for r in cold["steps"][1:]), 1)
    assert set(cold["parse_after_sleep_ms_us"]) == {"0.0", "0.1", "1.0", "10.0", "50.0"}
    assert cold["parse_second_call_us"] > 0 and cold["parse_after_200us_spin_us"] > 0
