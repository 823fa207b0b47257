"""Two processes (gloo, CPU) train exactly like one process on the same packed rows."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from speculators_vllm016.cli.train import build_parser
from speculators_vllm016.models.eagle3 import Eagle3DraftModel
from speculators_vllm016.train.data import Eagle3SampleFileDataset, create_collate_fn, split_files
from speculators_vllm016.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2
from speculators_vllm016.train.jobs.draft_build import build_draft_config
from speculators_vllm016.train.jobs.setup import verifier_text_config
from tests.training_fixtures import cli_env, free_port, gloo_group, train_args, train_command


def reference_step(argv: list[str]) -> dict[str, torch.Tensor]:
    """One optimizer step in this process on both ranks' rows, losses averaged (what DP computes)."""
    args = build_parser().parse_args(argv)
    verifier_config, text = verifier_text_config(args.verifier_name_or_path)
    d2t = torch.from_numpy(np.load(args.d2t_path)).long()
    t2d = torch.from_numpy(np.load(args.t2d_path)).bool()
    torch.manual_seed(args.seed)
    config = build_draft_config(
        args.verifier_name_or_path,
        verifier_config,
        text,
        draft_vocab=len(d2t),
        num_layers=1,
        norm_before_residual=True,
        ttt_steps=3,
        aux_layer_ids=[1, 2, 3],
    )
    model = Eagle3DraftModel(config, t2d=t2d, d2t=d2t)
    train_files, _ = split_files(args.data_path, 0.9, 0)
    dataset = Eagle3SampleFileDataset(args.total_seq_len, file_list=[str(f) for f in train_files])
    collate = create_collate_fn(args.total_seq_len)
    rows = []
    for rank in range(2):
        sampler = MultipackDistributedBatchSamplerV2(
            args.total_seq_len, dataset.lengths, 2, rank, seed=0
        )
        rows.append(collate([dataset[i] for i in sampler.batches(0)[0]]))
    optimizer = torch.optim.AdamW(list(model.named_parameters()), lr=args.lr, weight_decay=0.01)
    losses = []
    for row in rows:
        inputs = {k: v for k, v in row.items() if k != "skipped_samples"}
        output = model(
            **inputs,
            ttt_steps=3,
            ttt_step_loss_decay=1.0,
            use_off_policy_tokens=args.teacher_forcing,
        )
        losses.append(output.loss if hasattr(output, "loss") else output[1])
    (sum(losses) / 2).backward()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
    optimizer.step()
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["fsdp", "ddp"])
def test_one_step_on_two_processes_equals_one_process(
    tiny_llama, training_data, tmp_path, parallel
):
    save = tmp_path / "ckpt"
    argv = train_args(
        tiny_llama,
        training_data,
        save,
        "--max-steps",
        "1",
        "--noise-type",
        "none",
        "--parallel",
        parallel,
    )
    done = subprocess.run(
        train_command(argv, processes=2), env=cli_env(), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # Throughput is read off the metrics: every step logs its tokens and wall-clock seconds.
    lines = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    steps = [line["train"] for line in lines if "train" in line]
    assert steps and all(step["step_seconds"] > 0 and step["tokens"] > 0 for step in steps)
    trained = load_file(save / "0-step1" / "master_weights.safetensors")
    expected = reference_step(argv)
    assert sorted(trained) == sorted(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(trained[name], tensor, rtol=1e-5, atol=1e-5, msg=name)


def _gradients_under_ddp_modes(rank: int, port: int, verifier: str, out: str) -> None:
    """Two steps of the tiny draft under plain, static-graph and find-unused DDP; rank 0 saves
    each mode's gradients after the second step."""
    import gc

    from torch.nn.parallel import DistributedDataParallel

    from tests.models.test_eagle3 import batch, eagle3_config
    from tests.models.test_eagle3_training import vocab_maps

    torch.set_num_threads(1)
    with gloo_group(rank, port):
        found = {}
        for mode in ("plain", "static_graph", "find_unused_parameters"):
            torch.manual_seed(0)
            d2t, t2d = vocab_maps()
            draft = Eagle3DraftModel(eagle3_config(verifier), t2d=t2d, d2t=d2t)
            wrapped = DistributedDataParallel(
                draft,
                static_graph=mode == "static_graph",
                find_unused_parameters=mode == "find_unused_parameters",
            )
            for step in range(2):  # static graph handles its first iteration apart
                draft.zero_grad(set_to_none=True)
                wrapped(**batch(seed=10 * step + rank), ttt_steps=2).loss.backward()
            found[mode] = {
                n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None
            }
        if rank == 0:
            torch.save(found, out)
        del wrapped  # DDP's reducer lets go of the group before the group goes
        gc.collect()


@pytest.mark.slow
def test_static_graph_and_unused_parameter_ddp_average_like_plain_ddp(tiny_llama, tmp_path):
    import torch.multiprocessing as mp

    out = tmp_path / "grads.pt"
    mp.spawn(
        _gradients_under_ddp_modes,
        args=(free_port(), str(tiny_llama), str(out)),
        nprocs=2,
        join=True,
    )
    found = torch.load(out)
    plain = found["plain"]
    assert plain and "lm_head.weight" in plain
    for mode in ("static_graph", "find_unused_parameters"):
        assert found[mode].keys() == plain.keys(), mode
        for name, grad in plain.items():
            torch.testing.assert_close(found[mode][name], grad, msg=f"{mode}: {name}")


def _rows(training_data: str, rank: int) -> dict:
    """Rank 0's row holds two samples; rank 1's row lost all of its samples (unusable)."""
    from pathlib import Path

    files = sorted(Path(training_data).glob("data_*.pt"))[:2]
    dataset = Eagle3SampleFileDataset(128, file_list=[str(f) for f in files])
    collate = create_collate_fn(128)
    return collate([dataset[0], dataset[1]]) if rank == 0 else collate([None])


def _gradients_beside_an_empty_rank(
    rank: int, port: int, verifier: str, data: str, save: str, out: str
) -> None:
    """One step of the real trainer (DDP, gloo); rank 0 saves the averaged gradients."""
    import gc
    from pathlib import Path

    from tests.train.test_data import tiny_trainer

    torch.set_num_threads(1)
    with gloo_group(rank, port):
        row = _rows(data, rank)
        trainer = tiny_trainer(
            Path(verifier),
            Path(data),
            Path(save) / str(rank),
            [row],
            [],
            is_distributed=True,
            local_rank=rank,
            parallel="ddp",
            max_grad_norm=1e9,
        )
        trainer.train_step(row)
        grads = {n: p.grad for n, p in trainer.model.named_parameters() if p.grad is not None}
        if rank == 0:
            torch.save(grads, out)
        del trainer  # DDP's reducer lets go of the group before the group goes
        gc.collect()


@pytest.mark.slow
def test_a_rank_with_an_empty_row_does_not_scale_the_others_step_down(
    tiny_llama, training_data, tmp_path
):
    """The step's gradient is that of the rows that were there: rank 0's row alone, as one
    process gets it, not half of it (the empty rank's zeros averaged in)."""
    import torch.multiprocessing as mp

    from tests.train.test_data import tiny_trainer

    out = tmp_path / "grads.pt"
    mp.spawn(
        _gradients_beside_an_empty_rank,
        args=(free_port(), str(tiny_llama), str(training_data), str(tmp_path / "ranks"), str(out)),
        nprocs=2,
        join=True,
    )
    found = torch.load(out)
    row = _rows(str(training_data), 0)
    alone = tiny_trainer(
        tiny_llama, training_data, tmp_path / "alone", [row], [], max_grad_norm=1e9
    )
    alone.train_step(row)
    expected = {n: p.grad for n, p in alone.model.named_parameters() if p.grad is not None}
    assert found.keys() == expected.keys() and "fc.weight" in expected
    for name, grad in expected.items():
        torch.testing.assert_close(found[name], grad, rtol=1e-5, atol=1e-7, msg=name)
