"""A locked-down nats-server configuration: one user per role, each allowed only its subjects.

Clients may only publish requests (and cancels) and read their inboxes; only the router (and
the bridge, which admits each request in-process before routing it) may publish to worker
subjects (a snapshot request of a replica's KV cache among them); workers may only publish
replies, heartbeats, KV-cache events (which only routers and bridges may read), usage and
telemetry. So nobody can go around ingress, auth and the rate limits by talking to a worker
directly. The audit trail (:mod:`services.audit`) is written by the bridge and the admin
role; clients, workers, filter and telemetry can neither write nor read it, and no
role but admin may delete it or change its limits. ``tokenbus nats-config`` writes the
config and a secrets file with a random password per role, both mode 0600 in a folder of mode
0700; services read theirs from ``TOKENBUS_NATS_USER`` and ``TOKENBUS_NATS_PASSWORD``. The
config holds no password, only its bcrypt hash (nats-server takes a password that starts
with ``$2`` as one), so only the secrets file (and a deployment's login of each role) holds
what logs in.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from pathlib import Path
from typing import Any

import bcrypt

from bus_schemas.subjects import (
    BODIES_STREAM,
    PREFIX,
    RECORDS_CONSUMER,
    RECORDS_STREAM,
    audit_wildcard,
    bodies_reply_root,
    bodies_wildcard,
    body_quota_notices,
    inbox_prefix,
    members_wildcard,
    records_ack_root,
    replica_claim,
    requests_wildcard,
    stage,
    to_any_member,
    token,
    worker_cancel,
)
from services import natsjwt
from services.audit import STREAM as AUDIT_STREAM
from services.config import NATS_SYNC, NATS_SYNC_PATTERN
from services.tlsfiles import TLS_FILE, TlsFiles, write_private

INBOX = "_INBOX.>"
DISCOVERY = "$SRV.>"
JS_API = ["$JS.API.>", "$KV.>", "$JS.ACK.>", "$JS.FC.>"]
REQ = f"{PREFIX}.req.>"
STAGES = f"{PREFIX}.stage.>"
ENGINE = f"{PREFIX}.engine.>"
CANCEL = f"{PREFIX}.worker.*.cancel"
# Workers say which replica id they serve (engine_worker/claim.py): workers only.
CLAIMS = f"{PREFIX}.replica.*.claim"
HEARTBEAT = f"{PREFIX}.heartbeat.>"
# Replicas' KV-cache events (docs/kv-events.md): workers publish, routers and bridges
# follow. Snapshot requests need no rule of their own: they go to the replica's engine
# subjects (``subjects.kv_snapshot``), which only router and bridge may publish to and the
# worker subscribes to, and come back to the asker's inbox.
KV_EVENTS = f"{PREFIX}.kv.>"
# Queue-group members' beats, and each member's own subject (services/members.py): whoever
# may send to ingress or a stage may send to one member of it, and follow who beats.
MEMBERS = members_wildcard()
TO_REQ = to_any_member(requests_wildcard())
TO_STAGES = to_any_member(stage("*"))


def _member(name: str) -> str:
    return to_any_member(stage(name))


USAGE = [f"{PREFIX}.usage", f"{PREFIX}.usage.>"]
TELEMETRY = f"{PREFIX}.telemetry.>"
# The usage records' stream (docs/telemetry.md, "Durability"): the telemetry role makes it and
# its durable consumer, fetches and acknowledges, and may do nothing else with JetStream;
# publishers of records read the stream's acks under their own inbox root.
RECORDS_JS = [
    *[f"$JS.API.STREAM.{op}.{RECORDS_STREAM}" for op in ("INFO", "CREATE")],
    f"$JS.API.CONSUMER.INFO.{RECORDS_STREAM}.{RECORDS_CONSUMER}",
    f"$JS.API.CONSUMER.CREATE.{RECORDS_STREAM}.{RECORDS_CONSUMER}.>",
    f"$JS.API.CONSUMER.CREATE.{RECORDS_STREAM}.{RECORDS_CONSUMER}",
    f"$JS.API.CONSUMER.DURABLE.CREATE.{RECORDS_STREAM}.{RECORDS_CONSUMER}",
    f"$JS.API.CONSUMER.MSG.NEXT.{RECORDS_STREAM}.{RECORDS_CONSUMER}",
    f"$JS.ACK.{RECORDS_STREAM}.{RECORDS_CONSUMER}.>",
]
RECORDS_ACKS = f"{records_ack_root()}.>"
ADMIN = f"{PREFIX}.admin.>"
AUDIT = audit_wildcard()
# The Batch API (docs/batches.md): its work queue and done announcements (bridges publish),
# and its files in a JetStream object store (chunks and metadata on $O.<bucket>.>).
BATCH = f"{PREFIX}.batch.>"
# A background response's cancel, heard by the bridge whose runner runs it (jobs/background.py).
BATCH_CANCEL = f"{PREFIX}.batch.cancel.*"
OBJECTS = "$O.>"
# Claim-checked request bodies (services/bodies.py): the callers that upload them (the bridge,
# and the client role on its own; a key's connection under its own owner only, auth/callout.py)
# write chunks; the stages that read the text and the workers read them by direct get, whose
# API subject names the chunk (``$JS.API.DIRECT.GET.<stream>.<chunk subject>``).
BODIES = bodies_wildcard()
BODIES_READ = f"$JS.API.DIRECT.GET.{BODIES_STREAM}.>"
BODIES_REPLIES = f"{bodies_reply_root()}.>"
# The auth service's janitor of keys' bodies (auth/bodyquota.py) leaves a notice when it
# removes a key's bodies for its quota; it reads and purges through the JetStream API.
BODY_QUOTA = body_quota_notices()
# What no role but admin may do to the audit stream, although JS_API allows it: delete it,
# or change its limits (the stream itself refuses message deletes and purges to everyone;
# these two are denied here as well in case it was created without them).
AUDIT_GUARD = [f"$JS.API.STREAM.{op}.{AUDIT_STREAM}" for op in ("DELETE", "UPDATE", "PURGE")] + [
    f"$JS.API.STREAM.MSG.DELETE.{AUDIT_STREAM}"
]

# role -> (may publish, may subscribe)
ROLES: dict[str, tuple[list[str], list[str]]] = {
    "client": ([REQ, CANCEL, TO_REQ, BODIES], [INBOX, HEARTBEAT, MEMBERS]),
    # The bridge may run auth, ratelimit and filter in-process (``bridge.fuse_stages``) and
    # then route in-process (``bridge.fuse_router``): it is the one role besides the router
    # that may publish to workers, and it admits every request itself before it does; its
    # admin API records key and routing changes in the audit trail.
    "bridge": (
        # usage: an in-process ratelimit settles a migrated request's earlier attempt.
        [
            *[REQ, STAGES, TO_REQ, TO_STAGES, ENGINE, CANCEL, INBOX, TELEMETRY, AUDIT, BATCH],
            *[OBJECTS, BODIES, *USAGE, *JS_API],
        ],
        [INBOX, HEARTBEAT, KV_EVENTS, DISCOVERY, MEMBERS, BATCH_CANCEL, *USAGE],
    ),
    # KV: ingress keeps NATS clients' stored Responses API responses (tokenbus_responses)
    # and checks their keys (tokenbus_keys) as the bridge does.
    # The batch work queue and the object store: ingress answers NATS clients' files and
    # batches (docs/batches.md).
    "ingress": (
        [STAGES, TO_STAGES, MEMBERS, INBOX, BATCH, OBJECTS, *JS_API],
        [REQ, TO_REQ, MEMBERS, INBOX, DISCOVERY],
    ),
    "auth": (
        [STAGES, TO_STAGES, MEMBERS, INBOX, BODY_QUOTA, *JS_API],
        [f"{PREFIX}.stage.auth", _member("auth"), MEMBERS, INBOX, DISCOVERY, ADMIN],
    ),
    # telemetry: spend budgets' soft-threshold alerts (auth.budgets).
    "ratelimit": (
        [STAGES, TO_STAGES, MEMBERS, INBOX, *USAGE, TELEMETRY, *JS_API],
        [f"{PREFIX}.stage.ratelimit", _member("ratelimit"), MEMBERS, *USAGE, INBOX, DISCOVERY],
    ),
    "filter": (
        [STAGES, TO_STAGES, MEMBERS, INBOX, BODIES_READ],
        [f"{PREFIX}.stage.filter", _member("filter"), MEMBERS, INBOX, DISCOVERY],
    ),
    # KV: the router follows run-time routing changes (bucket tokenbus_routing).
    # telemetry: how many requests it holds per model and class (queue depth, for autoscalers).
    "router": (
        [ENGINE, CANCEL, MEMBERS, INBOX, TELEMETRY, *JS_API],
        [
            f"{PREFIX}.stage.route",
            _member("route"),
            MEMBERS,
            HEARTBEAT,
            KV_EVENTS,
            INBOX,
            DISCOVERY,
        ],
    ),
    "worker": (
        [HEARTBEAT, KV_EVENTS, *USAGE, TELEMETRY, INBOX, CLAIMS, BODIES_READ],
        [ENGINE, CANCEL, DISCOVERY, RECORDS_ACKS, CLAIMS, BODIES_REPLIES],
    ),
    # The telemetry service's probes of the bus (docs/telemetry.md): a discovery ping, the
    # key store's stream state (no key is read), the answers under its own inbox root only.
    "telemetry": (
        [
            INBOX,
            "$SRV.PING",
            "$JS.API.STREAM.INFO.KV_tokenbus_keys",
            "$JS.API.STREAM.INFO.OBJ_tokenbus_files",  # the file store's fill (telemetry)
            *RECORDS_JS,
        ],
        [TELEMETRY, HEARTBEAT, *USAGE, DISCOVERY, f"{inbox_prefix('telemetry')}.>"],
    ),
    "admin": ([">"], [">"]),
}

# The buckets whose entries a stolen service login must not rewrite: the API keys' records
# and the admission tickets' signing secret (issue 64: ingress, answering a reply subject a
# tenant named, wrote its error frame over a key's record and over the secret). Only the
# roles named here write them (the key store: auth's and the bridge's admin APIs, `tokenbus
# keys`; the secret: the limiter that starts first, in the ratelimit stage or a bridge running
# it in-process); every other role holding the JetStream API is denied their entries and the
# API calls that purge, delete or change them. docs/safety.md has the table.
GUARDED_BUCKETS: dict[str, tuple[str, ...]] = {
    "tokenbus_keys": ("auth", "bridge", "admin"),
    "tokenbus_secrets": ("ratelimit", "bridge", "admin"),
}


def bucket_guard(bucket: str) -> list[str]:
    """What writes ``bucket``'s entries: puts and deletes, purges, the stream's own changes."""
    stream = f"KV_{bucket}"
    return [
        f"$KV.{bucket}.>",
        *(f"$JS.API.STREAM.{op}.{stream}" for op in ("DELETE", "UPDATE", "PURGE")),
        f"$JS.API.STREAM.MSG.DELETE.{stream}",
    ]


# role -> may not publish (over its allow list): every role with the JetStream API but admin.
PUBLISH_DENY: dict[str, list[str]] = {
    role: AUDIT_GUARD
    + [
        subject
        for bucket, writers in GUARDED_BUCKETS.items()
        if role not in writers
        for subject in bucket_guard(bucket)
    ]
    for role, (pub, _) in ROLES.items()
    if role != "admin" and set(JS_API) <= set(pub)
}

# A login per GPU host (issue 64): ``worker-<host>`` may serve only the replica ids the
# deployment gave that host. It hears only their generate, snapshot, adapter and cancel
# subjects (not every tenant's prompts), beats, claims and publishes KV events only as them
# (no announcing another host's replicas, no claiming their ids). Replies, usage and telemetry
# are as the shared worker role's. The shared ``worker`` login stays for `tokenbus up`'s
# single host, where every worker is one machine's processes anyway.
WORKER_HOST_PREFIX = "worker-"
WORKER_HOSTS_FILE = "worker-hosts.json"
_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9_\-]{0,62}")


def worker_host_user(host: str) -> str:
    if not _HOST.fullmatch(host):
        raise ValueError(f"a host name: letters, digits, '-' and '_', got {host!r}")
    return f"{WORKER_HOST_PREFIX}{host}"


def worker_host_permissions(replicas: list[str]) -> tuple[list[str], list[str]]:
    """(may publish, may subscribe) of a GPU host's login serving ``replicas``."""
    if not replicas:
        raise ValueError("a worker host serves at least one replica id")
    own = [token(r) for r in replicas]
    pub = [
        *(f"{PREFIX}.heartbeat.*.{r}" for r in own),
        *(f"{PREFIX}.kv.*.{r}" for r in own),
        *(replica_claim(r) for r in replicas),
        *USAGE,
        TELEMETRY,
        INBOX,
        BODIES_READ,
    ]
    sub = [
        *(f"{PREFIX}.engine.*.{r}.>" for r in own),
        *(worker_cancel(r) for r in replicas),
        *(replica_claim(r) for r in replicas),
        DISCOVERY,
        RECORDS_ACKS,
        BODIES_REPLIES,
    ]
    return pub, sub


