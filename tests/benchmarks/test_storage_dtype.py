"""benchmarks/storage_dtype.py trains its drafts with the demo's training job (one home:
`demo.draft_training.train_config`), on its own data and vocabulary, with its own schedule."""

from __future__ import annotations

from pathlib import Path

from benchmarks.storage_dtype import draft_job
from speculators_vllm016.demo import draft_training
from speculators_vllm016.train.vocab_maps import D2T_FILE, T2D_FILE


def test_each_draft_is_the_demos_job_on_the_benchmarks_data(tmp_path, monkeypatch):
    data, vocab = tmp_path / "data-fp8-0", tmp_path / "vocab"
    data.mkdir()
    vocab.mkdir()
    homes = []
    real = draft_training.train_config
    monkeypatch.setattr(draft_training, "train_config", lambda *a: homes.append(a) or real(*a))
    config = draft_job(Path("/targets/llama"), data, vocab, tmp_path / "draft-fp8-seed2", 2, 3)
    assert len(homes) == 1  # built by the demo's function, not beside it
    assert Path(config.data.data_path).resolve() == data.resolve()
    assert Path(config.vocab.d2t_path).resolve() == (vocab / D2T_FILE).resolve()
    assert Path(config.vocab.t2d_path).resolve() == (vocab / T2D_FILE).resolve()
    assert config.model.verifier_name_or_path == "/targets/llama"
    training = config.training
    # The schedule this benchmark's results were measured with (2026-12-02).
    assert (training.epochs, training.lr, training.total_seq_len, training.seed) == (
        3,
        1e-3,
        2048,
        2,
    )
    assert (config.runtime.num_workers, config.runtime.device) == (0, "cpu")
    assert config.model.sliding_window is None and config.logging.no_progress
    # Made again for the same folder (a rerun), the links stay.
    assert draft_job(Path("/targets/llama"), data, vocab, tmp_path / "draft-fp8-seed2", 2, 3)
