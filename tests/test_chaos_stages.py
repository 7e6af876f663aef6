"""Chaos, the stages: kill -9 of an auth, ratelimit or filter instance under steady load
(64 concurrent clients) on the locked bus; the request path's processes:
tests/test_chaos.py, which holds the load and the stack these share."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.lockedbus import LockedBus
from tests.test_chaos import bus, kill_9_under_load

pytestmark = pytest.mark.fault

# The locked bus of each test's own (a fixture of tests/test_chaos.py).
__all__ = ["bus"]


@pytest.mark.parametrize("victim", ["auth", "ratelimit", "filter"])
async def test_kill_9_under_load_loses_no_request(
    bus: LockedBus, model: str, victim: str, tmp_path: Path
) -> None:
    await kill_9_under_load(bus, model, victim, tmp_path)
