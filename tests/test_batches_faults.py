"""Batches under faults: tests/test_batches.py's stack (its fixture: a stack of this file's
own), a bridge process and a worker killed mid-batch. Apart from the rest of the batch tests
so that neither file takes over 90 s of a worker's time (docs/testing.md), and its stack is
the only one a kill leaves short of a worker."""

from __future__ import annotations

import signal

import pytest

from tests.support.natsserver import NatsServer
from tests.support.ports import free_port
from tests.support.waits import wait_for, wait_http
from tests.test_batches import ENV, Env, chat_line, env, jsonl, lines_of, wait_batch

# The module-scoped fixture, one stack for this file.
__all__ = ["env"]


@pytest.mark.fault
async def test_killed_runners_and_a_killed_worker_lose_no_line_and_repeat_none(
    env: Env, nats_server: NatsServer
) -> None:
    """A second bridge process; mid-batch that bridge (its runner with it) and one worker
    are killed (SIGKILL): the batch completes through the first, every line answered
    exactly once."""
    port = free_port()
    second = env.procs.start("bridge-2", "serve", "bridge", "--port", str(port), env=ENV)
    await wait_http(f"http://127.0.0.1:{port}/ready")
    lines = [chat_line(env.model, f"k{i}", max_tokens=300, ignore_eos=True) for i in range(120)]
    async with env.stack.openai(env.key) as oai:
        f = await oai.files.create(file=("kill.jsonl", jsonl(lines)), purpose="batch")
        b = await oai.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )

        async def ten_answered() -> bool:
            cur = await oai.batches.retrieve(b.id)
            return bool(cur.request_counts and cur.request_counts.completed >= 10)

        await wait_for(ten_answered, timeout=60, what="ten lines answered before the kills")
        second.signal(signal.SIGKILL)
        env.stack.roles["worker"][0].signal(signal.SIGKILL)
        done = await wait_batch(oai, b.id, ("completed",), timeout=150)
        out = await lines_of(oai, done.output_file_id)
        errs = await lines_of(oai, done.error_file_id)
    ids = [x["custom_id"] for x in out + errs]
    assert sorted(ids) == sorted(x["custom_id"] for x in lines)  # each once
    assert not errs, errs[:3]
    assert done.request_counts is not None and done.request_counts.completed == 120
