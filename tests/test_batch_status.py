"""A batch's status machine (jobs/batch_status.py) and the table docs/batches.md shows."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from jobs.batch_status import OPEN, STATUSES, TRANSITIONS, ForbiddenTransition, transition

pytestmark = pytest.mark.unit

DOC = Path(__file__).resolve().parent.parent / "docs" / "batches.md"


def _documented() -> set[tuple[str, str]]:
    """The (from, to) pairs of the docs' "| from | to | when |" table."""
    text = DOC.read_text()
    table = text[text.index("| from | to | when |") :].split("\n\n", 1)[0]
    pairs = set()
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        for a in re.findall(r"`([a-z_]+)`", cells[0]):
            for b in re.findall(r"`([a-z_]+)`", cells[1]):
                pairs.add((a, b))
    return pairs


def test_the_documented_status_changes_are_the_ones_the_code_allows() -> None:
    allowed = {(a, b) for a, tos in TRANSITIONS.items() for b in tos}
    assert _documented() == allowed
    # Every status has its row, and only the open ones go anywhere.
    assert set(TRANSITIONS) == set(STATUSES)
    assert {a for a, _ in allowed} == set(OPEN)


def test_a_change_the_table_forbids_raises() -> None:
    assert transition("validating", "in_progress") == "in_progress"
    for frm, to in [("completed", "in_progress"), ("cancelled", "finalizing"), ("?", "failed")]:
        with pytest.raises(ForbiddenTransition):
            transition(frm, to)  # type: ignore[arg-type]
