"""Scanning whole texts (:class:`Scanner`) and token streams (:class:`StreamScanner`).

Both run the same engine, which walks the text left to right and decides about a position
only once no future text can change that decision. A whole text is decided at once; a stream
is decided up to its *hold point* (see :class:`StreamScanner`), so streamed output equals the
whole-text redaction.

Semantics shared by both:

* Each detector reports non-overlapping matches; a match its validator rejects (Luhn, mod-97,
  entropy) does not consume text. Findings are processed in order of start, stronger action
  first, then detector priority (specific secrets, then PII, then the heuristics).
* A finding wholly inside an earlier finding of a higher-priority detector whose action is at
  least as strong is a duplicate and dropped (a card number is not also a phone number).
* Redactions that overlap merge into one ``[REDACTED:<first detector>]``. Token secrets and
  private-key blocks are redacted to the end of the token (or the ``-----END`` line, or the end
  of the text when it never comes); flagged and blocked findings report the detected head.
* Injection phrases add their weight once per rule; nothing is reported until the total
  reaches the policy's threshold, then the phrase that crossed it and every later one are.
"""

from __future__ import annotations

import bisect
import functools
import operator
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from filter import detectors as D
from filter.policy import Action, FilterPolicy

DEFAULT_WINDOW = 128

FindingAction = Literal["block", "redact", "flag"]
_SEVERITY = {"flag": 1, "redact": 2, "block": 3}
_OPEN = sys.maxsize  # end of a redaction whose secret has not ended yet
_MARGIN = 16  # characters kept before the earliest undecided position (lookbehinds)
_DENSE = 32  # sparse-gate hits ahead beyond which a plain search is cheaper


@dataclass(frozen=True, slots=True)
class Finding:
    """One detection: which detector, where, and what the policy did. Never holds the text."""

    detector: str
    category: str
    start: int
    end: int
    action: FindingAction
    score: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain form for logs and error details (positions only, never the matched text)."""
        d: dict[str, Any] = {
            "detector": self.detector,
            "category": self.category,
            "start": self.start,
            "end": self.end,
            "action": self.action,
        }
        if self.score is not None:
            d["score"] = self.score
        return d


@dataclass(frozen=True, slots=True)
class ScanResult:
    """The outcome of scanning one text."""

    findings: tuple[Finding, ...]
    # The text with redacted (and blocked) spans replaced; flagged text is left as it was,
    # so this is not safe to log and is kept out of the repr.
    redacted_text: str = field(repr=False)
    injection_score: float = 0.0

    @property
    def blocked_finding(self) -> Finding | None:
        """The first finding whose action is ``block``."""
        return next((f for f in self.findings if f.action == "block"), None)

    @property
    def blocked(self) -> str | None:
        """The id of the first blocking detector, or ``None``."""
        f = self.blocked_finding
        return f.detector if f is not None else None

    @property
    def redacted(self) -> bool:
        """Whether any span was replaced."""
        return any(f.action != "flag" for f in self.findings)

    @property
    def flagged(self) -> tuple[str, ...]:
        """Ids of the flagging detectors, in order of first appearance."""
        return tuple(dict.fromkeys(f.detector for f in self.findings if f.action == "flag"))

    def to_dict(self) -> dict[str, Any]:
        """Plain form for logs: no text at all."""
        return {
            "blocked": self.blocked,
            "findings": [f.to_dict() for f in self.findings],
            "injection_score": self.injection_score,
        }


@dataclass(frozen=True, slots=True)
class StreamOutput:
    """What one :meth:`StreamScanner.feed` or :meth:`~StreamScanner.finish` releases."""

    text_to_emit: str
    blocked_by: str | None = None
    findings: tuple[Finding, ...] = ()


def redaction_label(detector_id: str) -> str:
    """The text that replaces a redacted span."""
    return f"[REDACTED:{detector_id}]"


# --- the compiled policy ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Active:
    """A detector with its policy applied."""

    det: D.Detector
    action: FindingAction
    # For the injection detector: rule name -> (rule id, action, weight).
    rules: dict[str, tuple[str, FindingAction, float]] | None = None


@dataclass(frozen=True, slots=True)
class _Group:
    """Detectors sharing a gate (or none); ``lowest`` reads their smallest resume position."""

    gate: D.Gate | None
    members: tuple[int, ...]
    lowest: Callable[[list[int]], int]


def _lowest(members: tuple[int, ...]) -> Callable[[list[int]], int]:
    if len(members) == 1:
        (i,) = members
        return lambda resume: resume[i]
    get = operator.itemgetter(*members)
    return lambda resume: min(get(resume))


@dataclass(frozen=True, slots=True)
class _Plan:
    active: tuple[_Active, ...]
    tail: re.Pattern[str]
    # When every enabled detector has a gate: all the gates in one regex. A chunk with no
    # hit and nothing to hold may skip the engine (see _Engine.skip).
    any_gate: re.Pattern[str] | None
    reach: int
    threshold: float
    lower: bool  # some detector reads the ASCII-lower-cased copy of the text
    # Detector indices by shared gate (None: always searched), so one gate search can
    # rule out a whole family of detectors.
    groups: tuple[_Group, ...]
    # For a whole text (Scanner.scan): the gates of the gated detectors in one regex, and
    # the detectors without a gate.
    gated: re.Pattern[str] | None = None
    ungated: tuple[D.Detector, ...] = ()

    def silent(self, text: str) -> bool:
        """Whether no enabled detector can match anywhere in ``text``: no gate hits, and no
        ungated detector's pattern matches (a match of the engine is a match of the pattern
        where it starts, and contains a hit of its gate). Then a whole-text scan finds
        nothing: one regex search or a few instead of the engine's walk."""
        if self.gated is not None and self.gated.search(text) is not None:
            return False
        low = None
        for det in self.ungated:
            hay = text
            if det.lower:
                if low is None:
                    low = D.ascii_lower(text)
                hay = low
            if det.anchor is None:
                if det.pattern.search(hay) is not None:
                    return False
                continue
            # As the engine does: the pattern tried where it can start (a big alternation
            # of phrases is slow to search, its first words are not).
            match = det.pattern.match
            for at in det.anchor.finditer(hay):
                if match(hay, at.start()) is not None:
                    return False
        return True


