"""The gateway: the front doors of the bus.

Ingress (validation and the envelope for NATS clients), the HTTP bridge (the OpenAI API
over HTTP and SSE, which may run the safety stages and dispatch in-process), its HTTP app
and admin routes. It imports the contract, the kit and the actors, never the other way.
"""
