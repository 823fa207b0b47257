"""`speculators convert` never damages what it reads, and publishes only whole, checked output."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from speculators_vllm016.convert import convert_model
from tests.convert.test_converters import H, eagle3_checkpoint


def snapshot(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def no_leftovers(parent: Path) -> None:
    assert not [p.name for p in parent.iterdir() if p.name.startswith(".")], list(parent.iterdir())


@pytest.fixture
def verifier(tiny_llama, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_llama, tmp_path / "verifier"))


def test_input_and_verifier_folders_are_never_written(tmp_path, verifier):
    source, _ = eagle3_checkpoint(tmp_path / "research")
    before = snapshot(verifier), snapshot(source)
    for target in (verifier, source, tmp_path, verifier / "sub"):
        with pytest.raises(ValueError, match="would overwrite"):
            convert_model(
                str(source), str(verifier), "eagle3", output_path=str(target), overwrite=True
            )
    assert (snapshot(verifier), snapshot(source)) == before


def test_non_empty_output_needs_overwrite_and_is_then_replaced_whole(tmp_path, verifier):
    source, _ = eagle3_checkpoint(tmp_path / "research")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty; pass --overwrite"):
        convert_model(str(source), str(verifier), "eagle3", output_path=str(out))
    assert snapshot(out) == {"notes.txt": b"mine"}
    convert_model(str(source), str(verifier), "eagle3", output_path=str(out), overwrite=True)
    assert sorted(snapshot(out)) == ["config.json", "model.safetensors"]
    no_leftovers(tmp_path)


def _with_bad_weight(folder: Path, name: str, shape: tuple[int, ...]) -> Path:
    weights = torch.load(folder / "pytorch_model.bin", weights_only=True)
    weights[name] = torch.zeros(shape)
    torch.save(weights, folder / "pytorch_model.bin")
    return folder


@pytest.mark.parametrize(
    ("name", "shape"),
    [
        ("midlayer.self_attn.k_proj.weight", (7, 2 * H)),
        ("midlayer.mlp.down_proj.weight", (H, 5)),
        ("midlayer.hidden_norm.weight", (H + 1,)),
    ],
)
def test_every_tensor_shape_is_checked_and_nothing_is_published(tmp_path, verifier, name, shape):
    source, _ = eagle3_checkpoint(tmp_path / "research")
    _with_bad_weight(source, name, shape)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="do not match the config"):
        convert_model(str(source), str(verifier), "eagle3", output_path=str(out))
    assert not out.exists()
    no_leftovers(tmp_path)


def test_validation_uses_the_given_device_and_a_failure_publishes_nothing(tmp_path, verifier):
    source, _ = eagle3_checkpoint(tmp_path / "research")
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="--validate-device 'nodevice:0'"):
        convert_model(
            str(source), str(verifier), "eagle3", output_path=str(out), validate_device="nodevice:0"
        )
    assert not out.exists()
    no_leftovers(tmp_path)
    convert_model(str(source), str(verifier), "eagle3", output_path=str(out), validate_device="cpu")
    assert (out / "model.safetensors").is_file()


def test_cli_errors_are_one_line_with_exit_2(tmp_path, verifier):
    import typer
    from typer.testing import CliRunner

    from speculators_vllm016.cli.convert import convert

    app = typer.Typer()
    app.command()(convert)
    app.command("noop")(lambda: None)
    source, _ = eagle3_checkpoint(tmp_path / "research")
    (source / "pytorch_model.bin").write_bytes(b"PK\x03\x04 not really a checkpoint")
    runner = CliRunner()
    result = runner.invoke(
        app,
        [
            "convert",
            str(source),
            "--verifier",
            str(verifier),
            "--algorithm",
            "eagle3",
            "--output-path",
            str(tmp_path / "out"),
        ],
    )
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "is not a readable PyTorch checkpoint" in lines[0], result.output
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()
    result = runner.invoke(
        app,
        [
            "convert",
            str(source),
            "--verifier",
            str(verifier),
            "--algorithm",
            "eagle3",
            "--output-path",
            str(verifier),
        ],
    )
    assert result.exit_code == 2 and "would overwrite" in result.output


@pytest.mark.parametrize("algorithm", ["eagle3", "eagle"])
def test_a_folder_already_converted_is_named_as_such_in_one_line(tmp_path, verifier, algorithm):
    """Converting convert's own output again: one line saying it is already converted (#29)."""
    import typer
    from typer.testing import CliRunner

    from speculators_vllm016.cli.convert import convert

    source, _ = eagle3_checkpoint(tmp_path / "research")
    done = tmp_path / "done"
    convert_model(str(source), str(verifier), "eagle3", output_path=str(done))
    app = typer.Typer()
    app.command()(convert)
    app.command("noop")(lambda: None)
    result = CliRunner().invoke(
        app,
        [
            "convert",
            str(done),
            "--verifier",
            str(verifier),
            "--algorithm",
            algorithm,
            "--output-path",
            str(tmp_path / "again"),
        ],
    )
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert "already in the speculators format" in lines[0] and "hidden_size" not in lines[0]
    assert not (tmp_path / "again").exists()
