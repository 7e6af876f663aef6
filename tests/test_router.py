"""The replica registry and the least-outstanding policy (no bus needed)."""

from __future__ import annotations

import pytest

from router.policies import least_outstanding
from router.registry import Registry

pytestmark = pytest.mark.unit


def hb(replica: str, **kw: object) -> dict[str, object]:
    return {
        "replica": replica,
        "model": "m",
        "in_flight": 0,
        "max_concurrency": 10,
        "interval_s": 1.0,
        "seq": 1,
        "boot": "a",
        **kw,
    }


def test_older_beats_are_ignored_but_a_restart_is_not() -> None:
    reg = Registry()
    reg.update(hb("r", seq=5, in_flight=3))
    reg.update(hb("r", seq=4, in_flight=9))
    assert reg.get("r") is not None and reg.get("r").reported_in_flight == 3  # type: ignore[union-attr]
    reg.update(hb("r", seq=1, boot="b", in_flight=0, draining=False))
    assert reg.get("r").reported_in_flight == 0  # type: ignore[union-attr]


def test_draining_and_expired_replicas_are_not_live() -> None:
    reg = Registry(missed_heartbeats=3)
    reg.update(hb("a"))
    reg.update(hb("b", draining=True))
    assert [r.replica for r in reg.live("m")] == ["a"]
    reg.get("a").last_seen -= 10  # type: ignore[union-attr]
    assert reg.live("m") == []
    reg.prune()
    assert reg.get("a") is None
    assert reg.ever_seen("m") and not reg.ever_seen("x")


def test_endpoints_and_aliases_from_heartbeats() -> None:
    reg = Registry()
    reg.update(hb("old"))  # a worker that names no endpoints: chat and completions
    reg.update(hb("emb", endpoints=["embeddings"], aliases=["m-lora"]))
    assert {r.replica for r in reg.live("m", "chat")} == {"old"}
    assert {r.replica for r in reg.live("m", "embeddings")} == {"emb"}
    assert {r.replica for r in reg.live("m")} == {"old", "emb"}
    # An adapter name routes to the replica that serves it, on the replica's own subject.
    lora = reg.live("m-lora")
    assert [r.replica for r in lora] == ["emb"]
    assert lora[0].subject == "tb.v1.engine.m.emb.generate"
    assert reg.models() == ["m", "m-lora"] and reg.ever_seen("m-lora")


def test_malformed_heartbeats_are_refused() -> None:
    from router.registry import MAX_INTERVAL_S

    reg = Registry()
    assert reg.update({"model": "m"}) is None
    assert reg.update(hb("r", in_flight="lots")) is None
    # Numbers no worker sends (a forged beat; the fuzz drew them): refused, nothing raised.
    inf, nan = float("inf"), float("nan")
    for field in ("in_flight", "max_concurrency", "seq", "prefill_backlog", "max_model_len"):
        assert reg.update(hb("r", **{field: inf})) is None, field
    for value in (inf, nan, -1.0, 0.0):
        assert reg.update(hb("r", interval_s=value)) is None, value
    # An interval past any worker's is held to the longest: a ghost still expires.
    r = reg.update(hb("r", interval_s=1e12))
    assert r is not None and r.interval_s == MAX_INTERVAL_S


def test_least_outstanding_counts_unacked_dispatches_and_capacity() -> None:
    reg = Registry()
    reg.update(hb("a", in_flight=2, max_concurrency=10))
    reg.update(hb("b", in_flight=2, max_concurrency=40))
    assert least_outstanding(reg.live("m")).replica == "b"
    reg.get("b").unacked = 20  # type: ignore[union-attr]
    assert least_outstanding(reg.live("m")).replica == "a"
