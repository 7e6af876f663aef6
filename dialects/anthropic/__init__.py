"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) as a
dialect of one chat request.

A Messages request is checked (:mod:`.anthropic_request`: :func:`parse`,
:class:`MessagesRequest`) and becomes a chat completion request
(:mod:`.anthropic_translation`: :func:`translate`), so routing, keys, limits, the content
filter, migration and telemetry are the chat path's. The answer goes the other way
(:mod:`.anthropic_events`: :class:`MessageBuilder`): the chat stream's chunks become content
blocks and, when streamed, Anthropic's events; errors take Anthropic's shape
(:func:`error_body`). :mod:`.anthropic_client` is the NATS client's stream of events
(:class:`MessageStream`, on :class:`dialects.stream.ClientStream`, as the Responses one is).

Both the HTTP bridge (:mod:`gateway.anthropic_api`) and the NATS client
(:meth:`tokenbus.Client.messages`) use it. They import from the package, never from its
modules (``from dialects import anthropic as M``, then ``M.parse``): each name they use is
re-exported here.
"""

from __future__ import annotations

from dialects.anthropic.anthropic_client import MessageStream
from dialects.anthropic.anthropic_events import (
    ANTHROPIC_TIERS,
    MessageBuilder,
    error_body,
    error_type,
    new_message_id,
    sse,
    stop_reason,
    usage_of,
)
from dialects.anthropic.anthropic_request import (
    CHAT_ONLY,
    IGNORED,
    OWNED,
    REFUSED,
    MessagesRequest,
    Strict,
    parse,
)
from dialects.anthropic.anthropic_translation import (
    EFFORTS,
    count_request,
    to_messages,
    translate,
)

__all__ = [
    "ANTHROPIC_TIERS",
    "CHAT_ONLY",
    "EFFORTS",
    "IGNORED",
    "OWNED",
    "REFUSED",
    "MessageBuilder",
    "MessageStream",
    "MessagesRequest",
    "Strict",
    "count_request",
    "error_body",
    "error_type",
    "new_message_id",
    "parse",
    "sse",
    "stop_reason",
    "to_messages",
    "translate",
    "usage_of",
]