def parse_worker_hosts(specs: list[str], flag: str = "--worker-host") -> dict[str, list[str]]:
    """``HOST=REPLICA[,REPLICA...]`` options as a map, refused when malformed or when two
    hosts name one replica id (``flag``: the option, for the message; ``--site`` too)."""
    hosts: dict[str, list[str]] = {}
    owner: dict[str, str] = {}
    for spec in specs:
        host, sep, ids = spec.partition("=")
        replicas = [r.strip() for r in ids.split(",") if r.strip()]
        if not sep or not replicas:
            label = flag.rsplit("-", 1)[-1].upper()
            raise ValueError(f"{flag} wants {label}=REPLICA[,REPLICA...], got {spec!r}")
        worker_host_user(host)
        for r in replicas:
            if owner.setdefault(r, host) != host:
                raise ValueError(f"replica id {r!r} is given to both {owner[r]!r} and {host!r}")
        hosts.setdefault(host, []).extend(r for r in replicas if r not in hosts[host])
    return hosts


# A site (issue 71): a nats-server of its own at the site that dials the hub outbound as a
# leaf node, logging in as ``site-<name>`` in account TB. What that link may carry is what the
# site's GPU hosts need, as a worker host's login (:func:`worker_host_permissions` of the
# site's replica ids): the hub holds the permissions, so a site that rewrote its own node's
# config reaches no more. nats-server 2.15 takes no ``permissions`` on a
# ``leafnodes.authorization`` user, so the site's login is a user of account TB beside the
# roles (a leaf connection with no leaf-only authorization logs in as one of the accounts'
# users, that user's permissions applied to the link), named among the callout's auth_users.
SITE_PREFIX = "site-"
SITES_FILE = "sites.json"


