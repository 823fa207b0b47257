"""`speculators datagen --regenerate`: regenerate the responses and extract their hidden states
with one engine load (for a 1T-parameter target, one load less is hours).

The hidden-states generator is started once, with a context long enough for both jobs. With its
capture paused it answers the turns (`GeneratorEngine`), into a regeneration folder with all of
`speculators regenerate`'s guarantees; then datagen extracts the regenerated conversations with
the same engine, into the same files (and with the same guarantees) as a plain datagen run on
them. Both halves render with the same chat-template arguments (`--chat-template-kwargs`, one
flag), so the tokens extracted are the ones the target answered to. Each half resumes on its own: a rerun of the same command regenerates only missing rows
and extracts only missing samples.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING, Any

from speculators_vllm016.data_generation.engine_sampling import capture_paused
from speculators_vllm016.data_generation.offline import run_datagen, start_generator
from speculators_vllm016.data_generation.preflight import inspect_model
from speculators_vllm016.data_generation.regeneration.capture_engine import GeneratorEngine
from speculators_vllm016.data_generation.regeneration.options import (
    RegenerateOptions,
    refuse_beyond_model_context,
)
from speculators_vllm016.data_generation.regeneration.run import (
    RegenerateSummary,
    run_regeneration,
)
from speculators_vllm016.utils.errors import InvalidInputError

if TYPE_CHECKING:
    from speculators_vllm016.data_generation.offline import DatagenSummary
    from speculators_vllm016.data_generation.options import DatagenOptions

__all__ = ["REGENERATED_DIR", "run_datagen_regenerating"]

REGENERATED_DIR = "regenerated"


def default_regenerate_dir(output_dir: str) -> str:
    return str(Path(output_dir) / REGENERATED_DIR)


def run_datagen_regenerating(
    options: DatagenOptions, regenerate: RegenerateOptions, generator: Any = None
) -> tuple[RegenerateSummary, DatagenSummary]:
    """Regenerate `regenerate.train_data_path` into `regenerate.output_dir`, then run datagen
    (`options`) on the result; one engine for both. `generator`: one already started, with a
    context long enough for both (tests share one); the caller closes it."""
    options = copy.deepcopy(options)
    options.validate()
    regenerate.validate()
    if regenerate.chat_template_kwargs != options.preprocessing.template_kwargs():
        raise InvalidInputError(
            f"the regeneration's chat template arguments {regenerate.chat_template_kwargs} differ "
            f"from the extraction's {options.preprocessing.template_kwargs()}; the samples would "
            "not be the tokens the target answered to"
        )
    if options.output.num_shards > 1:
        raise InvalidInputError(
            "datagen --regenerate runs unsharded; for shards, run `speculators regenerate` with "
            "--num-shards, join its files, and run datagen on them"
        )
    engine = options.engine
    if engine.max_model_len is None:  # room for the longest prompt and response, and a sample
        engine.max_model_len = max(
            options.resolved_max_model_len, regenerate.resolved_max_model_len
        )
    elif engine.max_model_len < regenerate.resolved_max_model_len:
        raise InvalidInputError(
            f"--max-model-len {engine.max_model_len} is shorter than --max-prompt-tokens + "
            f"--max-tokens ({regenerate.resolved_max_model_len}); raise it or leave it unset"
        )
    facts = inspect_model(
        engine.target_model_path, options.output.layer_ids, engine.trust_remote_code
    )
    refuse_beyond_model_context(engine.max_model_len, facts.config_dict)
    own_generator = generator is None
    if own_generator:
        generator = start_generator(options, facts)
    try:
        with capture_paused(generator):
            regenerated = run_regeneration(regenerate, engine=GeneratorEngine(generator))
        options.preprocessing.train_data_path = regenerated.output_file
        extracted = run_datagen(options, generator=generator)
    finally:
        if own_generator:
            generator.close()
    return regenerated, extracted
