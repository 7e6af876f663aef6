"""One settings model for the whole stack: defaults < ``tokenbus.toml`` < env vars < CLI flags.

Env vars: ``TOKENBUS_NATS_URL``, ``TOKENBUS_LOG_LEVEL``, and per section with ``__``:
``TOKENBUS_BRIDGE__PORT=8001``, ``TOKENBUS_WORKER__SIM__DECODE_MS=5``. The file is
``./tokenbus.toml`` or the path in ``TOKENBUS_CONFIG`` / ``--config``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from bus_schemas.subjects import STAGE_AUTH, STAGE_FILTER, STAGE_RATELIMIT, STAGE_ROUTE
from services import natsclient

DEFAULT_MODEL = "tokenbus-sim"


# What JetStream writes to disk before it acknowledges (docs/deploy.md, "Durability"): every
# write, fsynced before its acknowledgement. nats-server's own default syncs every two minutes,
# so a machine that loses power (or its kernel) loses what it acknowledged since; on a cluster
# that takes the nodes holding a quorum of a stream down together. ``always`` costs a sync per
# write on the stores that write per request (spend settlement, batch results) and nothing
# on admission's reads; docs/deploy.md has the measured cost. An interval ("1s") is the
# operator's trade (``nats_sync``, TOKENBUS_NATS_SYNC).
NATS_SYNC = "always"
NATS_SYNC_PATTERN = r"^(always|[1-9][0-9]*(ms|s|m|h))$"


class BridgeSettings(BaseModel):
    """The OpenAI-compatible HTTP bridge."""

    host: str = Field(default="127.0.0.1", description="Address to listen on.")
    port: int = Field(default=8000, description="Port to listen on.")
    processes: int = Field(default=1, ge=1, description="Bridge processes sharing the port.")
    tls_cert: str = Field(
        default="", description="Serve HTTPS with this certificate (PEM, with tls_key)."
    )
    tls_key: str = Field(default="", description="Private key of tls_cert (PEM).")
    max_body_bytes: int = Field(
        default=32 * 1024 * 1024,
        description="Larger bodies get 413, naming this limit. 32 MiB: Anthropic's Messages "
        "API takes 32 MB per request (OpenAI up to 50 MB of images); a request larger than "
        "half of NATS's max_payload travels by claim check (docs/large-requests.md), up to "
        "40 MiB.",
    )
    request_timeout_s: float = Field(default=600.0, description="Per-request deadline.")
    start_wait_s: float = Field(
        default=60.0,
        gt=0,
        description="The bridge listens as soon as it starts, before it has reached the bus "
        "and opened its stores: a request that arrives meanwhile waits this long for it, then "
        "gets 503 with Retry-After. /ready says 503 until it serves (docs/deploy.md).",
    )
    unready_s: float = Field(
        default=0.0,
        ge=0,
        description="On SIGTERM the bridge answers /ready with 503 at once but goes on taking "
        "requests this long before it stops listening, so that load balancers' health checks "
        "take it out first (compose and Kubernetes set 5; docs/deploy.md, 'Zero-downtime "
        "upgrade'). Open requests then finish within drain_timeout_s.",
    )
    body_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="The whole request body must arrive within this; otherwise 408 and the "
        "connection is closed (a body shorter than its Content-Length, or a trickle).",
    )
    max_header_bytes: int = Field(
        default=65_536,
        ge=1024,
        description="The request line and headers together may be this many bytes; a larger "
        "head gets 431 (request_header_fields_too_large) and the connection is closed. The "
        "HTTP parser (httptools) has no limit of its own; real clients send a few KiB.",
    )
    header_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="A request's line and headers must all arrive within this, counted from "
        "the connection's start or the request's first byte; otherwise 408 and the "
        "connection is closed (slowloris). A new connection that sends nothing is closed "
        "without an answer. A body the bridge answered early (413, 404) must finish "
        "arriving within this as well.",
    )
    max_connections_per_client: int = Field(
        default=4096,
        ge=0,
        description="Open connections one client address may hold on each bridge process; "
        "beyond it a connection's first request gets 429 (too_many_connections) and the "
        "connection is closed. 0: no limit (behind a proxy or load balancer every client "
        "has its address).",
    )
    max_connections: int = Field(
        default=0,
        ge=0,
        description="Open connections each bridge process holds in all; beyond it a "
        "connection's first request gets 503 (overloaded) and the connection is closed. "
        "0: no limit but the process's open-file limit.",
    )
    fuse_router: bool = Field(
        default=True,
        description="When the pipeline has no stage before the router, route in the bridge "
        "process instead of through a router service: two process hops fewer per request.",
    )
    pull_bodies: bool = Field(
        default=True,
        description="With the router in-process (fuse_router): a request too large for one "
        "bus message stays in the bridge and goes to the replica chosen when it asks for it "
        "(one pass over the bus, nothing stored). false: it is stored first (claim check), "
        "as NATS clients' are (docs/large-requests.md).",
    )
    fuse_stages: bool = Field(
        default=True,
        description="Run the pipeline's auth, ratelimit and filter stages in the bridge "
        "process (same code, same shared state as the stage services) instead of sending "
        "each HTTP request through them: a process hop fewer per stage. NATS clients still "
        "go through the stage services.",
    )


class IngressSettings(BaseModel):
    """Validates requests and starts them down the pipeline."""

    pipeline: list[str] = Field(
        default_factory=lambda: [STAGE_AUTH, STAGE_RATELIMIT, STAGE_FILTER, STAGE_ROUTE],
        description="Stages a request passes after ingress; the router is always last. "
        '["route"] alone runs without keys, limits or filtering.',
    )
    default_max_tokens: int = Field(
        default=0,
        ge=0,
        description="max_tokens of a chat or Responses request that sets none. 0 (the "
        "default, as OpenAI and `vllm serve`): what the model's context leaves after the "
        "prompt, still bounded by the key's TPM and max_request_s; N: at most N. "
        "/v1/completions defaults to 16 (OpenAI's documented default) either way.",
    )
    max_prompt_chars: int = Field(
        default=32 * 1024 * 1024,
        description="Longer prompts get 413 (the body bound's worth of text: long contexts "
        "travel by claim check, docs/large-requests.md).",
    )
    max_request_s: float = Field(
        default=600.0,
        gt=0,
        description="No request runs longer: a deadline a NATS client sets further out (or "
        "none) is brought to this; at the deadline the worker ends the request with a "
        "timeout and cancels the engine work.",
    )


LoadPolicyName = Literal[
    "least_outstanding",
    "round_robin",
    "power_of_two",
    "session_affinity",
    "prefix_aware",
    "kv_aware",
    "predicted_latency",
    "random",
]
PoolPolicyName = Literal["none", "concurrency_tiered", "expert"]


class TieredSettings(BaseModel):
    """ScaleLLM's concurrency-tiered pool choice."""

    threshold: int = Field(
        default=64, ge=1, description="The model's in-flight requests at which to go wide."
    )
    hysteresis: int = Field(
        default=8, ge=0, description="Go back to the high-TP pool below threshold - this."
    )
    high_pool: str = Field(default="high_tp", description="Pool tag of the high-TP replicas.")
    wide_pool: str = Field(default="wide", description="Pool tag of the many small replicas.")


