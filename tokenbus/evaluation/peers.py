"""Peer gateways measured beside tokenbus by ``tokenbus bench --spawn --peer NAME``: each is
started in front of the same OpenAI-compatible engine server as tokenbus' workers.

* ``vllm-router``: vLLM's Rust router (``pip install vllm-router``), ``--policy round_robin``
  over the one engine server;
* ``litellm``: the LiteLLM proxy (``pip install 'litellm[proxy]'``), one model entry pointing
  at the engine server;
* ``pyrelay``: a bare Python byte relay (``tokenbus.evaluation.pyrelay``, nothing to
  install): the floor of any Python process that every token crosses;
* ``busrelay``: a bare byte tunnel from a Python front process through a nats-server of its
  own to a Python back process (``tokenbus.evaluation.busrelay``, nothing to install): the
  floor of tokenbus' own shape, bridge, bus and worker, before any of their work.

The first two are not tokenbus dependencies: install them (a virtual environment of their own
is fine) and put them on PATH, or name the binary:
``--peer vllm-router=/opt/peers/bin/vllm-router``.
"""

from __future__ import annotations

import json
import secrets
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from tokenbus.evaluation.options import PEERS
from tokenbus.launcher import nats_server_binary


@dataclass(frozen=True, slots=True)
class PeerLaunch:
    """How to start one peer and where it answers."""

    name: str
    argv: list[str]
    base_url: str  # OpenAI base URL (…/v1)
    ready_url: str  # answers 200 once it serves
    api_key: str | None = None  # what requests must send (a gateway that checks keys)
    # Processes started before it, in order, as (name, argv); their CPU counts as its own.
    companions: tuple[tuple[str, list[str]], ...] = ()


def parse(spec: str) -> tuple[str, str]:
    """``NAME[=BINARY]`` -> (name, binary path); ValueError saying why not."""
    name, _, binary = spec.partition("=")
    if name not in PEERS:
        raise ValueError(f"--peer {spec!r}: known peers are {', '.join(PEERS)}")
    if name in ("pyrelay", "busrelay"):
        return name, binary or sys.executable
    path = binary or shutil.which(name) or ""
    if not path or not Path(path).exists():
        raise ValueError(
            f"--peer {name}: no {name} binary on PATH; install it (pip install "
            f"{'vllm-router' if name == 'vllm-router' else chr(39) + 'litellm[proxy]' + chr(39)}) "
            f"or give --peer {name}=/path/to/{name}"
        )
    return name, path


def launch(
    name: str, binary: str, engine: str, model: str, port: int, tmp: Path, spare_port: int
) -> PeerLaunch:
    """The command line of peer ``name`` in front of the engine server at ``engine`` (its
    base URL without ``/v1``); ``spare_port``: for a metrics listener it opens besides."""
    here = f"http://127.0.0.1:{port}"
    if name == "vllm-router":
        argv = [binary, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", engine]
        argv += ["--policy", "round_robin", "--log-level", "warning"]
        argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(spare_port)]
        return PeerLaunch(name, argv, f"{here}/v1", f"{here}/health")
    if name == "pyrelay":
        argv = [binary, "-m", "tokenbus.evaluation.pyrelay", "--port", str(port)]
        argv += ["--upstream", engine]
        return PeerLaunch(name, argv, f"{here}/v1", f"{here}/ready")
    if name == "busrelay":
        bus = f"nats://127.0.0.1:{spare_port}"
        relay = [binary, "-m", "tokenbus.evaluation.busrelay"]
        nats = [nats_server_binary(), "-a", "127.0.0.1", "-p", str(spare_port)]
        companions = (
            (f"{name}-nats", nats),
            (f"{name}-back", [*relay, "back", "--nats", bus, "--upstream", engine]),
        )
        argv = [*relay, "front", "--nats", bus, "--port", str(port)]
        return PeerLaunch(name, argv, f"{here}/v1", f"{here}/ready", companions=companions)
    key = f"sk-{secrets.token_hex(16)}"
    cfg = tmp / "litellm.json"  # YAML is a superset of JSON: no YAML writer needed
    cfg.write_text(
        json.dumps(
            {
                "model_list": [
                    {
                        "model_name": model,
                        "litellm_params": {
                            "model": f"openai/{model}",
                            "api_base": f"{engine}/v1",
                            "api_key": "none",
                        },
                    }
                ],
                "litellm_settings": {"drop_params": True, "telemetry": False},
                # It checks keys, as tokenbus does in the comparison.
                "general_settings": {"master_key": key},
            }
        )
    )
    argv = [binary, "--config", str(cfg), "--host", "127.0.0.1", "--port", str(port)]
    return PeerLaunch(name, argv, f"{here}/v1", f"{here}/health/liveliness", key)
