"""The services' kit: what every actor and the gateway share to run as a service on NATS.

Settings (:mod:`.config`), the service runtime (connect, subscribe in queue groups, drain,
signals: :mod:`.runtime`), ``$SRV`` discovery, the locked-bus configuration
(:mod:`.natsconf`), logging set-up, and the caller's half of the stream protocol
(:mod:`.caller`: what the HTTP bridge and the public NATS client both use). It imports only
the contract (:mod:`bus_schemas`); the services themselves are the actors' folders and
:mod:`gateway`.
"""
