"""The tokenbus contract: subjects, headers, messages, codec, frames and errors. The
client that speaks it is :mod:`tokenbus.client`."""

from bus_schemas import codec, errors, frames, headers, subjects
from bus_schemas.errors import TokenbusError

__all__ = ["TokenbusError", "codec", "errors", "frames", "headers", "subjects"]
