"""Content scanning for input and output streams (the safety module; see the issue tracker)."""
