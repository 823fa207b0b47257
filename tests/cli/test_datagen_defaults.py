"""`speculators datagen`'s documented defaults, as the parser hands them to the pipeline."""

from __future__ import annotations

from speculators_vllm016.cli.datagen import build_parser, options_from_args

REQUIRED = ["--target-model-path", "m", "--train-data-path", "d", "--output-dir", "o"]


def test_batch_size_and_max_model_len_defaults():
    options = options_from_args(build_parser().parse_args(REQUIRED))
    assert options.batch_size == 128  # 0.3.0: 8
    assert options.max_model_len is None
    assert options.seq_length == 2048
    assert options.resolved_max_model_len == 2049  # --seq-length + 1
    options = options_from_args(build_parser().parse_args([*REQUIRED, "--seq-length", "300"]))
    assert options.resolved_max_model_len == 301
    options = options_from_args(
        build_parser().parse_args([*REQUIRED, "--seq-length", "300", "--max-model-len", "512"])
    )
    assert options.resolved_max_model_len == 512
    assert options.output_format == "pt" and options.fsync is False
