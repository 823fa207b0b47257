"""Who does what under torchrun with `--extraction-ranks K` (online training, split layout).

The first K global ranks only extract: each hosts one engine replica over its own devices (TP x PP
GPUs of its node, or the CPU). The other ranks only train, among themselves (their own default
process group: FSDP2/DDP and every trainer collective see only them). torchrun numbers ranks node
by node (`rank = node_rank * local_world_size + local_rank`), so a node's extraction ranks are its
first local ranks: they take the node's first GPUs, TP x PP each, and its training ranks one GPU
each after them.

Pure logic: no process group, no device is touched here. A layout that cannot work is a
`TrainSetupError` of one line, raised before any engine starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from speculators_vllm016.train.jobs.job_config import TrainSetupError
from speculators_vllm016.utils.errors import InvalidInputError

__all__ = ["FLAG", "RankLayout", "plan_rank_layout"]

FLAG = "--extraction-ranks"


@dataclass(frozen=True)
class RankLayout:
    """This process's part in a split online run."""

    rank: int
    """Global rank (torchrun's RANK)."""
    world_size: int
    """Every process of the run: extraction and training ranks."""
    extraction_ranks: int
    """K: global ranks 0..K-1 extract."""
    engine_devices: tuple[int, ...] = ()
    """An extraction rank's GPUs (indices among the node's visible GPUs); empty on the CPU."""
    training_device: str | None = None
    """A training rank's device (`cuda:N` or `cpu`); None for an extraction rank."""
    node_extraction_ranks: int = 1
    """How many extraction ranks share this rank's node (their engines must not share cores)."""

    @property
    def node_extraction_index(self) -> int:
        """This extraction rank's place among its node's extraction ranks (they come first)."""
        return self.rank % max(self.node_extraction_ranks, 1) if self.extracts else -1

    @property
    def extracts(self) -> bool:
        return self.rank < self.extraction_ranks

    @property
    def training_world_size(self) -> int:
        return self.world_size - self.extraction_ranks

    @property
    def training_rank(self) -> int:
        """This rank's place among the training ranks (its rank in their process group)."""
        if self.extracts:
            raise InvalidInputError(f"rank {self.rank} extracts: it has no training rank")
        return self.rank - self.extraction_ranks

    def global_rank_of_training_rank(self, training_rank: int) -> int:
        return self.extraction_ranks + training_rank

    def extraction_rank_of_step(self, step: int) -> int:
        """The extraction rank that extracts (every training rank's samples of) `step`: steps go
        round-robin, so no sample is extracted twice in an epoch and every replica gets work."""
        return step % self.extraction_ranks

    def describe(self) -> str:
        if self.extracts:
            devices = f"GPUs {list(self.engine_devices)}" if self.engine_devices else "the CPU"
            return f"rank {self.rank}: extraction rank {self.rank} of {self.extraction_ranks}, engine on {devices}"
        return (
            f"rank {self.rank}: training rank {self.training_rank} of {self.training_world_size} "
            f"on {self.training_device}"
        )


def plan_rank_layout(
    extraction_ranks: int,
    *,
    rank: int,
    world_size: int,
    local_rank: int,
    local_world_size: int,
    engine_gpus: int,
    gpus_on_node: int,
) -> RankLayout:
    """This rank's layout, or a one-line `TrainSetupError` naming what cannot work.

    `engine_gpus` is TP x PP; `gpus_on_node` the GPUs this process sees (0: everything on the CPU).
    """
    if extraction_ranks < 1:
        raise TrainSetupError(f"{FLAG} must be at least 1, got {extraction_ranks}")
    if extraction_ranks >= world_size:
        raise TrainSetupError(
            f"{FLAG} {extraction_ranks} leaves no training rank among torchrun's {world_size} "
            "processes: start more processes (--nproc-per-node, --nnodes) or extract on fewer"
        )
    if local_world_size < 1 or not 0 <= local_rank < local_world_size:
        raise TrainSetupError(f"local rank {local_rank} is not in [0, {local_world_size})")
    node_first = rank - local_rank
    node_extractors = max(0, min(extraction_ranks - node_first, local_world_size))
    node_trainers = local_world_size - node_extractors
    if gpus_on_node == 0:  # the CPU: the engines and the trainers share it
        if rank < extraction_ranks:
            return RankLayout(
                rank, world_size, extraction_ranks, node_extraction_ranks=node_extractors
            )
        return RankLayout(
            rank,
            world_size,
            extraction_ranks,
            training_device="cpu",
            node_extraction_ranks=node_extractors,
        )
    needed = node_extractors * engine_gpus + node_trainers
    if needed > gpus_on_node:
        node = f"the node of ranks {node_first}-{node_first + local_world_size - 1}"
        raise TrainSetupError(
            f"{FLAG} {extraction_ranks}: {node} needs {needed} GPUs ({node_extractors} extraction "
            f"ranks x TP x PP {engine_gpus} + {node_trainers} training ranks x 1) but sees "
            f"{gpus_on_node}; use fewer processes there or a smaller TP x PP"
        )
    if local_rank < node_extractors:
        first = local_rank * engine_gpus
        return RankLayout(
            rank,
            world_size,
            extraction_ranks,
            engine_devices=tuple(range(first, first + engine_gpus)),
            node_extraction_ranks=node_extractors,
        )
    index = node_extractors * engine_gpus + (local_rank - node_extractors)
    return RankLayout(
        rank,
        world_size,
        extraction_ranks,
        training_device=f"cuda:{index}",
        node_extraction_ranks=node_extractors,
    )
