"""Tiny checkpoints of the architectures the tests run on, besides the package's tiny Llama.

Qwen3, DeepSeek-V3 (MLA + MoE) and Kimi-K2.5 (DeepSeek-V3 inside a multimodal wrapper with a
remote-code media processor), built locally with seeded random weights: no hub access. The shared
pieces (tokenizer, seeding, saving) are the package's, so these checkpoints are made exactly as the
demo's Llama is.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch

from speculators_vllm016.tiny_models import save_checkpoint, seeded_model

__all__ = [
    "THINKING_TEMPLATE",
    "build_taught_tiny_deepseek_v3",
    "build_tiny_deepseek_v3",
    "build_tiny_kimi_k25",
    "build_tiny_qwen3",
    "copy_with_thinking_template",
]

# Llama-3 style with Kimi-K2.5's kind of switch: `thinking=False` closes an empty thinking block
# right after the assistant header, in the generation prompt and in every assistant turn, so the
# target answers after it and the finished conversation renders it again; unset or true: none.
THINKING_TEMPLATE = (
    "{{ bos_token }}"
    "{% set no_thinking = thinking is defined and not thinking %}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{% if message['role'] == 'assistant' and no_thinking %}{{ '<think></think>' }}{% endif %}"
    "{{ message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% if no_thinking %}{{ '<think></think>' }}{% endif %}{% endif %}"
)


def build_tiny_qwen3(
    path: str | Path,
    *,
    hidden_size: int = 256,
    num_hidden_layers: int = 4,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 64,
    intermediate_size: int = 512,
    vocab_size: int = 512,
    max_position_embeddings: int = 1024,
    seed: int = 1,
    tokenizer_style: str | None = "chatml",
    corpus: Iterable[str] | None = None,
) -> Path:
    """A Qwen3 (q/k RMSNorm, explicit head_dim)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=2,
        pad_token_id=0,
        torch_dtype="float32",
    )
    model = seeded_model(Qwen3ForCausalLM, config, seed, init_std=0.05)
    return save_checkpoint(model, Path(path), tokenizer_style, corpus)


def build_tiny_deepseek_v3(
    path: str | Path,
    *,
    hidden_size: int = 256,
    num_hidden_layers: int = 3,
    vocab_size: int = 512,
    max_position_embeddings: int = 1024,
    seed: int = 2,
    tokenizer_style: str | None = "llama3",
    corpus: Iterable[str] | None = None,
) -> Path:
    """A DeepSeek-V3 (the Kimi-K2 architecture): MLA attention, a dense first layer, then MoE."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=512,
        moe_intermediate_size=128,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        q_lora_rank=128,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=32,
        v_head_dim=64,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        rope_theta=10000.0,
        # Real DeepSeek-V3 / Kimi-K2 configs use yarn; factor 1.0 is plain RoPE in both libraries,
        # through vLLM's yarn module. `rope_scaling: None` (vLLM's plain rotary module, which the
        # generator's worker moves off the CPU build's C++ op for MLA) is tested on a copy of this
        # checkpoint in tests/data_generation/test_deepseek_plain_rope.py.
        rope_scaling={
            "type": "yarn",
            "factor": 1.0,
            "original_max_position_embeddings": max_position_embeddings,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        # transformers always routes DeepSeek-V3 with sigmoid scores and the correction bias;
        # vLLM reads both choices from the config and defaults to softmax without them.
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=4,
        pad_token_id=1,
        torch_dtype="float32",
    )
    model = seeded_model(DeepseekV3ForCausalLM, config, seed, init_std=0.05)
    # HF initialises the router's score-correction bias to zeros: give it values so a wrong
    # routing path in any implementation would show.
    with torch.no_grad():
        for layer in model.model.layers[config.first_k_dense_replace :]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.02)
    out = save_checkpoint(model, Path(path), tokenizer_style, corpus)
    return out


def build_taught_tiny_deepseek_v3(
    path: str | Path, *, steps: int = 40, max_position_embeddings: int = 1024
) -> Path:
    """A tiny DeepSeek-V3 that has learnt the demo conversations: a target a draft can learn from.

    A random target's next tokens are noise (a draft trained on it stays at tau ~1.0), so, as the
    demo does for its Llama, the model is trained briefly (`steps` x 8 rows x 64 tokens) on the
    shipped conversations with a tokenizer trained on them. Seven layers: the smallest count whose
    default datagen layers `[2, N // 2, N - 3, N - 1]` are distinct, so the tutorial's commands run
    without `--layer-ids`. The tokenizer keeps one id of the 512 free, for the Kimi-K2.5 wrapper's
    media token. Reused when `path` holds a finished build. `max_position_embeddings` only bounds
    prompt length (the yarn factor is 1.0: plain RoPE, the same weights at any limit).
    """
    from speculators_vllm016.demo import demo_conversations_path, read_conversations
    from speculators_vllm016.demo.target import TargetTraining, train_demo_target
    from speculators_vllm016.tiny_models import build_tokenizer

    out = Path(path)
    initial = out.with_name(f"{out.name}-initial")
    if not (initial / "tokenizer.json").is_file():
        build_tiny_deepseek_v3(
            initial,
            num_hidden_layers=7,
            tokenizer_style=None,
            max_position_embeddings=max_position_embeddings,
        )
        corpus = [
            m["content"]
            for messages in read_conversations(demo_conversations_path())
            for m in messages
        ]
        build_tokenizer(initial, "llama3", corpus, vocab_size=511)
    threads = torch.get_num_threads()
    # One thread: OpenMP's spinning workers make this many times slower on a busy 2-core machine.
    torch.set_num_threads(1)
    try:
        train_demo_target(
            initial,
            out,
            demo_conversations_path(),
            TargetTraining(
                steps=steps,
                row_tokens=64,
                rows_per_step=8,
                lr=3e-3,
                show_progress=False,
            ),
        )
    finally:
        torch.set_num_threads(threads)
    return out


# Kimi-K2.5 loads its media processor as remote code from the checkpoint folder. The text-only
# runs here never process media, so this stand-in only answers the questions vLLM asks at start-up.
_KIMI_MEDIA_PROCESSOR = """
from transformers.image_processing_utils import BaseImageProcessor