def site_permissions(
    replicas: list[str], bridge: bool = False
) -> tuple[list[str], list[str], list[str] | None]:
    """(may publish, may subscribe, may not publish) over ``site``'s leaf link: its replica
    ids' (:func:`worker_host_permissions`); a site that serves its own users (``bridge``:
    ``deploy init --site-bridge``, a bridge at the site routing in-process) also the bridge
    role's, with the bridge's denials. Such a site is trusted as a bridge is: its login may
    admit any key's requests to any replica and read what a bridge reads."""
    pub, sub = worker_host_permissions(replicas)
    if not bridge:
        return in_hub_domain(pub), sub, None
    bpub, bsub = ROLES["bridge"]
    return (
        in_hub_domain([*pub, *(x for x in bpub if x not in pub)]),
        [*sub, *(x for x in bsub if x not in sub)],
        in_hub_domain(PUBLISH_DENY.get("bridge") or []),
    )


def site_user(site: str) -> str:
    """The hub-side login of ``site``'s leaf node."""
    if not _HOST.fullmatch(site):
        raise ValueError(f"a site name: letters, digits, '-' and '_', got {site!r}")
    return f"{SITE_PREFIX}{site}"


def permissions_table() -> str:
    """Every role's permissions on the locked bus as a markdown table (docs/safety.md holds
    it, and a test checks the two are the same): what it may publish, what of that it may
    not, what it may subscribe to."""

    def cell(subjects: list[str]) -> str:
        return "<br>".join(f"`{s}`" for s in subjects) or "—"

    rows = ["| role | may publish | may not publish | may subscribe |", "|---|---|---|---|"]
    for role, (pub, sub) in ROLES.items():
        rows.append(f"| {role} | {cell(pub)} | {cell(PUBLISH_DENY.get(role, []))} | {cell(sub)} |")
    pub, sub = worker_host_permissions(["REPLICA"])
    rows.append(f"| worker-HOST | {cell(pub)} | — | {cell(sub)} |")
    spub, ssub, _ = site_permissions(["REPLICA"])
    rows.append(f"| site-SITE (leaf link) | {cell(spub)} | — | {cell(ssub)} |")
    rows.append(
        "| site-SITE with `--site-bridge` | site-SITE's and the bridge's | the bridge's | "
        "site-SITE's and the bridge's |"
    )
    return "\n".join(rows) + "\n"


