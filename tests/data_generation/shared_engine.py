"""One engine for a test module's in-process datagen runs that share its settings.

`run_datagen(options, generator=engine)` runs with an engine already started (as `datagen
--regenerate` hands over its own) instead of starting one per call; engine starts are most of
what these tests cost on a 2-core machine. A run whose guarantee is about its own process (a
killed run, shards in parallel processes, a run that must start no engine) still starts its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from speculators_vllm016.data_generation.offline import start_generator
from speculators_vllm016.data_generation.options import DatagenOptions
from speculators_vllm016.data_generation.preflight import inspect_model


@contextmanager
def datagen_engine(options: DatagenOptions) -> Iterator[Any]:
    """The generator `run_datagen(options)` would start, for the block; closed after it."""
    engine, output = options.engine, options.output
    facts = inspect_model(engine.target_model_path, output.layer_ids, engine.trust_remote_code)
    generator = start_generator(options, facts)
    try:
        yield generator
    finally:
        generator.close()