class ExpertSettings(BaseModel):
    """Expert Router's prompt classification (``tokenbus router train``)."""

    model_dir: str = Field(default="", description="Directory written by `router train`.")
    targets: dict[str, str] = Field(
        default_factory=dict,
        description="Cluster index or majority label -> `pool:<tag>` (a pool of the "
        "requested model) or a model name (that model's replicas).",
    )


class PriceSettings(BaseModel):
    """What a model's tokens cost, in dollars per million tokens (as providers list them,
    and as LiteLLM's model_list sets them): spend budgets are settled with it."""

    model_config = ConfigDict(extra="forbid")

    input: float = Field(default=0.0, ge=0, description="Prompt tokens not read from cache.")
    cached_input: float | None = Field(
        default=None, ge=0, description="Prompt tokens read from the cache (default: input)."
    )
    output: float = Field(default=0.0, ge=0, description="Generated tokens.")


class KVRoutingSettings(BaseModel):
    """kv_aware: the weights of one cost per replica, lowest wins (docs/kv-events.md)."""

    model_config = ConfigDict(extra="forbid")

    prefix_weight: float = Field(
        default=1.0,
        ge=0,
        description="Times the share of the prompt's blocks the replica would prefill anew "
        "(1 - cached prefix / prompt blocks, from its KV events).",
    )
    load_weight: float = Field(
        default=1.0, ge=0, description="Times the replica's in-flight requests / capacity."
    )
    queue_weight: float = Field(
        default=1.0, ge=0, description="Times its engine's waiting requests / capacity."
    )
    work_weight: float = Field(
        default=1.0,
        ge=0,
        le=100,
        description="predicted_latency: a replica's score is the request's predicted time to "
        "first token there plus this times the prefill it would make it compute (its prompt "
        "less the prefix cached there), ms: the wait it adds for the requests behind it. 0: "
        "the lowest predicted TTFT alone.",
    )
    tail_weight: float = Field(
        default=3.0,
        ge=0,
        le=100,
        description="predicted_latency: among the replicas that meet the class's target, a "
        "replica's predicted time to first token counts as TTFT x (1 + this x TTFT / the "
        "class's TTFT target): a wait near the target counts more than its share, so long "
        "waits are spread before any queue nears it (the p99), at the price of a few cache "
        "hits. 0, or no replica meeting the target: the TTFT as it is.",
    )
    stay_ms: float = Field(
        default=0.0,
        ge=0,
        description="predicted_latency: a request whose session's prefix one replica holds "
        "deeper than any other (its home) goes there while its predicted time to first token "
        "there is at most this, ms, and meets the class's target; beyond, the scores decide "
        "(and while the fleet is behind: when_behind). 0: the scores always decide.",
    )
    neighbour_weight: float = Field(
        default=0.0,
        ge=0,
        le=100,
        description="predicted_latency: a new session's first request (a session id this "
        "router sent nowhere within neighbour_s) also counts, on each replica, this times "
        "the prompt tokens a session's turn adds (learned from the sessions routed) at the "
        "replica's prefill speed, for every session sent there within neighbour_s: its next "
        "turns will queue where it starts, beside theirs. 0: off.",
    )
    neighbour_s: float = Field(
        default=10.0,
        gt=0,
        le=3600,
        description="predicted_latency, neighbour_weight: how long a session sent to a "
        "replica counts as living there, s.",
    )
    when_behind: Literal["work", "latency"] = Field(
        default="work",
        description="predicted_latency, while every candidate replica has a prefill backlog "
        "and steps predicted at 75 % or more of the class's time per output token (the "
        "fleet is behind): 'work' scores the prefill the request would make each "
        "compute (ms at its own speed, its cached prefix taken off) times (1 + the backlog "
        "it joins / the class's TTFT target), without the predicted TTFT: the least prefill "
        "for the whole fleet, its goodput; 'latency' keeps the predicted-latency score.",
    )


class KVCheckSettings(BaseModel):
    """How a router checks the replicas' KV caches against its own view (docs/routing.md,
    "Checking the KV index"): the hashing it computes, and the closed loop of its predicted
    cache hits against the engines' reports."""

    model_config = ConfigDict(extra="forbid")

    block_size: int = Field(
        default=0,
        ge=0,
        description="The KV block size this router hashes prompts with; a replica that "
        "announces another is refused (its events ignored, an error logged). 0: each "
        "replica's own (the router hashes per replica).",
    )
    hash_seed: str = Field(
        default="",
        max_length=256,
        description="The seed of the sim's text block hash this router computes (the sim's "
        "`sim.hash_seed`); a sim replica announcing another is refused.",
    )
    window_s: float = Field(
        default=60.0,
        gt=0,
        description="The closed loop's window: predicted and reported cached tokens of a "
        "replica are compared over the heartbeats of this long.",
    )
    min_tokens: int = Field(
        default=512,
        ge=1,
        description="Predicted (or reported) cached tokens a window needs before it judges.",
    )
    tolerance: float = Field(
        default=0.25,
        gt=0,
        le=1,
        description="A replica disagrees when |reported - predicted| is above this share of "
        "the larger of the two over the window; it is routed by load until it agrees again.",
    )


class LatencyTarget(BaseModel):
    """What a request of one class must get (predicted_latency)."""

    model_config = ConfigDict(extra="forbid")

    ttft_ms: float = Field(gt=0, description="Time to first token, ms.")
    tpot_ms: float | None = Field(
        default=None, gt=0, description="Time per output token, ms (none: any)."
    )


