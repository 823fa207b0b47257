"""Speculative decoding on vLLM 0.16's CPU build, with vLLM's own proposer and rejection sampler.

vLLM 0.16's CPU model runner refuses a speculative config, yet every part that speculates (the
EAGLE/EAGLE-3 proposer, the ngram proposer, the rejection sampler, the acceptance counters) is
the GPU runner's code, which the CPU runner inherits. What stands in the way, and what this module
changes, in the process that runs the model runner:

1. `CPUModelRunner.__init__` asserts `speculative_config is None`. It is given an `__init__` that
   does the same four things as vLLM's (the GPU runner's `__init__` under the CPU's CUDA stand-ins,
   which already builds the drafter and the rejection sampler; the CPU flags; the buffer
   aliasing) without the assertion.
2. `CPUModelRunner.load_model` replaces the GPU runner's and so never loads the drafter nor, for
   EAGLE-3, sets the target's aux layers. It is wrapped to do both after vLLM's own loading, as
   `GPUModelRunner.load_model` does (the draft config's `eagle_aux_hidden_state_layer_ids`, else
   the model's default). Without them the KV cache has no draft layers and the warm-up fails.
3. `_copy_draft_token_ids_to_cpu` and `_copy_valid_sampled_token_count` overlap copies on CUDA
   streams; on CPU they become plain copies (the CPU platform already turns async scheduling off).
4. The rejection sampler and the EAGLE input preparation are Triton kernels
   (`v1/sample/rejection_sampler.py`, `v1/spec_decode/utils.py`, and `eagle.py`'s
   `triton.next_power_of_2`). On CPU vLLM binds Triton placeholders there (no active driver), so
   the kernels are plain Python functions that cannot be launched. Those three modules, and only
   they, are executed again with the real Triton in interpreter mode (`TRITON_INTERPRET=1`, which
   Triton reads when a kernel is defined); every other module keeps vLLM's CPU placeholders.

Active only on vLLM 0.16.x and the CPU platform; elsewhere nothing is patched (other versions get
one warning). Switched off with `SPECULATORS_CPU_SPECULATION=0`, and off with the plugin. Before
patching, each replaced or wrapped function is checked to be the one this module was written
against (its parameters, and for the CPU runner's `__init__` and `load_model` what their bodies
do): a vLLM that differs raises `CpuSpeculationError` naming the broken assumption rather than
speculating on changed code. Callers still need `enforce_eager=True` and, for MLA targets such as
DeepSeek-V3 and Kimi-K2.5, `VLLM_MLA_DISABLE=1` (vLLM has no MLA kernel on CPU).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import logging
import os
import textwrap
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

__all__ = [
    "CPU_SPECULATION_ENV",
    "KERNEL_MODULES",
    "CpuSpeculationError",
    "cpu_speculation_enabled",
    "cpu_speculation_unavailable",
    "enable_cpu_speculation",
]

logger = logging.getLogger(__name__)
# The start-up line goes through vLLM's own logger tree, which vLLM gives a handler in every
# process it starts (this package's loggers have none there, so an INFO line would vanish).
_startup_logger = logging.getLogger("vllm.speculators_cpu_speculation")

CPU_SPECULATION_ENV = "SPECULATORS_CPU_SPECULATION"  # "0" (or false/no/off) switches it off
SUPPORTED_VLLM = "0.16."
_RUNNER_MODULE = "vllm.v1.worker.cpu_model_runner"
# The modules whose Triton kernels speculative decoding launches, in dependency order (eagle.py
# imports its kernels by name from utils.py), and the kernels each must define.
KERNEL_MODULES: Mapping[str, tuple[str, ...]] = {
    "vllm.v1.spec_decode.utils": (
        "eagle_prepare_inputs_padded_kernel",
        "eagle_prepare_next_token_padded_kernel",
        "copy_and_expand_eagle_inputs_kernel",
    ),
    "vllm.v1.sample.rejection_sampler": (
        "rejection_greedy_sample_kernel",
        "rejection_random_sample_kernel",
        "expand_kernel",
        "sample_recovered_tokens_kernel",
    ),
    "vllm.v1.spec_decode.eagle": (
        "eagle_prepare_inputs_padded_kernel",
        "eagle_prepare_next_token_padded_kernel",
        "copy_and_expand_eagle_inputs_kernel",
    ),
}
# Parameters of the GPU runner's methods this module replaces or calls (vLLM 0.16.0).
_EXPECTED_PARAMETERS: Mapping[str, tuple[str, ...]] = {
    "_copy_draft_token_ids_to_cpu": ("self", "scheduler_output", "zeros_only"),
    "_copy_valid_sampled_token_count": ("self", "next_token_ids", "valid_sampled_tokens_count"),
    "_get_eagle3_aux_layers_from_config": ("self",),
    "load_model": ("self", "eep_scale_up"),
}
_applied: str | None = None  # the start-up line, once this process is patched


class CpuSpeculationError(RuntimeError):
    """vLLM's code is not what the CPU speculation patch was written against."""


