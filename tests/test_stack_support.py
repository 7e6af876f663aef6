"""The tests' own stack starter against a race of parallel test workers: a bridge whose port
another server took between its draw and its bind is started again on another port, never
left to a port that answers for someone else."""

from __future__ import annotations

import pytest

from tests.support import procs as procs_support
from tests.support.ports import listened_by, taken_port
from tests.support.procs import Procs, ProcStack, start_worker

pytestmark = pytest.mark.stack


async def test_a_bridge_whose_port_another_server_took_starts_again_elsewhere(
    procs: Procs, model: str
) -> None:
    """The port answers (another server listens on it) while the stack's own bridge exits
    with "Address already in use": before, the stack took that other server for its bridge
    (a CI run's test got 401 for its own key from another test's bridge). Now the bridge
    starts again on a free port, the dead one is forgotten, and the port is its own."""
    worker = start_worker(procs, model, 0)  # a bridge is ready once it has a replica
    with taken_port() as port:
        first = procs.start("bridge", "serve", "bridge", "--port", str(port))
        stack = ProcStack(procs, model, {"worker": [worker], "bridge": [first]}, port)
        await procs_support._wait_own_bridge(stack, procs, (), {})
        assert not first.alive() and "Address already in use" in first.output()
        assert stack.port != port and stack.bridge is not first
        assert listened_by(stack.bridge.pid, stack.port or 0)
        assert procs.all_alive() and first not in procs.procs
