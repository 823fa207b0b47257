"""Let `SpeculativeConfig(method="eagle3")` accept DeepSeek-V2/V3 and Kimi-K2(.5) targets.

vLLM 0.16's check is a list literal inside the pydantic model validator
`SpeculativeConfig._verify_args`, compiled into the function's constants. Pydantic holds that
very function object (in the class's validator and in every config that nests it), so neither
replacing the method nor subclassing the config reaches the check that `VllmConfig` runs. The
narrowest change that does is to give the function a copy of its own code whose one constant,
the tuple of accepted model types, has our three types appended: every line of vLLM's validator
still runs as shipped, and the error it raises for other models now lists the wider set.

If the constant is not there (another vLLM), nothing is patched and a warning says so.
"""

from __future__ import annotations

import logging
from types import CodeType

from speculators_vllm016.utils.eagle3_serving import PLUGIN_TEXT_MODEL_TYPES

__all__ = ["eagle3_model_types_in", "widen_eagle3_model_types"]

logger = logging.getLogger(__name__)


def eagle3_model_types_in(code: CodeType) -> tuple[str, ...] | None:
    """The accepted text model types, as the validator's compiled code holds them.

    Python compiles vLLM 0.16's list literal to one constant tuple of strings that starts with
    "llama". None unless exactly one such constant is there.
    """
    found = [
        value
        for value in code.co_consts
        if isinstance(value, tuple)
        and value
        and value[0] == "llama"
        and all(isinstance(item, str) for item in value)
    ]
    return found[0] if len(found) == 1 else None


def widen_eagle3_model_types() -> bool:
    """Append the plugin's text model types to vLLM's EAGLE-3 list; idempotent.

    Returns whether the list holds them afterwards.
    """
    from vllm.config.speculative import SpeculativeConfig

    validator = SpeculativeConfig._verify_args
    code = validator.__code__
    current = eagle3_model_types_in(code)
    if current is None:
        logger.warning(
            "speculators EAGLE-3 plugin: SpeculativeConfig's EAGLE-3 model list was not found "
            "in this vLLM; DeepSeek/Kimi targets stay refused by its config check"
        )
        return False
    missing = tuple(t for t in PLUGIN_TEXT_MODEL_TYPES if t not in current)
    if not missing:
        return True
    widened = current + missing
    constants = tuple(widened if value == current else value for value in code.co_consts)
    validator.__code__ = code.replace(co_consts=constants)
    return True