def cpu_speculation_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """False when the user switched CPU speculation off (the plugin's own switch is separate)."""
    environ = os.environ if environ is None else environ
    return environ.get(CPU_SPECULATION_ENV, "1").strip().lower() not in {"0", "false", "no", "off"}


def cpu_speculation_unavailable() -> str | None:
    """Why vLLM's CPU build cannot speculate here with this package, or None when it can.

    Read from the switches, the installed vLLM's version and the plugin's entry point, before any
    engine starts (vLLM runs the plugin in its own processes, so it must be installed, not only
    importable).
    """
    from speculators_vllm016.utils.eagle3_serving import (
        PLUGIN_ENV,
        plugin_enabled,
        plugin_installed,
    )

    refusal = "vLLM's CPU build refuses speculative decoding"
    if not plugin_enabled():
        return (
            f"{refusal} (this package's vLLM plugin, which lifts that, is switched off by "
            f"{PLUGIN_ENV} or VLLM_PLUGINS)"
        )
    if not cpu_speculation_enabled():
        return f"{refusal} (this package's CPU speculation is switched off: {CPU_SPECULATION_ENV})"
    import vllm

    version = str(getattr(vllm, "__version__", "unknown"))
    if not version.startswith(SUPPORTED_VLLM):
        return f"{refusal} (vLLM {version}; this package lifts that for vLLM 0.16.x only)"
    if not plugin_installed():
        return f"{refusal} (this package's vLLM plugin is not installed here: pip install it)"
    return None


def enable_cpu_speculation() -> str | None:
    """Let this process's vLLM CPU runner speculate; idempotent.

    Returns the one line saying what was patched, or None when nothing was (switched off, not the
    CPU platform, another vLLM). Raises `CpuSpeculationError` when vLLM 0.16's code is not as
    expected.
    """
    global _applied
    if _applied is not None:
        return _applied
    if not cpu_speculation_enabled():
        logger.info("speculators CPU speculative decoding switched off (%s=0)", CPU_SPECULATION_ENV)
        return None
    import vllm

    version = str(getattr(vllm, "__version__", "unknown"))
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    if not version.startswith(SUPPORTED_VLLM):
        logger.warning(
            "speculators CPU speculative decoding: written for vLLM 0.16.x, found %s; nothing "
            "patched (vLLM's CPU build refuses speculative decoding as shipped)",
            version,
        )
        return None
    runner = importlib.import_module(_RUNNER_MODULE)
    _check_runner(runner)
    kernels = _define_kernels_with_interpreter()
    _patch_runner(runner)
    _applied = (
        f"speculators: vLLM {version} CPU speculative decoding enabled in process {os.getpid()}: "
        "CPUModelRunner.__init__ (no spec-decode assertion), load_model (+drafter, +EAGLE-3 aux "
        "layers), _copy_draft_token_ids_to_cpu and _copy_valid_sampled_token_count (plain "
        f"copies); {kernels} Triton kernels run by Triton's interpreter (TRITON_INTERPRET=1)"
    )
    _startup_logger.info("%s", _applied)
    return _applied


# --- the assumptions, checked before anything is changed ---------------------------------------


def _parameters(function: Callable[..., Any]) -> tuple[str, ...]:
    return tuple(inspect.signature(function).parameters)