# Which role each `tokenbus serve <service>` runs as.
SERVICE_ROLE = {
    "bridge": "bridge",
    "ingress": "ingress",
    "auth": "auth",
    "ratelimit": "ratelimit",
    "filter": "filter",
    "router": "router",
    "worker": "worker",
    "telemetry": "telemetry",
}


# bcrypt's cost for the hashes in the config. tokenbus' passwords are 192 random bits
# (``secrets.token_urlsafe(24)``): no cost makes them guessable or less so, and nats-server
# checks the hash at every login of every service. So the least cost bcrypt has, 4: a login
# took 2.1 ms against 0.8 ms with the plain password, where nats-server's own default, 11,
# took 156 ms (this machine, p50 of 100 connections).
HASH_COST = 4


def password_hash(password: str) -> str:
    """What the config holds for ``password``: its bcrypt hash, which nats-server checks a
    login against."""
    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(HASH_COST)).decode()


def _list(items: list[str]) -> str:
    return "[" + ", ".join(json.dumps(i) for i in items) + "]"


def _role_users(
    passwords: dict[str, str],
    roles: list[str],
    indent: str,
    hosts: dict[str, list[str]] | None = None,
    sites: dict[str, list[str]] | None = None,
    site_bridges: frozenset[str] = frozenset(),
) -> str:
    users = []
    perms = [(role, *ROLES[role], PUBLISH_DENY.get(role)) for role in roles]
    for host, replicas in sorted((hosts or {}).items()):
        perms.append((worker_host_user(host), *worker_host_permissions(replicas), None))
    for site, replicas in sorted((sites or {}).items()):
        perms.append((site_user(site), *site_permissions(replicas, site in site_bridges)))
    for user, pub, sub, denied in perms:
        users.append(indent + user_entry(user, passwords[user], pub, sub, denied))
    return ",\n".join(users)


