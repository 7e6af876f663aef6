"""The services and the kit they share: :mod:`services.kit` (the runtime every actor
uses) and :mod:`services.gateway` (ingress and the HTTP bridge)."""