class TinyKimiMediaProcessor(BaseImageProcessor):
    model_input_names = ["pixel_values", "grid_thws"]

    def __init__(self, patch_size=14, merge_kernel_size=(2, 2), **kwargs):
        super().__init__(**kwargs)
        self.patch_size = patch_size
        self.merge_kernel_size = list(merge_kernel_size)

    def media_tokens_calculator(self, chunk):
        return 16

    def preprocess(self, chunks, **kwargs):
        raise NotImplementedError("this tiny checkpoint is text-only")
"""


def build_tiny_kimi_k25(path: str | Path, *, language_model: str | Path | None = None) -> Path:
    """A Kimi-K2.5-shaped checkpoint: a DeepSeek-V3 language model inside the multimodal wrapper.

    The language model's weights are those of `build_tiny_deepseek_v3` (built into
    `path/language_model_source` unless `language_model` names such a folder), renamed under
    `language_model.`; the vision tower is left out, which vLLM accepts in text-only mode. The
    same weights loaded as a plain DeepSeek-V3 are therefore the reference for this model.
    """
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    source = (
        Path(language_model)
        if language_model
        else build_tiny_deepseek_v3(out / "language_model_source")
    )
    text_config = json.loads((source / "config.json").read_text())
    weights = load_file(str(source / "model.safetensors"))
    renamed = {f"language_model.{name}": tensor for name, tensor in weights.items()}
    save_file(renamed, str(out / "model.safetensors"), metadata={"format": "pt"})

    tokenizer = AutoTokenizer.from_pretrained(str(source))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|media_pad|>"]})
    media_token_id = tokenizer.convert_tokens_to_ids("<|media_pad|>")
    if media_token_id >= text_config["vocab_size"]:
        raise ValueError("the language model's vocabulary has no room for the media token")
    tokenizer.save_pretrained(str(out))

    config = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        # The real folder's: its own code, which nothing here may need (no such file is written).
        "auto_map": {
            "AutoConfig": "configuration_kimi_k25.KimiK25Config",
            "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
            "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
        },
        "model_type": "kimi_k25",
        "text_config": text_config,
        "vision_config": {
            "model_type": "kimi_k25_vision",
            "patch_size": 14,
            "init_pos_emb_height": 8,
            "init_pos_emb_width": 8,
            "init_pos_emb_time": 4,
            "pos_emb_type": "divided_fixed",
            # vLLM builds the (unused) vision tower even text-only, with its heads split over
            # tensor-parallel ranks: 2 heads let the tiny Kimi-K2.5 run with TP2.
            "num_attention_heads": 2,
            "num_hidden_layers": 1,
            "hidden_size": 64,
            "intermediate_size": 128,
            "merge_kernel_size": [2, 2],
            "video_attn_type": "spatial_temporal",
            "merge_type": "sd2_tpool",
            "mm_projector_type": "patchmerger",
            "mm_hidden_size": text_config["hidden_size"],
        },
        "media_placeholder_token_id": media_token_id,
        "bos_token_id": text_config.get("bos_token_id"),
        "eos_token_id": text_config.get("eos_token_id"),
        "pad_token_id": text_config.get("pad_token_id"),
        "torch_dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    (out / "kimi_media_processor.py").write_text(_KIMI_MEDIA_PROCESSOR.lstrip())
    (out / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "auto_map": {"AutoImageProcessor": "kimi_media_processor.TinyKimiMediaProcessor"},
                "image_processor_type": "TinyKimiMediaProcessor",
                "patch_size": 14,
                "merge_kernel_size": [2, 2],
            },
            indent=2,
        )
    )
    return out


def copy_with_thinking_template(source: str | Path, path: str | Path) -> Path:
    """A copy of the checkpoint folder `source` whose tokenizer renders with `THINKING_TEMPLATE`
    (the same weights: the template is all that changes)."""
    import shutil

    from transformers import AutoTokenizer

    out = Path(path)
    shutil.copytree(source, out)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    tokenizer.chat_template = THINKING_TEMPLATE
    tokenizer.save_pretrained(str(out))
    return out