def _default_targets() -> dict[str, LatencyTarget]:
    return {
        "priority": LatencyTarget(ttft_ms=500, tpot_ms=50),
        "default": LatencyTarget(ttft_ms=2000, tpot_ms=100),
        "flex": LatencyTarget(ttft_ms=30000),
    }


class ModelRouting(BaseModel):
    """How one model's requests are routed: a pool choice, then a load policy inside it."""

    model_config = ConfigDict(extra="forbid")

    policy: LoadPolicyName = Field(
        default="least_outstanding", description="Chooses the replica inside the pool."
    )
    pool_policy: PoolPolicyName = Field(default="none", description="Chooses the pool first.")
    load_bound: float = Field(
        default=1.25,
        ge=1.0,
        description="session_affinity / prefix_aware / kv_aware: a replica above this times "
        "the average load is passed over.",
    )
    prefix_block_chars: int = Field(
        default=256, ge=16, description="prefix_aware: characters per hashed prompt block."
    )
    kv: KVRoutingSettings = Field(default_factory=KVRoutingSettings)
    latency_targets: dict[str, LatencyTarget] = Field(
        default_factory=_default_targets,
        description="predicted_latency: per class (service_tier: priority, default, flex) the "
        "time to first token and per output token a replica must be predicted to meet.",
    )
    tiered: TieredSettings = Field(default_factory=TieredSettings)
    expert: ExpertSettings = Field(default_factory=ExpertSettings)
    price: PriceSettings | None = Field(
        default=None,
        description="Dollars per million tokens, for spend budgets (docs/flow.md); "
        "none: the model's tokens cost nothing.",
    )


class RouterSettings(ModelRouting):
    """Replica registry and routing. The routing fields are the default for every model;
    ``models`` overrides them per model (and the admin API changes them at run time)."""

    model_config = ConfigDict(extra="ignore")

    models: dict[str, ModelRouting] = Field(
        default_factory=dict, description="Per-model routing, e.g. [router.models.big]."
    )
    aliases: dict[str, str] = Field(
        default_factory=dict,
        description="Model aliases from the configuration, name -> served model, e.g. "
        '[router.aliases] "claude-sonnet-4-5" = "qwen3-32b" (env TOKENBUS_ROUTER__ALIASES as '
        "JSON); run-time ones (`tokenbus router alias`) win over these (docs/routing.md).",
    )
    missed_heartbeats: int = Field(default=3, ge=1, description="Beats missed before expiry.")
    kv_check: KVCheckSettings = Field(
        default_factory=KVCheckSettings,
        description="kv_aware: the hashing this router computes and the check of its predicted "
        "cache hits against the replicas' reports.",
    )
    queue_timeout_s: float = Field(
        default=5.0,
        ge=0,
        description="When every replica of a model is at capacity, hold a request this long "
        "for one to free up before answering 503 overloaded.",
    )
    max_queued: int = Field(
        default=1024,
        ge=0,
        description="Requests one router holds per model while every replica is at "
        "capacity; more are refused at once with 503 overloaded (Retry-After).",
    )
    waiting_room_s: float = Field(
        default=0.0,
        ge=0,
        description="Scale from zero: hold a request for a model with no live replica this "
        "long for one to start (0: answer 503 no_replica at once). Held: models this router "
        "has seen, those under router.models, and waiting_room_models. The waiting requests "
        "are the tokenbus_model_queue_depth an autoscaler (KEDA) scales on (docs/flow.md).",
    )
    waiting_room_models: list[str] = Field(
        default_factory=list,
        description="Models held in the waiting room although this router never saw a "
        "replica of them (a model scaled to zero before the router started).",
    )
    dispatch_timeout_s: float = Field(default=2.0, description="Wait for a worker's ack.")
    write_at_once: bool = Field(
        default=True,
        description="Write each request to NATS as it is dispatched (the replica starts the "
        "first of a burst while the rest are admitted); false leaves it to the connection's "
        "flusher, which writes a burst together: less CPU per token, later first tokens "
        "(docs/benchmarks.md).",
    )
    max_attempts: int = Field(default=3, ge=1, description="Replicas tried per request.")
    pd_min_prompt_tokens: int = Field(
        default=512,
        ge=0,
        description="Prefill/decode disaggregation (docs/disaggregation.md): a request whose "
        "prompt has at least this many tokens the decode replicas do not hold cached is "
        "prefilled on a `prefill` replica and decoded on a `decode` one, when the model has "
        "both and a prefill replica has room; shorter ones run whole on a decode replica.",
    )
    pd_prefill_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="How long a prefill replica has for its part before the request runs "
        "whole on a decode replica instead.",
    )
    pd_cross_site: bool = Field(
        default=False,
        description="Let a prefill's KV cache be handed over to a decode replica at another "
        "site (docs/deploy.md, Sites): off, a request is disaggregated only on a prefill "
        "replica whose site has a decode replica, and decoded at that site, so the cache "
        "never crosses a site's link.",
    )
    warmup_s: float = Field(
        default=2.0,
        ge=0,
        description="After start, wait this long for a not-yet-heard model's heartbeats "
        "before answering 404.",
    )

    def routing_for(self, model: str, override: dict[str, Any] | None = None) -> ModelRouting:
        """The defaults, then ``models[model]``'s fields, then ``override`` (run-time)."""
        base = self.model_dump(include=set(ModelRouting.model_fields))
        found = self.models.get(model)
        if found is not None:
            base = _deep_merge(base, found.model_dump(exclude_unset=True))
        if override:
            base = _deep_merge(base, override)
        return ModelRouting.model_validate(base)


class RateLimitSettings(BaseModel):
    """The ratelimit stage."""

    fail_open: bool = Field(
        default=False,
        description="When the limiter's store is unreachable: admit (true) or refuse with a "
        "retryable 503 (false).",
    )
    cut_off_share: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="Above 0: when the limiter's store has not granted a lease in "
        "cut_off_after_s (a site's bridge whose link to the hub is cut), admit locally from "
        "this share of each limit per minute window (at least one request, one slot), "
        "written into the shared counters once the store answers again (auth/limits.py). "
        "0: wait for the store (then fail_open decides).",
    )
    cut_off_after_s: float = Field(
        default=2.0,
        gt=0.0,
        description="With cut_off_share: how long a lease waits for the store before it is "
        "taken locally.",
    )
    cut_off_dir: str | None = Field(
        default=None,
        description="With cut_off_share: a folder on local disk where what was admitted while "
        "cut off (window counts, spend holds) is kept until written into the store, so a "
        "bridge that dies meanwhile leaves it to the next one started with the same folder "
        "(auth/cut_off_state.py). None: in memory only.",
    )
    owner_grace_s: float = Field(
        default=5.0,
        ge=0,
        description="A spend report kept in the stream for another limiter is left to it this "
        "long before this one settles it (the one it names heard it directly and can correct "
        "a moved attempt's charge). How late a dead limiter's reports are charged.",
    )


