"""The API dialects of one request: each translates its own request into a chat completion
request and the chat stream's chunks back into its own answer and events, so that every
dialect travels the one chat path (keys, limits, the filter, routing, migration, telemetry).

Both front doors use them: the HTTP bridge (:mod:`gateway`) and the NATS client
(:mod:`tokenbus`).

- ``anthropic``: Anthropic's Messages API (``POST /v1/messages``), a package by the same
  roles: ``anthropic_request`` (the request model, :func:`~dialects.anthropic.parse`, the
  fields), ``anthropic_translation`` (a request onto the chat path), ``anthropic_events``
  (the answer, its streamed events and its errors from the chat chunks) and
  ``anthropic_client`` (the NATS client's stream). Its ``__init__`` re-exports every name
  callers use.
- ``responses``: OpenAI's Responses API (``POST /v1/responses``), a package by role:
  ``request`` (the request model, :func:`~dialects.responses.parse`, the fields and ids),
  ``translation`` (a request onto the chat path), ``events`` (the answer and its streamed
  events from the chat chunks; what is stored of it) and ``client`` (the NATS client's
  stream). Its ``__init__`` re-exports every name callers use.
- ``stream``: what the NATS client's streams of both share (``collect``, ``aclose``).
"""
