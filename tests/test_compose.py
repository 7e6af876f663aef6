"""Compose files as operators use them: the shipped one and ``tokenbus compose generate``'s
GPU topologies parse, and every service command is a ``tokenbus`` invocation the CLI takes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import ROOT, run_cli
from tokenbus.cli import build_parser
from tokenbus.cli.compose import plan


def _commands(doc: dict[str, Any]) -> dict[str, list[str]]:
    return {name: svc["command"] for name, svc in doc["services"].items() if "command" in svc}


def _devices(svc: dict[str, Any]) -> list[str]:
    devs = svc["deploy"]["resources"]["reservations"]["devices"]
    return [d for dev in devs for d in dev["device_ids"]]


def test_the_shipped_compose_file_runs_only_commands_the_cli_takes() -> None:
    doc = yaml.safe_load((ROOT / "compose" / "docker-compose.yml").read_text())
    cmds = _commands(doc)
    assert {"bridge", "ingress", "router", "worker"} <= set(cmds)
    for name, cmd in cmds.items():
        if name == "nats":
            continue
        args = build_parser().parse_args(cmd)  # exits (fails the test) on a bad one
        assert args.cmd == "serve", name


@pytest.mark.parametrize(
    ("gpus", "tp", "want"),
    [
        (8, "8", [[0, 1, 2, 3, 4, 5, 6, 7]]),  # ScaleLLM's one TP8 replica
        (8, "2,2,2,2", [[0, 1], [2, 3], [4, 5], [6, 7]]),  # four TP2 replicas
        (8, "4,2,2", [[0, 1, 2, 3], [4, 5], [6, 7]]),  # the tiered mix
        (4, "1,1,2", [[0], [1], [2, 3]]),
        (8, "2,2", [[0, 1], [2, 3]]),  # GPUs left free is allowed
    ],
)
def test_topologies_pin_each_worker_to_its_gpus(
    gpus: int, tp: str, want: list[list[int]], tmp_path: Path
) -> None:
    out = tmp_path / "workers.yml"
    r = run_cli(
        "compose", "generate", "--gpus", str(gpus), "--tp", tp, "--model", "m",
        "--pool", "high_tp:4", "--out", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    doc = yaml.safe_load(out.read_text())
    svcs = doc["services"]
    assert [[int(d) for d in _devices(s)] for s in svcs.values()] == want
    assert "hf-cache" in doc["volumes"]
    for svc in svcs.values():
        n = len(_devices(svc))
        args = build_parser().parse_args(svc["command"])
        assert (args.cmd, args.service, args.backend, args.model) == (
            "serve",
            "worker",
            "vllm",
            "m",
        )
        assert args.tp == n and f"tensor_parallel_size={n}" in svc["command"]
        assert args.pool == ("high_tp" if n == 4 else "default")
        assert svc["volumes"] == ["hf-cache:/root/.cache/huggingface"]


def test_explicit_gpu_sets() -> None:
    groups = plan(8, None, "6,7;0,1,2,3", [])
    assert [g.gpus for g in groups] == [(6, 7), (0, 1, 2, 3)] and [g.tp for g in groups] == [2, 4]


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (["--gpus", "8", "--devices", "0,1;1,2"], "GPU 1 is given to two workers"),
        (["--gpus", "8", "--tp", "4,4,2"], "GPU 8 does not exist"),
        (["--gpus", "4", "--devices", "0,1;4,5"], "GPU 4 does not exist"),
        (["--gpus", "8", "--tp", "3"], "TP 3 does not divide"),
        (["--gpus", "8", "--tp", "2", "--devices", "0,1"], "--tp"),
        (["--gpus", "8"], "--tp"),
        (["--gpus", "8", "--tp", "two"], "integers"),
        (["--gpus", "8", "--tp", "2", "--pool", "fast"], "NAME:TP"),
        (["--gpus", "0", "--tp", "1"], "at least 1"),
    ],
)
def test_impossible_topologies_are_refused_with_the_reason(args: list[str], why: str) -> None:
    r = run_cli("compose", "generate", "--model", "m", *args)
    assert r.returncode == 2 and why in r.stderr, (r.returncode, r.stderr)
    assert r.stdout == ""
