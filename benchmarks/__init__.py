"""Benchmark suite: hidden-state extraction throughput against vLLM's own prefill ceiling.

Entry point: `python benchmarks/extraction.py --preset cpu-small` (see benchmarks/README.md).
"""
