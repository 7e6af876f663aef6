"""The nemesis run's NATS cluster: locked nats-server nodes with the auth callout, on
loopback or on hosts of their own (network namespaces), each node killable, pausable and
restartable, its JetStream store copied aside at a sync point and put back after a crash;
and its sites: a leaf node each (the config ``tokenbus deploy init --site`` writes), dialling
a hub node's leaf port through a link of its own (:class:`WanLink`) that the site faults
cut, stall and slow."""

from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path
from typing import Any

from services.supervisor import Process
from tokenbus.evaluation.netns import Hosts
from tokenbus.evaluation.wanlink import WanLink
from tokenbus.launcher import free_port, port_open

# Site names, in order (``Config.sites`` of them).
SITE_NAMES = "abcdefgh"


def _until_listening(addr: str, port: int, what: str) -> None:
    """Until a nats-server just started listens on ``addr:port`` (20 s at most)."""
    deadline = time.monotonic() + 20
    while not port_open(addr, port):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not listen")
        time.sleep(0.02)


async def quiet_errors(exc: Exception) -> None:
    """A NATS connection's error callback: the faults make many, and the outcomes say
    what they cost."""


class Cluster:
    """``n`` nats-server nodes on the locked config with the auth callout (each node a config
    of its own including the generated one), on loopback or on hosts of their own; each
    node's JetStream store in a folder of its own, with a copy taken at each sync point."""

    def __init__(
        self, folder: Path, n: int, hosts: Hosts | None, sites: dict[str, list[str]] | None = None
    ) -> None:
        from services.natsconf import HUB_DOMAIN, generate, write_node_configs

        self.folder = folder
        self.hostset = hosts
        self.hosts = [hosts.add(f"n{i}") for i in range(n)] if hosts else []
        self.addrs = [h.addr for h in self.hosts] if hosts else ["127.0.0.1"] * n
        self.ports = [free_port() for _ in range(n)]
        cports = [free_port() for _ in range(n)]
        self.conf, self.users = generate(folder, port=self.ports[0], callout=True, sites=sites)
        self.stores = [folder / f"jetstream-{i}" for i in range(n)]
        self.confs = write_node_configs(
            self.conf,
            self.addrs,
            self.ports,
            cports,
            self.stores,
            cluster="nemesis",
            domain=HUB_DOMAIN if sites else None,
        )
        self.procs: list[Process | None] = [None] * n
        self.sites = sorted(sites or {})
        self.links: dict[str, WanLink] = {}
        self.site_ports: dict[str, int] = {}
        self.site_procs: dict[str, Process] = {}
        if sites:
            self._write_sites(sites)

    def _write_sites(self, sites: dict[str, list[str]]) -> None:
        """A leaf listener on every node, and per site its folder (services/sites.py) with
        its node dialling its link, the link in front of one node's leaf port (sites spread
        over the nodes)."""
        from services import natsconf
        from services import sites as sitefiles

        leaf_ports = [free_port() for _ in self.ports]
        for i, conf in enumerate(self.confs):
            block = sitefiles.hub_leaf_block(None, f"{self.addrs[i]}:{leaf_ports[i]}")
            conf.write_text(conf.read_text() + block)
        passwords = json.loads(self.users.read_text())
        for k, site in enumerate(self.sites):
            node = k % len(self.ports)
            link = WanLink(leaf_ports[node], self.addrs[node])
            self.links[site] = link
            sitefiles.write_site(
                self.folder,
                site,
                hub_url=f"nats://127.0.0.1:{link.port}",
                hub_password=passwords[natsconf.site_user(site)],
                replicas=sites[site],
                tls=None,
            )
            self.site_ports[site] = free_port()
            local = self.site_folder(site) / "local.conf"
            local.write_text(
                'include "nats.conf"\n' + f'listen: "127.0.0.1:{self.site_ports[site]}"\n'
            )

    def site_folder(self, site: str) -> Path:
        from services import sites as sitefiles

        return self.folder / sitefiles.SITES_DIR / site

    def site_url(self, site: str) -> str:
        return f"nats://127.0.0.1:{self.site_ports[site]}"

    def site_login(self, site: str) -> dict[str, str]:
        """The site's workers' login on the site's node."""
        from services import sites as sitefiles

        path = self.site_folder(site) / "roles" / f"{sitefiles.SITE_WORKER}.json"
        return dict(json.loads(path.read_text()))

    async def start_links(self) -> None:
        for link in self.links.values():
            await link.start()

    async def close_links(self) -> None:
        for link in self.links.values():
            await link.close()

    def start_site(self, site: str) -> None:
        from tokenbus.launcher import nats_server_binary

        folder = self.site_folder(site)
        argv = [nats_server_binary(), "-c", "local.conf"]
        node = Process(f"site-{site}", argv, log=self.folder / f"site-{site}.log", cwd=folder)
        node.start()
        self.site_procs[site] = node
        _until_listening("127.0.0.1", self.site_ports[site], f"site {site}'s node")

    def url(self, i: int) -> str:
        return f"nats://{self.addrs[i]}:{self.ports[i]}"

    def urls(self, first: int) -> str:
        order = [first] + [i for i in range(len(self.ports)) if i != first]
        return ",".join(self.url(i) for i in order)

    def start_node(self, i: int) -> None:
        from tokenbus.launcher import nats_server_binary

        prefix = self.hosts[i].prefix() if self.hosts else []
        argv = [*prefix, nats_server_binary(), "-c", str(self.confs[i])]
        node = Process(f"node{i}", argv, log=self.folder / f"node{i}.log")
        node.start()
        self.procs[i] = node
        _until_listening(self.addrs[i], self.ports[i], f"nats node {i}")

    def start(self) -> Cluster:
        for i in range(len(self.ports)):
            self.start_node(i)
        for site in self.sites:
            self.start_site(site)
        return self

    def signal(self, i: int, sig: int) -> None:
        p = self.procs[i]
        if p is not None:
            p.signal(sig)

    def kill(self, i: int) -> None:
        p = self.procs[i]
        if p is not None:
            p.kill()

    def sync_point(self, i: int) -> float:
        """What node ``i``'s store holds on disk after a sync: a copy of it aside, taken
        with the node paused for the moment of the copy (a consistent one); the seconds the
        copy took (the node's pause)."""
        store, p = self.stores[i], self.procs[i]
        if p is None or not p.alive() or not store.exists():
            return 0.0
        aside = store.with_name(store.name + ".synced")
        tmp = store.with_name(store.name + ".copying")
        shutil.rmtree(tmp, ignore_errors=True)
        t0 = time.monotonic()
        self.signal(i, signal.SIGSTOP)
        try:
            shutil.copytree(store, tmp, symlinks=True)
        except (OSError, shutil.Error):
            shutil.rmtree(tmp, ignore_errors=True)
            return time.monotonic() - t0
        finally:
            self.signal(i, signal.SIGCONT)
        shutil.rmtree(aside, ignore_errors=True)
        tmp.rename(aside)
        return time.monotonic() - t0

    def revert_store(self, i: int) -> bool:
        """Node ``i``'s store back to its last sync point's copy (the node is down); False
        when no sync point was taken yet (the store is emptied: nothing was synced)."""
        store = self.stores[i]
        aside = store.with_name(store.name + ".synced")
        shutil.rmtree(store, ignore_errors=True)
        if aside.exists():
            shutil.copytree(aside, store, symlinks=True)
            return True
        return False

    def stop(self) -> None:
        for p in [*self.site_procs.values(), *self.procs]:
            if p is not None:
                p.stop(10)

    async def admin(self, i: int = 0, **kw: Any) -> Any:
        import nats

        from services.natsconf import role_login
        from services.runtime import servers

        return await nats.connect(
            servers(self.urls(i)),
            dont_randomize=True,
            error_cb=quiet_errors,
            **role_login(self.users, "admin"),
            **kw,
        )
