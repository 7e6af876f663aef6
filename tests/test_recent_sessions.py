"""router.sessions.RecentSessions: the sessions a router sent somewhere lately."""

from __future__ import annotations

import pytest

from router.sessions import RecentSessions

pytestmark = pytest.mark.unit


def test_sessions_count_where_they_were_last_sent_until_the_horizon() -> None:
    """A session counts on the replica it was last sent to, once, until ``horizon_s`` has
    passed since; a session sent elsewhere moves its count."""
    r = RecentSessions(horizon_s=10.0)
    r.heard(("k", "s1"), "a", 100, now=0.0)
    r.heard(("k", "s2"), "a", 100, now=1.0)
    r.heard(("k", "s3"), "b", 100, now=2.0)
    assert (r.neighbours("a", 2.0), r.neighbours("b", 2.0)) == (2, 1)
    r.heard(("k", "s1"), "b", 150, now=3.0)  # moved
    assert (r.neighbours("a", 3.0), r.neighbours("b", 3.0)) == (1, 2)
    assert r.known(("k", "s2"), 10.5) is True
    assert r.known(("k", "s2"), 11.0) is False  # 10 s since: gone, a new session again
    assert (r.neighbours("a", 11.0), r.neighbours("b", 11.0)) == (0, 2)
    assert (r.neighbours("a", 13.0), r.neighbours("b", 13.0)) == (0, 0)
    assert len(r) == 0


def test_a_turn_s_growth_is_learned_from_sessions_that_grew() -> None:
    """The tokens a turn adds: the first seen as it is, then a weighted mean; a session whose
    prompt shrank (its caller began anew under the same id) teaches nothing."""
    r = RecentSessions(horizon_s=60.0)
    r.heard(("k", "s"), "a", 1000, now=0.0)
    assert r.growth == 0.0
    r.heard(("k", "s"), "a", 1600, now=1.0)
    assert r.growth == 600.0
    r.heard(("k", "s"), "a", 200, now=2.0)
    assert r.growth == 600.0
    r.heard(("k", "s"), "a", 1400, now=3.0)  # grew by 1 200
    assert 600.0 < r.growth < 1200.0


def test_session_ids_named_by_callers_cannot_grow_the_table_past_its_cap() -> None:
    """A caller naming a new session id in every request turns the oldest out: the table
    holds ``cap`` keys at most, and the counts stay those of the keys it holds."""
    r = RecentSessions(horizon_s=3600.0, cap=100)
    for i in range(10_000):
        r.heard(("attacker", f"s{i}"), "a" if i % 2 else "b", 10, now=i * 0.001)
    assert len(r) == 100
    assert r.neighbours("a", 10.0) + r.neighbours("b", 10.0) == 100
    assert r.known(("attacker", "s9999"), 10.0) and not r.known(("attacker", "s0"), 10.0)


def test_one_key_s_session_id_is_not_another_key_s() -> None:
    """Keys are (principal, session id): the same id under another principal is another
    session."""
    r = RecentSessions(horizon_s=60.0)
    r.heard(("k1", "shared"), "a", 100, now=0.0)
    assert r.known(("k1", "shared"), 1.0)
    assert not r.known(("k2", "shared"), 1.0)


def test_a_caller_inflating_its_turns_moves_the_learned_growth_only_so_far() -> None:
    """A turn's growth is what the caller's next prompt says. One session whose every turn
    claims a million more tokens, a quarter of the samples beside real sessions adding 600
    each, holds the learned growth under twice the real one; its first sample alone counts
    at most FIRST_GROWTH_CAP tokens."""
    from router.sessions import FIRST_GROWTH_CAP

    first = RecentSessions(horizon_s=1e9)
    first.heard(("attacker", "a"), "x", 10, now=0.0)
    first.heard(("attacker", "a"), "x", 1_000_010, now=1.0)
    assert first.growth == FIRST_GROWTH_CAP
    r = RecentSessions(horizon_s=1e9)
    t = 0.0
    for i in range(2000):
        t += 1.0
        if i % 4 == 3:  # the attacker: a tiny prompt, then a million tokens more
            r.heard(("attacker", f"a{i}"), "x", 10, now=t)
            r.heard(("attacker", f"a{i}"), "x", 1_000_010, now=t)
        else:
            r.heard(("k", f"s{i}"), "x", 1000, now=t)
            r.heard(("k", f"s{i}"), "x", 1600, now=t)
        assert r.growth < 2 * 600
    assert 600 < r.growth < 1200
