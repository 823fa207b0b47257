"""The inputs every path sees: the model to load and the token batches to push through it."""

from __future__ import annotations

import json
import random
from pathlib import Path

from benchmarks.presets import BenchSettings, TinyModelSpec, Workload

__all__ = ["make_sequences", "model_vocab_size", "prepare_model"]


def make_sequences(workload: Workload, vocab_size: int) -> list[list[int]]:
    """Random token ids of uniformly mixed lengths; the seed makes them identical across runs.

    Ids avoid nothing special: prefill cost does not depend on which ids they are.
    """
    rng = random.Random(workload.seed)
    sequences = []
    for _ in range(workload.num_sequences):
        length = rng.randint(workload.min_length, workload.max_length)
        sequences.append([rng.randrange(vocab_size) for _ in range(length)])
    return sequences


def _tiny_model_dir(root: Path, spec: TinyModelSpec) -> Path:
    tag = (
        f"llama-h{spec.hidden_size}-l{spec.num_hidden_layers}-a{spec.num_attention_heads}"
        f"-kv{spec.num_key_value_heads}-i{spec.intermediate_size}-v{spec.vocab_size}"
    )
    return root / tag


def prepare_model(settings: BenchSettings, cache_root: Path) -> str:
    """The checkpoint to benchmark: the user's, or the preset's tiny Llama (built once, reused)."""
    if settings.model is not None:
        return settings.model
    spec = settings.preset.tiny_model
    assert spec is not None, "build_settings guarantees a model or a tiny-model spec"
    path = _tiny_model_dir(cache_root, spec)
    if not (path / "config.json").exists() or not (path / "model.safetensors").exists():
        from speculators_vllm016.tiny_models import build_tiny_llama

        build_tiny_llama(
            path,
            hidden_size=spec.hidden_size,
            num_hidden_layers=spec.num_hidden_layers,
            num_attention_heads=spec.num_attention_heads,
            num_key_value_heads=spec.num_key_value_heads,
            intermediate_size=spec.intermediate_size,
            vocab_size=spec.vocab_size,
            max_position_embeddings=spec.max_position_embeddings,
        )
    return str(path)


def model_vocab_size(model: str) -> int:
    """The vocabulary the engine accepts ids from (the text model's, for multimodal wrappers)."""
    local = Path(model) / "config.json"
    if local.exists():
        config = json.loads(local.read_text())
    else:
        from transformers import PretrainedConfig

        config, _ = PretrainedConfig.get_config_dict(model)
    from speculators_vllm016.utils.text_config import text_config_of

    text = text_config_of(config)
    return int(text.get("vocab_size") or config["vocab_size"])
