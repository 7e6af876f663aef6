"""A nemesis run's state, shared by its load, its faults and its checks: the windows (one
per fault), each request's outcome, the keys."""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from typing import Any

from tokenbus.evaluation.nemesis_config import Config
from tokenbus.evaluation.nemesis_stack import Stack


@dataclass
class Outcome:
    rid: str
    via: str  # http | nats | batch | background
    key: str  # the key's name
    window: int
    t0: float
    t1: float = 0.0
    status: str = "open"  # ok | error | hung
    error: str = ""
    text_ok: bool = True
    text_problem: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    max_cost: int = 0  # what it could have been charged at most (micro-dollars)


class Run:
    """The run's state: windows (one per fault), outcomes, keys."""

    def __init__(self, cfg: Config, stack: Stack, rng: random.Random) -> None:
        self.cfg = cfg
        self.stack = stack
        self.rng = rng  # the clients' draws (how many tokens), which follow their pace
        # The faults' own draws: a seed replays the same schedule (kinds, targets) whatever
        # the clients drew meanwhile.
        self.fault_rng = random.Random(rng.random())
        self.t_start = time.monotonic()
        self.windows: list[dict[str, Any]] = [{"kind": "none", "target": "", "t": 0.0}]
        self.outcomes: list[Outcome] = []
        self.keys: dict[str, tuple[str, str]] = {}  # name -> (secret, id)
        self.acked_keys: list[str] = []  # ids of keys created during the run, acknowledged
        self.stop_at = float("inf")
        self.seq = 0
        self.log: list[str] = []
        self.http_bases: list[str] = []  # the balancer's, when there is one
        # Every spend report (and supersede) seen on the bus during the run, by request id:
        # where a key's spend is off, which answered attempt's report never came (a tap on
        # the admin login, which may miss what crossed while its node was down).
        self.spend_reports: dict[str, list[dict[str, Any]]] = {}
        self.tap_disconnects = 0

    def now(self) -> float:
        return time.monotonic() - self.t_start

    def say(self, line: str) -> None:
        line = f"[{self.now():7.2f}s] {line}"
        self.log.append(line)
        if not self.cfg.quiet:
            print(line, flush=True)

    def new(self, via: str, key: str) -> Outcome:
        self.seq += 1
        o = Outcome(f"nem{os.getpid()}x{self.seq}", via, key, len(self.windows) - 1, self.now())
        self.outcomes.append(o)
        return o
