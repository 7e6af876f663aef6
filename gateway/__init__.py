"""The gateway: the front doors of the bus.

Ingress (validation and the envelope for NATS clients), the HTTP bridge (the OpenAI API
over HTTP and SSE, which may run the safety stages and dispatch in-process), its HTTP app
and admin routes. It imports the contract, the kit and the actors, never the other way.

The HTTP app: ``asgi`` is the route table, the response helpers and the uvicorn server;
``openai_api`` the OpenAI handlers mounted on it; ``admin_keys`` and ``admin_routing`` the
admin handlers the bridge adds.
"""