def user_entry(
    user: str, password: str, pub: list[str], sub: list[str], denied: list[str] | None = None
) -> str:
    """One user of a config's ``users`` list: its login (the password's bcrypt hash only)
    and what it may publish (but ``denied``) and subscribe to."""
    deny = f", deny: {_list(denied)}" if denied else ""
    return (
        f"{{user: {json.dumps(user)}, "
        f"password: {json.dumps(password_hash(password))}, "
        f"permissions: {{publish: {{allow: {_list(pub)}{deny}}}, "
        f"subscribe: {{allow: {_list(sub)}}}}}}}"
    )


# Accounts of the bus with the auth callout: tokenbus' services and clients share one; the
# callout responder's login and the system user live apart.
ACCOUNT = "TB"
CALLOUT_ACCOUNT = "CALLOUT"
SYS_ACCOUNT = "SYS"


def render_auth(
    passwords: dict[str, str],
    callout: dict[str, str] | None = None,
    hosts: dict[str, list[str]] | None = None,
    revoked: list[str] | None = None,
    sites: dict[str, list[str]] | None = None,
    revoked_sites: list[str] | None = None,
    site_bridges: frozenset[str] = frozenset(),
) -> str:
    """The authorization part of the config (users, accounts, the auth callout): what every
    node of a deployment includes beside its own listen, JetStream and cluster settings.
    Each user's password appears as its bcrypt hash only (:func:`password_hash`). ``hosts``:
    a login per GPU host (:func:`worker_host_permissions`); ``sites``: a login per site's
    leaf node (:func:`site_user`, its replica ids' permissions; those in ``site_bridges`` a
    bridge's as well: :func:`site_permissions`), ``revoked_sites`` those taken
    out (named as revoked hosts are); ``revoked``: hosts whose login
    was taken away, still named among the callout's ``auth_users`` (nats-server refuses to
    reload a changed ``auth_users`` list: it logs that the name is "not valid", and a login
    with it is refused, neither answered by the callout nor by a user of the config)."""
    if callout is None:
        users = _role_users(passwords, list(ROLES), "    ", hosts, sites, site_bridges)
        return "authorization {\n  users = [\n" + users + "\n  ]\n}\n"
    roles = [r for r in ROLES if r != "client"]
    named = sorted({*(hosts or {}), *(revoked or [])})
    bypass = [*roles, *(worker_host_user(h) for h in named)]
    bypass += [site_user(s) for s in sorted({*(sites or {}), *(revoked_sites or [])})]
    bypass += [callout["user"], callout["sys_user"]]
    return (
        "# NATS clients log in with a tokenbus API key: the server asks the auth service.\n"
        + "accounts {\n"
        + f"  {ACCOUNT} {{\n    jetstream: enabled\n    users = [\n"
        + _role_users(passwords, roles, "      ", hosts, sites, site_bridges)
        + "\n    ]\n  }\n"
        + f"  {CALLOUT_ACCOUNT} {{ users = [ {{user: {json.dumps(callout['user'])}, "
        + f"password: {json.dumps(password_hash(callout['password']))}}} ] }}\n"
        + f"  {SYS_ACCOUNT} {{ users = [ {{user: {json.dumps(callout['sys_user'])}, "
        + f"password: {json.dumps(password_hash(callout['sys_password']))}}} ] }}\n"
        + "}\n"
        + f"system_account: {SYS_ACCOUNT}\n"
        + "authorization {\n  auth_callout {\n"
        + f"    issuer: {json.dumps(natsjwt.public_key(callout['issuer_seed']))}\n"
        + f"    auth_users: {_list(bypass)}\n"
        + f"    account: {CALLOUT_ACCOUNT}\n"
        + "  }\n}\n"
    )


