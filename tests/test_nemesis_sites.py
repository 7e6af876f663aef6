"""The short nemesis run with a site (issue 71, item 4): tests/test_nemesis.py's run and
invariants on one hub node, with a site whose leaf node dials the hub through a link the
faults cut (connections closed, new ones refused), stall (nothing crosses, the connections
stay) and slow (100 ms each way), each for 1.5 s, every 3 s, among kills and pauses of the
processes; a worker at the site. A file apart so that no file takes over 90 s of a worker's
time (docs/testing.md)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.test_nemesis import short_config, verdict
from tokenbus.evaluation.nemesis import run_nemesis
from tokenbus.evaluation.nemesis_report import print_table
from tokenbus.evaluation.options import SITE_KINDS

pytestmark = pytest.mark.fault


@pytest.mark.timeout(300)
async def test_invariants_hold_while_a_site_s_link_is_cut_stalled_and_slowed(
    tmp_path: Path,
) -> None:
    seed = int(os.environ.get("TOKENBUS_NEMESIS_SEED") or 7101)
    cfg = short_config(
        tmp_path,
        seed=seed,
        nodes=1,
        sites=1,
        duration_s=27.0,
        bridges=1,
        partition_s=1.5,
        kinds=(*SITE_KINDS, "pause", "kill"),
    )
    report = await run_nemesis(cfg)
    print_table(report)
    failed = {i["name"]: i["examples"] for i in report["invariants"] if not i["ok"]}
    assert report["hung"] == 0, (seed, failed)
    assert {f["kind"] for f in report["faults"]} & set(SITE_KINDS), report["faults"]
    assert report["requests"]["completed"] > 0, report["requests"]
    # The site's worker served over its link (it is one of the three replicas routed to).
    assert report["served_by"].get(f"{cfg.model}-a0", 0) > 0, report["served_by"]
    verdict(seed, failed)