def _enabled(action: Action) -> FindingAction | None:
    return None if action == "off" else action


def _build_plan(policy: FilterPolicy, changes_only: bool = False) -> _Plan:
    """The detectors the policy enables; with ``changes_only``, just those whose action changes
    the text (block, redact), and a hold-back tail made of their own stream tails."""

    def wanted(action: Action) -> FindingAction | None:
        a = _enabled(action)
        return None if changes_only and a == "flag" else a

    active: list[_Active] = []
    first: set[str] = set()
    vocab: set[str] = set()
    for det in D.BUILTIN:
        action = wanted(policy.action_for(det.id))
        if action is not None:
            active.append(_Active(det, action))
    terms = D.blocklist_terms(policy.blocklist)
    action = wanted(policy.action_for("blocklist"))
    if terms and action is not None:
        pattern, lower = D.blocklist_pattern(terms)
        det = D.Detector(
            "blocklist",
            pattern,
            reach=D.blocklist_reach(terms),
            description="policy blocklist term",
            lower=lower,
            anchor=D.word_anchor(t.split(" ")[0] for t in terms) if lower else None,
            stream_tail="(?!)",  # a phrase: the phrase tail below holds it
        )
        active.append(_Active(det, action))
        f, v = D.phrase_words(terms)
        first |= f
        vocab |= v
    rules: dict[str, tuple[D.InjectionRule, FindingAction]] = {}
    for rule in D.INJECTION_RULES:
        rule_action = _enabled(policy.action_for(rule.id))
        if rule_action is not None:
            rules[rule.name] = (rule, rule_action)
    # Rules share one score, so they stay together: all of them when any changes the text.
    if changes_only and all(a == "flag" for _, a in rules.values()):
        rules = {}
    if rules:
        enabled = [r for r, _ in rules.values()]
        det = D.Detector(
            "injection",
            D.injection_pattern(enabled),
            reach=max(D.phrase_reach(r.slots) for r in enabled),
            description="prompt-injection phrase",
            lower=True,
            anchor=D.word_anchor(w.split(" ")[0] for r in enabled for w in r.slots[0].words),
            stream_tail="(?!)",
        )
        table = {name: (r.id, a, r.weight) for name, (r, a) in rules.items()}
        active.append(_Active(det, "flag", table))
        for r in enabled:
            f, _ = D.phrase_words(r.slots[0].words)
            first |= f
            for slot in r.slots:
                vocab |= D.phrase_words(slot.words)[1]
    # Heuristic detectors rank last so specific ones win ties and absorb duplicates.
    active.sort(key=lambda a: a.det.id == "secret.high_entropy")
    groups: dict[int, tuple[D.Gate | None, list[int]]] = {}
    for i, a in enumerate(active):
        groups.setdefault(id(a.det.gate), (a.det.gate, []))[1].append(i)
    if changes_only:
        tails: list[str] = []
        for a in active:
            tails.extend(D.DEFAULT_TAILS if a.det.stream_tail is None else [a.det.stream_tail])
        tails = [t for t in tails if t != "(?!)"]
        if first:  # a phrase's first word still arriving ("ign" of "ignore all ...")
            tails.append("(?i:" + D.literal_tail(first, before=r"\w", then="") + ")")
    else:
        tails = list(D.DEFAULT_TAILS)
    return _Plan(
        groups=tuple(_Group(g, tuple(m), _lowest(tuple(m))) for g, m in groups.values()),
        active=tuple(active),
        tail=D.tail_pattern(first, vocab, tails),
        any_gate=_any_gate(active),
        gated=_any_gate([a for a in active if a.det.gate is not None]),
        ungated=tuple(a.det for a in active if a.det.gate is None),
        reach=max((a.det.reach for a in active), default=0),
        threshold=policy.injection_threshold,
        lower=any(a.det.lower for a in active),
    )


