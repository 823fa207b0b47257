"""KV cache per token of a Kimi-K2.5 EAGLE-3 draft: the Llama-layer draft vs the MLA draft.

Arithmetic, not a timing: the drafts' configs are built by the trainer's own config writer
(`build_draft_config`, `--draft-arch llama` and `mla`) from a Kimi-K2.5-shaped DeepSeek-V3 text
config (the public config's shape: hidden 7168, 61 layers, 64 heads, q_lora 1536, kv_lora 512,
qk_nope 128, qk_rope 64, v 128, vocab 163840, YaRN x64), and what each keeps per token and layer
is read off them as vLLM stores it:
- a Llama layer: keys and values, `2 * num_key_value_heads * head_dim`;
- an MLA layer with vLLM's MLA kernels (a GPU): the compressed latent and the shared rotary key,
  `kv_lora_rank + qk_rope_head_dim`;
- an MLA layer without them (`VLLM_MLA_DISABLE=1`, the CPU build): expanded keys and values,
  both `qk_nope_head_dim + qk_rope_head_dim` wide per head (vLLM pads the values to the keys'
  width), `2 * heads * (qk_nope + qk_rope)`.
bf16: 2 bytes a value. The target's own cache (61 MLA layers) is beside them.

    python benchmarks/draft_kv_cache.py [--output benchmarks/results/draft-kv-cache-kimi-k2.5.md]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

__all__ = ["KVRow", "kimi_k25_text_config", "kv_rows", "main", "render"]

BYTES_PER_VALUE = 2  # bf16


def kimi_k25_text_config():
    """A DeepSeek-V3 config of Kimi-K2.5's text-model shape (no weights)."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        hidden_size=7168,
        intermediate_size=18432,
        num_hidden_layers=61,
        num_attention_heads=64,
        num_key_value_heads=64,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        vocab_size=163840,
        max_position_embeddings=262144,
        rope_theta=50000.0,
        rope_scaling={
            "type": "yarn",
            "factor": 64.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    )


@dataclass
class KVRow:
    what: str
    values_per_token: int

    @property
    def bytes_per_token(self) -> int:
        return self.values_per_token * BYTES_PER_VALUE


def kv_rows() -> list[KVRow]:
    """The drafts' and the target's KV values per token, from the configs our trainer writes."""
    from speculators_vllm016.train.jobs.draft_build import build_draft_config

    text = kimi_k25_text_config()
    verifier = SimpleNamespace(
        architectures=["KimiK25ForConditionalGeneration"], model_type="kimi_k25"
    )

    def draft(arch: str):
        return build_draft_config(
            "kimi-k2.5",
            verifier,
            text,
            draft_vocab=32000,
            num_layers=1,
            norm_before_residual=arch == "llama",
            ttt_steps=3,
            aux_layer_ids=[2, 30, 58],
            draft_arch=arch,
        ).transformer_layer_config

    llama, mla = draft("llama"), draft("mla")
    latent = mla.kv_lora_rank + mla.qk_rope_head_dim
    expanded = 2 * mla.num_attention_heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim)
    head_dim = llama.head_dim or llama.hidden_size // llama.num_attention_heads
    return [
        KVRow(
            f"Llama-layer draft (ours: {llama.num_key_value_heads} KV heads x {head_dim})",
            2 * llama.num_key_value_heads * head_dim,
        ),
        KVRow("Llama-layer draft (TorchSpec's: 64 KV heads x 128)", 2 * 64 * 128),
        KVRow("MLA draft, vLLM's MLA kernels (GPU)", latent),
        KVRow("MLA draft, VLLM_MLA_DISABLE=1 (CPU build)", expanded),
        KVRow(f"target, {text.num_hidden_layers} MLA layers", text.num_hidden_layers * latent),
    ]


def render(rows: list[KVRow]) -> str:
    target = rows[-1].values_per_token
    lines = [
        "# KV cache per token, Kimi-K2.5 EAGLE-3 drafts (bf16)",
        "",
        "From the configs `speculators train` writes (`--draft-arch llama` / `mla`) for a "
        "Kimi-K2.5-shaped target; command: `python benchmarks/draft_kv_cache.py`.",
        "",
        "| cache | values / token | bytes / token | vs the target's |",
        "|---|---:|---:|---:|",
    ]
    for row in rows:
        share = f"{100 * row.values_per_token / target:.1f}%"
        lines.append(
            f"| {row.what} | {row.values_per_token:,} | {row.bytes_per_token:,} | {share} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=None, help="also write the table here")
    args = parser.parse_args(argv)
    table = render(kv_rows())
    print(table, end="")
    if args.output is not None:
        args.output.write_text(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