class FilterSettings(BaseModel):
    """The content filter stage and output scanning."""

    default_policy: str = Field(
        default="default", description="Policy for requests whose key names none."
    )
    policies: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="Named policies (FilterPolicy fields) besides the built-in 'default', "
        "'strict' and 'off'.",
    )
    window: int | None = Field(
        default=None,
        description="Output hold-back in characters (default: what the "
        "policy's longest pattern needs).",
    )


class SimSettings(BaseModel):
    """The simulated continuous-batching engine (see engine_worker/backends/sim.py)."""

    prefill_ms: float = Field(default=20.0, description="Base prefill (first token) time.")
    max_model_len: int = Field(
        default=1048576,
        ge=1,
        description="The simulated model's context length (1M tokens, as the long-context "
        "models agents use have: GPT-4.1, Gemini, Qwen2.5-1M; a coding agent's 0.8-4 MB "
        "context, docs/large-requests.md, is 200k-1M tokens): prompt plus max_tokens must "
        "fit (a request that does not is refused as vLLM refuses it; one without max_tokens "
        "gets what fits, at most the gateway's default when one is set).",
    )
    prefill_ms_per_token: float = Field(default=0.0, description="Extra prefill per prompt token.")
    decode_ms: float = Field(default=10.0, description="Decode step time at batch size 1.")
    decode_ms_per_seq: float = Field(default=0.0, description="Extra step time per running seq.")
    max_running: int = Field(default=256, ge=1, description="Max sequences in the batch.")
    fault_signals: bool = Field(
        default=False,
        description="For tests of engine health: SIGUSR1 makes the sim's engine die (the worker "
        "is told at once, as vLLM's errored engine says), SIGUSR2 makes it hang (no more steps, "
        "nothing said: the worker finds it stuck after worker.engine_stuck_s).",
    )
    tp_comm_ms: float = Field(default=0.0, description="All-reduce cost per step when tp>1.")
    tp_efficiency: float = Field(default=0.9, gt=0, le=1, description="Scaling per extra GPU.")
    embedding_dim: int = Field(
        default=64, ge=1, description="Length of the embeddings (without `dimensions`)."
    )
    answer_tokens_median: int = Field(
        default=256,
        ge=0,
        description="A plain answer ends on its own (finish `stop`) after a length drawn per "
        "prompt and seed from a log-normal distribution with this median, unless `max_tokens` "
        "comes first or the request sets `ignore_eos` (0: answers always run to `max_tokens`, "
        "the simulator before its natural stop).",
    )
    answer_tokens_sigma: float = Field(
        default=0.9, ge=0, description="Spread of that log-normal (of the natural log)."
    )
    answer_tokens_min: int = Field(
        default=8, ge=1, description="The shortest answer that ends on its own."
    )
    kv_cache_blocks: int = Field(
        default=16384,
        ge=0,
        description="Blocks in the simulated KV cache, with prefix caching as vLLM's "
        "(engine_worker/kvcache.py, docs/kv-events.md): a prompt's full blocks already cached "
        "are not prefilled again (prefill_ms_per_token counts only the others), and the "
        "replica publishes what it stores and evicts as KV events. 16384 blocks of 16 tokens: "
        "262 144 tokens, about what an 8B model leaves for its KV cache on an 80 GB GPU. "
        "0: no prefix caching and no KV events.",
    )
    block_size: int = Field(
        default=16,
        ge=1,
        le=1024,
        description="Tokens per KV-cache block (vLLM's default, 16): only full blocks are "
        "cached and matched.",
    )
    hash_seed: str = Field(
        default="",
        max_length=256,
        description="Seeds the sim's block hashes (as PYTHONHASHSEED seeds vLLM's): a router "
        "computes the same hashes only with the same `router.kv_check.hash_seed`. Announced "
        "in heartbeats.",
    )
    fault_cached_scale: float = Field(
        default=1.0,
        ge=0,
        description="For tests of the router's closed loop: the cached prompt tokens the sim "
        "reports are its real ones times this (its KV events stay true), as an engine whose "
        "reports disagree with its events.",
    )
    max_loras: int = Field(
        default=1,
        ge=1,
        le=256,
        description="LoRA adapters in one batch at once (vLLM's `max_loras`, default 1): a "
        "request on another adapter waits in the queue until the batch holds fewer, as "
        "vLLM's scheduler keeps it; requests on the base model never wait for it.",
    )
    lora_load_ms: float = Field(
        default=300.0,
        ge=0,
        description="How long loading an adapter at run time takes (reading its weights; "
        "docs/adapters.md).",
    )
    max_lora_rank: int = Field(
        default=16,
        ge=1,
        description="The largest adapter rank a load accepts (vLLM's `max_lora_rank`, "
        "default 16), read from the adapter folder's adapter_config.json (`r`) when present.",
    )
    chunked_prefill_tokens: int = Field(
        default=0,
        ge=0,
        description="vLLM's chunked prefill: the tokens one engine step computes "
        "(`max_num_batched_tokens`): every running sequence's next token, then prompt "
        "tokens of the sequences prefilling in chunks of what is left, so a long prompt "
        "stretches every running sequence's step: a step takes decode_ms + decode_ms_per_seq "
        "x running + prefill_ms_per_token x its prompt tokens (prefill_ms is not used). 0: "
        "prefills run beside the decode steps without slowing them (the default, an engine "
        "with compute to spare; docs/disaggregation.md).",
    )
    kv_bytes_per_token: int = Field(
        default=131072,
        ge=1,
        description="Bytes of KV cache one prompt token takes (an 8B model with grouped "
        "queries, fp16: 2 x 32 layers x 8 KV heads x 128 x 2 bytes = 128 KiB): what a "
        "prefill replica hands a decode replica.",
    )
    kv_link_gb_per_s: float = Field(
        default=25.0,
        gt=0,
        description="The KV transfer's bandwidth between replicas, GB/s (NIXL over RDMA, "
        "a 200 Gb/s link): a handed-over prompt arrives after its bytes over this.",
    )


