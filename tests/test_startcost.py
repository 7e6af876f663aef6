"""``tokenbus bench --start-cost`` as a user runs it: each service started on a nats-server of
the run's own, its time to ready and its CPU written as JSON (docs/testing.md, "Every
process's start")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.repo import run_cli

pytestmark = pytest.mark.stack


def test_the_start_cost_report_times_each_service_it_started(tmp_path: Path) -> None:
    out = tmp_path / "start.json"
    done = run_cli(
        "bench", "--start-cost", "--start-trials", "2", "--start-services", "router,worker",
        "--out", str(out), timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["tool"] == "tokenbus bench --start-cost"
    cost = report["start_cost"]
    assert cost["trials"] == 2 and set(cost["services"]) == {"router", "worker"}
    for role, row in cost["services"].items():
        for key in ("ready_s", "cpu_s"):  # a start takes time and CPU, and both are spread
            assert 0 < row[key]["min"] <= row[key]["p50"] <= row[key]["max"], (role, row)
    assert cost["cpu_s_p50_sum"] == pytest.approx(
        sum(r["cpu_s"]["p50"] for r in cost["services"].values()), abs=0.002
    )


def test_an_unknown_service_is_refused_before_anything_starts(tmp_path: Path) -> None:
    out = tmp_path / "start.json"
    done = run_cli("bench", "--start-cost", "--start-services", "router,nope", "--out", str(out))
    assert done.returncode == 2 and "nope" in done.stderr
    assert not out.exists()
