"""The ``tokenbus bench`` command's options, apart from the benchmarks that use them: the
parser is built for every command (``tokenbus --help``, ``tokenbus up``), so it imports none
of the bench modules and nothing beyond the runtime install (issue 63). Each benchmark module
reads its own options from the parsed namespace when it runs."""

from __future__ import annotations

from typing import Any

from services.config import DEFAULT_MODEL

# --peer NAME: the peer gateways `tokenbus bench --spawn` can start (tokenbus.evaluation.peers).
PEERS = ("vllm-router", "litellm", "pyrelay", "busrelay")
# --kv-policies: the routing policies the agent-session benchmark compares (kvbench).
POLICIES = ("kv_aware", "predicted_latency", "least_outstanding", "prefix_aware", "random")
# --nemesis-kinds: the faults the nemesis injects (nemesis).
KINDS = (
    "kill",
    "pause",
    "nats_kill",
    "nats_pause",
    "nats_partition",
    "host_crash",
    "site_cut",
    "site_stall",
    "site_slow",
)
# The faults of a site's leaf link (a proxy in front of the hub's leaf port).
SITE_KINDS = ("site_cut", "site_stall", "site_slow")


def _bench(sub: Any) -> Any:
    """The ``bench`` subcommand's parser (the CLI adds the scenarios that build on this
    module: ``--kv-sessions``)."""
    b = sub.add_parser("bench", help="concurrency sweep: TTFT, TBT, e2e, tokens/s, errors (JSON)")
    b.add_argument(
        "--url", default="http://127.0.0.1:8000/v1", help="OpenAI-compatible base URL (mode http)"
    )
    b.add_argument("--mode", choices=["http", "nats"], default="http")
    b.add_argument(
        "--api",
        choices=["chat", "responses", "messages"],
        default="chat",
        help="drive /v1/chat/completions, /v1/responses (the Responses API: streamed "
        "events; add --extra-body '{\"store\": false}' to leave its responses unstored) or "
        "/v1/messages (Anthropic's Messages API; over NATS, Client.messages)",
    )
    b.add_argument("--baseline-url", help="a second base URL measured level by level beside it")
    b.add_argument(
        "--spawn",
        action="store_true",
        help="start a private stack and a direct sim server and compare them",
    )
    b.add_argument("--model", default=DEFAULT_MODEL)
    b.add_argument(
        "--concurrency", default="1,2,4,8,16,32,64,128,256", help="comma separated levels"
    )
    b.add_argument(
        "--requests-per-client",
        type=int,
        default=20,
        help="requests per level = this x concurrency (ScaleLLM uses 20)",
    )
    b.add_argument("--max-tokens", type=int, default=64)
    b.add_argument(
        "--max-tokens-std",
        type=float,
        default=0.0,
        help="sample each request's output length from a normal distribution around "
        "--max-tokens with this standard deviation (0: fixed)",
    )
    b.add_argument(
        "--prompt", default="Explain how a continuous batching engine schedules sequences."
    )
    b.add_argument(
        "--prompts",
        help='prompts from a file: JSONL ({"prompt": ...} or {"messages": [...]}) or one '
        "prompt per line; used in turn",
    )
    b.add_argument(
        "--prompt-words",
        help="generated prompts of MEAN[:STD] words (a normal distribution), instead of --prompt",
    )
    b.add_argument(
        "--prompt-bytes",
        help="instead of the concurrency sweep, a prompt-size axis: comma separated sizes in "
        "bytes (e.g. 1000,262144,1048576,4194304,16777216), each a level at the first "
        "--concurrency; with --spawn, TTFT added against the direct server per size, and each "
        "process's peak memory (docs/large-requests.md)",
    )
    b.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="send each level's requests in this many rounds, each running every target in "
        "turn for its share, so a shared machine's changing load falls on every target alike "
        "(figures over all rounds; default 1: each target's level in one go)",
    )
    b.add_argument("--seed", type=int, default=0, help="for sampled lengths and prompts")
    b.add_argument(
        "--extra-body",
        help="fields added to every request body: a JSON object, or @FILE holding one "
        '(e.g. 20 tools with "tool_choice": "none" to measure what carrying them costs)',
    )
    se = b.add_argument_group("Expert Router's methodology: multi-turn sessions")
    se.add_argument(
        "--sessions",
        type=int,
        default=0,
        help="instead of the sweep: this many simulated users, each sending a base prompt "
        "then continuations with the conversation so far",
    )
    se.add_argument("--turns", type=int, default=3, help="requests per session")
    se.add_argument("--bucket", type=float, default=60.0, help="seconds per throughput bucket")
    b.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    b.add_argument("--out", help="JSON file (default bench-results/bench-<time>.json)")
    b.add_argument("--no-progress", action="store_true")
    b.add_argument(
        "--filter-cost",
        action="store_true",
        help="measure the content filter alone: us per KB and per streamed token",
    )
    g = b.add_argument_group("--spawn: the simulated engine")
    g.add_argument("--sim-prefill-ms", type=float, default=20.0)
    g.add_argument("--sim-decode-ms", type=float, default=10.0)
    g.add_argument("--sim-max-running", type=int, default=1024)
    g.add_argument(
        "--sim-decode-ms-per-seq",
        type=float,
        default=0.0,
        help="decode step time added per running sequence (every engine of the run)",
    )
    g.add_argument(
        "--engine",
        choices=["sim", "vllm-scripted"],
        default="sim",
        help="--spawn: the engine behind every path. sim: tokenbus' simulator; vllm-scripted: "
        "vLLM's own front end on the scripted engine core (direct is `vllm serve`, workers "
        "are --backend vllm; needs vLLM: make test-vllm, then .venv/vllm/bin/tokenbus bench)",
    )
    g.add_argument("--bridge-processes", type=int, default=1)
    g.add_argument("--nats-too", action="store_true", help="--spawn: also measure over NATS")
    g.add_argument(
        "--pipeline",
        default="route",
        help="--spawn: stages before the router, e.g. auth,ratelimit,filter,route "
        "(a key with generous limits is created for the run)",
    )
    g.add_argument(
        "--replica",
        action="append",
        default=[],
        metavar="N:KEY=VALUE,...",
        help="--spawn: N sim workers with these settings (repeatable), e.g. "
        "1:tp=8,pool=high_tp,tp_efficiency=0.5,tp_comm_ms=1.5 ; keys: tp, pool, max_running, "
        "max_concurrency, decode_ms_per_seq, tp_efficiency, tp_comm_ms, flow (on|off: the "
        "worker's flow control) (default: one worker)",
    )
    g.add_argument(
        "--routing",
        help='--spawn: router settings as JSON, e.g. \'{"pool_policy": "concurrency_tiered"}\'',
    )
    g.add_argument(
        "--no-direct", action="store_true", help="--spawn: skip the direct-engine baseline"
    )
    g.add_argument(
        "--upstream",
        action="store_true",
        help="--spawn: tokenbus' workers use the openai backend against the direct engine server "
        "(`tokenbus serve openai-http`), as peers do, instead of simulating in-process",
    )
    g.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="NAME[=BINARY]",
        help="--spawn: a peer gateway in front of the same engine server, measured side by side "
        f"(repeatable): {', '.join(PEERS)}; BINARY defaults to the name on PATH",
    )
    g.add_argument(
        "--locked",
        action="store_true",
        help="--spawn: the locked bus of `tokenbus up` (a user per role; with auth in "
        "--pipeline, NATS clients log in with the run's API key through the auth callout)",
    )
    g.add_argument(
        "--budget-usd",
        type=float,
        default=None,
        help="--spawn with auth,ratelimit: the run's key has this hard budget and the model a "
        "price ($1/$2 per million input/output tokens), so every request reserves spend at "
        "admission and settles it at its end (a JetStream write each)",
    )
    g.add_argument(
        "--nats-sync",
        default=None,
        metavar="always|DURATION",
        help="--spawn: the NATS server's JetStream sync policy (default: nats_sync, 'always'; "
        "'2m' is nats-server's own default): what each policy costs (docs/deploy.md)",
    )
    g.add_argument(
        "--telemetry",
        choices=["on", "off"],
        default="on",
        help="--spawn: per-request records and the telemetry service (default on)",
    )
    b.add_argument("--api-key", help="API key sent with every request")
    te = b.add_argument_group("many tenants on one saturated model (flow control)")
    te.add_argument(
        "--tenants",
        choices=["two", "weights", "tiers", "overload", "all"],
        help="instead of the sweep: a scenario of tenants (own keys) on one sim worker, each "
        "on a stack of its own, with the worker's flow control on and then off",
    )
    te.add_argument(
        "--duration", type=float, default=30.0, help="--tenants: seconds measured per run"
    )
    return b


