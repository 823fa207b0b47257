"""Records written by earlier versions are read as they are: no migration for users' folders."""

from __future__ import annotations

import json

from speculators_vllm016.pipeline.ledgers import StateFile
from speculators_vllm016.pipeline.runner import StageEntry


def test_a_demo_state_file_of_the_earlier_runner_is_read(tmp_path):
    path = tmp_path / "demo_state.json"
    old = {
        "target": {
            "options": {"seed": 0},
            "seconds": 1.5,
            "outputs": {"target": "out/target"},
            "figures": {"tokens": 10},
        },
        "datagen": {"options": {"seed": 0, "max_samples": 4}},
    }
    path.write_text(json.dumps(old, indent=2) + "\n")
    ledger = StateFile(path)
    assert ledger.read("target") == StageEntry(
        options={"seed": 0},
        finished=True,
        seconds=1.5,
        output={"outputs": {"target": "out/target"}, "figures": {"tokens": 10}},
    )
    assert ledger.read("datagen") == StageEntry(
        options={"seed": 0, "max_samples": 4}, finished=False
    )
    assert ledger.read("vocab") is None


def test_a_finished_stage_is_written_in_the_same_layout(tmp_path):
    path = tmp_path / "demo_state.json"
    ledger = StateFile(path)
    ledger.started("vocab", {"draft_vocab_size": 8})
    assert json.loads(path.read_text()) == {"vocab": {"options": {"draft_vocab_size": 8}}}
    ledger.finished("vocab", {"draft_vocab_size": 8}, 2.0, {"outputs": {"d2t": "x"}, "figures": {}})
    assert json.loads(path.read_text()) == {
        "vocab": {
            "options": {"draft_vocab_size": 8},
            "seconds": 2.0,
            "outputs": {"d2t": "x"},
            "figures": {},
        }
    }
    assert StateFile(path).read("vocab").finished
