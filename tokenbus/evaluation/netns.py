"""Several hosts on one machine, for fault tests and the nemesis bench where hosts matter
(tests/ and :mod:`tokenbus.evaluation.nemesis` share it): each host a network namespace,
joined to the machine's own namespace by a veth pair on a Linux bridge. A partition takes a
host's link down: its packets are dropped, nothing is reset, its sockets stay open (the gray
failure a kill never shows). Needs root and ``ip``; tests skip (and the bench leaves
partitions out) where namespaces cannot be made (:func:`available`). ``tc netem`` is not in
these machines' kernels, so nothing here adds latency."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def available() -> bool:
    """Whether this machine lets the tests make network namespaces (root, ``ip``)."""
    if shutil.which("ip") is None or os.geteuid() != 0:
        return False
    name = f"tbprobe{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", name)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError):
        return False
    with contextlib.suppress(subprocess.CalledProcessError, subprocess.TimeoutExpired):
        _ip("netns", "del", name)
    return True


@dataclass
class Host:
    name: str
    netns: str
    addr: str
    link: str  # the machine's end of its veth pair: down is a partition

    def prefix(self) -> list[str]:
        """What runs a command on this host."""
        return ["ip", "netns", "exec", self.netns]


class Hosts:
    """A Linux bridge with an address of the machine's own (``gateway``: where the machine's
    processes, a nats-server say, are reached from the hosts) and hosts added to it."""

    def __init__(self) -> None:
        self.tag = secrets.token_hex(2)
        self.bridge = f"tbbr{self.tag}"
        # A /24 of its own, unlikely to meet another run's.
        self.net = f"10.{100 + secrets.randbelow(100)}.{secrets.randbelow(250)}"
        self.gateway = f"{self.net}.1"
        self.hosts: list[Host] = []

    def start(self) -> Hosts:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        return self

    def add(self, name: str) -> Host:
        i = len(self.hosts)
        ns, inner, outer = f"tb{self.tag}{name}", f"tbv{self.tag}{i}", f"tbv{self.tag}{i}b"
        _ip("netns", "add", ns)
        _ip("link", "add", inner, "type", "veth", "peer", "name", outer)
        _ip("link", "set", inner, "netns", ns)
        _ip("link", "set", outer, "master", self.bridge)
        _ip("link", "set", outer, "up")
        addr = f"{self.net}.{i + 2}"
        _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", inner)
        _ip("-n", ns, "link", "set", inner, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        host = Host(name, ns, addr, outer)
        self.hosts.append(host)
        return host

    def cut(self, host: Host) -> None:
        """Partition ``host``: its link goes down, its packets are dropped, none reset."""
        _ip("link", "set", host.link, "down")

    def heal(self, host: Host) -> None:
        _ip("link", "set", host.link, "up")

    def isolate(self, a: Host, b: Host) -> None:
        """Cut ``a`` and ``b`` off from each other only (each drops what it would send the
        other: a blackhole route, nothing reset); both still reach everyone else."""
        _ip("-n", a.netns, "route", "add", "blackhole", f"{b.addr}/32")
        _ip("-n", b.netns, "route", "add", "blackhole", f"{a.addr}/32")

    def rejoin(self, a: Host, b: Host) -> None:
        for x, y in ((a, b), (b, a)):
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("-n", x.netns, "route", "del", "blackhole", f"{y.addr}/32")

    def stop(self) -> None:
        for h in self.hosts:
            with contextlib.suppress(subprocess.CalledProcessError, subprocess.TimeoutExpired):
                _ip("netns", "del", h.netns)
            with contextlib.suppress(subprocess.CalledProcessError, subprocess.TimeoutExpired):
                _ip("link", "del", h.link)
        with contextlib.suppress(subprocess.CalledProcessError, subprocess.TimeoutExpired):
            _ip("link", "del", self.bridge)