def _kvbench(te: Any) -> None:
    te.add_argument(
        "--kv-sessions",
        metavar="N[,N]",
        help="instead of the sweep: N concurrent multi-turn agent sessions per load level "
        "(e.g. 16,64) on sim replicas with prefix caches, routed kv_aware, predicted_latency, "
        "least_outstanding, prefix_aware and random in turn",
    )
    te.add_argument("--kv-turns", type=int, default=10, help="--kv-sessions: turns per session")
    te.add_argument("--kv-replicas", type=int, default=4, help="--kv-sessions: sim workers")
    te.add_argument(
        "--kv-system-tokens", type=int, default=2000, help="--kv-sessions: the shared prompt"
    )
    te.add_argument(
        "--kv-prefill-ms-per-token",
        type=float,
        default=0.05,
        help="--kv-sessions: the sim's prefill cost per uncached prompt token",
    )
    te.add_argument(
        "--kv-cache-blocks",
        type=int,
        default=16384,
        help="--kv-sessions: blocks (of 16 tokens) in each replica's prefix cache",
    )
    te.add_argument(
        "--kv-policies",
        default=",".join(POLICIES),
        help=f"--kv-sessions: the policies compared (default {','.join(POLICIES)})",
    )
    te.add_argument(
        "--kv-routers",
        type=int,
        default=1,
        help="--kv-sessions: routing instances (bridge processes that route in-process), each "
        "turn on a new connection so it may land on any of them, as behind a request-level "
        "load balancer",
    )
    te.add_argument(
        "--kv-churn",
        action="store_true",
        help="--kv-sessions: kill one replica at half time and start another",
    )


