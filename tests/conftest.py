"""The suite's fixtures and hooks: a real nats-server on a random port, a client and a bare
connection on it, the key store, a test's processes, the fake upstream, the pids a test
paused, network-namespace hosts; the order files run in and the tier every test must name.
The helpers they use are tests/support's modules."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client as NATS

from auth.store import KeyStore
from services import logging as tlog
from tests import netns
from tests.support.busdata import key_store, new_model
from tests.support.natsserver import NatsServer
from tests.support.procs import Procs
from tests.support.upstreams import Upstream
from tokenbus import Client

tlog.setup("warning")

# The simulated model's context (8192 tokens by default) would refuse the very long streams
# many tests use to keep a request running; the tests of the context limit set their own.
os.environ.setdefault("TOKENBUS_WORKER__SIM__MAX_MODEL_LEN", str(10**9))


# The test files that take longest, in that order. `make test` hands whole files to its
# workers in collection order (--dist loadfile --no-loadscope-reorder): these go out first,
# so that none of them is still running alone on one worker when the others are done. The
# figures are seconds of one worker (docs/testing.md, "Per file, now"): "alone" measured one
# file at a time with -n 0, "suite" from `make test`'s run at f102f6a. A file that computes
# (the fuzzers, the batch module's stack) takes about twice as long in the suite as alone,
# one that waits on processes about 1.1 times: the order is by the suite's figure, for the
# files split since then estimated from the alone one.
SLOWEST_FILES = [
    "test_conformance_openapi.py",  # suite 184, alone 88
    "test_fuzz_openapi.py",  # suite 126, alone 52
    "test_batches.py",  # suite 95, alone 30-44
    "test_nemesis.py",  # suite 88
    "test_readme.py",  # suite 84
    "test_processes.py",  # suite 82
    "test_stalls.py",  # alone 57-73
    "test_upstream_caps.py",  # suite 75
    "test_cli_bench.py",  # alone 55
    "test_cli.py",  # alone 55
    "test_stalls_nodes.py",  # alone 59-67
    "test_migration_limits.py",  # alone 46-69
    "test_rolling_upgrade.py",  # suite 66
    "test_chaos_stages.py",  # alone 35-62
    "test_flow_e2e.py",  # alone 51-52
    "test_migration.py",  # alone 43-52
    "test_fuzz_nats.py",  # suite 60
    "test_compose.py",  # suite 55
    "test_responses.py",  # suite 53
    "test_flow_queues.py",  # alone 46-49
    "test_chaos.py",  # alone 35-49
    "test_stalls_leaders.py",  # alone 36-38
    "test_cluster_batches.py",  # alone 20-82 (docs/testing.md, "Per file, now")
    "test_chaos_restarts.py",  # alone 20-27
    "test_cli_up.py",  # alone 19
    "test_cluster.py",  # alone 16-18
]


# The tiers a test belongs to (docs/testing.md, "Tiers"): what it starts, the cheapest first.
# Each test names exactly one, with a module-level ``pytestmark`` or a mark of its own.
TIERS = ("unit", "bus", "stack", "fault")
# The fixtures that start a nats-server or processes: no unit test asks for one.
NEEDS_A_BUS = frozenset(("nats_server", "private_nats", "client", "nc", "keys", "procs"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test names exactly one tier (:data:`TIERS`), or collection fails; then the
    slowest files first (:data:`SLOWEST_FILES`), every other file after them in its usual
    order; the tests of a file keep theirs (a sort that keeps equal keys in place)."""
    wrong = []
    for item in items:
        named = [m.name for m in item.iter_markers() if m.name in TIERS]
        if len(named) != 1:
            wrong.append(f"{item.nodeid}: {named or 'none'}")
        elif named == ["unit"] and set(getattr(item, "fixturenames", ())) & NEEDS_A_BUS:
            wrong.append(f"{item.nodeid}: unit, but it asks for a bus")
    if wrong:
        listed = "\n  ".join(wrong)
        raise pytest.UsageError(
            f"every test names exactly one tier of {', '.join(TIERS)} "
            f"(docs/testing.md, Tiers); these do not:\n  {listed}"
        )
    rank = {name: i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    srv = NatsServer(tmp_path_factory.mktemp("nats")).start()
    yield srv
    srv.stop()


@pytest.fixture
def private_nats(tmp_path: Path) -> Iterator[NatsServer]:
    """A nats-server of this test's own, for tests that need an empty bus."""
    srv = NatsServer(tmp_path / "nats").start()
    yield srv
    srv.stop()


@pytest.fixture
def model() -> str:
    """A model name of this test's own."""
    return new_model()


@pytest.fixture
async def client(nats_server: NatsServer) -> AsyncIterator[Client]:
    """A tokenbus client connected to the shared bus (closed after the test)."""
    c = await Client.connect(nats_server.url)
    async with c:
        yield c


@pytest.fixture
async def nc(nats_server: NatsServer) -> AsyncIterator[NATS]:
    """A bare NATS connection to the shared bus, for what the client never sends."""
    conn = await nats.connect(nats_server.url)
    yield conn
    await conn.drain()


@pytest.fixture
async def keys(nats_server: NatsServer) -> AsyncIterator[KeyStore]:
    """The API-key store on the shared bus (its connection is ``keys.nc``)."""
    async with key_store(nats_server.url) as store:
        yield store


@pytest.fixture
def procs(nats_server: NatsServer, tmp_path: Path) -> Iterator[Procs]:
    with Procs(nats_server.url, tmp_path) as ps:
        yield ps


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Upstream]:
    """The fake OpenAI-compatible upstream (:class:`Upstream`), one for the module."""
    up = Upstream(tmp_path_factory.mktemp("upstream"))
    try:
        yield up
    finally:
        up.stop()


@pytest.fixture
def paused() -> Iterator[list[int]]:
    """Pids a test paused (SIGSTOP): continued when it ends, whatever happened."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


@pytest.fixture
def hosts() -> Iterator[netns.Hosts]:
    """Hosts of their own on this machine (network namespaces); skipped where none can be
    made."""
    if not netns.available():
        pytest.skip("network namespaces cannot be made here (needs root and ip)")
    h = netns.Hosts().start()
    yield h
    h.stop()
