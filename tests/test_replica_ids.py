"""One process per replica id (engine_worker/claim.py, docs/deploy.md "Replica ids"): a
second worker started with an id another process serves refuses to start, with the reason,
and the first keeps serving; a worker that was paused while another took its id finds out
when it comes back, and one of them (the older) keeps it. Every request runs in one
process. Real processes on a real nats-server, the locked bus among them."""

from __future__ import annotations

import json
import signal
import uuid
from collections import Counter
from pathlib import Path

import pytest

from services.natsconf import role_login
from tests.lockedbus import LockedBus
from tests.support.procs import Procs, ProcStack, start_stack
from tests.support.waits import wait_for

pytestmark = pytest.mark.fault

MSG = [{"role": "user", "content": "whose id is it"}]


def served(*logs: Path) -> Counter[str]:
    """Request ids each worker log says it ran (its ``request`` events), summed."""
    out: Counter[str] = Counter()
    for log in logs:
        for line in log.read_text(errors="replace").splitlines():
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if ev.get("event") == "request" and ev.get("service") == "worker":
                # The client's X-Request-Id: a label the gateway's own id travels with.
                out[str(ev.get("client_request_id"))] += 1
    return out


async def ask(stack: ProcStack, n: int) -> list[str]:
    """``n`` chat requests through the bridge; their request ids."""
    ids = [f"claim-{uuid.uuid4().hex[:10]}" for _ in range(n)]
    async with stack.openai() as oai:
        for rid in ids:
            out = await oai.chat.completions.create(
                model=stack.model,
                messages=MSG,  # type: ignore[arg-type]
                max_tokens=5,
                extra_headers={"X-Request-Id": rid},
            )
            assert out.usage is not None and out.usage.completion_tokens == 5
    return ids


async def test_a_second_worker_with_a_taken_replica_id_refuses_to_start(tmp_path: Path) -> None:
    # On the locked bus: the worker role may say and hear claims (and nothing else new).
    bus = LockedBus(tmp_path / "bus").start()
    model = "claimed"
    try:
        with Procs(bus.url, tmp_path) as procs:
            stack = await start_stack(
                procs,
                model,
                "ingress",
                "router",
                env={"TOKENBUS_BRIDGE__FUSE_ROUTER": "false"},
                env_for=bus.env,
                login=role_login(bus.users, "admin"),
            )
            first = stack.workers[0]
            second = procs.start(
                "worker-again",
                *("serve", "worker", "--model", model, "--replica", f"{model}-0"),
                env=bus.env("worker"),
            )
            await wait_for(lambda: not second.alive(), timeout=30, what="the second worker exit")
            assert second.proc.returncode == 2, second.output()
            assert f"replica id '{model}-0' is already served by another process" in (
                second.output()
            )
            assert first.alive()
            ids = await ask(stack, 3)
            # Each ran once, in the first process; the second never took one.
            assert served(first.log) == Counter(ids)
            assert not served(second.log)
    finally:
        bus.stop()


async def test_a_paused_worker_back_finds_its_id_taken_and_the_older_keeps_it(
    procs: Procs,
) -> None:
    model = "paused-claim"
    stack = await start_stack(procs, model, "ingress", "router")
    first = stack.workers[0]
    before = await ask(stack, 2)
    # Paused with its sockets open, it cannot answer a claim: a second process with its id
    # starts (an operator's mistake, or a supervisor that thought it dead).
    first.signal(signal.SIGSTOP)
    try:
        second = procs.start(
            "worker-again", *("serve", "worker", "--model", model, "--replica", f"{model}-0")
        )
        await wait_for(
            lambda: "service_started" in second.output(), timeout=30, what="the second start"
        )
    finally:
        first.signal(signal.SIGCONT)
    # Back, the first hears the second's claim and answers with its own, older one: the
    # second stops serving and exits with the reason.
    await wait_for(lambda: not second.alive(), timeout=30, what="the second worker exit")
    assert second.proc.returncode == 2, second.output()
    assert "service_giving_up" in second.output()
    assert "already served by another process" in second.output()
    assert first.alive()
    after = await ask(stack, 3)
    runs = served(first.log, second.log)
    assert all(runs[i] == 1 for i in before + after), runs
    assert set(after) <= set(served(first.log))