class OpenAIUpstreamSettings(BaseModel):
    """An OpenAI-compatible upstream joined to the bus."""

    upstream_url: str = Field(default="", description="Base URL, e.g. http://host:8000/v1.")
    upstream_model: str = Field(default="", description="Model name upstream (default: model).")
    api_key: str = Field(default="", description="Bearer token for the upstream, if any.")
    timeout_s: float = 600.0
    # What the upstream can do is probed at start (engine_worker/backends/upstream_caps.py,
    # docs/deploy.md); each of these, when set, overrides what the probe would find.
    stream_usage: bool | None = Field(
        default=None,
        description="The upstream sends usage on streams (None: probed). False: prompt "
        "tokens are counted here (its tokenize endpoint, else estimated).",
    )
    continue_message: bool | None = Field(
        default=None,
        description="The upstream continues a final assistant message left open "
        "(continue_final_message; None: probed). Only then does a chat stream cut off by a "
        "lost replica resume on another; otherwise it ends with a retryable replica_lost.",
    )
    logprobs: bool | None = Field(
        default=None, description="The upstream streams logprobs (None: probed; shown only)."
    )
    tokenize_url: str = Field(
        default="",
        description="A tokenize endpoint to count prompt tokens with when the upstream sends "
        "no usage (vLLM's or llama.cpp's /tokenize, llama-cpp-python's /extras/tokenize, "
        "TGI's /tokenize, of the same model); default: found on the upstream.",
    )
    probe: bool = Field(
        default=True,
        description="Probe the upstream's capabilities with tiny requests at start; off: "
        "only the fields set here are known (unknown: no resume, prompt counted here).",
    )


class VLLMSettings(BaseModel):
    """vLLM AsyncLLM in-process."""

    gpus: str = Field(default="", description="CUDA_VISIBLE_DEVICES for this worker, e.g. 0,1.")
    engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Any `vllm serve` option by name: engine args (tensor_parallel_size, "
        "max_model_len...) and front-end options (tool_call_parser, "
        "enable_auto_tool_choice, reasoning_parser, lora_modules...); see docs/vllm.md.",
    )
    scripted_core: dict[str, Any] | None = Field(
        default=None,
        description="Run vLLM's front end on the scripted engine core "
        "(engine_worker/backends/scripted_core.py) instead of a GPU, with these settings "
        "(prefill_ms, decode_ms, scripts...; {} for the defaults); see docs/vllm.md.",
    )
    kv_events: bool = Field(
        default=True,
        description="Publish vLLM's KV-cache events on the bus (docs/kv-events.md): turns on "
        "its kv_events_config (ZMQ on private IPC sockets) unless engine_args sets one, and "
        "forwards what it publishes. Needs prefix caching (vLLM's default).",
    )


def _default_reserve() -> dict[Literal["priority", "default"], float]:
    return {"default": 0.0625}


def _default_waits() -> dict[Literal["priority", "default", "flex"], float]:
    return {"priority": 30.0, "default": 60.0, "flex": 600.0}


class FlowSettings(BaseModel):
    """Flow control in front of a replica's engine (engine_worker/flow.py, docs/flow.md):
    fair shares between keys, priority classes, admission."""

    enabled: bool = Field(
        default=True,
        description="Hold requests beyond the engine's batch in the worker's fair queues "
        "(false: hand every request to the engine at once, first come first served).",
    )
    slots: int = Field(
        default=0,
        ge=0,
        description="Requests in the engine at once (0: the engine's batch: sim.max_running, "
        "vllm's max_num_seqs; max_concurrency for the openai backend).",
    )
    reserved: dict[Literal["priority", "default"], float] = Field(
        default_factory=_default_reserve,
        description="Share of the slots kept for a class and those above it (classes below "
        "may not take them): by default 1/16 for default, so a flex flood never fills the "
        "engine. A share > 0 keeps at least one slot.",
    )
    max_queued: dict[Literal["priority", "default", "flex"], int] = Field(
        default_factory=dict,
        description="Requests waiting per class at most (absent or 0: bounded by "
        "max_concurrency only); beyond, 429 for a key over its share, else another replica.",
    )
    max_queued_tokens: dict[Literal["priority", "default", "flex"], int] = Field(
        default_factory=dict, description="Prompt tokens waiting per class at most (0: none)."
    )
    max_wait_s: dict[Literal["priority", "default", "flex"], float] = Field(
        default_factory=_default_waits,
        description="Longest wait per class for a slot, then 503 with Retry-After (0: none; "
        "the request's own deadline always holds).",
    )
    aging_s: float = Field(
        default=30.0, ge=0, description="Each wait this long counts one class higher (0: off)."
    )
    input_weight: float = Field(
        default=1.0, ge=0, description="Fair-share cost of a prompt token (VTC's w_p)."
    )
    output_weight: float = Field(
        default=2.0, ge=0, description="Fair-share cost of an answer token (VTC's w_q)."
    )
    displace: bool = Field(
        default=True,
        description="A higher class may take the slot of a lower-class request that has not "
        "sent its first byte (that one waits again; it is not failed).",
    )


