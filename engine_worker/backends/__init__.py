"""Engine backends. Each is imported lazily by :func:`create` so nothing else needs vLLM."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine_worker.backends.base import Backend
    from services.config import WorkerSettings


def create(cfg: WorkerSettings) -> Backend:
    """Build the backend named by ``cfg.backend``."""
    if cfg.backend == "sim":
        from engine_worker.backends.sim import SimBackend

        return SimBackend(cfg)
    if cfg.backend == "openai":
        from engine_worker.backends.openai_upstream import OpenAIUpstreamBackend

        return OpenAIUpstreamBackend(cfg)
    if cfg.backend == "vllm":
        from engine_worker.backends.vllm_backend import VLLMBackend

        return VLLMBackend(cfg)
    raise ValueError(f"unknown backend {cfg.backend!r}")
