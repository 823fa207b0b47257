"""`speculators datagen --regenerate`: regenerate the responses and extract their hidden states
with one engine load (for a 1T-parameter target, one load less is hours).

The hidden-states generator is started once, with a context long enough for both jobs. With its
capture paused it answers the turns (`GeneratorEngine`), into a regeneration folder with all of
`speculators regenerate`'s guarantees; then datagen extracts the regenerated conversations with
the same engine, into the same files (and with the same guarantees) as a plain datagen run on
them. Sharded (`--num-shards`), shard I regenerates rows I, I+N, ... of the data, waits for the
other shards' rows (`shard_join`), and extracts samples I, I+N, ... of them all, so all shards
together write the unsharded run's files. Both halves render with the same chat-template
arguments (`--chat-template-kwargs`, one flag), so the tokens extracted are the ones the target
answered to. Each half resumes on its own: a rerun of the same command regenerates only missing
rows and extracts only missing samples.
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
from speculators_vllm016.data_generation.regeneration.shard_join import (
    join_shard_files,
    wait_for_shards,
)
from speculators_vllm016.utils.errors import InvalidInputError

if TYPE_CHECKING:
    from speculators_vllm016.data_generation.offline import DatagenSummary
    from speculators_vllm016.data_generation.options import DatagenOptions
    from speculators_vllm016.data_generation.preflight import ModelFacts

__all__ = [
    "REGENERATED_DIR",
    "default_regenerate_dir",
    "prepare_one_pass",
    "run_datagen_regenerating",
]

REGENERATED_DIR = "regenerated"


def default_regenerate_dir(output_dir: str) -> str:
    return str(Path(output_dir) / REGENERATED_DIR)


def prepare_one_pass(
    options: DatagenOptions, regenerate: RegenerateOptions
) -> tuple[DatagenOptions, ModelFacts]:
    """Every check of a one-pass run that needs no engine, and the engine's context: a mistake
    is refused in one line before anything is loaded or written (gen-and-train asks before it
    clears an earlier run's folders). Returns the options with the context set, and the model."""
    options = copy.deepcopy(options)
    options.validate()
    regenerate.validate()
    _refuse_halves_that_differ(options, regenerate)
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
        engine.target_model_path,
        options.output.layer_ids,
        engine.trust_remote_code,
        config_dict=regenerate.target_config,  # where the command read it already
    )
    refuse_beyond_model_context(engine.max_model_len, facts.config_dict, spare=1)
    return options, facts


def run_datagen_regenerating(
    options: DatagenOptions, regenerate: RegenerateOptions, generator: Any = None
) -> tuple[RegenerateSummary, DatagenSummary]:
    """Regenerate `regenerate.train_data_path` into `regenerate.output_dir`, then run datagen
    (`options`) on the result; one engine for both. `generator`: one already started, with a
    context long enough for both (tests share one); the caller closes it."""
    options, facts = prepare_one_pass(options, regenerate)
    own_generator = generator is None
    if own_generator:
        generator = start_generator(options, facts)
    try:
        with capture_paused(generator):
            regenerated = run_regeneration(regenerate, engine=GeneratorEngine(generator))
        options.preprocessing.train_data_path = regenerated.output_file
        if regenerate.num_shards > 1:  # samples are numbered over every shard's rows
            folder = Path(regenerate.output_dir)
            wait_for_shards(folder, regenerate.num_shards)
            joined = join_shard_files(folder, regenerate.num_shards, regenerate.fsync)
            options.preprocessing.train_data_path = str(joined)
        extracted = run_datagen(options, generator=generator, facts=facts)
    finally:
        if own_generator:
            generator.close()
    return regenerated, extracted


def _refuse_halves_that_differ(options: DatagenOptions, regenerate: RegenerateOptions) -> None:
    """The two halves must render alike and shard alike (a library caller builds both)."""
    if regenerate.chat_template_kwargs != options.preprocessing.template_kwargs():
        raise InvalidInputError(
            f"the regeneration's chat template arguments {regenerate.chat_template_kwargs} differ "
            f"from the extraction's {options.preprocessing.template_kwargs()}; the samples would "
            "not be the tokens the target answered to"
        )
    shards = (regenerate.num_shards, regenerate.shard_index)
    if shards != (options.output.num_shards, options.output.shard_index):
        raise InvalidInputError(
            f"the regeneration is shard {shards[1]} of {shards[0]}, the extraction shard "
            f"{options.output.shard_index} of {options.output.num_shards}; give both the same"
        )
