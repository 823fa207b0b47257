"""Make vLLM 0.16 carry EAGLE-3.1's switches from a speculators-format `config.json`.

vLLM turns a speculators-format config into the draft's Hugging Face config with one function
per algorithm (`transformers_utils/configs/speculators/algos.py`, looked up by name in
`SUPPORTED_SPECULATORS_TYPES` at every parse). 0.16's EAGLE-3 function copies the draft vocabulary,
target width, `norm_before_residual` and aux layer ids, and drops everything else, so a 3.1
draft would be served as a 3.0 one (its norms never applied, its weights refused). Later vLLM
(0.22) copies `norm_before_fc`, `fc_norm` and `norm_output` as well; this wraps 0.16's function
to do the same: it runs first, unchanged, then the three keys are copied when the config has
them. A config without them parses exactly as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from speculators_vllm016.utils.eagle31 import EAGLE31_FIELDS

__all__ = ["carry_eagle31_fields", "with_eagle31_fields"]

logger = logging.getLogger(__name__)

_MARK = "_speculators_eagle31"


def with_eagle31_fields(update: Callable[[dict, dict], None]) -> Callable[[dict, dict], None]:
    """vLLM's EAGLE-3 config function `update`, followed by copying the EAGLE-3.1 keys."""

    def update_eagle3_and_31(config_dict: dict[str, Any], pre_trained_config: dict[str, Any]):
        update(config_dict=config_dict, pre_trained_config=pre_trained_config)
        for name in EAGLE31_FIELDS:
            if name in config_dict:
                pre_trained_config[name] = bool(config_dict[name])

    setattr(update_eagle3_and_31, _MARK, True)
    update_eagle3_and_31.__wrapped__ = update  # type: ignore[attr-defined]
    return update_eagle3_and_31


def carry_eagle31_fields() -> bool:
    """Wrap vLLM's registered EAGLE-3 config function once; returns whether it is wrapped."""
    from vllm.transformers_utils.configs.speculators.algos import SUPPORTED_SPECULATORS_TYPES

    update = SUPPORTED_SPECULATORS_TYPES.get("eagle3")
    if update is None:
        logger.warning(
            "speculators plugin: this vLLM has no speculators EAGLE-3 config function; "
            "EAGLE-3.1 drafts would lose their norms"
        )
        return False
    if not getattr(update, _MARK, False):
        SUPPORTED_SPECULATORS_TYPES["eagle3"] = with_eagle31_fields(update)
    return True
