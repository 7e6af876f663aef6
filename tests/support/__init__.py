"""The suite's helpers, a module to a role (the fixtures that use them: tests/conftest.py)."""
