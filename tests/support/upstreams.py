"""The fake OpenAI-compatible upstream (``tests/fakes/upstream.py``) as a real process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from tests.support.pids import stop_process
from tests.support.ports import free_port, wait_port
from tests.support.repo import ROOT


class Upstream:
    """The fake OpenAI-compatible upstream (``tests/fakes/upstream.py``), a real process on a
    free port, recording what it receives."""

    def __init__(self, log_dir: Path, flavor: str = "vllm") -> None:
        self.port = free_port()
        self._log = open(log_dir / "upstream.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.fakes.upstream",
                "--port",
                str(self.port),
                "--flavor",
                flavor,
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
        wait_port(self.port, 20)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def last_request(self) -> dict[str, Any]:
        async with httpx.AsyncClient() as c:
            r = await c.get(f"{self.url}/last_request")
            r.raise_for_status()
            body: dict[str, Any] = r.json()
            return body

    def stop(self) -> None:
        stop_process(self.proc)
        self._log.close()
