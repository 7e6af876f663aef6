"""A labelled prompt set (six domains) for the expert router; see make_prompts.py."""