# nats-server's own timers, in every configuration tokenbus writes: it pings each client and
# route every 2 s and drops one that leaves 2 pings unanswered (a paused process, a host cut
# off), so its subscriptions stop taking queue-group messages within 4 to 6 s instead of the
# defaults' 4 minutes; a client that does not read what it is sent for 5 s is dropped as a
# slow consumer instead of holding the server's writes (docs/fault-tolerance.md, stalls).
SERVER_PING_INTERVAL = "2s"
SERVER_PING_MAX = 2
SERVER_WRITE_DEADLINE = "5s"
SERVER_TIMERS = (
    f'ping_interval: "{SERVER_PING_INTERVAL}"\n'
    f"ping_max: {SERVER_PING_MAX}\n"
    f'write_deadline: "{SERVER_WRITE_DEADLINE}"\n'
)


# The hub's JetStream domain once sites join it (services/sites.py): a site's node has no
# JetStream of its own and maps its users' JetStream API to this domain
# (``default_js_domain``), so what a site's worker or bridge asks of JetStream crosses the
# link; without a domain on the hub, nats-server 2.15 answers a site's ``$JS.API`` "no
# responders".
HUB_DOMAIN = "hub"


def in_hub_domain(subjects: list[str]) -> list[str]:
    """``subjects`` and, for each JetStream API subject among them, the same in the hub's
    domain (``$JS.hub.API...``): what a site's node publishes for its users' JetStream API
    (mapped by its ``default_js_domain``), checked against its users' permissions and the
    site's login on the hub alike."""
    api = "$JS.API."
    mapped = [f"$JS.{HUB_DOMAIN}.API.{x[len(api) :]}" for x in subjects if x.startswith(api)]
    return [*subjects, *mapped]


def jetstream_block(store_dir: str, sync: str = NATS_SYNC, domain: str | None = None) -> str:
    """The server's ``jetstream`` block: its store, its sync policy
    (:data:`services.config.NATS_SYNC`) and, for a hub with sites, its domain."""
    if not re.fullmatch(NATS_SYNC_PATTERN, sync):
        raise ValueError(f"sync: {sync!r} is neither 'always' nor a duration such as '1s'")
    named = f", domain: {json.dumps(domain)}" if domain else ""
    return (
        f"jetstream {{ store_dir: {json.dumps(store_dir)}, sync_interval: {json.dumps(sync)}"
        f"{named} }}\n"
    )


def render(
    passwords: dict[str, str],
    *,
    host: str,
    port: int,
    store_dir: str,
    callout: dict[str, str] | None = None,
    tls: TlsFiles | None = None,
    sync: str = NATS_SYNC,
    hosts: dict[str, list[str]] | None = None,
    revoked: list[str] | None = None,
    sites: dict[str, list[str]] | None = None,
) -> str:
    """The nats-server configuration text: a user per role; with ``callout`` (the issuer
    and logins of :func:`generate`), NATS clients log in with their API key instead of a
    shared ``client`` password, answered by the auth service (:mod:`auth.callout`);
    ``sites``: a leaf-node login per site (:func:`render_auth`)."""
    head = (
        "# Generated by `tokenbus nats-config`: one user per tokenbus role.\n"
        f"listen: {json.dumps(f'{host}:{port}')}\n"
        + jetstream_block(store_dir, sync)
        + SERVER_TIMERS
        + (tls.server_block() if tls else "")
    )
    return head + render_auth(passwords, callout, hosts, revoked, sites)


