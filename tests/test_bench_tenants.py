"""``tokenbus bench --tenants``: a flooding tenant and a light one on one saturated worker,
with the worker's flow control on and off, as a user runs it (the CLI, real processes)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.support.repo import run_cli
from tokenbus.evaluation.bench_stack import replica_specs

pytestmark = pytest.mark.stack


def test_replica_spec_turns_the_workers_flow_control_off_and_on() -> None:
    assert replica_specs(["1:max_running=8,flow=off"]) == [
        (["--sim-max-running", "8"], {"TOKENBUS_WORKER__FLOW__ENABLED": "false"})
    ]
    assert replica_specs(["2:flow=on"])[1][1] == {"TOKENBUS_WORKER__FLOW__ENABLED": "true"}
    with pytest.raises(SystemExit, match="flow is on or off"):
        replica_specs(["1:flow=maybe"])


def test_two_tenants_the_light_one_is_served_first_only_with_flow_control(
    tmp_path: Path,
) -> None:
    out = tmp_path / "tenants.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENBUS_")}
    # 5 ms a token: A's answers take 0.65 s, so with flow control off B waits behind A's
    # 56 queued answers for about 4.6 s; with it on, for the next free slot.
    r = run_cli(
        *("bench", "--tenants", "two", "--duration", "2", "--sim-decode-ms", "5"),
        *("--out", str(out)),
        env=env,
        timeout=110,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "results:" in r.stdout and "B TTFT while A floods" in r.stdout
    report = json.loads(out.read_text())
    assert report["machine"]["cpus"] and report["config"]["tenants"] == "two"
    two = report["scenarios"]["two"]
    on, off = two["on"], two["off"]
    for run in (on, off):
        assert run["errors"] == {"a": {}, "b": {}}
        # What the machine's load cannot change (the figures themselves are the benchmark's
        # to report, not this test's to bound): B alone is answered before B behind A's
        # queue; 8 slots of one token per 5 ms step make at most 1600 tokens/s, most A's.
        assert run["b_alone_requests"] > 5
        assert 0 < run["b_alone_ttft_ms"]["p50"] < off["b_flood_ttft_ms"]["p50"]
        assert run["b_flood_requests"] >= 1
        assert 0 < run["a_tokens_per_s"] <= run["total_tokens_per_s"] < 1700
        assert run["a_tokens_per_s"] > run["total_tokens_per_s"] / 2
        assert run["settings"]["slot_turnover_ms"] == 128 * 5 / 8
    # Flow control puts B ahead of A's queue: a large effect, not a margin.
    # (How long B waits behind A's queue without it is the machine's: 955 ms in one loaded
    # full run, over 2 s alone; only the ratio is this test's.)
    assert on["b_flood_ttft_ms"]["p50"] * 5 < off["b_flood_ttft_ms"]["p50"]
    assert on["b_flood_requests"] > off["b_flood_requests"]
    targets = {c["target"]: c for c in two["checks"]}
    assert len(targets) == 2 and all(isinstance(c["met"], bool) for c in targets.values())
