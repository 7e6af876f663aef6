"""What a nemesis run is given (:class:`Config`: its length, the faults, the stack's size,
the load) and the constants its parts share (the roles, the model's price, the pipeline)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenbus.evaluation.options import KINDS

ROLES = ("ingress", "router", "auth", "ratelimit", "filter", "worker", "bridge", "telemetry")
MEMBER_ROLES = ("ingress", "auth", "ratelimit", "filter", "router")
# Price of the run's model, dollars per million tokens: one micro-dollar per prompt token,
# two per generated token (auth/budgets.py).
PRICE_IN, PRICE_OUT = 1, 2
PIPELINE = ["auth", "ratelimit", "filter", "route"]


@dataclass
class Config:
    """One nemesis run's settings (``tokenbus bench --nemesis``'s flags set some of them)."""

    duration_s: float = 600.0
    fault_every_s: float = 10.0
    nodes: int = 3
    seed: int | None = None
    kinds: tuple[str, ...] = KINDS
    per_role: int = 2  # instances of each member role (ingress, auth, ratelimit, ...)
    workers: int = 3
    bridges: int = 2
    nats_clients: int = 6
    http_clients: int = 6
    deadline_s: float = 30.0  # every request's own deadline
    batch_lines: int = 40
    pause_s: float = 1.5  # how long a paused process or node stays paused
    partition_s: float = 2.0
    # Sites (leaf nodes with a worker each, named a, b, ...) and their links' faults: a cut
    # (connections closed, new ones refused), a stall (nothing crosses, the connections
    # stay) or a delay each way, each for ``partition_s``.
    sites: int = 0
    site_delay_s: float = 0.1
    down_s: float = 1.0  # how long a killed node or crashed host stays down
    warmup_s: float = 3.0  # load before the first fault (the "none" window)
    sim_prefill_ms: float = 5.0
    sim_decode_ms: float = 8.0
    model: str = "nemesis-sim"
    run_dir: str = ""
    out: str = ""
    quiet: bool = False
    extra_env: dict[str, str] = field(default_factory=dict)
    # What a crashed host's JetStream store keeps. False: what its node synced, which with
    # the nodes' policy (``sync_interval: always``, every config tokenbus writes) is every
    # write it acknowledged. True: only what it held one fault interval before the crash,
    # as a node syncing lazily (nats' own 2 minutes) loses its page cache.
    lost_cache: bool = False
    # HTTP clients through a load balancer with health checks on the bridges' /ready
    # (tokenbus/evaluation/balancer.py, what compose/haproxy.cfg does), not each to one
    # bridge of its own: a crashed host takes none of their new requests with it.
    balancer: bool = True
