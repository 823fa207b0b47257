"""#29 item 15: a resumed datagen run whose engine makes other tensors than the kept files (same
flags, same token ids: `--dtype auto` resolved otherwise, another device, adopted files) is
refused before it writes, so a folder never ends up mixed. A stand-in engine, no vLLM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from speculators_vllm016.data_generation import offline, output_folder
from speculators_vllm016.data_generation.offline import run_datagen
from speculators_vllm016.data_generation.options import DatagenOptions
from speculators_vllm016.data_generation.sample_io import load_sample
from speculators_vllm016.data_generation.vllm_hidden_states_generator import HiddenStatesResult
from speculators_vllm016.demo import demo_conversations_path

ROWS = 8


class StandIn:
    """Seeded states of the model's width in `dtype`, as an engine of that dtype makes them."""

    def __init__(self, dtype: torch.dtype, hidden_size: int, layers: int) -> None:
        self.dtype, self.hidden_size, self.layers = dtype, hidden_size, layers
        self.calls = 0

    def generate_stream(self, sequences):
        self.calls += 1
        for k, ids in enumerate(sequences):
            seed = torch.Generator().manual_seed(sum(ids))
            states = torch.randn(self.layers, len(ids), self.hidden_size, generator=seed)
            yield (
                k,
                HiddenStatesResult(
                    input_ids=torch.tensor(ids), hidden_states=list(states.to(self.dtype).unbind(0))
                ),
            )

    def close(self) -> None:
        pass


@pytest.fixture
def run(tiny_llama, tmp_path, monkeypatch):
    """`run(dtype, **flags)`: datagen into one folder with an engine that makes `dtype` states."""
    chats = tmp_path / "chats.jsonl"
    chats.write_text("\n".join(demo_conversations_path().read_text().splitlines()[:ROWS]) + "\n")
    hidden = json.loads((Path(tiny_llama) / "config.json").read_text())["hidden_size"]
    engines: list[StandIn] = []

    def start(options, facts, generator_class=None):
        engines.append(StandIn(engines_dtype[0], hidden, len(facts.layer_ids)))
        return engines[-1]

    engines_dtype = [torch.float32]
    monkeypatch.setattr(offline, "start_generator", start)
    monkeypatch.setattr(output_folder, "data_config_of", lambda *args: None)

    def go(makes: torch.dtype, **flags):
        engines_dtype[0] = makes
        return run_datagen(
            DatagenOptions(
                target_model_path=str(tiny_llama),
                train_data_path=str(chats),
                output_dir=str(tmp_path / "out"),
                seq_length=64,
                batch_size=4,
                max_samples=ROWS,
                hf_cache_dir=str(tmp_path / "hf"),
                num_preprocessing_workers=1,
                show_progress=False,
                **flags,
            )
        )

    go.folder = tmp_path / "out"
    go.engines = engines
    return go


def dtypes(folder: Path) -> set[torch.dtype]:
    return {load_sample(path)["hidden_states"][0].dtype for path in folder.glob("data_*.pt")}


def test_a_resume_whose_engine_makes_another_dtype_is_refused_before_it_writes(run):
    first = run(torch.float32)  # --dtype auto: the model's config says float32 here
    assert first.samples_written == ROWS
    folder = run.folder
    for index in (5, 6):  # a run stopped before its last batch
        (folder / f"data_{index}.pt").unlink()
    # The same command, but `auto` now resolves to bfloat16 (config edited, another device).
    with pytest.raises(
        ValueError,
        match=(
            rf"^--output-dir {folder} holds samples of a different run \(data_0.pt holds "
            r"torch.float32 hidden states \d+ wide; this run's engine makes torch.bfloat16, \d+ wide: "
            r"another --dtype, model or device\); use another --output-dir or remove it$"
        ),
    ):
        run(torch.bfloat16)
    assert not (folder / "data_5.pt").exists() and dtypes(folder) == {torch.float32}
    # The engine that makes what the folder holds finishes it.
    again = run(torch.float32)
    assert again.samples_written == 2 and dtypes(folder) == {torch.float32}


def test_adopted_files_of_another_dtype_are_refused_too(run):
    run(torch.bfloat16)
    folder = run.folder
    (folder / ".datagen_state.json").unlink()
    for path in (folder / "manifest").iterdir():
        path.unlink()
    (folder / "data_7.pt").unlink()
    with pytest.raises(ValueError, match="data_0.pt holds torch.bfloat16 hidden states"):
        run(torch.float32, adopt_existing=True)
    assert not (folder / ".datagen_state.json").exists()  # refused: the folder stays unrecorded
    assert run(torch.bfloat16, adopt_existing=True).samples_written == 1


def test_a_complete_folder_starts_no_engine_and_a_folder_of_before_resumes(run):
    run(torch.float32)
    folder = run.folder
    assert run(torch.float32).samples_written == 0 and len(run.engines) == 1
    # A record written before num_samples was recorded resumes with the same command.
    state = folder / ".datagen_state.json"
    record = json.loads(state.read_text())
    del record["details"]["num_samples"]
    state.write_text(json.dumps(record))
    (folder / "data_3.pt").unlink()
    assert run(torch.float32).samples_written == 1


def test_another_dtype_flag_is_refused_before_the_engine_starts(run):
    run(torch.float32, dtype="float32")
    (run.folder / "data_1.pt").unlink()
    with pytest.raises(
        ValueError, match="different run \\(dtype: was 'float32', now 'bfloat16'\\)"
    ):
        run(torch.bfloat16, dtype="bfloat16")
    assert len(run.engines) == 1
