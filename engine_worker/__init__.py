"""The engine worker actor and its backends (sim, openai, vllm)."""
