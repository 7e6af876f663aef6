"""Structured logging, metrics and (later) per-request records."""