class WorkerSettings(BaseModel):
    """One engine worker (one replica)."""

    backend: Literal["sim", "openai", "vllm"] = "sim"
    model: str = DEFAULT_MODEL
    replica: str = Field(default="", description="Replica id; generated when empty.")
    host: str = Field(
        default="",
        max_length=255,
        description="The host name its heartbeats announce (the console's Replicas page "
        "shows it); empty: the GPU host of its bus login (`worker-<host>`) where it logs in "
        "as one, else the machine's host name.",
    )
    engine_stuck_s: float = Field(
        default=60.0,
        ge=0,
        description="A worker whose engine made no output for this long while requests are "
        "in flight calls it stuck (0: never): it leaves routing, hands its requests back to "
        "their callers (they move them) and exits to be restarted, as when the engine dies "
        "(docs/deploy.md, 'Engine health').",
    )
    claim_wait_s: float = Field(
        default=0.3,
        ge=0,
        description="How long a starting worker listens for another process that serves its "
        "replica id already (engine_worker/claim.py): one that does makes it refuse to start. "
        "A live one answers within a round trip.",
    )
    max_concurrency: int = Field(default=256, ge=1)
    heartbeat_interval_s: float = Field(default=0.5, gt=0)
    max_model_len: int = Field(
        default=0,
        ge=0,
        description="The model's context length announced in heartbeats (0: the backend's: "
        "sim.max_model_len, or the upstream's /v1/models max_model_len for the openai "
        "backend where it says).",
    )
    idle_heartbeat_factor: float = Field(
        default=4.0,
        ge=1.0,
        description="An idle replica (no request in flight) beats this many times less often "
        "(0.5 s -> 2 s): an idle stack costs less CPU and bus traffic. It beats at the full "
        "rate again the moment it takes a request, before the caller's watchdog could miss a "
        "beat; routers expire it after missed beats of the interval it announced.",
    )
    kv_events_interval_s: float = Field(
        default=0.005,
        ge=0,
        le=1,
        description="A replica whose engine reports its prefix cache (the sim with "
        "kv_cache_blocks) publishes the KV events gathered over this long in one message "
        "(docs/kv-events.md); 0: at the end of each event-loop turn.",
    )
    stream_coalesce_ms: float = Field(
        default=25.0,
        ge=0,
        le=100,
        description="Under load (at least `stream_coalesce_streams` requests in flight), a "
        "stream's text after its first chunk is held up to this long so that one frame (and "
        "one SSE event) carries the tokens of several engine steps, as `vllm serve "
        "--stream-interval` does; the first chunk, side outputs and the last chunk with the "
        "final frame are never held (docs/benchmarks.md, issue 70). 0: a frame per step.",
    )
    stream_coalesce_reads: bool = Field(
        default=False,
        description="While a stream's text is held (`stream_coalesce_ms`), the worker reads "
        "nothing more of it from an upstream's socket (the `openai` backend): the tokens "
        "written meanwhile wait there and come in one read when the hold ends, one read a "
        "hold instead of one a token (about 9 % less CPU per token at c=64 and c=256). The "
        "price: an answer's end that comes during a hold is seen when the hold ends, up to "
        "`stream_coalesce_ms` later (docs/benchmarks.md, issue 70). Off: the end is never held.",
    )
    stream_coalesce_streams: int = Field(
        default=16,
        ge=1,
        description="Requests in flight from which `stream_coalesce_ms` holds text; below, "
        "every chunk leaves in the turn it was produced (a lone stream is never held).",
    )
    tp: int = Field(default=1, ge=1)
    pool: str = "default"
    pd_role: Literal["both", "prefill", "decode"] = Field(
        default="both",
        description="Prefill/decode disaggregation (docs/disaggregation.md): `prefill` "
        "replicas compute prompts and hand their KV cache to `decode` replicas, which "
        "generate; `both` serves whole requests (and is a decode replica to the router).",
    )
    endpoints: list[Literal["chat", "completions", "embeddings"]] = Field(
        default_factory=list,
        description="Request kinds this replica serves (chat, completions, embeddings); "
        "empty: what the backend serves.",
    )
    sim: SimSettings = Field(default_factory=SimSettings)
    openai: OpenAIUpstreamSettings = Field(default_factory=OpenAIUpstreamSettings)
    vllm: VLLMSettings = Field(default_factory=VLLMSettings)
    flow: FlowSettings = Field(default_factory=FlowSettings)


class TelemetrySettings(BaseModel):
    """Per-request records, metrics and the telemetry service (docs/telemetry.md)."""

    enabled: bool = Field(
        default=True,
        description="Workers and bridges publish a record per request (fire and forget).",
    )
    db_path: str = Field(
        default=".tokenbus/telemetry.db", description="The telemetry service's SQLite store."
    )
    max_rows: int = Field(
        default=1_000_000, ge=100, description="Records kept; the oldest go first."
    )
    metrics_port: int = Field(
        default=9464, description="The telemetry service's Prometheus endpoint (0: none)."
    )
    metrics_host: str = Field(default="127.0.0.1", description="Address of that endpoint.")
    flush_interval_s: float = Field(
        default=0.5, gt=0, description="How often buffered records are written."
    )
    max_buffer: int = Field(
        default=50_000, ge=1, description="Records buffered at most; beyond, new ones drop."
    )
    nats_monitor_urls: list[str] = Field(
        default_factory=list,
        description="The NATS servers' monitoring endpoints (http://host:8222): at each probe "
        "the service reads their /varz and exports connections, routes, slow consumers, "
        "memory, CPU and JetStream's storage, API errors and meta leader "
        "(tokenbus_nats_server_*, tokenbus_jetstream_*; docs/telemetry.md).",
    )
    probe_interval_s: float = Field(
        default=5.0,
        ge=0,
        description="How often the service probes the bus (NATS round trip, services answering "
        "$SRV.PING, the key store) for the health metrics; 0: never.",
    )
    stream_max_age_s: float = Field(
        default=7 * 86400.0,
        gt=0,
        description="Records stay in the JetStream stream TOKENBUS_USAGE this long (stored "
        "or not): the longest telemetry outage that loses none.",
    )
    stream_max_bytes: int = Field(
        default=1 << 30,
        ge=1 << 20,
        description="The stream's size bound: past it the oldest records are dropped first.",
    )
    ack_wait_s: float = Field(
        default=30.0,
        gt=0,
        description="A record fetched and not acknowledged (stored) this long goes to another "
        "telemetry service.",
    )
    spool_dir: str = Field(
        default="",
        description="Where workers and bridges write down each usage record and spend report "
        "until its stream acknowledges it (a file per process): one killed in that time has "
        "them sent again by the next process started on the same directory. Empty: kept in "
        "memory only (a process killed while a stream elects a leader loses them).",
    )
    store: Literal["sqlite", "postgres"] = Field(
        default="sqlite", description="Where records are stored: the SQLite file or PostgreSQL."
    )
    postgres_dsn: str = Field(
        default="",
        description="PostgreSQL connection string for store = postgres "
        "(postgresql://user:password@host:5432/db; needs the postgres extra).",
    )


class ResponsesSettings(BaseModel):
    """Stored responses of the Responses API (``POST /v1/responses`` with ``store``), kept in
    a JetStream KV bucket (docs/responses.md)."""

    ttl_s: float = Field(
        default=30 * 86400.0,
        gt=0,
        description="A stored response is deleted this long after it was made (OpenAI keeps "
        "them 30 days).",
    )
    max_bytes: int = Field(
        default=1 << 30,
        ge=1 << 20,
        description="The bucket's size bound: past it the oldest responses are dropped first.",
    )


