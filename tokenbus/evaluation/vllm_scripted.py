"""``tokenbus bench --spawn --engine vllm-scripted``: the shape users deploy, without a GPU.

Every path runs vLLM 0.33's own front end (its serve parser, ``AsyncLLM``, renderer, chat
template, output processor and OpenAI serving classes) on the scripted engine core
(:mod:`engine_worker.backends.scripted_core`: the GPU step on the sim's clock) and the tiny
checkpoint it builds:

* ``direct``: ``vllm serve`` itself, the core put in by tokenbus' vLLM general plugin
  (``TOKENBUS_VLLM_SCRIPTED_CORE``);
* a peer such as ``vllm-router`` in front of that ``vllm serve`` (``--peer``);
* ``tokenbus``: the bridge, the bus and ``--backend vllm`` workers on the same core settings.

The bench must run in an interpreter that can import vLLM (``make test-vllm`` builds
``.venv/vllm``); its ``vllm`` command is taken from beside that interpreter, else from PATH.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The checkpoint's position limit (its config's max_position_embeddings).
MAX_MODEL_LEN = 2048
# vLLM picks its CPU platform where the CUDA wheel finds no GPU.
PLATFORM_ENV = {"VLLM_TARGET_DEVICE": "cpu"}


@dataclass(frozen=True, slots=True)
class VLLMScripted:
    """How to start ``vllm serve`` and tokenbus' vllm workers on one scripted core."""

    checkpoint: Path
    core: dict[str, Any]
    direct_argv: list[str]
    direct_env: dict[str, str]
    worker_args: list[str]
    worker_env: dict[str, str]


def vllm_command() -> str:
    """The ``vllm`` command of this interpreter's environment (or PATH); ValueError if none."""
    if importlib.util.find_spec("vllm") is None:
        raise ValueError(
            "--engine vllm-scripted needs vLLM importable by this interpreter: run "
            "`make test-vllm` once, then .venv/vllm/bin/tokenbus bench ..."
        )
    beside = Path(sys.executable).with_name("vllm")
    found = str(beside) if beside.exists() else shutil.which("vllm")
    if not found:
        raise ValueError("--engine vllm-scripted: no `vllm` command beside python or on PATH")
    return found


def core_settings(a: Any) -> dict[str, Any]:
    """The scripted core's clock from the bench's sim options (the same names and meaning)."""
    return {
        "prefill_ms": a.sim_prefill_ms,
        "decode_ms": a.sim_decode_ms,
        "decode_ms_per_seq": a.sim_decode_ms_per_seq,
        "max_running": a.sim_max_running,
    }


def prepare(a: Any, tmp: Path, port: int) -> VLLMScripted:
    """Build the checkpoint under ``tmp`` and the command lines of both shapes."""
    from engine_worker.backends import scripted_core as sc

    vllm = vllm_command()
    ckpt = sc.build_checkpoint(tmp / "checkpoint")
    core = core_settings(a)
    sc.ScriptedCoreSettings.model_validate(core)  # a bad value fails here, not in a child
    # Identical vLLM options on both paths. max_num_seqs: vLLM's scheduler admits no more
    # than this many at once; the scripted core's own batch bound is max_running.
    options: dict[str, Any] = {
        "max_model_len": MAX_MODEL_LEN,
        "dtype": "bfloat16",
        "max_num_seqs": a.sim_max_running,
        # What a scenario needs on (the adapters bench: enable_lora).
        **(getattr(a, "engine_options", None) or {}),
    }
    argv = [vllm, "serve", str(ckpt), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--served-model-name", a.model]
    for name, value in options.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    # An access-log line per request is not what a loaded deployment runs with.
    argv.append("--disable-uvicorn-access-log")
    direct_env = {**PLATFORM_ENV, sc.ENV: json.dumps(core)}
    worker_args = ["--backend", "vllm", "--model", a.model]
    worker_args += ["--max-concurrency", str(a.sim_max_running)]
    worker_env = {
        **PLATFORM_ENV,
        "TOKENBUS_WORKER__VLLM__ENGINE_ARGS": json.dumps({"model": str(ckpt), **options}),
        "TOKENBUS_WORKER__VLLM__SCRIPTED_CORE": json.dumps(core),
    }
    return VLLMScripted(ckpt, core, argv, direct_env, worker_args, worker_env)
