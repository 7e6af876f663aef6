"""Replica registry from heartbeats, routing policies, dispatch with failover."""
