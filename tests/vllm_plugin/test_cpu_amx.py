"""The plugin keeps vLLM's CPU wheel off the AMX kernels it was built without (vllm_plugin/cpu_amx)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from speculators_vllm016.vllm_plugin import cpu_amx

# What a fresh vLLM process sees after the plugin ran: torch's AMX answer, the attention ISA vLLM
# picks for bf16, and whether the kernels accept that ISA.
_PROBE = """
import json, torch
amx_before = torch._C._cpu._is_amx_tile_supported()
from speculators_vllm016.vllm_plugin import register
register()
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
from vllm import _custom_ops as ops
isa = _get_attn_isa(torch.bfloat16, 32, 64)
ops.cpu_attn_get_scheduler_metadata(
    num_reqs=1, num_heads=1, num_kv_heads=1, head_dim=64,
    seq_lens=torch.tensor([4], dtype=torch.int32), dtype=torch.bfloat16,
    query_start_loc=torch.tensor([0, 4], dtype=torch.int32), causal=True,
    sliding_window_size=-1, isa=isa, enable_kv_split=True,
)
print(json.dumps({"amx_before": amx_before, "isa": isa}))
"""


def test_bf16_attention_gets_an_isa_the_installed_kernels_run():
    """On an AMX processor vLLM would ask the CPU wheel for its (absent) AMX attention; after the
    plugin it asks for one the kernels run. On other processors nothing changes."""
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["isa"] == "vec"  # block size 32: vLLM's vector kernel, as without AMX


def test_the_cpu_wheel_refuses_amx_attention():
    """The fact the guard rests on, for the wheel this project installs without a GPU."""
    assert cpu_amx.kernels_run_amx() is False


def test_any_other_kernel_failure_is_raised(monkeypatch):
    from vllm import _custom_ops as ops

    def broken(**_):
        raise RuntimeError("the scheduler's signature changed")

    monkeypatch.setattr(ops, "cpu_attn_get_scheduler_metadata", broken)
    with pytest.raises(RuntimeError, match="signature changed"):
        cpu_amx.kernels_run_amx()
