"""API keys, principals and the key store (the safety module; see the issue tracker)."""
