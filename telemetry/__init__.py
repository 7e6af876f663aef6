"""Telemetry: the per-request records engines publish (``records``), the service that
aggregates them into Prometheus metrics and stores them (``service``, ``metrics``,
``store``)."""
