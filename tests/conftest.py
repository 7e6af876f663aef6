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
# figures are seconds of one worker from a `make test`'s per-test times (pytest's junit
# report summed per file; docs/testing.md, "Per file, now").
SLOWEST_FILES = [  # seconds of one worker in `make test` (2026-11-30, before the splits)
    "test_conformance_openapi_responses.py",  # 184 with _2's and _3's thirds, before the split
    "test_conformance_openapi_responses_2.py",
    "test_conformance_openapi_responses_3.py",
    "test_fuzz_openapi.py",  # 211 with _chat's and _completions', before the split
    "test_fuzz_openapi_chat.py",
    "test_fuzz_openapi_completions.py",
    "test_nemesis.py",  # 93 with test_nemesis_single_server.py's, before the split
    "test_console_browser.py",  # 112 with test_console.py's, before the split
    "test_console.py",
    "test_nemesis_single_server.py",
    "test_stalls_nodes.py",  # 72
    "test_stalls.py",  # 70
    "test_batches.py",  # 95 with test_batches_faults.py's, before the split
    "test_cli_bench.py",  # 63
    "test_upstream_caps.py",  # 61
    "test_fuzz_nats.py",  # 61
    "test_readme.py",  # 60
    "test_processes.py",  # 46
    "test_flow_e2e.py",  # 46
    "test_bus.py",  # 41
    "test_flow_queues.py",  # 40
    "test_migration_limits.py",  # 36
    "test_budgets.py",  # 35
    "test_migration.py",  # 35
    "test_bench_tenants.py",  # 35
    "test_stalls_leaders.py",  # 35
    "test_disaggregation.py",  # 34
    "test_conformance_openapi.py",  # 31
    "test_adapters.py",  # 30
    "test_cli_up.py",  # 29
    "test_chaos.py",  # 28
    "test_chaos_stages.py",  # 28
    "test_responses.py",  # 28
    "test_cli.py",  # 27
    "test_callout.py",  # 25
    "test_cluster_batches.py",  # 12-82 (a cluster's leaders elected under load)
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
