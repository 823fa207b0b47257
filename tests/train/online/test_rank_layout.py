"""Who extracts and who trains under `--extraction-ranks` (pure logic, no process group)."""

from __future__ import annotations

import pytest

from speculators_vllm016.train.jobs.job_config import TrainSetupError
from speculators_vllm016.train.online.rank_layout import plan_rank_layout


def layout(k, rank, world, local_world, *, engine_gpus=1, gpus=0):
    return plan_rank_layout(
        k,
        rank=rank,
        world_size=world,
        local_rank=rank % local_world,
        local_world_size=local_world,
        engine_gpus=engine_gpus,
        gpus_on_node=gpus,
    )


def test_the_first_k_ranks_extract_and_the_rest_train_as_a_world_of_their_own():
    ranks = [layout(2, rank, 5, 5) for rank in range(5)]
    assert [r.extracts for r in ranks] == [True, True, False, False, False]
    assert [r.training_rank for r in ranks[2:]] == [0, 1, 2]
    assert {r.training_world_size for r in ranks} == {3}
    assert ranks[3].global_rank_of_training_rank(0) == 2
    with pytest.raises(ValueError):
        ranks[0].training_rank  # noqa: B018 - an extraction rank has none
    assert all(r.training_device == "cpu" for r in ranks[2:]) and ranks[0].engine_devices == ()


def test_steps_go_round_robin_over_the_extraction_ranks():
    two = layout(2, 3, 4, 4)
    assert [two.extraction_rank_of_step(step) for step in range(5)] == [0, 1, 0, 1, 0]
    one = layout(1, 2, 3, 3)
    assert {one.extraction_rank_of_step(step) for step in range(7)} == {0}


def test_two_nodes_engine_node_at_tp8_and_a_training_node_of_eight_gpus():
    engine = layout(1, 0, 9, 1, engine_gpus=8, gpus=8)  # node A: one rank, TP8
    assert engine.extracts and engine.engine_devices == tuple(range(8))
    trainers = [
        plan_rank_layout(
            1,
            rank=1 + local,
            world_size=9,
            local_rank=local,
            local_world_size=8,
            engine_gpus=8,
            gpus_on_node=8,
        )
        for local in range(8)
    ]
    assert [t.training_device for t in trainers] == [f"cuda:{i}" for i in range(8)]
    assert [t.training_rank for t in trainers] == list(range(8))


def test_one_node_shares_its_gpus_engine_first_then_one_per_trainer():
    ranks = [layout(1, rank, 3, 3, engine_gpus=6, gpus=8) for rank in range(3)]
    assert ranks[0].engine_devices == tuple(range(6))
    assert [r.training_device for r in ranks[1:]] == ["cuda:6", "cuda:7"]


@pytest.mark.parametrize(
    "k, world, says",
    [
        (2, 2, "--extraction-ranks 2 leaves no training rank among torchrun's 2 processes"),
        (3, 2, "leaves no training rank"),
        (0, 4, "--extraction-ranks must be at least 1"),
    ],
)
def test_a_layout_without_training_ranks_is_one_line(k, world, says):
    with pytest.raises(TrainSetupError, match=says) as raised:
        layout(k, 0, world, world)
    assert "\n" not in str(raised.value)


def test_tp_times_pp_beyond_the_nodes_gpus_is_one_line_naming_the_count():
    with pytest.raises(TrainSetupError) as raised:
        layout(1, 0, 3, 3, engine_gpus=8, gpus=8)  # 8 for the engine + 2 trainers > 8
    message = str(raised.value)
    assert "needs 10 GPUs" in message and "sees 8" in message and "\n" not in message
