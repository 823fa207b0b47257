"""The tiny Llama built locally: the demo's default target, and the helpers to build such models.

No hub access: a checkpoint is made from a transformers config with seeded random weights and saved
as `config.json` + `model.safetensors`, with a small byte-level BPE tokenizer that carries a real
chat template. Shapes respect what vLLM's CPU build accepts (head_dim 64). The test suite's other
architectures (Qwen3, DeepSeek-V3, Kimi-K2.5) are built by `tests/tiny_models.py` with these helpers.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from speculators_vllm016.utils.errors import InvalidInputError

__all__ = [
    "CHATML_TEMPLATE",
    "LLAMA3_TEMPLATE",
    "build_tiny_llama",
    "build_tokenizer",
    "save_checkpoint",
    "seeded_model",
]

# Llama-3 style: header tokens around the role, <|eot_id|> closes each turn.
LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{{ message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

# ChatML (Qwen): <|im_start|>role\n ... <|im_end|>\n.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{{ message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_SPECIAL_TOKENS = {
    "llama3": [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
    ],
    "chatml": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
}

_DEFAULT_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Speculative decoding drafts several tokens with "
    "a small model and lets the large model verify them in one pass. Hidden states of the target "
    "model teach the draft what comes next. user assistant system: What is the capital of France? "
    "Paris is the capital of France. Write a short poem about the sea. Numbers 0 1 2 3 4 5 6 7 8 9."
)


def build_tokenizer(
    path: str | Path,
    style: str = "llama3",
    corpus: Iterable[str] | None = None,
    vocab_size: int = 512,
):
    """Train a byte-level BPE tokenizer and save it with a chat template; returns it.

    `style` is "llama3" or "chatml" and decides the special tokens and the chat template.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if style not in _SPECIAL_TOKENS:
        raise InvalidInputError(
            f"unknown tokenizer style {style!r}; use one of {sorted(_SPECIAL_TOKENS)}"
        )
    specials = _SPECIAL_TOKENS[style]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = list(corpus) if corpus is not None else [_DEFAULT_CORPUS]
    backend.train_from_iterator(texts, trainer=trainer)
    if style == "llama3":
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=backend,
            bos_token="<|begin_of_text|>",
            eos_token="<|eot_id|>",
            pad_token="<|end_of_text|>",
            chat_template=LLAMA3_TEMPLATE,
        )
    else:
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=backend,
            eos_token="<|im_end|>",
            pad_token="<|endoftext|>",
            chat_template=CHATML_TEMPLATE,
        )
    tokenizer.save_pretrained(str(path))
    return tokenizer


def save_checkpoint(
    model, path: Path, tokenizer_style: str | None, corpus: Iterable[str] | None
) -> Path:
    """Save the model as safetensors, with a tokenizer of `tokenizer_style` (None: none)."""
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    if tokenizer_style is not None:
        build_tokenizer(path, tokenizer_style, corpus, vocab_size=model.config.vocab_size)
    return path


def seeded_model(model_class, config, seed: int, init_std: float):
    """`model_class(config)` with weights drawn from `seed` (std `init_std`), fp32, eval mode."""
    torch.manual_seed(seed)
    config.initializer_range = init_std
    model = model_class(config)
    return model.to(torch.float32).eval()


def build_tiny_llama(
    path: str | Path,
    *,
    hidden_size: int = 256,
    num_hidden_layers: int = 4,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 512,
    vocab_size: int = 512,
    max_position_embeddings: int = 1024,
    seed: int = 0,
    tokenizer_style: str | None = "llama3",
    corpus: Iterable[str] | None = None,
) -> Path:
    """A Llama with head_dim = hidden_size / num_attention_heads (64 by default)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=4,
        pad_token_id=1,
        torch_dtype="float32",
    )
    model = seeded_model(LlamaForCausalLM, config, seed, init_std=0.05)
    return save_checkpoint(model, Path(path), tokenizer_style, corpus)