def _any_gate(active: list[_Active]) -> re.Pattern[str] | None:
    gates = {id(a.det.gate): a.det.gate for a in active}
    if not active or any(g is None for g in gates.values()):
        return None
    return re.compile("|".join(f"(?:{g.pattern.pattern})" for g in gates.values() if g))


@functools.lru_cache(maxsize=64)
def _plan_from_json(key: str, changes_only: bool) -> _Plan:
    return _build_plan(FilterPolicy.model_validate_json(key), changes_only)


def _plan_for(policy: FilterPolicy | None, changes_only: bool = False) -> _Plan:
    # Compiling a policy costs milliseconds (blocklist and tail regexes); streams are created
    # per request, so plans are cached by the policy's JSON (pydantic's, in field order: two
    # equal policies whose maps were written in another order only miss the cache once).
    p = policy if policy is not None else FilterPolicy()
    return _plan_from_json(p.model_dump_json(), changes_only)


# --- the engine ------------------------------------------------------------------------------


class _Cand(NamedTuple):
    start: int  # absolute positions
    end: int
    idx: int  # index into the plan's detectors: also the priority rank
    detector: str
    action: FindingAction
    weight: float


_DONE, _BLOCKED, _OPENED = 0, 1, 2


class _Engine:
    """Left-to-right decisions over a text that may still grow (see the module docstring)."""

    def __init__(self, plan: _Plan, *, stream: bool, window: int = DEFAULT_WINDOW) -> None:
        self.plan = plan
        self.stream = stream
        self.window = window
        n = len(plan.active)
        self.buf = ""  # the text from absolute position `origin` on
        self.low = ""  # ascii_lower(buf), kept only when a detector needs it
        self.gates: dict[int, tuple[int, int]] = {}  # id(gate) -> (searched from, first hit)
        self.sparse_hits: dict[int, tuple[int, list[int]]] = {}  # id(gate) -> (from, hits)
        self.dense: dict[int, bool] = {}  # id(gate) -> too many hits ahead to go one by one
        self.ends: dict[int, tuple[int, int]] = {}  # id(terminator) -> (searched from, end)
        self.origin = 0
        self.pos = 0  # everything before this has been emitted or replaced
        self.final = 0  # the hold point: matches starting before it are decided
        self.done_to = 0  # every match starting before this has been handled
        self.resume = [0] * n  # where each detector searches next
        self.cache: list[_Cand | None] = [None] * n
        self.red_end = 0  # end of the latest redaction
        self.open: _Cand | None = None  # a redaction still waiting for its secret to end
        self.open_from = 0
        self.open_prev_end = 0
        self.recent: list[tuple[Finding, int]] = []  # findings that may contain later ones
        self.rules: set[str] = set()
        self.score = 0.0
        self.findings: list[Finding] = []
        self.blocked: Finding | None = None
        self.out: list[str] = []

    def feed(self, delta: str, *, eof: bool) -> str:
        self.buf += delta
        if self.plan.lower:
            self.low += D.ascii_lower(delta)
        self.gates.clear()
        self.sparse_hits.clear()
        self.ends.clear()
        end = self.origin + len(self.buf)
        final = self._run(end, eof)
        if final is not None and self.pos < final:
            self._emit_to(final)
        text = "".join(self.out)
        self.out.clear()
        if self.stream:
            self._trim()
        return text

    def skip(self, delta: str) -> bool:
        """Fast path for a stream: when everything so far is decided and released, no gate
        of an enabled detector hits in ``delta`` (so no match can begin in it) and nothing at
        its end must be held, take ``delta`` as decided at once. Same result as :meth:`feed`
        without the per-detector work. (A hold cannot begin before ``delta``: its start
        would already have been held, and nothing was.)"""
        plan = self.plan
        gate = plan.any_gate
        end = self.origin + len(self.buf)
        if (
            gate is None
            or self.open is not None
            or self.blocked is not None
            or self.pos != end
            or self.done_to != end
            or self.cache.count(None) != len(self.cache)
        ):
            return False
        ctx = self.buf[-_MARGIN:]
        text, at = ctx + delta, len(ctx)
        if gate.search(text, at) is not None or plan.tail.search(text, at) is not None:
            return False
        self.buf += delta
        if plan.lower:
            self.low += D.ascii_lower(delta)
        new_end = end + len(delta)
        self.pos = self.final = self.done_to = new_end
        # Clean means every detector has searched up to ``end`` (nothing lies beyond it).
        self.resume = [new_end] * len(self.resume)
        if len(self.buf) > 2048:
            self._trim()
        return True

    def _run(self, end: int, eof: bool) -> int | None:
        """Decide what can be decided; return the position raw text may be emitted up to."""
        while True:
            if self.open is not None and not self._close_open(end, eof):
                return None
            final = end if eof else self._hold_point(end)
            if final <= self.done_to:  # nothing new is decided (a word is still growing)
                return final
            status = self._process(final, end, eof)
            if status == _BLOCKED:
                return None
            if status == _DONE:
                self.done_to = final
                return final

    def _hold_point(self, end: int) -> int:
        # The leftmost suffix within the window that could still become (or change) a match.
        # Positions before it are decided; it only moves forward, so search from the last one.
        start = max(self.final, end - self.window) - self.origin
        m = self.plan.tail.search(self.buf, start)
        final = end if m is None else m.start() + self.origin
        self.final = final
        return final

    def _live(self, final: int) -> list[int]:
        """Detectors that may have a match starting before ``final``; the rest skip to it."""
        cache, resume, origin = self.cache, self.resume, self.origin
        live: list[int] = []
        for group in self.plan.groups:
            gate, members = group.gate, group.members
            if gate is not None:
                lo = group.lowest(resume)
                if lo >= final:
                    continue
                hit = self._gate(gate, lo - origin)
                if hit < 0 or hit - gate.offset + origin >= final:
                    # No gate hit early enough: nothing of this family starts before final
                    # (a cached candidate would contain a hit, so there is none).
                    for i in members:
                        if cache[i] is None and resume[i] < final:
                            resume[i] = final
                    continue
            live.extend(members)
        return live

    def _process(self, final: int, end: int, eof: bool) -> int:
        cache, resume = self.cache, self.resume
        live = self._live(final)
        while True:
            best: _Cand | None = None
            best_key = (0, 0, 0)
            for i in live:
                c = cache[i]
                if c is None:
                    if resume[i] >= final:
                        continue
                    c = self._next(i, final)
                    if c is None:
                        continue
                    cache[i] = c
                key = (c.start, -_SEVERITY[c.action], i)
                if best is None or key < best_key:
                    best, best_key = c, key
            if best is None:
                return _DONE
            cache[best.idx] = None
            resume[best.idx] = best.end
            status = self._handle(best, end, eof)
            if status != _DONE:
                return status

    def _next(self, i: int, final: int) -> _Cand | None:
        """Detector i's next decided match, or None (then nothing of it starts before final)."""
        a = self.plan.active[i]
        det, origin = a.det, self.origin
        buf = self.low if det.lower else self.buf
        p = self.resume[i] - origin
        limit = final - origin
        while True:
            m = self._search(det, buf, p, limit)
            if m is None or m.start() >= limit:
                self.resume[i] = final
                return None
            e = m.end() if det.check is None else det.check(m)
            if e >= 0:
                break
            p = m.start() + 1  # a rejected match consumes nothing
        if a.rules is not None:
            rule_id, action, weight = a.rules[m.lastgroup or ""]
            return _Cand(m.start() + origin, e + origin, i, rule_id, action, weight)
        return _Cand(m.start() + origin, e + origin, i, det.id, a.action, 0.0)

    def _search(self, det: D.Detector, buf: str, p: int, limit: int) -> re.Match[str] | None:
        """Same result as ``det.pattern.search(buf, p)`` for matches starting before limit."""
        gate = det.gate
        if gate is not None:
            hit = self._gate(gate, p)
            while True:
                if hit < 0:
                    return None
                lo = max(p, hit - gate.offset)
                if lo >= limit:
                    return None
                if not gate.sparse or self.dense[id(gate)]:
                    p = lo
                    break
                # Only matches starting in [lo, hit] can use this hit. Searching up to
                # hit + reach sees everything such a match depends on; a match found
                # starting after hit may be cut short by the window, so it is not trusted.
                m = det.pattern.search(buf, lo, hit + det.reach + 1)
                if m is not None and m.start() <= hit:
                    return m
                p = hit + 1
                hit = self._gate(gate, p)
        anchor = det.anchor
        if anchor is None:
            return det.pattern.search(buf, p)
        while True:
            at = anchor.search(buf, p)
            if at is None or at.start() >= limit:
                return None
            m = det.pattern.match(buf, at.start())
            if m is not None:
                return m
            p = at.start() + 1

    def _gate(self, gate: D.Gate, p: int) -> int:
        """First hit of a gate at or after buffer index p, or -1 (cached until the text grows)."""
        key = id(gate)
        if gate.sparse:
            # Every hit at once: detectors of the family ask hit after hit.
            listed = self.sparse_hits.get(key)
            if listed is None or listed[0] > p:
                hits = [m.start() for m in gate.pattern.finditer(self.buf, p)]
                listed = self.sparse_hits[key] = (p, hits)
            hits = listed[1]
            k = bisect.bisect_left(hits, p)
            # Many hits ahead: windows would overlap, one plain regex search is cheaper.
            self.dense[key] = len(hits) - k > _DENSE
            return hits[k] if k < len(hits) else -1
        cached = self.gates.get(key)
        if cached is not None and cached[0] <= p and (cached[1] < 0 or cached[1] >= p):
            return cached[1]
        m = gate.pattern.search(self.buf, p)
        hit = -1 if m is None else m.start()
        self.gates[key] = (p, hit)
        return hit

    def _handle(self, c: _Cand, end: int, eof: bool) -> int:
        score = None
        if c.weight:
            if c.detector not in self.rules:
                self.rules.add(c.detector)
                self.score += c.weight
            if self.score < self.plan.threshold:
                return _DONE
            score = round(self.score, 3)
        sev = _SEVERITY[c.action]
        if self.recent:
            self.recent = [(f, r) for f, r in self.recent if f.end > c.start]
            for f, rank in self.recent:
                if rank < c.idx and f.end >= c.end and _SEVERITY[f.action] >= sev:
                    return _DONE  # a duplicate inside a stronger, more specific finding
        category = self.plan.active[c.idx].det.category
        if c.action == "flag":
            self._record(Finding(c.detector, category, c.start, c.end, "flag", score), c.idx)
            return _DONE
        if c.action == "block" and self.stream:
            f = Finding(c.detector, category, c.start, c.end, "block", score)
            self._record(f, c.idx)
            self.blocked = f
            if c.start > self.pos:
                self._emit_to(c.start)
            return _BLOCKED
        e = c.end
        det = self.plan.active[c.idx].det
        if det.terminator is not None:
            t = self._secret_end(det, c.end - self.origin)
            if t >= 0:
                e = t + self.origin
            elif eof:
                e = end
            else:
                # The secret runs past what has arrived: replace it now, swallow the rest
                # until its end shows up (see _close_open).
                self.open = c._replace(end=_OPEN)
                self.open_from = c.end
                self.open_prev_end = self.red_end if c.start < self.red_end else 0
                self._redact(c.start, _OPEN, c.detector)
                return _OPENED
        self._redact(c.start, e, c.detector)
        self._record(Finding(c.detector, category, c.start, e, c.action, score), c.idx)
        return _DONE

    def _close_open(self, end: int, eof: bool) -> bool:
        c = self.open
        assert c is not None
        det = self.plan.active[c.idx].det
        assert det.terminator is not None
        start = max(c.start, self.open_from - det.terminator_overlap) - self.origin
        t = self._secret_end(det, start)
        if t >= 0:
            e = t + self.origin
        elif eof:
            e = end
        else:
            self.open_from = end
            return False
        self.open = None
        self.red_end = self.pos = max(self.open_prev_end, e)
        self._record(Finding(c.detector, det.category, c.start, e, c.action), c.idx)
        return True

    def _secret_end(self, det: D.Detector, p: int) -> int:
        """Buffer index where a secret whose head ends at p ends, or -1 if not arrived yet."""
        term = det.terminator
        assert term is not None
        # Cached: many heads inside one unterminated block would each search to the end.
        key = id(term)
        cached = self.ends.get(key)
        if cached is not None and cached[0] <= p and (cached[1] < 0 or cached[1] > p):
            return cached[1]
        t = term.search(self.buf, p)
        end = -1 if t is None else (t.end() if det.terminator_inclusive else t.start())
        self.ends[key] = (p, end)
        return end

    def _redact(self, start: int, end: int, detector: str) -> None:
        if start >= self.red_end:  # a new redaction: emit what precedes it, then the label
            if start > self.pos:
                self._emit_to(start)
            self.out.append(redaction_label(detector))
            self.red_end = self.pos = end
        else:  # overlaps the previous redaction: extend it
            self.red_end = max(self.red_end, end)
            self.pos = max(self.pos, self.red_end)

    def _record(self, f: Finding, rank: int) -> None:
        self.findings.append(f)
        sev = _SEVERITY[f.action]
        # Kept as a possible container of later findings unless an earlier one already
        # covers it at least as strongly (keeps the list short inside long redactions).
        for g, r in self.recent:
            if r <= rank and g.end >= f.end and _SEVERITY[g.action] >= sev:
                break
        else:
            self.recent.append((f, rank))
        if f.action == "block" and self.blocked is None:
            self.blocked = f

    def _emit_to(self, position: int) -> None:
        self.out.append(self.buf[self.pos - self.origin : position - self.origin])
        self.pos = position

    def _trim(self) -> None:
        # Drop text nothing will look at again (amortised: only in large steps).
        keep = min(min(self.resume, default=self.final), self.final)
        if self.open is not None:
            keep = min(keep, self.open.start)
        cut = keep - _MARGIN - self.origin
        if cut >= 1024:
            self.buf = self.buf[cut:]
            if self.plan.lower:
                self.low = self.low[cut:]
            self.origin += cut


