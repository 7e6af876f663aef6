"""A real nats-server process for the tests: spawned on a port, or with JetStream on a free one."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from services.natsconf import jetstream_block
from services.supervisor import Process
from tests.support.ports import free_port, wait_port
from tokenbus.launcher import nats_server_binary


def spawn_nats(
    port: int,
    *args: str,
    prefix: Sequence[str] = (),
    host: str = "127.0.0.1",
    cwd: str | Path | None = None,
) -> Process:
    """A nats-server process with ``args`` (the kit's :class:`~services.supervisor.Process`,
    which has ``subprocess.Popen``'s names too), once it listens on ``host``:``port``
    (``prefix``: what runs it elsewhere, ``ip netns exec <host>``; ``cwd``: its working
    directory, where a config's relative file names are opened). Its output goes to a file
    that is removed at once (kept open by the server): read only when it fails to start."""
    # Until it listens, or it exits (a port taken, a bad config: said with its own words),
    # or a minute passes (a loaded machine starting a JetStream store).
    fd, name = tempfile.mkstemp(prefix="nats-", suffix=".log")
    os.close(fd)
    log = Path(name)
    proc = Process(
        "nats-server",
        [*prefix, nats_server_binary(), *args],
        log=log,
        cwd=Path(cwd) if cwd is not None else None,
    )
    try:
        proc.start()
        try:
            if wait_port(port, 60, host, proc):
                return proc
        except RuntimeError:
            pass
        proc.kill()
        said = log.read_text(errors="replace")[-2000:]
    finally:
        log.unlink(missing_ok=True)
    raise RuntimeError(f"nats-server did not listen on {host}:{port}: {said}")


TEST_SYNC = "2m"  # the test servers' JetStream sync interval (NatsServer.start)


class NatsServer:
    """A real nats-server process with JetStream, on a free port."""

    def __init__(self, data_dir: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.data_dir = data_dir
        self.proc: Process | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> NatsServer:
        # JetStream from the block the configs tokenbus writes have, but syncing lazily
        # (nats-server's own 2 minutes): no test loses a machine's page cache (the nemesis
        # bench simulates that itself), so a sync per write would only load the shared disk
        # under four workers. That the configs tokenbus writes sync every write is
        # tests/test_durability.py's to check.
        self.data_dir.mkdir(parents=True, exist_ok=True)
        conf = self.data_dir.parent / f"{self.data_dir.name}.conf"
        conf.write_text(jetstream_block(str(self.data_dir), TEST_SYNC))
        args = ("-c", str(conf), "-a", "127.0.0.1", "-p", str(self.port))
        self.proc = spawn_nats(self.port, *args)
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
