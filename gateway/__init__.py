"""The gateway: the front doors of the bus.

Ingress (``ingress``: validation and the envelope for NATS clients, and the jobs' state it
serves them), the HTTP bridge (``bridge``: the OpenAI API over HTTP and SSE, which may run
the safety stages in-process, ``stages``) and its HTTP app. It imports the contract, the
kit, the actors, the dialects and the jobs, never the other way.

The HTTP app: ``asgi`` is the HTTP server, the route table and the request and response
helpers; ``sse`` what a stream is to a handler and the server-sent event writers;
``validation`` OpenAI-shaped bodies into validated requests and envelopes; ``openapi`` the
OpenAPI document. The handlers mounted on it: ``openai_api`` (chat, completions,
embeddings, models), ``responses_api`` (OpenAI's Responses API), ``anthropic_api``
(Anthropic's Messages API), ``files_api`` and ``batches_api`` (their stores and runners are
:mod:`jobs`), and the admin handlers ``admin_keys`` and ``admin_routing``.
"""