class FilesSettings(BaseModel):
    """Files of the Files API (``/v1/files``: batch input and output), kept in a JetStream
    object store (docs/batches.md)."""

    max_file_bytes: int = Field(
        default=100 << 20,
        ge=1024,
        description="The largest file one upload may carry (OpenAI's batch input limit is 200 "
        "MB; the bridge holds an upload in memory while it stores it).",
    )
    ttl_s: float = Field(
        default=30 * 86400.0, gt=0, description="A file is deleted this long after its upload."
    )
    max_bytes: int = Field(
        default=4 << 30,
        ge=1 << 20,
        description="The object store's size bound: past it uploads are refused (507). "
        "JetStream reserves it on its volume, which the keys and spend share: with "
        "responses.max_bytes and telemetry.stream_max_bytes it must leave room there "
        "(the NATS volume of 10Gi on Kubernetes; docs/deploy.md, backup section).",
    )
    max_bytes_per_key: int = Field(
        default=1 << 30,
        ge=1024,
        description="What one API key's uploads may hold in the store at once: past it its "
        "uploads are refused (429 insufficient_quota) until it deletes files or they expire, "
        "so one tenant cannot fill the store the others share. Batch output files the store "
        "writes for a key are not refused. Checked at each upload: uploads in flight at once "
        "may pass it by their own sizes.",
    )


class BodiesSettings(BaseModel):
    """Claim-checked request bodies (docs/large-requests.md): what one API key's NATS
    connections may hold in the store of large bodies (the auth service enforces it)."""

    max_bytes_per_key: int = Field(
        default=256 << 20,
        ge=0,
        description="What one API key's own bodies (those its NATS connections upload) may "
        "hold in the store at once: past it the auth service removes them all (a request "
        "still reading one gets 429 naming this setting), so one tenant cannot fill the 4 GiB "
        "every tenant shares. Eight 32 MiB requests in flight at once fit. A key's "
        "max_body_bytes overrides it; 0: no bound.",
    )
    max_bytes_per_owner: int = Field(
        default=1 << 30,
        ge=0,
        description="What the bodies of all the keys of one owner (a key record's owner) may "
        "hold in the store at once, so that a tenant with many keys cannot hold many times "
        "the per-key quota: past it the auth service removes the bodies of that owner's key "
        "holding the most, then the next, until the owner is under it (a request still "
        "reading one gets 429 naming this setting). Keys without an owner are bound per key "
        "only. 0: no bound.",
    )


class BatchSettings(BaseModel):
    """The Batch API (``/v1/batches``): lines run by every bridge process from a JetStream
    work queue, at the lowest priority (docs/batches.md)."""

    enabled: bool = Field(default=True, description="Serve /v1/batches and run batch lines.")
    run_lines: bool = Field(
        default=True,
        description="This bridge process runs batch lines and background responses (false: "
        "it only takes and answers the API calls; run the work in bridges apart from the "
        "interactive front, so it never takes that front's CPU).",
    )
    concurrency: int = Field(default=32, ge=1, description="Lines one bridge process runs at once.")
    max_lines: int = Field(default=50_000, ge=1, description="Lines one batch may hold.")
    priority: Literal["priority", "default", "flex"] = Field(
        default="flex",
        description="The class lines run in (flex: from spare capacity, after interactive "
        "work; docs/flow.md).",
    )
    ack_wait_s: float = Field(
        default=60.0,
        gt=0,
        description="A line whose runner stopped answering (killed) runs again after this.",
    )
    max_deliver: int = Field(
        default=6, ge=1, description="Tries of a line before a retryable error is final."
    )
    line_timeout_s: float = Field(default=600.0, gt=0, description="One line's time limit.")


class UpSettings(BaseModel):
    """The local launcher (``tokenbus up``)."""

    workers: int = Field(default=2, ge=0, description="Sim workers to start.")
    nats_port: int = Field(default=4222, description="Port of the embedded nats-server.")
    nats_monitor_port: int = Field(
        default=0,
        ge=-1,
        le=65535,
        description="Monitoring port (nats-server -m: /varz, /jsz...) of the embedded "
        "nats-server, on 127.0.0.1; its URL is the services' telemetry.nats_monitor_urls "
        "unless that is set (the console's Bus page and the telemetry service read it). 0: a "
        "free port; -1: none.",
    )
    data_dir: str = Field(default=".tokenbus", description="JetStream data, logs, pid files.")
    restart_backoff_s: float = 1.0
    watchdog_s: float = Field(
        default=15.0,
        ge=0,
        description="Kill and restart a child whose event loop has not written its health "
        "file (every 2 s) for this long: a paused or stuck process (0: off). Also the "
        "processes of `tokenbus serve bridge --processes N`.",
    )
    locked: bool = Field(
        default=True,
        description="Start the embedded nats-server with the generated per-role config.",
    )


