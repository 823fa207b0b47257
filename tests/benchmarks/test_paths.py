"""Path (a) of the extraction benchmark times datagen's own loop, not a copy of it."""

from __future__ import annotations

from benchmarks.paths import ExtractionPath
from benchmarks.presets import build_settings
from speculators_vllm016.data_generation import extraction
from tests.data_generation.test_extract_and_write import ReversedGenerator


def test_extraction_path_runs_datagens_extract_and_write(tmp_path, monkeypatch) -> None:
    settings = build_settings("smoke", output_dir=str(tmp_path), batch_size=2)
    path = ExtractionPath(settings, "unused", tmp_path / "samples")
    path.generator = ReversedGenerator()
    calls = []
    real = extraction.extract_and_write

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(extraction, "extract_and_write", spy)
    sequences = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10, 11]]

    measurement = path.run(sequences, repeat=0)

    assert len(calls) == 1 and calls[0]["batch_size"] == 2
    assert path.generator.calls == [sequences[:2], sequences[2:]]
    assert measurement.tokens == 11
