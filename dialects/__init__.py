"""The API dialects of one request: each translates its own request into a chat completion
request and the chat stream's chunks back into its own answer and events, so that every
dialect travels the one chat path (keys, limits, the filter, routing, migration, telemetry).

Both front doors use them: the HTTP bridge (:mod:`gateway`) and the NATS client
(:mod:`tokenbus`). ``messages``: Anthropic's Messages API (``POST /v1/messages``);
``responses``: OpenAI's Responses API (``POST /v1/responses``).
"""
