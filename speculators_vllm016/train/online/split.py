"""Online training with extraction ranks apart from training ranks (`--extraction-ranks K`).

    torchrun --nnodes 2 --nproc-per-node 8 -m speculators_vllm016 train --online \
        --extraction-ranks 1 --tensor-parallel-size 8 ...

Ranks 0..K-1 extract (`extraction_rank.ExtractionServer`, one engine replica each), the other ranks
train among themselves (`remote_loader.RemoteSampleLoader`; their own default process group,
`split_groups`). This module decides the layout from torchrun's variables and runs an extraction
rank's part of the job; `train.jobs.job` runs the training ranks' part.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from speculators_vllm016.train.jobs.job_config import TrainJobConfig, TrainSetupError
from speculators_vllm016.train.online.rank_layout import RankLayout, plan_rank_layout

if TYPE_CHECKING:
    from speculators_vllm016.train.jobs.setup import TrainSetup
    from speculators_vllm016.train.online.split_groups import SplitGroups

__all__ = ["run_extraction_rank", "split_layout"]

logger = logging.getLogger("speculators")


def split_layout(config: TrainJobConfig) -> RankLayout | None:
    """This process's layout under `--extraction-ranks`, None without it; bad layouts are one-line
    `TrainSetupError`s, before any process group or engine starts."""
    if not config.online.enabled or config.online.extraction_ranks == 0:
        return None
    import torch

    on_cpu = config.runtime.device == "cpu" or not torch.cuda.is_available()
    return plan_rank_layout(
        config.online.extraction_ranks,
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        local_rank=int(os.environ["LOCAL_RANK"]),
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])),
        engine_gpus=config.online.engine.tensor_parallel_size
        * config.online.engine.pipeline_parallel_size,
        gpus_on_node=0 if on_cpu else torch.cuda.device_count(),
    )


def _engine_visible(layout: RankLayout) -> str | None:
    """CUDA_VISIBLE_DEVICES for this extraction rank's engine: its GPUs among the visible ones."""
    if not layout.engine_devices:
        return None
    from speculators_vllm016.train.jobs.devices import visible_gpus

    visible = visible_gpus()
    return ",".join(visible[index] for index in layout.engine_devices)


def cpu_share(layout: RankLayout, cpus: list[int], engine_workers: int) -> str | None:
    """`VLLM_CPU_OMP_THREADS_BIND` for this extraction rank's CPU engine when several share the
    node: its own slice of the CPUs, one group per engine worker. vLLM's own binding would put
    every engine's first worker on the same cores, where an idle engine's polling starves the
    other engine's start-up. None: one engine on the node, vLLM's default is fine."""
    if layout.node_extraction_ranks <= 1:
        return None
    per_rank = len(cpus) // layout.node_extraction_ranks
    if per_rank < engine_workers:
        raise TrainSetupError(
            f"{layout.node_extraction_ranks} CPU engines of {engine_workers} workers each need "
            f"{layout.node_extraction_ranks * engine_workers} CPUs; this node has {len(cpus)}"
        )
    mine = cpus[
        layout.node_extraction_index * per_rank : (layout.node_extraction_index + 1) * per_rank
    ]
    per_worker = len(mine) // engine_workers
    groups = [mine[i * per_worker : (i + 1) * per_worker] for i in range(engine_workers)]
    return "|".join(",".join(str(cpu) for cpu in group) for group in groups)


def run_extraction_rank(
    config: TrainJobConfig, setup: TrainSetup, layout: RankLayout, groups: SplitGroups
) -> None:
    """Serve the training ranks' requests until all are done; the engine starts at the first
    sample that is not in the cache folder."""
    from speculators_vllm016.train.data import split_items
    from speculators_vllm016.train.distributed_batch_sampler import (
        MultipackDistributedBatchSamplerV2,
    )
    from speculators_vllm016.train.online.errors import CacheFolderError
    from speculators_vllm016.train.online.extraction_rank import ExtractionServer, PlanSource
    from speculators_vllm016.train.online.loader import OnlineExtractor
    from speculators_vllm016.train.online.remote_loader import TRAIN_ITERATION, VALIDATION_ITERATION

    online = setup.online
    assert online is not None
    if not layout.engine_devices and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        workers = (
            config.online.engine.tensor_parallel_size * config.online.engine.pipeline_parallel_size
        )
        binding = cpu_share(layout, sorted(os.sched_getaffinity(0)), workers)
        if binding is not None:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = binding
            # The whole rank too: its engine's processes start on these cores (they inherit the
            # affinity), never on a core where another rank's idle engine polls.
            os.sched_setaffinity(
                0, {int(cpu) for group in binding.split("|") for cpu in group.split(",")}
            )
    cache_dir = config.online.cache_dir
    try:
        extractor = OnlineExtractor(
            online.options,
            online.facts,
            online.dataset,
            Path(cache_dir) if cache_dir else None,
            engine_devices=_engine_visible(layout),
            writes_cache=True,
            cache_shard=(layout.rank, layout.extraction_ranks),
        )
    except CacheFolderError as error:
        raise TrainSetupError(str(error)) from None
    try:
        train_items, val_items = split_items(
            extractor.indices, config.data.train_ratio, config.data.split_seed
        )
        sources = {}
        for iteration, items in ((TRAIN_ITERATION, train_items), (VALIDATION_ITERATION, val_items)):
            if not items:
                continue
            sampler = MultipackDistributedBatchSamplerV2(
                config.training.total_seq_len,
                extractor.lengths(items),
                layout.training_world_size,
                0,
                seed=config.training.seed,
            )
            sources[iteration] = PlanSource(sampler=sampler, indices=items)
        server = ExtractionServer(
            layout, groups.transport(), extractor, sources, config.online.online_queue_size
        )
        logger.info("%s: serving %d training ranks", layout.describe(), layout.training_world_size)
        server.serve()
    finally:
        extractor.close()
