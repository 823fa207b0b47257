"""The dtype the demo's extraction engine runs in: bfloat16 only where the CPU computes it.

vLLM's CPU build turns a float32 model into bfloat16 by default. On an x86 CPU without AVX-512,
AVX512-BF16 or AMX that bfloat16 is emulated and the demo's extraction runs about 5x slower than
in float32, so the demo asks for float32 there and says so in one line.
"""

from __future__ import annotations

__all__ = ["ENGINE_DTYPES", "choose_engine_dtype"]

ENGINE_DTYPES = ("auto", "float32", "bfloat16")


def choose_engine_dtype(
    requested: str, flags: frozenset[str] | None = None
) -> tuple[str, str | None]:
    """The engine dtype for `requested` (`--dtype`), and the line that tells why when the demo
    chose it. `flags`: the CPU's feature flags (read from /proc/cpuinfo when not given).

    "auto" stays vLLM's choice where bfloat16 is native or where the flags cannot be read (not
    Linux, not x86: nothing known to be slow is changed), and becomes "float32" otherwise.
    """
    from speculators_vllm016.data_generation.cpu_defaults import FAST_BF16_FLAGS, cpu_vector_flags

    if requested != "auto":
        return requested, None
    flags = cpu_vector_flags() if flags is None else flags
    x86 = flags is not None and "sse2" in flags
    if not x86 or flags & FAST_BF16_FLAGS:
        return "auto", None
    return "float32", (
        "[demo] this CPU has no native bfloat16 (no AVX-512, AVX512-BF16 or AMX): extracting "
        "in float32, several times faster here than emulated bfloat16 (--dtype bfloat16 forces it)"
    )