# --- public API ------------------------------------------------------------------------------


class Scanner:
    """Scans whole texts (input messages) against a policy."""

    def __init__(self, policy: FilterPolicy | None = None) -> None:
        self.policy = policy if policy is not None else FilterPolicy()
        self._plan = _plan_for(self.policy)

    @property
    def max_span(self) -> int:
        """The longest bounded match (with lookahead) of the enabled detectors."""
        return self._plan.reach

    def scan(self, text: str) -> ScanResult:
        """Findings, the first block and the redacted text of ``text``."""
        if self._plan.silent(text):  # most texts: nothing to find
            return ScanResult((), text, 0.0)
        engine = _Engine(self._plan, stream=False)
        redacted = engine.feed(text, eof=True)
        return ScanResult(tuple(engine.findings), redacted, round(engine.score, 3))


class StreamScanner:
    """Scans a token stream, holding back only what a later chunk could still change.

    Hold-back rule: after each chunk the scanner finds the *hold point*, the leftmost start
    of a suffix (among the last ``window`` characters) that could still grow into a match or
    change one:

    * the trailing run of non-space characters (a word, e-mail, key or token in progress);
    * a trailing run of digits, capitals, spaces and ``+-().`` that begins with a digit or
      one of ``+(-`` (a phone, card, SSN or PEM header), or with two capitals and a digit
      (an IBAN or NI number);
    * a trailing chain of words that starts like an injection phrase or blocklist term
      ("ignore all pre...").

    Everything before the hold point is final and released (with redactions applied); text
    ending in whitespace after ordinary words is released entirely. The hold never exceeds
    ``window`` characters, which must be at least the longest match of the enabled detectors
    (:attr:`Scanner.max_span`); by default it is 128 or that, whichever is larger.

    A redacted secret that is still arriving (a private-key block, a long token) has its
    label emitted at once and the rest swallowed until it ends. A block stops the stream:
    the text before the blocked match is released and every later call returns nothing but
    ``blocked_by``. Concatenated output equals :meth:`Scanner.scan`'s ``redacted_text`` for
    the same text (up to the blocked match when blocked).

    ``changes_only=True`` runs only the detectors whose action changes the text (block,
    redact) and holds back only what could still grow into one of *their* matches (a prefix
    of ``sk-``, a run of digits, ...), so an ordinary word is released as soon as it arrives;
    flagged detectors are then not run (scan the whole text afterwards for them). The
    engine's output stays equal to the whole-text redaction by the same detectors. This is
    what the worker uses for output: the first token is not held for a flag.
    """

    def __init__(
        self,
        policy: FilterPolicy | None = None,
        *,
        window: int | None = None,
        changes_only: bool = False,
    ) -> None:
        self.policy = policy if policy is not None else FilterPolicy()
        plan = _plan_for(self.policy, changes_only)
        if window is None:
            window = max(DEFAULT_WINDOW, plan.reach)
        elif window < plan.reach:
            raise ValueError(f"window {window} is shorter than the longest match ({plan.reach})")
        self.window = window
        self._engine = _Engine(plan, stream=True, window=window)
        self._finished = False

    @property
    def blocked_by(self) -> str | None:
        """The id of the detector that stopped the stream, or ``None``."""
        f = self._engine.blocked
        return f.detector if f is not None else None

    @property
    def findings(self) -> tuple[Finding, ...]:
        """Every finding so far (positions are offsets in the whole stream)."""
        return tuple(self._engine.findings)

    @property
    def injection_score(self) -> float:
        return round(self._engine.score, 3)

    def feed(self, delta: str) -> StreamOutput:
        """Take the next chunk; return the text that is now safe to send."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        return self._step(delta, eof=False)

    def finish(self) -> StreamOutput:
        """End of stream: decide and release the held-back tail."""
        if self._finished:
            return StreamOutput("", self.blocked_by)
        self._finished = True
        return self._step("", eof=True)

    def _step(self, delta: str, *, eof: bool) -> StreamOutput:
        engine = self._engine
        if engine.blocked is not None:
            return StreamOutput("", self.blocked_by)
        if delta and not eof and engine.skip(delta):
            return StreamOutput(delta, None)
        seen = len(engine.findings)
        text = engine.feed(delta, eof=eof)
        return StreamOutput(text, self.blocked_by, tuple(engine.findings[seen:]))
