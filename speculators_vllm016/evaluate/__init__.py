"""Acceptance evaluation of drafts: speculative decoding and the counters vLLM reports."""
