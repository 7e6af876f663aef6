"""``tokenbus.client``: the NATS-native client (defined in :mod:`bus_schemas.client`)."""

from bus_schemas.client import Chunk, Client, Completion, Stream, Usage

__all__ = ["Chunk", "Client", "Completion", "Stream", "Usage"]
