"""Is the verifier the model the data was extracted from? Compared by weights, not path.

`data_config.json` records the target's fingerprint (`utils.verifier_weights.verifier_fingerprint`:
its final norm and LM head); a verifier of the same shapes but other weights would train a draft
against targets the data was not made for, silently. Refused in one line unless
`--allow-other-verifier` says the change is deliberate.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from speculators_vllm016.train.jobs.job_config import TrainSetupError
from speculators_vllm016.utils.errors import first_line

__all__ = [
    "check_same_verifier",
    "data_model",
    "fingerprint_of_verifier",
    "recorded_verifier_path",
]


def data_model(data_path: Path) -> Any:
    """The `model` section of `data_config.json` (the target the data comes from), or None."""
    from speculators_vllm016.data_generation.config_generator import read_data_config

    recorded = read_data_config(data_path)
    return None if recorded is None else recorded.model


def fingerprint_of_verifier(verifier: str) -> str:
    """`utils.verifier_weights.verifier_fingerprint` of --verifier-name-or-path (one line if not)."""
    from speculators_vllm016.utils.verifier_weights import verifier_fingerprint

    try:
        return verifier_fingerprint(verifier)
    except (ValueError, OSError) as error:
        raise TrainSetupError(
            f"cannot read the final norm and LM head of --verifier-name-or-path {verifier} "
            f"({first_line(error)})"
        ) from None


def check_same_verifier(
    verifier: str, mine: str, source: str, source_fingerprint: str | None, what: str, allow: bool
) -> None:
    """Refuse (one line) a verifier whose fingerprint `mine` differs from `source_fingerprint`,
    that of the model `source` the data comes from (`what` says where that is recorded), unless
    `allow` (--allow-other-verifier: a warning). Nothing to compare: nothing to refuse."""
    if source_fingerprint is None:
        return
    if mine != source_fingerprint:
        message = (
            f"the data comes from {source} ({what}), whose final norm and LM head differ "
            f"from those of --verifier-name-or-path {verifier}"
        )
        if not allow:
            raise TrainSetupError(
                f"{message}: train against the model of the data, or pass --allow-other-verifier "
                "to do so deliberately"
            )
        logging.getLogger("speculators").warning(
            "%s; training against it (--allow-other-verifier)", message
        )


def recorded_verifier_path(name_or_path: str) -> str:
    """The verifier as a checkpoint names it: a local folder absolute (`eval` and vLLM then find
    it from any working folder), a hub id as given."""
    path = Path(name_or_path).expanduser()
    return str(path.resolve()) if path.exists() else name_or_path
