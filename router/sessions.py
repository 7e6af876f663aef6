"""The sessions a router sent somewhere lately: ``predicted_latency``'s neighbours.

A multi-turn session comes back to the replica holding its conversation, so where a new
session starts decides where its next turns will queue. :class:`RecentSessions` remembers,
per session key (the key's principal and the session id the caller gave: one tenant's id
names nothing of another's), the replica this router last sent it to, when, and its prompt's
tokens. From that it counts each replica's *neighbours* (sessions sent there within
``horizon_s``) and learns how many prompt tokens a session's turn adds (the answer and the
next user message: what a returning turn computes at home).

Session ids are the caller's to choose, so the table is bounded (``cap`` keys, the oldest
forgotten first); a key forgotten or never seen reads as a new session. Time is the caller's
``now`` (``time.monotonic()``), so entries are in the order they were heard.
"""

from __future__ import annotations

from collections import OrderedDict

# The learned tokens a turn adds: an exponentially weighted mean, this weight on the newest.
GROWTH_WEIGHT = 0.05
# A turn's growth is the caller's to state (its next prompt), so one sample counts at most
# twice what was learned (the first at most this many tokens): callers who inflate every
# turn they send move the mean only as far as their share of the samples lets them.
FIRST_GROWTH_CAP = 8192
# Keys remembered at most (a few MiB): a caller naming a new session id in every request
# turns the oldest out, never the router's memory.
CAP = 65536


class RecentSessions:
    """Sessions heard within ``horizon_s``, per replica; see the module's docstring."""

    def __init__(self, horizon_s: float, cap: int = CAP) -> None:
        self.horizon_s = horizon_s
        self.cap = cap
        # key -> (replica, when heard, prompt tokens): the oldest first.
        self._last: OrderedDict[tuple[str, str], tuple[str, float, int]] = OrderedDict()
        self._count: dict[str, int] = {}
        self.growth = 0.0  # prompt tokens a session's turn adds (0: not learned yet)

    def __len__(self) -> int:
        return len(self._last)

    def known(self, key: tuple[str, str], now: float) -> bool:
        """Whether ``key`` was heard within the horizon (else: a new session)."""
        self._expire(now)
        return key in self._last

    def neighbours(self, replica: str, now: float) -> int:
        """Sessions sent to ``replica`` within the horizon."""
        self._expire(now)
        return self._count.get(replica, 0)

    def heard(self, key: tuple[str, str], replica: str, tokens: int, now: float) -> None:
        """``key``'s request of ``tokens`` prompt tokens was sent to ``replica`` at ``now``."""
        old = self._last.pop(key, None)
        if old is not None:
            self._forget(old[0])
            grew = tokens - old[2]
            if grew > 0:  # a conversation that grew (a shorter prompt: the caller began anew)
                g = self.growth
                if not g:
                    self.growth = float(min(grew, FIRST_GROWTH_CAP))
                else:
                    self.growth = g + GROWTH_WEIGHT * (min(grew, 2 * g) - g)
        self._last[key] = (replica, now, tokens)
        self._count[replica] = self._count.get(replica, 0) + 1
        self._expire(now)

    def _expire(self, now: float) -> None:
        last = self._last
        while last:
            key, (replica, t, _) = next(iter(last.items()))
            if now - t < self.horizon_s and len(last) <= self.cap:
                return
            del last[key]
            self._forget(replica)

    def _forget(self, replica: str) -> None:
        n = self._count.get(replica, 0) - 1
        if n > 0:
            self._count[replica] = n
        else:
            self._count.pop(replica, None)