def _routebench(g: Any) -> None:
    g.add_argument(
        "--routing-trace",
        type=int,
        metavar="SESSIONS",
        help="instead of the sweep: a generated trace of SESSIONS sessions (shared system "
        "prompts, multi-turn, long-tailed prompts; tokenbus.evaluation.trace) replayed against "
        "each routing policy on --kv-replicas sim replicas with chunked prefill (or the groups "
        "--replica names: a mixed fleet), side by side",
    )
    g.add_argument("--trace-file", help="--routing-trace: replay this trace (JSON lines) instead")
    g.add_argument(
        "--trace-sessions-per-s",
        type=float,
        default=4.0,
        help="--routing-trace: the generated trace's session arrivals (Poisson, per second)",
    )
    g.add_argument(
        "--trace-policies",
        default="least_outstanding,prefix_aware,kv_aware,predicted_latency",
        help="--routing-trace: the policies compared",
    )
    g.add_argument(
        "--trace-detail",
        action="store_true",
        help="--routing-trace: keep every request's row in the report (its session, turn, "
        "start, TTFT, time between tokens, replica, prompt and cached tokens)",
    )
    g.add_argument(
        "--trace-chunked-prefill",
        type=int,
        default=512,
        help="--routing-trace: the sim's chunked prefill (tokens per step; 0: off)",
    )
    g.add_argument(
        "--slo-ttft-ms", type=float, default=2000.0, help="--routing-trace: goodput's TTFT"
    )
    g.add_argument(
        "--slo-tbt-ms", type=float, default=100.0, help="--routing-trace: goodput's time per token"
    )


def _batchbench(g: Any) -> None:
    g.add_argument(
        "--batch-lines",
        type=int,
        help="instead of the sweep: a batch of N lines on the replica an interactive load "
        "uses (docs/batches.md); --duration seconds per window",
    )
    g.add_argument(
        "--batch-runner-lines",
        type=int,
        default=160,
        help="--batch-lines: lines the runner bridge runs at once (batches.concurrency)",
    )
    g.add_argument(
        "--batch-interactive",
        type=int,
        default=64,
        help="--batch-lines: the interactive client's concurrent streams",
    )
    g.add_argument(
        "--batch-interactive-std",
        type=float,
        default=16.0,
        help="--batch-lines: the spread (standard deviation, tokens) of the interactive "
        "answers' lengths around 64 (0: all 64, and the streams that end in one engine step "
        "all come back in the next: a burst)",
    )


def _nemesis(g: Any) -> None:
    """``tokenbus bench --nemesis`` and its options."""
    g.add_argument(
        "--nemesis",
        action="store_true",
        help="instead of the sweep: mixed traffic on a locked NATS cluster of its own while a "
        "fault is injected every --fault-every seconds, then the invariants (docs/nemesis.md)",
    )
    g.add_argument("--nemesis-duration", type=float, default=600.0, help="seconds of load")
    g.add_argument("--fault-every", type=float, default=10.0, help="seconds between faults")
    g.add_argument("--nemesis-nodes", type=int, default=3, help="NATS nodes (hosts)")
    g.add_argument(
        "--nemesis-sites",
        type=int,
        default=1,
        help="sites: a leaf node each, dialling the hub through a link the site faults cut, "
        "stall and slow, with a worker of its own (0: none, and no site faults)",
    )
    g.add_argument("--nemesis-seed", type=int, help="the fault schedule's seed (default: random)")
    g.add_argument(
        "--nemesis-lost-cache",
        action="store_true",
        help="a crashed host's store loses what its node wrote in the fault interval before "
        "the crash, as a node syncing lazily would (default: it keeps what it synced, every "
        "acknowledged write with the nodes' sync_interval: always)",
    )
    g.add_argument(
        "--nemesis-no-balancer",
        action="store_true",
        help="HTTP clients each to a bridge of their own, round robin, instead of through a "
        "load balancer checking the bridges' /ready (as compose's gateways profile runs)",
    )
    g.add_argument(
        "--nemesis-faults",
        default=",".join(KINDS),
        help=f"fault kinds to choose among, comma separated: {', '.join(KINDS)}",
    )


