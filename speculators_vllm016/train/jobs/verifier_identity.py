"""Is the verifier the model the data was extracted from? Compared by weights, not path.

`data_config.json` records the target's fingerprint (`utils.verifier_weights.verifier_fingerprint`:
its final norm and LM head); a verifier of the same shapes but other weights would train a draft
against targets the data was not made for, silently. Refused in one line unless
`--allow-other-verifier` says the change is deliberate.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from speculators_vllm016.train.jobs.job_config import TrainSetupError
from speculators_vllm016.utils.errors import first_line

if TYPE_CHECKING:
    from speculators_vllm016.utils.verifier_weights import VerifierInfo

__all__ = [
    "check_same_verifier",
    "fingerprint_of_verifier",
    "read_verifier",
    "recorded_verifier_path",
]


def read_verifier(path: str, config: Any = None, text_config: Any = None) -> VerifierInfo:
    """The verifier read once (`utils.verifier_weights.VerifierInfo`, with vLLM's `config` and
    `text_config` of it where read): its tensor names listed, and the tensors the draft copies
    (embeddings, final norm, LM head) found there and unquantized, before anything is written."""
    from speculators_vllm016.utils.verifier_weights import VerifierInfo

    try:
        info = VerifierInfo.read(path)
        info.config, info.text_config = config, text_config
        info.weight_names()
    except (ValueError, OSError) as error:
        raise TrainSetupError(first_line(error)) from None
    return info


def fingerprint_of_verifier(verifier: str | VerifierInfo) -> str:
    """`VerifierInfo.fingerprint` of --verifier-name-or-path (a path is read; one line if not)."""
    path = verifier if isinstance(verifier, str) else verifier.path
    try:
        if isinstance(verifier, str):
            from speculators_vllm016.utils.verifier_weights import VerifierInfo

            verifier = VerifierInfo.read(verifier)
        return verifier.fingerprint()
    except (ValueError, OSError) as error:
        raise TrainSetupError(
            f"cannot read the final norm and LM head of --verifier-name-or-path {path} "
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
