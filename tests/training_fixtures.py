"""Training test helpers: sample files from a tiny verifier's real hidden states, CLI runs."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from speculators_vllm016.data_generation.sample_io import write_sample
from speculators_vllm016.train.vocab_mapping import build_vocab_mappings_from_distribution
from tests.hf_reference import HFReference

LAYER_IDS = [0, 1, 2, 3]  # the tiny Llama has 4 layers: 3 fused + the last
DRAFT_VOCAB = 64


def write_dataset(
    verifier: Path,
    out: Path,
    lengths: list[int],
    seed: int = 0,
    output_format: str = "pt",
    layer_ids: list[int] = LAYER_IDS,
) -> Path:
    """Sample files in datagen's layout from the verifier's own (fp32) hidden states of
    `layer_ids` (datagen's numbering; the tiny Llama's 4 layers by default)."""
    reference = HFReference(verifier)
    vocab = reference.model.config.vocab_size
    generator = torch.Generator().manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    counts: dict[int, int] = {}
    for index, length in enumerate(lengths):
        ids = torch.randint(0, vocab, (length,), generator=generator)
        mask = (torch.rand(length, generator=generator) > 0.3).long()
        states = reference.streams(ids.tolist(), layer_ids)
        suffix = "pt" if output_format == "pt" else "safetensors"
        write_sample(
            out / f"data_{index}.{suffix}",
            {"input_ids": ids, "hidden_states": states, "loss_mask": mask},
            output_format=output_format,
        )
        for token in ids[mask.bool()].tolist():
            counts[token] = counts.get(token, 0) + 1
    (out / "data_config.json").write_text(json.dumps({"hidden_states": {"layer_ids": layer_ids}}))
    torch.save(counts, out / "token_freq.pt")
    return out


def write_vocab_maps(data: Path, target_vocab: int, out: Path) -> tuple[Path, Path]:
    counts = torch.load(data / "token_freq.pt", weights_only=True)
    d2t, t2d = build_vocab_mappings_from_distribution(counts, DRAFT_VOCAB, target_vocab)
    np.save(out / "d2t.npy", d2t.numpy())
    np.save(out / "t2d.npy", t2d.numpy())
    return out / "d2t.npy", out / "t2d.npy"


def train_args(verifier: Path, data: Path, save: Path, *extra: str) -> list[str]:
    """A small, fast, deterministic training command line."""
    return [
        "--verifier-name-or-path",
        str(verifier),
        "--data-path",
        str(data),
        "--save-path",
        str(save),
        "--d2t-path",
        str(data.parent / "d2t.npy"),
        "--t2d-path",
        str(data.parent / "t2d.npy"),
        "--total-seq-len",
        "256",
        "--epochs",
        "2",
        "--lr",
        "1e-3",
        "--num-workers",
        "0",
        "--no-progress",
        "--log-dir",
        str(save.parent / "logs"),
        *extra,
    ]


# A schedule that does not depend on the number of epochs: a run continued with more epochs
# keeps it (tests of resumed settings compare learning rates step by step).
FIXED_SCHEDULE = ("--scheduler-warmup-steps", "0", "--scheduler-total-steps", "100")


def train_finished_run(verifier: Path, data: Path, save: Path) -> Path:
    """One whole epoch of training in this process (`--epochs 1`, `FIXED_SCHEDULE`): a finished
    run whose checkpoint `<save>/0` tests resume, evaluate or rerun (copy it before changing it)."""
    from speculators_vllm016.cli.train import main

    assert main(train_args(verifier, data, save, "--epochs", "1", *FIXED_SCHEDULE)) == 0
    return save


REPO = Path(__file__).resolve().parents[2]


def cli_env() -> dict[str, str]:
    import os

    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    return env


def train_command(args: list[str], processes: int = 1) -> list[str]:
    """`speculators train` in a fresh interpreter; under torchrun (gloo) for several processes."""
    import sys

    if processes == 1:
        return [sys.executable, "-m", "speculators_vllm016", "train", *args]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={processes}",
        "-m",
        "speculators_vllm016",
        "train",
        *args,
    ]


def load_checkpoint_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Weights (master where present) and every optimizer-state tensor of a checkpoint, by name."""
    from safetensors.torch import load_file

    tensors = {f"model/{k}": v for k, v in load_file(folder / "model.safetensors").items()}
    if (folder / "master_weights.safetensors").exists():
        tensors.update(
            {f"master/{k}": v for k, v in load_file(folder / "master_weights.safetensors").items()}
        )
    optimizer = torch.load(folder / "optimizer_state_dict.pt", weights_only=True)
    for name, state in optimizer["state"].items():
        for key, value in state.items():
            tensors[f"optim/{name}/{key}"] = torch.as_tensor(value)
    return tensors


def finished_checkpoints(save: Path) -> list[str]:
    """Checkpoint folders whose save finished (renamed into place; a hidden `.tmp-` folder is a
    save in progress or one that a kill interrupted)."""
    if not save.is_dir():
        return []
    return sorted(
        p.parent.name
        for p in save.glob("*/training_state.json")
        if not p.parent.name.startswith(".")
    )


def free_port() -> int:
    """A TCP port free on this host now, for a test's own process group (gloo rendezvous)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def gloo_group(rank: int, port: int, world_size: int = 2) -> Iterator[None]:
    """One rank's membership of a test's own gloo group (CPU), left safely.

    A rank that leaves without error first waits at a barrier for the others: a rank that tore
    gloo down while another still used it aborted ("terminate called without an active
    exception") in about one run in three of the FSDP2 tests, and hung once in a CI run of the
    DDP one. Objects that hold the group (DDP's reducer, FSDP2's device mesh) must be dropped
    inside the block (`del`, then `gc.collect()`): one that outlives it is torn down at exit.
    """
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()