def _syncbench(g: Any) -> None:
    g.add_argument(
        "--sync-cost",
        action="store_true",
        help="instead of the sweep: what each JetStream sync policy costs the stores "
        "(keys, budgets, a batch, files) on this machine's disk (docs/deploy.md)",
    )
    g.add_argument(
        "--sync-policies",
        default="2m,1s,always",
        help="--sync-cost: the policies compared, comma-separated",
    )
    g.add_argument("--sync-keys", type=int, default=200, help="--sync-cost: keys created")
    g.add_argument(
        "--sync-clients", type=int, default=64, help="--sync-cost: concurrent budgeted requests"
    )
    g.add_argument("--sync-rounds", type=int, default=20, help="--sync-cost: requests per client")
    g.add_argument("--sync-lines", type=int, default=5000, help="--sync-cost: batch lines")
    g.add_argument("--sync-files", type=int, default=20, help="--sync-cost: 1 MiB files put")


def _adapterbench(g: Any) -> None:
    g.add_argument(
        "--adapters",
        type=int,
        help="instead of the sweep: load, ask and unload N LoRA adapters at run time under "
        "load (--concurrency streams; two replicas; docs/adapters.md)",
    )


def _pdbench(g: Any) -> None:
    g.add_argument(
        "--pd",
        action="store_true",
        help="instead of the sweep: disaggregated (R/2 prefill + R/2 decode replicas) against "
        "aggregated serving on R replicas, a mix of short chats and long prompts "
        "(docs/disaggregation.md)",
    )
    g.add_argument("--pd-replicas", default="2,4", help="replica counts R, even (default 2,4)")
    g.add_argument("--pd-duration", type=float, default=30.0, help="seconds of load each")
    g.add_argument(
        "--pd-short-clients", type=int, default=12, help="short-chat clients per 2 replicas"
    )
    g.add_argument(
        "--pd-long-clients", type=int, default=1, help="long-prompt clients per 2 replicas"
    )
    g.add_argument("--pd-slo-ttft-ms", type=float, default=2000.0)
    g.add_argument("--pd-slo-itl-ms", type=float, default=100.0)


def _coldpath(g: Any) -> None:
    g.add_argument(
        "--cold-path",
        action="store_true",
        help="instead of the sweep: each in-process step of a chat request timed warm (in a "
        "loop) and cold (once, after the process slept), on this machine",
    )
    g.add_argument("--cold-gap-ms", type=float, default=10.0, help="the sleep before a cold call")
    g.add_argument("--cold-trials", type=int, default=60, help="cold calls per step")


def _startcost(g: Any) -> None:
    g.add_argument(
        "--start-cost",
        action="store_true",
        help="instead of the sweep: start each service on a nats-server of its own and "
        "report its time to ready and its CPU (tokenbus/evaluation/startcost.py)",
    )
    g.add_argument("--start-trials", type=int, default=5, help="starts of each service")
    g.add_argument(
        "--start-services",
        default="worker,ingress,auth,ratelimit,filter,router,bridge,telemetry",
        help="the services started, comma-separated",
    )


def add_parser(sub: Any) -> Any:
    """The ``bench`` sub-command with every scenario's options."""
    bp = _bench(sub)
    _kvbench(bp.add_argument_group("multi-turn agent sessions"))
    _routebench(bp.add_argument_group("routing policies on a trace"))
    _batchbench(bp.add_argument_group("a batch beside interactive traffic"))
    _nemesis(bp.add_argument_group("faults under mixed traffic (docs/nemesis.md)"))
    _syncbench(bp.add_argument_group("what each JetStream sync policy costs"))
    _adapterbench(bp.add_argument_group("LoRA adapters at run time"))
    _pdbench(bp.add_argument_group("prefill/decode disaggregation"))
    _coldpath(bp.add_argument_group("one request's steps, warm and cold"))
    _startcost(bp.add_argument_group("what each service's start costs"))
    return bp
