"""The short nemesis run on one nats-server (what `tokenbus up` runs): tests/test_nemesis.py's
run and invariants with pauses of the only server, in a file apart so that neither file takes
over 90 s of a worker's time (docs/testing.md)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.test_nemesis import short_config, verdict
from tokenbus.evaluation.nemesis import run_nemesis
from tokenbus.evaluation.nemesis_report import print_table

pytestmark = pytest.mark.fault


@pytest.mark.timeout(300)
async def test_invariants_hold_when_the_only_nats_server_is_paused_and_killed(
    tmp_path: Path,
) -> None:
    """The same on one nats-server (what `tokenbus up` runs): pauses of it, and kills and
    pauses of the processes, every 3 s under the load; two bridges behind the harness'
    balancer. Streams ride out a pause of the only server (issue 65)."""
    seed = int(os.environ.get("TOKENBUS_NEMESIS_SEED") or 9001)
    cfg = short_config(
        tmp_path,
        seed=seed,
        nodes=1,
        duration_s=24.0,
        bridges=2,
        kinds=("nats_pause", "pause", "kill"),
    )
    report = await run_nemesis(cfg)
    print_table(report)
    failed = {i["name"]: i["examples"] for i in report["invariants"] if not i["ok"]}
    assert report["hung"] == 0, (seed, failed)
    assert "nats_pause" in {f["kind"] for f in report["faults"]}, report["faults"]
    assert report["requests"]["completed"] > 0, report["requests"]
    verdict(seed, failed)