# Written beside ``nats-users.json`` by :func:`generate` with ``callout``.
CALLOUT_FILE = "callout.json"


def _write_private(path: Path, data: dict[str, str]) -> None:
    write_private(path, json.dumps(data, indent=2))


def _kept(path: Path) -> dict[str, str]:
    return dict(json.loads(path.read_text())) if path.exists() else {}


def generate(
    out_dir: Path,
    *,
    host: str = "127.0.0.1",
    port: int = 4222,
    store_dir: str | None = None,
    callout: bool = False,
    tls: TlsFiles | None = None,
    sync: str = NATS_SYNC,
    worker_hosts: dict[str, list[str]] | None = None,
    sites: dict[str, list[str]] | None = None,
) -> tuple[Path, Path]:
    """Write ``nats.conf`` (the passwords' hashes only) and ``nats-users.json`` (the
    passwords, kept if it exists already), both mode 0600, and make ``out_dir`` mode 0700;
    with ``callout``, also ``callout.json`` (the issuer seed and the responder's and system
    logins, mode 0600) for the auth service, and clients log in with API keys; with
    ``tls`` (:func:`services.tlsfiles.generate`'s files, or the operator's), the server
    takes TLS connections only, and ``tls.json`` tells :func:`role_env` where the files are.
    ``worker_hosts`` (host -> its replica ids): a login per GPU host, its password kept
    across runs; a host left out of a later run has no login any more (revoked once the
    server reloads its config), the others keep theirs. The map is kept in
    ``worker-hosts.json``; None keeps the one there. ``sites`` (site -> its replica ids): a
    leaf-node login per site, its password made or kept (the nemesis' sites; ``tokenbus
    deploy init --site`` keeps its own list, services/deploybundle.py)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(out_dir, 0o700)  # what logs in as every role, admin included
    secrets_file = out_dir / "nats-users.json"
    # Only the logins the config has: with the callout, NATS clients log in with their API
    # keys and there is no shared ``client`` user (a stale one would mislead). What else the
    # file holds (a deployment's route password) is kept.
    passwords = {k: v for k, v in _kept(secrets_file).items() if not (callout and k == "client")}
    for role in ROLES:
        if not (callout and role == "client"):
            passwords.setdefault(role, secrets.token_urlsafe(24))
    hosts, revoked = worker_hosts_of(out_dir)
    if worker_hosts is not None:
        revoked = sorted({*revoked, *hosts} - set(worker_hosts))
        hosts = {h: list(r) for h, r in worker_hosts.items()}
    for user in [u for u in passwords if u.startswith(WORKER_HOST_PREFIX)]:
        if user[len(WORKER_HOST_PREFIX) :] not in hosts:
            del passwords[user]  # a host taken out: its login goes
    for name in hosts:
        passwords.setdefault(worker_host_user(name), secrets.token_urlsafe(24))
    for site in sites or {}:
        passwords.setdefault(site_user(site), secrets.token_urlsafe(24))
    _write_private(secrets_file, passwords)
    hosts_file = out_dir / WORKER_HOSTS_FILE
    if hosts or revoked:
        write_private(hosts_file, json.dumps({"hosts": hosts, "revoked": revoked}, indent=2))
    else:
        hosts_file.unlink(missing_ok=True)
    callout_creds = None
    if callout:
        callout_file = out_dir / CALLOUT_FILE
        callout_creds = _kept(callout_file)
        callout_creds.setdefault("issuer_seed", natsjwt.new_account_seed())
        callout_creds.setdefault("user", "callout")
        callout_creds.setdefault("password", secrets.token_urlsafe(24))
        callout_creds.setdefault("sys_user", "sys")
        callout_creds.setdefault("sys_password", secrets.token_urlsafe(24))
        _write_private(callout_file, callout_creds)
    conf = out_dir / "nats.conf"
    write_private(
        conf,
        render(
            passwords,
            host=host,
            port=port,
            store_dir=store_dir or str(out_dir / "jetstream"),
            callout=callout_creds,
            tls=tls,
            sync=sync,
            hosts=hosts,
            revoked=revoked,
            sites=sites,
        ),
    )
    if tls is not None:
        tls.save(out_dir)
    else:
        (out_dir / TLS_FILE).unlink(missing_ok=True)
    return conf, secrets_file


def write_node_configs(
    include: Path,
    addrs: list[str],
    ports: list[int],
    cluster_ports: list[int],
    stores: list[Path],
    *,
    cluster: str = "tokenbus",
    monitor_ports: list[int] | None = None,
    domain: str | None = None,
    sync: str = NATS_SYNC,
) -> list[Path]:
    """One config per node of a cluster, beside ``include`` (the locked config
    :func:`generate` wrote: same accounts, role passwords and callout issuer), each adding
    its server name, listen address, monitoring port (``monitor_ports``), JetStream store and,
    with more than one node, the cluster block routing to every node (routes carry no auth:
    loopback or a test's own network namespaces only). Keys after the include override its
    own (listen, jetstream: a whole block, so the sync policy ``sync`` and the domain are
    written again here). The nemesis' cluster and the tests' locked cluster use it."""
    routes = ", ".join(
        json.dumps(f"nats://{a}:{p}") for a, p in zip(addrs, cluster_ports, strict=True)
    )
    confs = []
    for i, addr in enumerate(addrs):
        conf = include.parent / f"node{i}.conf"
        text = (
            f"include {json.dumps(include.name)}\n"
            f"server_name: node{i}\n"
            f"listen: {json.dumps(f'{addr}:{ports[i]}')}\n"
        )
        if monitor_ports is not None:
            text += f"http: {json.dumps(f'{addr}:{monitor_ports[i]}')}\n"
        text += jetstream_block(str(stores[i]), sync, domain)
        if len(addrs) > 1:
            text += (
                f"cluster {{ name: {cluster}, listen: "
                f"{json.dumps(f'{addr}:{cluster_ports[i]}')}, routes: [{routes}] }}\n"
            )
        conf.write_text(text)
        confs.append(conf)
    return confs


def worker_hosts_of(folder: Path) -> tuple[dict[str, list[str]], list[str]]:
    """(each GPU host's replica ids, the hosts revoked) of a generated config folder."""
    path = folder / WORKER_HOSTS_FILE
    data = json.loads(path.read_text()) if path.exists() else {}
    hosts = {str(h): [str(r) for r in rs] for h, rs in (data.get("hosts") or {}).items()}
    return hosts, [str(h) for h in data.get("revoked") or []]


def role_login(secrets_file: Path, role: str) -> dict[str, Any]:
    """nats-py's connect options (``user``, ``password``, and ``tls`` on a TLS bus) for
    ``role``."""
    passwords: dict[str, Any] = json.loads(secrets_file.read_text())
    login: dict[str, Any] = {"user": role, "password": str(passwords[role])}
    tls = TlsFiles.load(secrets_file.parent)
    if tls is not None:
        from services.tlsfiles import client_context

        login["tls"] = client_context(tls.ca, tls.client_cert, tls.client_key)
    return login


def role_env(secrets_file: Path, role: str) -> dict[str, str]:
    """The environment a service of ``role`` needs to log in (the auth service, on a bus
    whose clients log in with their keys, also the callout's credentials beside it)."""
    login = role_login(secrets_file, role)
    env = {"TOKENBUS_NATS_USER": login["user"], "TOKENBUS_NATS_PASSWORD": login["password"]}
    callout = secrets_file.parent / CALLOUT_FILE
    if role == "auth" and callout.exists():
        env["TOKENBUS_NATS_CALLOUT"] = str(callout)
    return env | tls_env(secrets_file.parent)


def tls_env(folder: Path) -> dict[str, str]:
    """The TLS settings of a service on the bus configured in ``folder`` (none when plain):
    the CA to trust and the client certificate to present (mutual TLS)."""
    tls = TlsFiles.load(folder)
    if tls is None:
        return {}
    env = {"TOKENBUS_NATS_TLS_CA": tls.ca}
    if tls.client_cert:
        env |= {"TOKENBUS_NATS_TLS_CERT": tls.client_cert, "TOKENBUS_NATS_TLS_KEY": tls.client_key}
    return env