class Settings(BaseSettings):
    """The whole stack's configuration."""

    model_config = SettingsConfigDict(
        env_prefix="TOKENBUS_", env_nested_delimiter="__", extra="ignore"
    )

    nats_url: str | None = Field(
        default=None, description="Existing NATS server; unset means the embedded one."
    )
    nats_user: str | None = Field(default=None, description="NATS user (locked bus).")
    site: str = Field(
        default="",
        max_length=63,
        description="The site this process runs at (docs/deploy.md, 'Sites'): workers announce "
        "it in their heartbeats, and a router (or a bridge routing in-process) prefers "
        "replicas at its own site while they have room. Empty: one site.",
    )
    nats_password: str | None = Field(default=None, description="NATS password (locked bus).")
    nats_login_file: str = Field(
        default="",
        description="A role's login file (`tokenbus deploy init`'s roles/<role>.json: user and "
        "password), read when nats_user is not set: credentials from a file or secret, not "
        "the environment.",
    )
    nats_ping_interval_s: float = Field(
        default=natsclient.PING_INTERVAL_S,
        gt=0,
        le=120,
        description="How often every connection pings its NATS server; a server silent for "
        "nats_pings_outstanding + 1 intervals (3 s) is taken for gone, and the connection "
        "moves to another node of the cluster (docs/fault-tolerance.md, stalls).",
    )
    nats_pings_outstanding: int = Field(
        default=natsclient.PINGS_OUTSTANDING,
        ge=1,
        le=10,
        description="Unanswered pings before the server is taken for gone.",
    )
    nats_sync: str = Field(
        default=NATS_SYNC,
        pattern=NATS_SYNC_PATTERN,
        description="What the NATS server tokenbus configures syncs to disk before it "
        "acknowledges a JetStream write: 'always' (every write, the default) or an interval "
        "such as '1s' (faster writes; a machine that loses power loses what was acknowledged "
        "in the last interval). docs/deploy.md, Durability.",
    )
    kv_replicas: int = Field(
        default=1,
        ge=1,
        le=5,
        description="Replicas of the JetStream buckets and streams tokenbus creates (keys, "
        "limits, routing, audit): 3 on a 3-node NATS cluster, so they survive a node's loss.",
    )
    loop_watchdog_s: float = Field(
        default=0.0,
        ge=0,
        description="End the process (exit 70) when its event loop has not turned for this "
        "long, so that a restart policy brings it back (0: off; compose sets 30).",
    )
    health_file: str = Field(
        default="",
        description="Write this file every 2 s while connected to NATS (`tokenbus health "
        "--file` checks it: a container health check or Kubernetes probe).",
    )
    nats_tls_ca: str = Field(
        default="",
        description="CA file to trust for a TLS bus (`tokenbus nats-config --tls`); set, every "
        "connection to NATS is TLS.",
    )
    nats_tls_cert: str = Field(
        default="", description="Client certificate for mutual TLS (with nats_tls_key)."
    )
    nats_tls_key: str = Field(default="", description="Private key of nats_tls_cert.")
    nats_callout: str = Field(
        default="",
        description="The locked bus's callout.json: the auth service then answers the "
        "server's auth callout, logging NATS clients in by their API key.",
    )
    log_level: str = "info"
    drain_timeout_s: float = Field(default=30.0, description="How long in-flight work may finish.")
    malloc_keep_mb: int = Field(
        default=256,
        ge=0,
        description="MiB of freed memory a service keeps mapped (glibc), so that a large "
        "request's buffers do not fault their pages in anew each time (services/heap.py; "
        "0: glibc's defaults).",
    )
    metrics_port: int = Field(
        default=0,
        description="Serve this process's own Prometheus metrics on 127.0.0.1:<port>/metrics "
        "(0: off; the bridge always has /metrics on its HTTP port).",
    )
    bridge: BridgeSettings = Field(default_factory=BridgeSettings)
    ingress: IngressSettings = Field(default_factory=IngressSettings)
    router: RouterSettings = Field(default_factory=RouterSettings)
    ratelimit: RateLimitSettings = Field(default_factory=RateLimitSettings)
    filter: FilterSettings = Field(default_factory=FilterSettings)
    worker: WorkerSettings = Field(default_factory=WorkerSettings)
    up: UpSettings = Field(default_factory=UpSettings)
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)
    responses: ResponsesSettings = Field(default_factory=ResponsesSettings)
    files: FilesSettings = Field(default_factory=FilesSettings)
    batches: BatchSettings = Field(default_factory=BatchSettings)
    bodies: BodiesSettings = Field(default_factory=BodiesSettings)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        path = os.environ.get("TOKENBUS_CONFIG", "tokenbus.toml")
        return (
            init_settings,
            env_settings,
            TomlConfigSettingsSource(settings_cls, toml_file=Path(path)),
        )

    def url(self) -> str:
        """The NATS URL services connect to."""
        return self.nats_url or f"nats://127.0.0.1:{self.up.nats_port}"

    def nats_auth(self) -> dict[str, Any]:
        """Connect options: the pings (every connection), and for a locked bus the role's
        login (when a user is configured) and the TLS context (when a CA is)."""
        opts: dict[str, Any] = self.nats_tls()
        opts |= {
            "ping_interval": self.nats_ping_interval_s,
            "max_outstanding_pings": self.nats_pings_outstanding,
        }
        if self.nats_user:
            opts |= {"user": self.nats_user, "password": self.nats_password or ""}
        elif self.nats_login_file:
            opts |= read_login(self.nats_login_file)
        return opts

    def nats_tls(self) -> dict[str, Any]:
        """nats-py's ``tls`` option for a TLS bus (empty when plain)."""
        if not self.nats_tls_ca:
            return {}
        from services.tlsfiles import client_context

        return {"tls": client_context(self.nats_tls_ca, self.nats_tls_cert, self.nats_tls_key)}


def read_login(path: str) -> dict[str, str]:
    """A role's login file (``{"user": ..., "password": ...}``, as ``tokenbus deploy init``
    writes it) as nats-py's options."""
    data = json.loads(Path(path).read_text())
    return {"user": str(data["user"]), "password": str(data["password"])}


def kv_replicas() -> int:
    """The configured replicas of the JetStream buckets tokenbus creates (read when one is
    created, which is rare: the stores that create them are not given the settings)."""
    return Settings().kv_replicas


def load(config_file: str | None = None, **overrides: Any) -> Settings:
    """Settings from file and env, with ``overrides`` (nested dicts) applied on top."""
    if config_file:
        if not Path(config_file).is_file():
            raise FileNotFoundError(f"config file not found: {config_file}")
        os.environ["TOKENBUS_CONFIG"] = config_file
    base = Settings()
    if not overrides:
        return base
    merged = _deep_merge(base.model_dump(), overrides)
    return Settings.model_validate(merged)


def env_overrides(
    overrides: dict[str, Any], model: type[BaseModel] | None = None, prefix: str = "TOKENBUS_"
) -> dict[str, str]:
    """``overrides`` (nested dicts, as :func:`load` takes them; None is "not given") as the
    environment variables that set the same on another process: how a launcher's
    command-line options reach the services it starts. Lists and maps are JSON."""
    out: dict[str, str] = {}
    for k, v in overrides.items():
        if v is None:
            continue
        field = (model or Settings).model_fields.get(k)
        sub = field.annotation if field is not None else None
        if isinstance(v, dict) and isinstance(sub, type) and issubclass(sub, BaseModel):
            out.update(env_overrides(v, sub, f"{prefix}{k.upper()}__"))
        else:
            out[f"{prefix}{k.upper()}"] = v if isinstance(v, str) else json.dumps(v)
    return out


def _deep_merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        if v is None:
            continue
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out
