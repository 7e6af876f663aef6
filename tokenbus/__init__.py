"""tokenbus: LLM serving on NATS. ``from tokenbus import Client`` for the NATS-native client.

The client is imported on first use (PEP 562), not with the package: ``tokenbus --help`` and
every sub-command's parser load without nats-py's client, aiohttp and the dialects."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bus_schemas.errors import TokenbusError
    from tokenbus.client import Chunk, Client, Completion, EmbeddingResult, Stream, Usage

__all__ = ["Chunk", "Client", "Completion", "EmbeddingResult", "Stream", "TokenbusError", "Usage"]
__version__ = "0.1.0"

_WHERE = dict.fromkeys(__all__, "tokenbus.client") | {"TokenbusError": "bus_schemas.errors"}


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'tokenbus' has no attribute {name!r}")
    value = getattr(importlib.import_module(where), name)
    globals()[name] = value
    return value
