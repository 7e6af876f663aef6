"""The tokenbus contract: subjects, headers, messages, codec, frames, errors and the client."""

from bus_schemas import codec, errors, frames, headers, subjects
from bus_schemas.errors import TokenbusError

__all__ = ["TokenbusError", "codec", "errors", "frames", "headers", "subjects"]
