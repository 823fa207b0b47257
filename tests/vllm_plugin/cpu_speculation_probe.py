"""Run in a fresh interpreter by test_cpu_speculation.py: what `cpu_speculation` does to vLLM.

`python cpu_speculation_probe.py refusals` tries every case where nothing may be patched (switched
off, another vLLM version, each broken assumption), then the real entry point
(`load_general_plugins`), and prints one JSON object of what it saw. `... plugin-off` loads the
plugins with `SPECULATORS_VLLM_PLUGIN=0` set by the caller.
"""

from __future__ import annotations

import json
import logging
import os
import sys


def runner_patched() -> bool:
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    return CPUModelRunner.__init__.__module__.endswith("cpu_speculation")


def interpreted_kernels(module_name: str) -> list[str]:
    import importlib

    from triton.runtime.interpreter import InterpretedFunction

    module = importlib.import_module(module_name)
    return sorted(n for n, v in vars(module).items() if isinstance(v, InterpretedFunction))


def broken(attribute_owner, name, replacement, enable) -> str:
    """The error `enable` raises while `owner.name` is `replacement` (restored after)."""
    from speculators_vllm016.vllm_plugin.cpu_speculation import CpuSpeculationError

    shipped = attribute_owner.__dict__[name]
    setattr(attribute_owner, name, replacement)
    try:
        enable()
    except CpuSpeculationError as error:
        return str(error)
    finally:
        setattr(attribute_owner, name, shipped)
    return "no error"


def refusals() -> dict:
    import vllm
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from speculators_vllm016.vllm_plugin import cpu_speculation

    seen: dict = {}
    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    cpu_speculation.logger.addHandler(Keep(level=logging.WARNING))
    enable = cpu_speculation.enable_cpu_speculation

    os.environ[cpu_speculation.CPU_SPECULATION_ENV] = "off"
    seen["switched_off"] = [enable(), runner_patched()]
    del os.environ[cpu_speculation.CPU_SPECULATION_ENV]

    shipped_version = vllm.__version__
    vllm.__version__ = "0.17.1"
    seen["other_version"] = [enable(), runner_patched(), warnings[:]]
    vllm.__version__ = shipped_version

    def copy_with_other_parameters(self, scheduler_output):
        return None

    def load_that_loads_the_drafter(self, eep_scale_up=False):
        self.drafter.load_model(self.model)

    def init_without_assertion(self, vllm_config, device):
        super(CPUModelRunner, self).__init__(vllm_config, device)

    seen["broken"] = {
        "copy_parameters": broken(
            GPUModelRunner, "_copy_draft_token_ids_to_cpu", copy_with_other_parameters, enable
        ),
        "load_model": broken(CPUModelRunner, "load_model", load_that_loads_the_drafter, enable),
        "init": broken(CPUModelRunner, "__init__", init_without_assertion, enable),
    }
    seen["patched_after_refusals"] = runner_patched()
    # Imported as shipped before the patch: the kernels are plain functions here.
    from vllm.v1.sample import rejection_sampler

    taken_before = rejection_sampler.rejection_sample
    seen["interpreted_before"] = interpreted_kernels("vllm.v1.sample.rejection_sampler")

    from vllm.plugins import load_general_plugins

    load_general_plugins()  # the entry point vLLM runs in each of its processes
    import vllm.triton_utils
    from triton.runtime.interpreter import InterpretedFunction

    seen["patched"] = runner_patched()
    seen["line"] = enable()
    seen["kernels"] = {name: interpreted_kernels(name) for name in cpu_speculation.KERNEL_MODULES}
    seen["taken_before_sees_interpreted"] = isinstance(
        taken_before.__globals__["rejection_greedy_sample_kernel"], InterpretedFunction
    )
    seen["vllm_triton_is_placeholder"] = type(vllm.triton_utils.triton).__name__
    seen["other_module_kernels"] = interpreted_kernels(
        "vllm.v1.attention.ops.triton_unified_attention"
    )
    seen["triton_interpret"] = os.environ.get("TRITON_INTERPRET")
    return seen


def plugin_off() -> dict:
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    return {"patched": runner_patched()}


if __name__ == "__main__":
    result = {"refusals": refusals, "plugin-off": plugin_off}[sys.argv[1]]()
    print("PROBE " + json.dumps(result))
