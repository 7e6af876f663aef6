"""``tokenbus deploy init``: the locked bus of a compose or Kubernetes deployment, and
``tokenbus health``: the container health check of a service.

``deploy init`` writes, once, into a folder (the compose file's ``config`` volume, or files
an operator turns into Kubernetes secrets) the nats-server configs, a login per role, the
auth callout's keys and a TLS CA and server certificate (:mod:`services.deploybundle`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def add_parsers(sub: Any) -> None:
    d = sub.add_parser("deploy", help="the locked bus of a compose or Kubernetes deployment")
    dsub = d.add_subparsers(dest="deploy_cmd", required=True)
    i = dsub.add_parser(
        "init",
        help="write the NATS configs, one login per role, the callout keys and TLS files "
        "(kept when they exist)",
    )
    i.add_argument("--dir", required=True, help="folder for the files (a volume)")
    i.add_argument("--nodes", type=int, default=1, help="NATS nodes: 1, or 3 for a cluster")
    i.add_argument(
        "--nats-host",
        default="nats",
        help="the nodes' host name: HOST for one node, HOST-0 ... HOST-<n-1> for a cluster",
    )
    i.add_argument("--no-tls", action="store_true", help="plain TCP inside the network")
    i.add_argument(
        "--tls-name",
        action="append",
        default=[],
        help="another name or address the server certificate is valid for (the host that "
        "publishes NATS to clients outside; repeatable)",
    )
    i.add_argument(
        "--chown",
        action="append",
        default=[],
        metavar="PATH=ROLE",
        help="give a data folder to a role's uid (or to nats), when run as root: the "
        "services run as non-root users of their own",
    )
    i.add_argument(
        "--worker-host",
        action="append",
        default=None,
        metavar="HOST=REPLICA[,REPLICA...]",
        help="a login of its own for a GPU host, which may serve only these replica ids "
        "(roles/worker-<HOST>.json; repeatable). Given once, the list replaces the last "
        "run's: a host left out loses its login (reload the nodes); not given, it is kept",
    )
    i.add_argument(
        "--site",
        action="append",
        default=None,
        metavar="NAME=REPLICA[,REPLICA...]",
        help="a site whose own nats-server joins the hub as a leaf node (dialling out), "
        "serving these replica ids: a hub login site-<NAME> limited to them, and "
        "sites/<NAME>/ to copy to the site (docs/deploy.md, Sites; repeatable). Given once, "
        "the list replaces the last run's; not given, it is kept",
    )
    i.add_argument(
        "--site-bridge",
        action="append",
        default=None,
        metavar="NAME",
        help="a site given with --site that serves its own users: a bridge at the site "
        "(sites/<NAME>/roles/bridge.json, its login on the site's node) routing to the site's "
        "replicas first, and the site's hub login a bridge's rights (trusted as a bridge is; "
        "docs/deploy.md, Sites; repeatable). Given once, the list replaces the last run's",
    )
    i.add_argument(
        "--hub-url",
        default=None,
        help="where sites reach the hub's leaf-node port, e.g. tls://hub.example.com:7422 "
        "(default: the nodes' host name, port 7422)",
    )
    i.add_argument("--print-url", action="store_true", help="print the NATS URL of services")
    i.add_argument(
        "--renew-certs",
        action="store_true",
        help="issue the nodes' certificate again from the same CA (done anyway within 30 "
        "days of its expiry); reload the nodes after (nats-server --signal reload, SIGHUP)",
    )
    i.add_argument(
        "--sync",
        default=None,
        help="what the nodes sync to disk before acknowledging a JetStream write: 'always' "
        "(the default, nats_sync) or an interval such as '1s' (docs/deploy.md, Durability)",
    )

    h = sub.add_parser(
        "health",
        help="exit 0 when this container's service is healthy (a Docker health check or "
        "Kubernetes probe)",
    )
    h.add_argument("--file", help="the service's TOKENBUS_HEALTH_FILE")
    h.add_argument("--url", help="an HTTP endpoint that must answer 200 (the bridge's /ready)")
    h.add_argument("--max-age", type=float, default=10.0, help="seconds the file may be old")


def _chown_tree(path: Path, uid: int) -> None:
    import os

    for root, dirs, files in os.walk(path):
        os.chown(root, uid, uid)
        for name in dirs + files:
            os.lchown(os.path.join(root, name), uid, uid)


def init(a: argparse.Namespace) -> int:
    from services import deploybundle as db

    owners: list[tuple[Path, int]] = []
    for item in a.chown:
        path, _, role = item.partition("=")
        uid = db.NATS_UID if role == "nats" else db.ROLE_UID.get(role)
        if not path or uid is None:
            print(
                f"error: --chown {item}: want PATH=ROLE with a role of "
                f"{', '.join([*db.ROLE_UID, 'nats'])}",
                file=sys.stderr,
            )
            return 2
        owners.append((Path(path), uid))
    from services.config import Settings
    from services.natsconf import parse_worker_hosts
    from services.sites import parse_sites

    try:
        hosts = parse_worker_hosts(a.worker_host) if a.worker_host is not None else None
        sites = parse_sites(a.site) if a.site is not None else None
        written = db.init(
            Path(a.dir),
            nodes=a.nodes,
            host=a.nats_host,
            tls=not a.no_tls,
            tls_names=a.tls_name,
            sync=a.sync or Settings().nats_sync,
            renew_certs=a.renew_certs,
            worker_hosts=hosts,
            sites=sites,
            hub_url=a.hub_url,
            site_bridges=a.site_bridge,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    import os

    if os.geteuid() == 0:
        for path, uid in owners:
            path.mkdir(parents=True, exist_ok=True)
            _chown_tree(path, uid)
    if a.print_url:
        print(db.nats_urls(a.nats_host, a.nodes, tls=not a.no_tls))
    else:
        print(f"wrote {len(written)} files in {a.dir}: " + ", ".join(p.name for p in written[:3]))
    return 0


def health(a: argparse.Namespace) -> int:
    if not a.file and not a.url:
        print("error: give --file or --url", file=sys.stderr)
        return 2
    if a.file:
        from services.runtime import check_health

        why = check_health(a.file, a.max_age)
        if why:
            print(f"unhealthy: {why}", file=sys.stderr)
            return 1
    if a.url:
        import ssl
        import urllib.request

        ctx = ssl._create_unverified_context()  # its own port: the name is not what counts
        try:
            with urllib.request.urlopen(a.url, timeout=3, context=ctx) as r:
                if r.status != 200:
                    print(f"unhealthy: {a.url} answered {r.status}", file=sys.stderr)
                    return 1
        except Exception as exc:
            print(f"unhealthy: {a.url}: {exc}", file=sys.stderr)
            return 1
    return 0
