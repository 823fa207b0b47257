"""benchmarks/draft_kv_cache.py: the KV values per token read off the configs the trainer writes
for a Kimi-K2.5-shaped target (the figures docs/kimi-k2.5.md quotes)."""

from __future__ import annotations

from benchmarks.draft_kv_cache import kv_rows, render


def test_kimi_k25_kv_cache_per_token_of_each_draft():
    values = [row.values_per_token for row in kv_rows()]
    # ours Llama (64 x 112), TorchSpec's Llama (64 x 128), MLA latent, MLA expanded, the target
    assert values == [14336, 16384, 576, 24576, 61 * 576]
    table = render(kv_rows())
    assert "| 576 | 1,152 | 1.6% |" in table and "| 14,336 | 28,672 | 40.8% |" in table
