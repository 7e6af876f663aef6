"""The OpenAI Responses API (``POST /v1/responses``) translated onto the chat path.

A Responses request is checked (:mod:`.request`: :func:`parse`, :class:`ResponsesRequest`)
and becomes a chat completion request (:mod:`.translate`: :func:`translate` gives a
:class:`Turn`), so routing, keys, limits, the content filter, migration and telemetry are
the chat path's, with no second path to keep equal to it. The answer goes the other way
(:mod:`.events`: :class:`ResponseBuilder`): the chat stream's chunks become output items
and, when streamed, the specification's events; :func:`record` is what is stored of it.
:mod:`.client` is the NATS client's stream of events (:class:`ResponseStream`).

The HTTP bridge (:mod:`gateway.responses_api`) and the NATS client
(:meth:`tokenbus.Client.responses`) share this package; every name they use is here, so
``from dialects import responses as R`` then ``R.parse`` (or ``from dialects.responses
import parse``) reads the same wherever a name's module is.
"""

from __future__ import annotations

from dialects.responses.client import ResponseStream, StoredResponses
from dialects.responses.events import ResponseBuilder, record, usage_of
from dialects.responses.request import (
    BUILT_IN_TOOLS,
    CHAT_ONLY,
    ENCRYPTED_REASONING_INCLUDE,
    LOGPROBS_INCLUDE,
    OWNED,
    REFUSED,
    RESPONSE_ID,
    WEB_SEARCH_TOOLS,
    ResponsesRequest,
    Strict01,
    new_response_id,
    parse,
)
from dialects.responses.translation import ROLES, ToolNames, Turn, flat_name, to_messages, translate

__all__ = [
    "BUILT_IN_TOOLS",
    "CHAT_ONLY",
    "ENCRYPTED_REASONING_INCLUDE",
    "LOGPROBS_INCLUDE",
    "OWNED",
    "REFUSED",
    "RESPONSE_ID",
    "ROLES",
    "WEB_SEARCH_TOOLS",
    "ResponseBuilder",
    "ResponseStream",
    "ResponsesRequest",
    "StoredResponses",
    "Strict01",
    "ToolNames",
    "Turn",
    "flat_name",
    "new_response_id",
    "parse",
    "record",
    "to_messages",
    "translate",
    "usage_of",
]
