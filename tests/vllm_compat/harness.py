"""Feed our speculator checkpoints to vLLM 0.16's own config parser and Eagle-3 draft model.

Nothing here starts an engine. The CPU model runner of vLLM refuses speculative decoding, but
everything before it works on the CPU build:

* `EngineArgs(model=<verifier>, speculative_config={...}).create_engine_config()` builds the full
  `VllmConfig`, including `SpeculativeConfig.draft_model_config`, whose `hf_config` is vLLM's
  `SpeculatorsConfig` parsed from our `config.json` and whose architecture resolves to
  `Eagle3LlamaForCausalLM`.
* The draft model is then built the way vLLM's `DefaultModelLoader.load_model` builds it
  (`initialize_model(vllm_config, model_config=draft_model_config)` under the draft dtype and the
  CPU device), after a one-process gloo "distributed" world has been set up, and its own
  `load_weights` is called with the tensors of `model.safetensors`.

What was loaded is measured from the outside, so it does not depend on `load_weights` returning
anything (vLLM's `Eagle3LlamaForCausalLM.load_weights` returns None): every parameter is first
filled with a sentinel (NaN, or a huge negative integer), and a parameter counts as loaded only
when no sentinel is left in it, i.e. every shard of a fused `qkv_proj` / `gate_up_proj` was
written. Each parameter's `weight_loader` is also wrapped to record which checkpoint tensor
reached it, which reveals checkpoint tensors that vLLM silently drops.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from tests.training_fixtures import free_port

__all__ = [
    "Eagle3LoadResult",
    "build_vllm_config",
    "ensure_vllm_distributed",
    "iter_checkpoint_tensors",
    "load_eagle3_into_vllm",
    "parse_with_vllm",
    "shutdown_vllm_distributed",
    "write_reference_eagle3_checkpoint",
]

_INT_SENTINEL = -(2**62)


# --------------------------------------------------------------------------------------------
# config parsing


def _read_config(folder: str | Path) -> dict[str, Any]:
    return json.loads((Path(folder) / "config.json").read_text())


def parse_with_vllm(folder: str | Path) -> dict[str, Any]:
    """What vLLM 0.16 derives from a speculators-format `config.json`.

    Returns `method` and `num_speculative_tokens` (from
    `SpeculatorsConfig.extract_vllm_speculative_config`), `hf_config` (the draft's Hugging Face
    config as a dict, from `SpeculatorsConfig.from_pretrained`) and a few fields of it that the
    Eagle-3 draft model reads, lifted to the top level for convenience.
    """
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    folder = str(folder)
    hf_config = SpeculatorsConfig.from_pretrained(folder)
    spec = SpeculatorsConfig.extract_vllm_speculative_config(_read_config(folder))
    hf_dict = hf_config.to_dict()
    return {
        "method": spec["method"],
        "num_speculative_tokens": spec["num_speculative_tokens"],
        "speculative_config": spec,
        "hf_config": hf_dict,
        "architectures": hf_dict.get("architectures"),
        "draft_vocab_size": hf_dict.get("draft_vocab_size"),
        "vocab_size": hf_dict.get("vocab_size"),
        "hidden_size": hf_dict.get("hidden_size"),
        "target_hidden_size": hf_dict.get("target_hidden_size"),
        "norm_before_residual": hf_dict.get("norm_before_residual"),
        "eagle_aux_hidden_state_layer_ids": hf_dict.get("eagle_aux_hidden_state_layer_ids"),
    }


def build_vllm_config(
    draft_folder: str | Path,
    verifier_folder: str | Path,
    *,
    num_speculative_tokens: int | None = None,
    dtype: str = "float32",
    max_model_len: int = 256,
):
    """A `VllmConfig` for `verifier_folder` with `draft_folder` as its Eagle-3 speculator.

    `num_speculative_tokens` defaults to what vLLM reads from the draft's config. This goes through
    `EngineArgs.create_engine_config()`, the same path `vllm serve --speculative-config` takes, and
    works on the CPU build (only the CPU model runner rejects speculative decoding).
    """
    from vllm.engine.arg_utils import EngineArgs

    parsed = parse_with_vllm(draft_folder)
    if num_speculative_tokens is None:
        num_speculative_tokens = parsed["num_speculative_tokens"]
    engine_args = EngineArgs(
        model=str(verifier_folder),
        speculative_config={
            "model": str(draft_folder),
            "method": parsed["method"],
            "num_speculative_tokens": num_speculative_tokens,
        },
        dtype=dtype,
        enforce_eager=True,
        max_model_len=max_model_len,
        seed=0,
    )
    return engine_args.create_engine_config()


# --------------------------------------------------------------------------------------------
# one-process distributed state


def ensure_vllm_distributed() -> None:
    """Initialise vLLM's world / TP / PP groups for a single gloo process; a no-op when done.

    Call it inside `set_current_vllm_config(...)` (vLLM reads the parallel config from there).
    """
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        return
    if not torch.distributed.is_initialized() or ps._WORLD is None:
        ps.init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
            local_rank=0,
            backend="gloo",
        )
    ps.ensure_model_parallel_initialized(1, 1)


def shutdown_vllm_distributed() -> None:
    """Undo `ensure_vllm_distributed` (for a fixture's teardown); safe to call when not set up."""
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.destroy_distributed_environment()


# --------------------------------------------------------------------------------------------
# weights


def iter_checkpoint_tensors(folder: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of `folder/model.safetensors` (or its shards), file order."""
    from safetensors import safe_open

    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    for file_name in files:
        with safe_open(str(folder / file_name), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, handle.get_tensor(name)


class Eagle3LoadResult(tuple):
    """`(expected, loaded)`, plus diagnostics as attributes.

    * `expected`: names of the vLLM model's parameters (vLLM's own criterion: its
      `DefaultModelLoader` requires every `named_parameters()` name to be loaded).
    * `loaded`: those whose every element was written by `load_weights`.
    * `missing`: `expected - loaded`.
    * `unexpected`: checkpoint tensor name -> error vLLM raised for it (KeyError for a name
      `LlamaModel.load_weights` has no parameter for, ValueError from `AutoWeightsLoader`,
      AssertionError for a shape mismatch).
    * `routed`: checkpoint tensor name -> vLLM parameter names it was written into.
    * `ignored`: checkpoint tensors vLLM accepted without writing them anywhere (vLLM drops `t2d`
      on purpose; anything else here is a silently lost weight).
    * `model`: the vLLM `Eagle3LlamaForCausalLM`, `vllm_config`: the config it was built with.
    """

    expected: set[str]
    loaded: set[str]

    def __new__(cls, expected: set[str], loaded: set[str], **extra: Any):
        self = super().__new__(cls, (expected, loaded))
        self.expected = expected
        self.loaded = loaded
        for key, value in extra.items():
            setattr(self, key, value)
        return self

    @property
    def missing(self) -> set[str]:
        return self.expected - self.loaded


def _fill_sentinel(tensor: torch.Tensor) -> None:
    with torch.no_grad():
        if tensor.is_floating_point():
            tensor.fill_(float("nan"))
        elif tensor.dtype != torch.bool:
            tensor.fill_(_INT_SENTINEL)


def _fully_written(tensor: torch.Tensor) -> bool:
    if tensor.is_floating_point():
        return not bool(torch.isnan(tensor).any())
    if tensor.dtype == torch.bool:
        return True  # no sentinel possible; counted by the weight_loader trace instead
    return not bool((tensor == _INT_SENTINEL).any())


def _instrument(model: torch.nn.Module, trace: dict[int, set[str]]) -> None:
    """Wrap each parameter's weight_loader to record `id(tensor handed in) -> parameter name`."""
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    for name, param in model.named_parameters():
        inner = getattr(param, "weight_loader", default_weight_loader)

        def recording_loader(p, loaded_weight, *args, _inner=inner, _name=name, **kwargs):
            trace.setdefault(id(loaded_weight), set()).add(_name)
            return _inner(p, loaded_weight, *args, **kwargs)

        try:
            param.weight_loader = recording_loader
        except AttributeError:  # a parameter class whose weight_loader is read-only
            pass


def _run_load(model, weights: list[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """model.load_weights(weights); on failure, retry tensor by tensor to name every offender."""
    errors = (KeyError, ValueError, AssertionError, RuntimeError, IndexError)
    try:
        model.load_weights(iter(weights))
        return {}
    except errors:
        pass
    unexpected: dict[str, str] = {}
    for name, tensor in weights:
        try:
            model.load_weights(iter([(name, tensor)]))
        except errors as exc:
            unexpected[name] = f"{type(exc).__name__}: {exc}"
    return unexpected


def load_eagle3_into_vllm(folder: str | Path, verifier_folder: str | Path) -> Eagle3LoadResult:
    """Build vLLM 0.16's Eagle-3 draft model for `folder` on the CPU and load its weights.

    Returns `(expected, loaded)` (see `Eagle3LoadResult`, which also carries `unexpected`,
    `ignored`, `routed`, `model`). Raises if vLLM resolves the draft to another model class.
    """
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
    from vllm.utils.torch_utils import set_default_torch_dtype

    vllm_config = build_vllm_config(folder, verifier_folder)
    draft_model_config = vllm_config.speculative_config.draft_model_config

    with set_current_vllm_config(vllm_config):
        ensure_vllm_distributed()
        with set_default_torch_dtype(draft_model_config.dtype), torch.device("cpu"):
            model = initialize_model(vllm_config=vllm_config, model_config=draft_model_config)
        if not isinstance(model, Eagle3LlamaForCausalLM):
            raise TypeError(f"vLLM built {type(model).__name__}, not Eagle3LlamaForCausalLM")

        # vLLM's DefaultModelLoader demands exactly the parameters (buffers such as the attention
        # layers' _k_scale/_v_scale keep their defaults); it cannot check an Eagle-3 draft itself
        # because Eagle3LlamaForCausalLM.load_weights returns None, hence this harness.
        tensors = dict(model.named_parameters())
        expected = set(tensors)
        for tensor in tensors.values():
            _fill_sentinel(tensor.data)

        trace: dict[int, set[str]] = {}
        _instrument(model, trace)
        weights = list(iter_checkpoint_tensors(folder))
        with torch.no_grad():
            unexpected = _run_load(model, weights)

    loaded = {name for name, tensor in tensors.items() if _fully_written(tensor.data)}
    routed = {name: trace.get(id(tensor), set()) for name, tensor in weights}
    ignored = {name for name, targets in routed.items() if not targets and name not in unexpected}
    return Eagle3LoadResult(
        expected,
        loaded,
        unexpected=unexpected,
        routed=routed,
        ignored=ignored,
        checkpoint_names={name for name, _ in weights},
        model=model,
        vllm_config=vllm_config,
    )


# --------------------------------------------------------------------------------------------
# the checkpoint layout our library writes, made by hand


def reference_eagle3_tensor_shapes(
    *,
    hidden_size: int = 256,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 64,
    intermediate_size: int = 512,
    vocab_size: int = 512,
    draft_vocab_size: int = 128,
    target_hidden_size: int | None = None,
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every tensor in our planned Eagle-3 `model.safetensors`."""
    h = hidden_size
    q_out = num_attention_heads * head_dim
    kv_out = num_key_value_heads * head_dim
    f32 = torch.float32
    return {
        "fc.weight": ((h, 3 * (target_hidden_size or h)), f32),
        "layers.0.input_layernorm.weight": ((h,), f32),
        "layers.0.hidden_norm.weight": ((h,), f32),
        "layers.0.self_attn.q_proj.weight": ((q_out, 2 * h), f32),
        "layers.0.self_attn.k_proj.weight": ((kv_out, 2 * h), f32),
        "layers.0.self_attn.v_proj.weight": ((kv_out, 2 * h), f32),
        "layers.0.self_attn.o_proj.weight": ((h, q_out), f32),
        "layers.0.post_attention_layernorm.weight": ((h,), f32),
        "layers.0.mlp.gate_proj.weight": ((intermediate_size, h), f32),
        "layers.0.mlp.up_proj.weight": ((intermediate_size, h), f32),
        "layers.0.mlp.down_proj.weight": ((h, intermediate_size), f32),
        "norm.weight": ((h,), f32),
        "lm_head.weight": ((draft_vocab_size, h), f32),
        "embed_tokens.weight": ((vocab_size, h), f32),
        "d2t": ((draft_vocab_size,), torch.int64),
        "t2d": ((vocab_size,), torch.bool),
    }


def write_reference_eagle3_checkpoint(
    folder: str | Path,
    verifier_folder: str | Path,
    *,
    speculative_tokens: int = 3,
    aux_layer_ids: tuple[int, ...] | None = (1, 2, 3),
    seed: int = 0,
) -> Path:
    """Lay out, by hand, the Eagle-3 checkpoint our library is planned to write.

    Hidden 256, 4 heads / 2 KV heads of 64, MLP 512, one layer, vocab 512, draft vocab 128, with a
    valid d2t/t2d pair (every 4th target id is in the draft vocabulary).
    """
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    layer_config = LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=512,
        num_hidden_layers=1,
        vocab_size=512,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
    ).to_diff_dict()
    layer_config["model_type"] = "llama"
    config: dict[str, Any] = {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "speculators_version": "0.4.0",
        "transformer_layer_config": layer_config,
        "draft_vocab_size": 128,
        "norm_before_residual": False,
        "target_hidden_size": None,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": speculative_tokens,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": str(verifier_folder),
                "architectures": ["LlamaForCausalLM"],
            },
        },
    }
    if aux_layer_ids is not None:
        config["eagle_aux_hidden_state_layer_ids"] = list(aux_layer_ids)
    (folder / "config.json").write_text(json.dumps(config, indent=2))

    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, (shape, dtype) in reference_eagle3_tensor_shapes().items():
        if dtype.is_floating_point:
            tensors[name] = torch.randn(shape, generator=generator, dtype=dtype) * 0.02
    kept = torch.arange(0, 512, 4, dtype=torch.long)  # 128 target ids
    tensors["d2t"] = kept - torch.arange(128, dtype=torch.long)
    t2d = torch.zeros(512, dtype=torch.bool)
    t2d[kept] = True
    tensors["t2d"] = t2d
    save_file(tensors, str(folder / "model.safetensors"))
    return folder