def _body_calls(function: Callable[..., Any]) -> set[str]:
    """Names of the functions and methods the body calls (`a.b.c(...)` gives "c")."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            target = node.func
            if isinstance(target, ast.Attribute):
                names.add(target.attr)
            elif isinstance(target, ast.Name):
                names.add(target.id)
    return names


def _asserts_no_speculation(function: Callable[..., Any]) -> bool:
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    return any(
        isinstance(node, ast.Assert) and "speculative_config" in ast.unparse(node.test)
        for node in ast.walk(tree)
    )


def _require(condition: bool, assumption: str) -> None:
    if not condition:
        raise CpuSpeculationError(
            f"speculators CPU speculative decoding: this vLLM breaks the assumption that "
            f"{assumption}; nothing patched (set {CPU_SPECULATION_ENV}=0 to run vLLM as shipped)"
        )


def _check_runner(runner: ModuleType) -> None:
    """Every function this module replaces, wraps or calls is the one it was written against."""
    cpu = getattr(runner, "CPUModelRunner", None)
    _require(cpu is not None, f"{_RUNNER_MODULE} defines CPUModelRunner")
    gpu = cpu.__mro__[1]
    _require(gpu.__name__ == "GPUModelRunner", "CPUModelRunner's base class is GPUModelRunner")
    for name, expected in _EXPECTED_PARAMETERS.items():
        function = getattr(gpu, name, None)
        _require(callable(function), f"GPUModelRunner has a method {name}")
        _require(
            _parameters(function) == expected,
            f"GPUModelRunner.{name} takes {expected} (it takes {_parameters(function)})",
        )
    _require(
        callable(getattr(runner, "_torch_cuda_wrapper", None)),
        f"{_RUNNER_MODULE} has the _torch_cuda_wrapper context manager",
    )
    init = cpu.__init__
    _require(
        _parameters(init) == ("self", "vllm_config", "device"),
        "CPUModelRunner.__init__ takes (self, vllm_config, device)",
    )
    _require(
        _asserts_no_speculation(init),
        "CPUModelRunner.__init__ asserts there is no speculative config",
    )
    _require(
        _body_calls(init)
        == {"_torch_cuda_wrapper", "__init__", "super", "device", "_postprocess_tensors"},
        "CPUModelRunner.__init__ only runs GPUModelRunner.__init__ under _torch_cuda_wrapper, "
        "checks its device and speculative config, sets two flags and calls _postprocess_tensors",
    )
    load = cpu.load_model
    _require(
        _parameters(load) == ("self", "eep_scale_up"),
        "CPUModelRunner.load_model takes (self, eep_scale_up)",
    )
    _require(
        "drafter" not in inspect.getsource(load)
        and "set_aux_hidden_state_layers" not in inspect.getsource(load),
        "CPUModelRunner.load_model neither loads the drafter nor sets EAGLE-3 aux layers",
    )


# --- Triton's interpreter for the spec-decode kernels ------------------------------------------


def _define_kernels_with_interpreter() -> int:
    """Execute the spec-decode kernel modules again, bound to the real Triton in interpreter mode.

    They are first imported as vLLM ships them on CPU (so every module they import is loaded with
    vLLM's placeholders, untouched by this), then re-executed in place while `vllm.triton_utils`
    lends them the real Triton: objects taken from them earlier (classes, functions) look their
    kernels up in the same module namespace and so see the interpreted ones. Returns how many
    kernels are now interpreted.
    """
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton
        import triton.language as language
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError as error:
        raise CpuSpeculationError(
            f"speculators CPU speculative decoding needs Triton's interpreter ({error}); nothing "
            f"patched (set {CPU_SPECULATION_ENV}=0 to run vLLM as shipped)"
        ) from error
    _require(
        bool(triton.knobs.runtime.interpret), "Triton reads TRITON_INTERPRET into knobs.runtime"
    )
    triton_utils = importlib.import_module("vllm.triton_utils")
    for name in ("triton", "tl"):
        _require(hasattr(triton_utils, name), f"vllm.triton_utils exports `{name}`")
    modules = [importlib.import_module(name) for name in KERNEL_MODULES]
    for module in modules:
        for kernel in KERNEL_MODULES[module.__name__]:
            _require(callable(getattr(module, kernel, None)), f"{module.__name__} has {kernel}")
        _require(hasattr(module, "triton"), f"{module.__name__} uses `triton` by name")
    shipped = (triton_utils.triton, triton_utils.tl)
    if not all(_interpreted(module, InterpretedFunction) for module in modules):
        triton_utils.triton, triton_utils.tl = triton, language
        try:
            for module in modules:
                importlib.reload(module)
        finally:
            triton_utils.triton, triton_utils.tl = shipped
    kernels = set()
    for module in modules:
        _require(
            _interpreted(module, InterpretedFunction) and module.triton is triton,
            f"{module.__name__} defines {', '.join(KERNEL_MODULES[module.__name__])} with the "
            "`triton` it imports from vllm.triton_utils",
        )
        kernels.update(id(getattr(module, name)) for name in KERNEL_MODULES[module.__name__])
    return len(kernels)


def _interpreted(module: ModuleType, interpreted_type: type) -> bool:
    return all(
        isinstance(getattr(module, kernel, None), interpreted_type)
        for kernel in KERNEL_MODULES[module.__name__]
    )


# --- the runner's replacements -----------------------------------------------------------------


def _patch_runner(runner: ModuleType) -> None:
    cpu = runner.CPUModelRunner
    gpu = cpu.__mro__[1]
    cuda_stand_ins = runner._torch_cuda_wrapper
    shipped_load_model = cpu.load_model

    def init_without_refusal(self: Any, vllm_config: Any, device: Any) -> None:
        """vLLM's CPU runner `__init__` minus the refusal: the GPU runner's `__init__` (which
        builds the drafter and the rejection sampler) under the CPU's CUDA stand-ins."""
        import torch

        with cuda_stand_ins():
            gpu.__init__(self, vllm_config, device)
        if device != torch.device("cpu"):
            raise ValueError(f"CPUModelRunner runs on the CPU, not {device}")
        self.use_cuda_graph = False
        self.cascade_attn_enabled = False
        self._postprocess_tensors()

    def load_model(self: Any, eep_scale_up: bool = False) -> None:
        """vLLM's CPU loading, then what the GPU runner's loading adds for speculation."""
        shipped_load_model(self, eep_scale_up)
        if hasattr(self, "drafter"):
            self.drafter.load_model(self.model)
        if self.use_aux_hidden_state_outputs:
            from vllm.model_executor.models.interfaces import supports_eagle3

            if not supports_eagle3(self.model):
                raise RuntimeError(
                    f"{type(self.model).__name__} does not implement vLLM's SupportsEagle3 "
                    "interface, which an EAGLE-3 draft needs from its target"
                )
            layers = self._get_eagle3_aux_layers_from_config()
            if not layers:
                layers = self.model.get_eagle3_aux_hidden_state_layers()
            self.model.set_aux_hidden_state_layers(layers)

    def _copy_draft_token_ids_to_cpu(
        self: Any, scheduler_output: Any, zeros_only: bool = False
    ) -> None:
        """The drafted tokens into the runner's host buffer, now (no copy stream on CPU)."""
        if self.use_async_scheduling and not (
            scheduler_output.has_structured_output_requests
            or self.input_batch.sampling_metadata.output_token_ids
        ):
            return  # as the GPU runner: async scheduling copies only when something reads them
        self._draft_token_req_ids = self.input_batch.req_ids.copy()
        drafted = self._draft_token_ids
        if not hasattr(drafted, "shape"):
            return  # a list (ngram): read as is by _get_draft_token_ids_cpu
        rows = drafted.shape[0]
        if zeros_only:
            self.draft_token_ids_cpu[:rows] = 0
        else:
            self.draft_token_ids_cpu[:rows].copy_(drafted)

    def _copy_valid_sampled_token_count(
        self: Any, next_token_ids: Any, valid_sampled_tokens_count: Any
    ) -> None:
        """The GPU runner's copy, without its stream (used only under async scheduling)."""
        if self.valid_sampled_token_count_event is None:
            return
        counts = valid_sampled_tokens_count
        self.valid_sampled_token_count_cpu[: counts.shape[0]].copy_(counts)
        self.input_batch.prev_sampled_token_ids = next_token_ids.unsqueeze(1)

    replacements = {
        "__init__": init_without_refusal,
        "load_model": load_model,
        "_copy_draft_token_ids_to_cpu": _copy_draft_token_ids_to_cpu,
        "_copy_valid_sampled_token_count": _copy_valid_sampled_token_count,
    }
    for name, function in replacements.items():
        function.__name__ = name
        function.__qualname__ = f"CPUModelRunner.{name}"
        function.__module__ = __name__
        setattr(cpu, name, function)
