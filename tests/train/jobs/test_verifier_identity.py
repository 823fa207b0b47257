"""The verifier's identity (its final norm and LM head, hashed): datagen records it, training
refuses a verifier of the same shapes but other weights, `eval` refuses a draft trained for
another verifier; --allow-other-verifier lets a deliberate change through (#37 item 14)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from speculators_vllm016.__main__ import app
from speculators_vllm016.cli.train import main as train_main
from speculators_vllm016.data_generation.config_generator import (
    DataGenerationConfig,
    read_data_config,
)
from speculators_vllm016.tiny_models import build_tiny_llama
from speculators_vllm016.utils.verifier_weights import verifier_fingerprint
from tests.training_fixtures import train_args


@pytest.fixture(scope="module")
def twin(tmp_path_factory) -> Path:
    """A verifier of the tiny Llama's shapes (and tokenizer) with other weights."""
    return build_tiny_llama(tmp_path_factory.mktemp("twin") / "llama", seed=1)


def _data_from(training_data: Path, tmp_path: Path, target: Path) -> Path:
    """`training_data` with a data_config.json that names `target` and its fingerprint."""
    data = tmp_path / "data"
    shutil.copytree(training_data, data)
    for name in ("d2t.npy", "t2d.npy"):
        shutil.copy(training_data.parent / name, tmp_path / name)
    config = json.loads((data / "data_config.json").read_text())
    config["model"] = {
        "target_model_path": str(target),
        "tensor_parallel_size": 1,
        "gpu_memory_utilization": 0.8,
        "hidden_size": 256,
        "verifier_fingerprint": verifier_fingerprint(str(target)),
    }
    (data / "data_config.json").write_text(json.dumps(config))
    return data


def test_datagen_records_the_fingerprint_and_readers_tolerate_folders_without_it(
    tiny_llama, tmp_path
):
    generator = SimpleNamespace(
        model_path=str(tiny_llama),
        tensor_parallel_size=1,
        hidden_size=256,
        layer_ids=[0, 1, 2, 3],
        dtype="torch.bfloat16",
        vllm_config=SimpleNamespace(cache_config=SimpleNamespace(gpu_memory_utilization=0.8)),
    )
    config = DataGenerationConfig.from_generator(generator, "chat.jsonl", 64, str(tmp_path), 3)
    (tmp_path / "data_config.json").write_text(json.dumps(config.to_dict()))
    assert read_data_config(tmp_path).model.verifier_fingerprint == verifier_fingerprint(
        str(tiny_llama)
    )
    older = config.to_dict()
    del older["model"]["verifier_fingerprint"]
    (tmp_path / "data_config.json").write_text(json.dumps(older))
    assert read_data_config(tmp_path).model.verifier_fingerprint is None


def test_the_fingerprint_tells_weights_apart_and_reads_the_kimi_wrapper(
    tiny_llama, twin, tiny_kimi_k25, tiny_deepseek_v3
):
    assert verifier_fingerprint(str(tiny_llama)) != verifier_fingerprint(str(twin))
    assert verifier_fingerprint(str(tiny_llama)) == verifier_fingerprint(str(tiny_llama))
    # The wrapper keeps the language model's tensors under `language_model.`.
    assert verifier_fingerprint(str(tiny_kimi_k25)) == verifier_fingerprint(str(tiny_deepseek_v3))


def test_training_against_another_verifier_of_the_same_shapes_is_refused(
    tiny_llama, twin, training_data, tmp_path, capfd, caplog
):
    data = _data_from(training_data, tmp_path, tiny_llama)
    save = tmp_path / "save"
    capfd.readouterr()
    assert train_main(train_args(twin, data, save, "--max-steps", "1")) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--allow-other-verifier" in err[0] and str(tiny_llama) in err[0], err
    assert not save.exists()

    assert (
        train_main(train_args(twin, data, save, "--max-steps", "1", "--allow-other-verifier")) == 0
    )
    assert any(
        "--allow-other-verifier" in r.getMessage() and r.levelname == "WARNING"
        for r in caplog.records
    )
    assert train_main(train_args(tiny_llama, data, tmp_path / "right", "--max-steps", "1")) == 0


def test_eval_refuses_a_draft_trained_for_another_verifier(
    finished_run, tiny_llama, twin, tmp_path
):
    draft = finished_run / "0"
    recorded = json.loads((draft / "config.json").read_text())["speculators_config"]["verifier"]
    assert recorded["weights_fingerprint"] == verifier_fingerprint(str(tiny_llama))
    chat = tmp_path / "chat.jsonl"
    chat.write_text(
        json.dumps(
            {
                "conversations": [
                    {"from": "human", "value": "Hi?"},
                    {"from": "gpt", "value": "Hello."},
                ]
            }
        )
        + "\n"
    )
    base = [
        "eval",
        "--draft",
        str(draft),
        "--data-path",
        str(chat),
        "--engine",
        "hf",
        "--max-prompts",
        "1",
        "--max-new-tokens",
        "4",
        "--no-progress",
        "--verifier",
        str(twin),
    ]
    result = CliRunner().invoke(app, base)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.strip().splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "--allow-other-verifier" in lines[0], result.output
    result = CliRunner().invoke(app, [*base, "--allow-other-verifier"])
    assert result.exit_code == 0, result.output
