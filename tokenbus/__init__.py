"""tokenbus: LLM serving on NATS. ``from tokenbus import Client`` for the NATS-native client."""

from bus_schemas.errors import TokenbusError
from tokenbus.client import Chunk, Client, Completion, EmbeddingResult, Stream, Usage

__all__ = ["Chunk", "Client", "Completion", "EmbeddingResult", "Stream", "TokenbusError", "Usage"]
__version__ = "0.1.0"
