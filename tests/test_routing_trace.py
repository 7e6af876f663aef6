"""The routing trace ``tokenbus bench --routing-trace`` replays (tokenbus.evaluation.trace):
generated with the shape of the published production traces, the same for the same seed."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from tokenbus.evaluation import trace as T

pytestmark = pytest.mark.unit


def test_a_trace_has_shared_prompts_multi_turn_sessions_and_a_long_tail(tmp_path: Path) -> None:
    shape = T.TraceShape(sessions=400, seed=3)
    head, sessions = T.generate(shape)
    assert len(sessions) == 400 and len(head["system_tokens"]) == shape.system_prompts
    # Shared system prompts, the first the most popular (Zipf).
    uses = [sum(1 for s in sessions if s.system == i) for i in range(shape.system_prompts)]
    assert uses[0] == max(uses) and all(uses)
    # Multi-turn sessions, arriving over time in order.
    assert max(len(s.turns) for s in sessions) > 1
    assert all(a.arrival_s < b.arrival_s for a, b in itertools.pairwise(sessions))
    # A long tail: the longest user turns are many times the median.
    lengths = sorted(t["user_tokens"] for s in sessions for t in s.turns)
    median = lengths[len(lengths) // 2]
    assert lengths[-1] > 8 * median and lengths[-1] <= shape.user_max_tokens
    # The same seed, the same trace; saved and loaded whole.
    assert T.generate(shape) == (head, sessions)
    path = tmp_path / "t.jsonl"
    T.save(path, head, sessions)
    assert T.load(path) == (head, sessions)


def test_the_pooled_fleet_reference_queues_the_runs_own_work_first_come_first_served() -> None:
    """``pooled_ttft_ms``: the fleet's prefill speeds pooled, each request's own tokens to
    compute queued in the order they were sent, its own prefill no faster than the fastest
    replica's; nothing without every replica's speed."""
    from tokenbus.evaluation.routebench import _pooled

    perf = {"prefill_ms_per_token": 1.0, "ttft_base_ms": 0.0}
    rows = [
        {"start_s": 0.0, "prompt": 2000, "cached": 0},  # alone: its own 2 000 ms
        {"start_s": 0.0, "prompt": 300, "cached": 200},  # behind it: (2 000 + 100) / 2
        {"start_s": 10.0, "prompt": 100, "cached": 0},  # the queue long gone: its own 100
    ]
    assert _pooled(rows, [perf, perf]) == {"p50": 1050.0, "p99": 2000.0}
    assert _pooled(rows, [perf, None]) == {}
    assert _pooled([], [perf, perf]) == {}


def test_a_sessions_move_is_a_next_turn_on_another_replica() -> None:
    """``session_moves``: consecutive turns of one session on different replicas; a turn
    that failed (no row) breaks the chain rather than counting as a move."""
    from tokenbus.evaluation.routebench import _moves

    rows = [
        {"session": 1, "turn": 0, "replica": "a"},
        {"session": 1, "turn": 1, "replica": "a"},
        {"session": 1, "turn": 2, "replica": "b"},  # a move
        {"session": 1, "turn": 3, "replica": "a"},  # and back: another
        {"session": 2, "turn": 0, "replica": "b"},  # another session: not a move
        {"session": 2, "turn": 2, "replica": "a"},  # turn 1 missing: not counted
        {"session": 3, "turn": 0, "replica": None},  # an answer that named no replica
        {"session": 3, "turn": 1, "replica": "a"},  # not known to have moved
    ]
    assert _moves(rows) == 2
    assert _moves([]) == 0
