"""How loud vLLM is while datagen (or online training, or a chain of stages) starts it."""

from __future__ import annotations

import logging
import os

__all__ = ["HUB_RETRY_LOGGER", "keep_vllm_quiet"]

HUB_RETRY_LOGGER = "huggingface_hub.utils._http"


def keep_vllm_quiet() -> None:
    """vLLM's INFO lines (config dumps, compile and cache notes: dozens at every start) buried
    datagen's own; only its warnings and errors show. The variable reaches vLLM when it is
    imported and its worker processes; a level the user set is kept."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"].upper())
    # The hub client's retries of a model id it cannot reach: a long MaxRetryError warning per
    # try before the one error line that says the id cannot be read (--verbose shows them).
    logging.getLogger(HUB_RETRY_LOGGER).setLevel(logging.ERROR)
