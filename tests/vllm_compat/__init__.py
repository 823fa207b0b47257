"""Checks that vLLM 0.16 accepts the speculator checkpoints this library writes (CPU, no engine)."""
