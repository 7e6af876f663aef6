"""The service kit: what every actor and gateway service shares.

Settings (:mod:`.config`), the service runtime (connect, subscribe in queue groups, drain,
signals: :mod:`.runtime`), ``$SRV`` discovery, the locked-bus configuration
(:mod:`.natsconf`), logging set-up, and the caller's half of the stream protocol
(:mod:`.caller`: what the HTTP bridge and the public NATS client both use). It imports only
the contract (:mod:`bus_schemas`).
"""
