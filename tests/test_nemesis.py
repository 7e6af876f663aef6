"""The nemesis run, short (docs/nemesis.md): a 3-node locked cluster, one instance of each
member role, two workers, a bridge and telemetry; HTTP and NATS streams from three keys with
budgets, a batch and a background response, while a fault is injected every 3 s (chosen by
a seeded generator: the seed is printed, ``TOKENBUS_NEMESIS_SEED`` replays one) and healed
before the next. Asserts the invariants (no violation, no hung request), never a timing or
an availability."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tokenbus.evaluation.nemesis import run_nemesis
from tokenbus.evaluation.nemesis_config import Config
from tokenbus.evaluation.nemesis_report import print_table

pytestmark = pytest.mark.fault


# Its own waits are bounded, and together can pass the suite's 120 s on a loaded machine:
# 27 s of load and its start, then up to 60 s each for the spend reports' and the records'
# consumers to settle, and holds of failed requests waited out to their 15 s deadlines.
@pytest.mark.timeout(300)
async def test_invariants_hold_under_a_fault_every_three_seconds(tmp_path: Path) -> None:
    seed = int(os.environ.get("TOKENBUS_NEMESIS_SEED") or 4805)
    cfg = short_config(tmp_path, seed=seed, nodes=3, duration_s=27.0, bridges=1, partition_s=1.5)
    report = await run_nemesis(cfg)
    print_table(report)  # shown with -s: the seed, the faults, what each cost
    failed = {i["name"]: i["examples"] for i in report["invariants"] if not i["ok"]}
    assert report["hung"] == 0, (seed, failed)
    assert len(report["faults"]) >= 5, report["faults"]
    assert report["requests"]["completed"] > 0, report["requests"]
    # Harsher than the 10-minute target (a fault every 3 s). No expected failure is left:
    # finding 16's undercharge (a report settled on a replica's stale read; a router's
    # resend's duplicate settling the hold its answer needed) was the last, both causes
    # fixed; any violation fails, an overcharge and a hold of an answered request included.
    verdict(seed, failed)


def short_config(tmp_path: Path, **over: Any) -> Config:
    """The suite's short run: one instance of each member role, two workers, three NATS and
    three HTTP clients, a fault every 3 s, timers small; ``over`` what a test sets."""
    base: dict[str, Any] = {
        "fault_every_s": 3.0,
        "per_role": 1,
        "workers": 2,
        "nats_clients": 3,
        "http_clients": 3,
        "deadline_s": 15.0,
        "batch_lines": 12,
        "warmup_s": 2.0,
        "pause_s": 1.2,
        "down_s": 0.5,
        "run_dir": str(tmp_path / "run"),
        "out": str(tmp_path / "nemesis.json"),
        "quiet": True,
    }
    return Config(**{**base, **over})


def verdict(seed: int, failed: dict[str, Any]) -> None:
    """Fail on any violation, naming the seed that replays it."""
    assert not failed, (seed, failed)
