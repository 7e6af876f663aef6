"""Header names carried on bus messages; every stage reads these without decoding the body."""

# The request's id on the bus: made by the gateway (ingress, the bridge) at each admission,
# never the client's (issue 64: slots, holds, tickets and charges are keyed by it, and one id
# repeated by a client made twenty requests one). A NATS client's own value is read only as
# the label below.
REQUEST_ID = "Tb-Request-Id"
# The id the client gave its request (HTTP ``X-Request-Id``, a NATS client's Tb-Request-Id),
# when it is a short plain token: a label for logs, traces and the response header, never a key.
CLIENT_REQUEST_ID = "Tb-Client-Request-Id"
# Set ("1") by the HTTP bridge on the requests it sends: what a migration says its caller got
# (``resume``) was counted by the gateway, not claimed by a client, so a supersede may price
# the earlier attempt at it. Ingress never passes it on from a NATS client, whose count is a
# hint for where to resume only (auth.ratelimit, auth.budgets).
GATEWAY_COUNTED = "Tb-Gateway-Counted"
# Absolute deadline, Unix epoch milliseconds. Work past it is dropped with a timeout error.
DEADLINE = "Tb-Deadline"
# Client send time (t0), Unix epoch nanoseconds.
T0 = "Tb-T0"
# Comma separated ``stage=epoch_ns`` marks appended by each stage as the request passes.
TIMINGS = "Tb-Timings"
# Remaining pipeline stages (the routing slip), comma separated; each stage pops itself.
ROUTE = "Tb-Route"
MODEL = "Tb-Model"
# The model name the client asked for, once an alias of it was resolved (Tb-Model then names
# the served model): set by the stage that resolved it, so no later stage resolves again.
MODEL_ALIAS = "Tb-Model-Alias"
KIND = "Tb-Kind"
# The caller's reply inbox when the message itself is sent as a request (router -> worker).
REPLY_TO = "Tb-Reply-To"
# API key as sent by the caller; auth strips it and sets PRINCIPAL.
API_KEY = "Tb-Api-Key"
PRINCIPAL = "Tb-Principal"
ATTEMPT = "Tb-Attempt"
# How many times the caller re-issued this request after its replica failed (migration).
MIGRATION = "Tb-Migration"
# Set ("1") on a migration whose caller already has answer text (the request carries it as
# ``resume``): routers send a chat request so marked only to replicas that continue an
# answer exactly, where any is live (an openai worker whose upstream starts over says it
# cannot in its heartbeat).
RESUME = "Tb-Resume"
# Set ("1") by a caller that cannot see heartbeats (a NATS client logged in with its API key
# receives only its own inbox): the replica sends each of its streams a keepalive frame
# every heartbeat interval instead.
KEEPALIVE = "Tb-Keepalive"
# Set ("1") by a caller that takes the answer whole (not streamed to anyone): the replica may
# hold the text and send it in one chunk with the end instead of a chunk per engine step.
WHOLE = "Tb-Whole"
# The ratelimit stage's signed admission of this attempt (``auth.ratelimit.Ticket``); the
# worker hands it to the caller in the accept frame, and a migrated request brings it back
# so that it counts once.
ADMISSION = "Tb-Admission"
# On an empty frame from a replica to a caller: send me the request's body (a claim by pull,
# services/bodies.py); the value is the replica's id.
BODY_PULL = "Tb-Body-Pull"
# NATS' own status header (503 = no responders).
NATS_STATUS = "Status"
# Limits of the principal as ``rpm,tpm,concurrent`` (empty field = unlimited), set by auth.
LIMITS = "Tb-Limits"
# Rate-limit admission ``window,reserved_tokens`` (for reconciliation by the worker's usage).
RATELIMIT = "Tb-Ratelimit"
# The x-ratelimit-* values for the response, ``name=value`` pairs joined by ``;``.
RATELIMIT_INFO = "Tb-Ratelimit-Info"
# Detectors the filter flagged on the input, comma separated.
FILTER_FLAGS = "Tb-Filter-Flags"
# Name of the content filter policy of the principal, set by auth.
FILTER_POLICY = "Tb-Filter-Policy"
# A session or user key for session-affinity routing (HTTP: ``X-Session-Id``).
SESSION = "Tb-Session"
# The class the request asks for (OpenAI's ``service_tier``: priority, default, flex; auto or
# absent: the key's default), from the body or the client; auth settles it within the key's
# ceiling. The worker serves higher classes first (engine_worker/flow.py).
PRIORITY = "Tb-Priority"
# A fairness id the client sends (one per agent program or session): requests of one key
# are shared fairly between its fairness ids (HTTP: ``X-Fairness-Id``).
FAIRNESS = "Tb-Fairness"
# The flow a request's fair share is counted in (the key's id, or its owner), and its
# weight, set by auth.
FLOW = "Tb-Flow"
FLOW_WEIGHT = "Tb-Flow-Weight"
# A time-to-first-token objective in milliseconds the client sends: within its fairness id
# the request with the earliest objective goes first (HTTP: ``X-SLO-TTFT-Ms``).
TTFT_OBJECTIVE = "Tb-Ttft-Ms"
# The key's spend budget as auth sets it: ``period,hard,soft,owner`` (micro-dollars; empty
# hard or soft: none). The ratelimit stage holds the key and its owner to their budgets.
BUDGET = "Tb-Budget"
# What the ratelimit stage held of a request's spend, as it set it (JSON: the model, the hold's
# key, the budgets and their entries): the usage report carries it back, so that any limiter
# can settle the spend, not only the one that admitted the request (auth.budgets).
SPEND = "Tb-Spend"
# W3C trace context, carried from HTTP callers (or NATS clients) through every stage; each
# traced hop puts its own span's here for the next.
TRACEPARENT = "traceparent"
# A migrated request's earlier attempt: the traceparent of the replica span that served it
# (from its accept frame), which the next attempt's replica span links to.
TRACE_LINK = "Tb-Trace-Link"
# The prompt tokens the router expects the chosen replica to read from its KV cache (its
# index of the replicas' KV events, router/kv_index.py) and the router's instance id:
# ``tokens,router``. Set (or removed) by the router on every dispatch, whatever came in, so
# a client's value never reaches a worker; the worker puts it beside the engine's reported
# ``cached_tokens`` in its record and heartbeats (the closed loop, docs/routing.md).
KV_PREDICTED = "Tb-Kv-Predicted"
# The prompt tokens the router expects the chosen replica to compute for the request (its
# prompt less the cached prefix it predicted): set (or removed) by the router on every
# dispatch, as Tb-Kv-Predicted is. The worker counts it in its prefill backlog until the
# request's first token (engine_worker/backlog.py) and announces the total.
PREFILL_TOKENS = "Tb-Prefill-Tokens"
