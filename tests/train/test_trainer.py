"""The trainer end to end on CPU: checkpoints, exact resume after SIGKILL, SIGTERM and Ctrl-C, 0.3.0 folders."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors import safe_open

from speculators_vllm016.cli.train import main
from tests.training_fixtures import (
    cli_env,
    finished_checkpoints,
    load_checkpoint_tensors,
    train_args,
    train_command,
)


def metric_steps(save: Path) -> int:
    path = save / "metrics.jsonl"
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines() if '"train"' in line)


def assert_same_checkpoint(expected: Path, actual: Path) -> None:
    want, got = load_checkpoint_tensors(expected), load_checkpoint_tensors(actual)
    assert sorted(want) == sorted(got)
    different = [name for name in want if not torch.equal(want[name], got[name])]
    assert not different, f"not bit-identical: {different[:5]}"


@pytest.fixture(scope="module")
def trained(tiny_llama, training_data, tmp_path_factory) -> Path:
    """Two epochs straight, in this process."""
    save = tmp_path_factory.mktemp("trained") / "ckpt"
    assert main(train_args(tiny_llama, training_data, save)) == 0
    return save


def test_checkpoints_have_the_030_layout_and_what_vllm_needs(trained, training_data):
    assert (trained / "0").is_dir() and (trained / "1").is_dir()
    assert os.readlink(trained / "best") in {"0", "1"}
    folder = trained / "1"
    for name in [
        "config.json",
        "model.safetensors",
        "optimizer_state_dict.pt",
        "scheduler_state_dict.pt",
        "training_state.json",
        "rng_state_rank0.pt",
        "master_weights.safetensors",
    ]:
        assert (folder / name).is_file(), name
    config = json.loads((folder / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    # D8: datagen captured the outputs of layers 0..3; vLLM counts inputs, so fused ids + 1.
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert config["speculators_config"]["verifier"]["architectures"] == ["LlamaForCausalLM"]
    assert config["norm_before_residual"] is True
    with safe_open(str(folder / "model.safetensors"), "pt") as handle:
        names = set(handle.keys())
        assert handle.get_tensor("fc.weight").dtype == torch.bfloat16
    assert "fc.weight" in names and "d2t" in names and "t2d" in names
    assert not any(name.startswith("verifier_") for name in names), "verifier weights saved (D1)"
    with safe_open(str(folder / "master_weights.safetensors"), "pt") as handle:
        assert handle.get_tensor("fc.weight").dtype == torch.float32
    optimizer = torch.load(folder / "optimizer_state_dict.pt", weights_only=True)
    moments = [state["exp_avg"] for state in optimizer["state"].values()]
    assert moments and all(m.dtype == torch.float32 for m in moments), "optimizer state cast (D2)"
    assert all(state["step"].dtype == torch.float32 for state in optimizer["state"].values())
    state = json.loads((folder / "training_state.json").read_text())
    assert state["epoch"] == 1 and state["epoch_complete"] and state["global_step"] > 2
    lines = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    train_lines = [line for line in lines if "train" in line]
    assert [line["step"] for line in train_lines] == list(range(state["global_step"]))
    val = [line for line in lines if "val" in line]
    assert len(val) == 2 and all("tau_sim" in line["val"] for line in val)
    full = [v for k, v in val[-1]["val"].items() if k.startswith("full_acc_")]
    assert val[-1]["val"]["tau_sim"] == pytest.approx(1 + sum(full))


def test_saved_draft_loads_back_with_the_trained_weights(trained):
    from safetensors.torch import load_file

    from speculators_vllm016.model import SpeculatorModel

    draft = SpeculatorModel.from_pretrained(str(trained / "1"))
    saved = load_file(trained / "1" / "model.safetensors")
    state = draft.state_dict()
    for name, tensor in saved.items():
        assert torch.equal(state[name].to(tensor.dtype), tensor), name


def _run_killed(
    command: list[str], save: Path, kill_at: int, sig: int, need_checkpoint: bool = False
) -> tuple[int, str]:
    """Start `command`, stop it with `sig` once `kill_at` steps are logged (and, with
    `need_checkpoint`, once a complete checkpoint exists); its return code and output."""
    process = subprocess.Popen(
        command,
        env=cli_env(),
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )

    def ready() -> bool:
        return metric_steps(save) >= kill_at and (
            not need_checkpoint or bool(finished_checkpoints(save))
        )

    try:
        while process.poll() is None and not ready():
            time.sleep(0.02)
        if process.poll() is None:
            # torchrun starts its workers in sessions of their own: signal the whole tree.
            tree = psutil.Process(process.pid)
            for member in [tree, *tree.children(recursive=True)]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    member.send_signal(sig)
        output, _ = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode is not None
    return process.returncode, output


@pytest.mark.slow
@pytest.mark.parametrize(("processes", "parallel"), [(1, None), (2, "fsdp"), (2, "ddp")])
def test_sigkill_then_resume_is_bit_identical(
    tiny_llama, training_data, tmp_path, processes, parallel
):
    epochs = 2 if processes == 1 else 3  # two ranks halve the steps of an epoch
    last = str(epochs - 1)
    extra = ["--checkpoint-freq", "0.25", "--epochs", str(epochs)]
    if parallel is not None:
        extra += ["--parallel", parallel]
    straight = tmp_path / "straight"
    done = subprocess.run(
        train_command(train_args(tiny_llama, training_data, straight, *extra), processes),
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    total = json.loads((straight / last / "training_state.json").read_text())["global_step"]
    assert total >= 8

    resumed = tmp_path / "resumed"
    command = train_command(train_args(tiny_llama, training_data, resumed, *extra), processes)
    kill_at = random.Random(os.getpid()).randint(2, total - 4)
    # Killed only once a checkpoint is complete: otherwise the rerun starts from scratch and
    # the resume path this test is about would not run.
    code, _ = _run_killed(command, resumed, kill_at, signal.SIGKILL, need_checkpoint=True)
    assert code != 0, "the run finished before the kill"
    assert not (resumed / last).exists()
    logged = metric_steps(resumed)
    assert kill_at <= logged < total
    again = subprocess.run(command, env=cli_env(), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "resuming from" in again.stderr
    assert_same_checkpoint(straight / last, resumed / last)
    steps = [
        json.loads(line)["step"]
        for line in (resumed / "metrics.jsonl").read_text().splitlines()
        if '"train"' in line
    ]
    assert steps == list(range(total)), "metrics of the killed run's lost steps were not replaced"


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "name"), [(signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "Ctrl-C")])
def test_sigterm_or_ctrl_c_writes_a_checkpoint_and_the_rerun_finishes_identically(
    tiny_llama, training_data, tmp_path, trained, sig, name
):
    save = tmp_path / "ckpt"
    command = train_command(train_args(tiny_llama, training_data, save))
    code, output = _run_killed(command, save, 2, sig)
    assert code == 128 + sig, output[-2000:]  # 143 after SIGTERM, 130 after Ctrl-C
    assert (
        f"stopped by {name} at step" in output and "run the same command again to resume" in output
    )
    mid = [p.name for p in save.iterdir() if "-step" in p.name]
    assert len(mid) == 1
    again = subprocess.run(command, env=cli_env(), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert_same_checkpoint(trained / "1", save / "1")


def test_a_030_layout_folder_resumes_at_the_next_epoch(
    tiny_llama, training_data, tmp_path, trained
):
    save = tmp_path / "ckpt"
    save.mkdir()
    legacy = save / "0"
    shutil.copytree(trained / "0", legacy)
    for name in ["training_state.json", "rng_state_rank0.pt", "master_weights.safetensors"]:
        (legacy / name).unlink()
    # 0.3.0 wrote the optimizer state in bf16, keyed by index.
    optimizer = torch.load(legacy / "optimizer_state_dict.pt", weights_only=True)
    names = optimizer["param_groups"][0]["params"]
    optimizer["state"] = {
        names.index(k): {n: v.to(torch.bfloat16) for n, v in s.items()}
        for k, s in optimizer["state"].items()
    }
    optimizer["param_groups"][0]["params"] = list(range(len(names)))
    torch.save(optimizer, legacy / "optimizer_state_dict.pt")
    assert main(train_args(tiny_llama, training_data, save)) == 0
    state = json.loads((save / "1" / "training_state.json").read_text())
    first = json.loads((trained / "0" / "training_state.json").read_text())
    assert state["epoch"] == 1 and state["global_step"] > first["global_step"]
    steps = [json.loads(line)["step"] for line in (save / "metrics.jsonl").read_text().splitlines()]
    assert steps[0] == first["global_step"], "0.3.0 resume must continue the step count"


def test_no_resume_starts_over(tiny_llama, training_data, tmp_path, trained):
    save = tmp_path / "ckpt"
    shutil.copytree(trained, save, symlinks=True)
    (save / "metrics.jsonl").unlink()
    assert main(train_args(tiny_llama, training_data, save, "--no-resume-from-checkpoint")) == 0
    steps = [json.loads(line)["step"] for line in (save / "metrics.jsonl").read_text().splitlines()]
    assert steps[0] == 0
