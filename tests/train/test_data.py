"""Sample files -> shifted samples -> packed rows: the data side of the trainer contract."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from speculators_vllm016.data_generation.conversations import normalize_conversation
from speculators_vllm016.data_generation.preprocessing import tokenize_conversation
from speculators_vllm016.data_generation.sample_io import write_sample
from speculators_vllm016.tiny_models import build_tokenizer
from speculators_vllm016.train.data import (
    Eagle3SampleFileDataset,
    SampleFileError,
    create_collate_fn,
    list_files,
    sample_lengths,
    shift_batch,
    split_files,
)
from speculators_vllm016.train.noise_transforms import AddUniformNoise

HIDDEN = 8


def sample(length: int, seed: int = 0, layers: int = 4) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, 100, (length,), generator=generator),
        "hidden_states": [torch.randn(length, HIDDEN, generator=generator) for _ in range(layers)],
        "loss_mask": torch.ones(length, dtype=torch.long),
    }


def test_only_sample_files_are_listed_in_index_order(tmp_path):
    for name in [
        "data_10.pt",
        "data_2.pt",
        "data_1.safetensors",
        "token_freq.pt",
        "other.pt",
        "data_config.json",
        "data_x.pt",
        ".tmp-ab12-data_5.pt",
    ]:
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "shard").mkdir()
    (tmp_path / "shard" / "data_0.pt").write_bytes(b"")
    names = [path.relative_to(tmp_path).as_posix() for path in list_files(tmp_path)]
    assert names == ["data_1.safetensors", "data_2.pt", "data_10.pt", "shard/data_0.pt"]


def test_split_is_seeded_disjoint_and_never_leaves_training_empty(tmp_path):
    for index in range(20):
        (tmp_path / f"data_{index}.pt").write_bytes(b"")
    train, val = split_files(str(tmp_path), 0.9, seed=0)
    assert len(train) == 18 and len(val) == 2 and not set(train) & set(val)
    assert split_files(str(tmp_path), 0.9, seed=0) == (train, val)
    assert split_files(str(tmp_path), 0.9, seed=1) != (train, val)
    one = tmp_path / "one"
    one.mkdir()
    (one / "data_0.pt").write_bytes(b"")
    assert len(split_files(str(one), 0.9)[0]) == 1


def test_lengths_are_read_from_headers_not_guessed_from_sizes(tmp_path):
    lengths = [3, 500, 17, 1, 64]
    for index, length in enumerate(lengths):
        fmt = "pt" if index % 2 == 0 else "safetensors"
        write_sample(tmp_path / f"data_{index}.{fmt}", sample(length, index), output_format=fmt)
    files = list_files(tmp_path)
    found, failures = sample_lengths(files)
    assert failures == []
    assert found == lengths
    dataset = Eagle3SampleFileDataset(128, datapath=str(tmp_path))
    assert dataset.lengths == [length - 1 for length in lengths]  # packed after the shift


def test_shift_pairs_states_of_token_t_with_token_t_plus_one():
    length = 6
    data = {
        "input_ids": torch.arange(10, 10 + length),
        "hidden_states": torch.arange(length)[:, None].float(),
        "verifier_last_hidden_states": torch.arange(100, 100 + length)[:, None].float(),
        "loss_mask": torch.tensor([0, 0, 1, 1, 0, 1]),
        "lengths": torch.tensor([length]),
        "position_ids": torch.arange(length),
    }
    shifted = shift_batch(data)
    assert shifted["input_ids"].tolist() == [11, 12, 13, 14, 15]
    assert shifted["hidden_states"][:, 0].tolist() == [0, 1, 2, 3, 4]
    assert shifted["verifier_last_hidden_states"][:, 0].tolist() == [101, 102, 103, 104, 105]
    # Position t predicts token t + 2: its mask is token t + 2's flag.
    assert shifted["loss_mask"].tolist() == [1, 1, 0, 1, 0]
    assert shifted["position_ids"].tolist() == [1, 2, 3, 4, 5]
    assert shifted["lengths"].tolist() == [5]
    assert shift_batch(data, legacy_loss_mask_shift=True)["loss_mask"].tolist() == [0, 1, 1, 0, 1]


CHAT = [
    {"from": "system", "value": "Be brief."},
    {"from": "human", "value": "Name a colour."},
    {"from": "gpt", "value": "Blue is a colour."},
    {"from": "human", "value": "Another one?"},
    {"from": "gpt", "value": "Green works too."},
    {"from": "human", "value": "Thanks."},
]


@pytest.mark.parametrize("style", ["llama3", "chatml"])
def test_d9_every_assistant_token_is_trained_and_nothing_after_the_turn(tmp_path, style):
    """Which prediction each position makes, and whether it is trained, on a rendered chat.

    After the shift, position j holds the verifier's state of token j + 1 and predicts token j + 2.
    The prediction must be trained exactly when token j + 2 belongs to an assistant turn: the first
    token of each assistant turn is trained, the token after its end-of-turn marker is not.
    """
    tokenizer = build_tokenizer(
        tmp_path, style, corpus=[t["value"] for t in CHAT] * 3, vocab_size=300
    )
    ids, mask = tokenize_conversation(tokenizer, normalize_conversation(CHAT), 4096)
    length = len(ids)
    data = {
        "input_ids": torch.tensor(ids),
        "hidden_states": torch.zeros(length, 1),
        "verifier_last_hidden_states": torch.zeros(length, 1),
        "loss_mask": torch.tensor(mask),
        "lengths": torch.tensor([length]),
        "position_ids": torch.arange(length),
    }
    starts = [t for t in range(1, length) if mask[t] == 1 and mask[t - 1] == 0]
    ends = [t for t in range(length - 1) if mask[t] == 1 and mask[t + 1] == 0]
    assert len(starts) == 2 and len(ends) == 2
    for legacy in (False, True):
        shifted = shift_batch(data, legacy_loss_mask_shift=legacy)
        # predicted token (index into ids) -> trained?
        trained = {
            j + 2: bool(flag)
            for j, flag in enumerate(shifted["loss_mask"].tolist())
            if j + 2 < length
        }
        if not legacy:
            assert trained == {t: bool(mask[t]) for t in range(2, length)}
            assert all(trained[t] for t in starts), "first assistant token of a turn not trained"
            assert not any(trained.get(t + 1, False) for t in ends), (
                "token after end-of-turn trained"
            )
        else:  # 0.3.0: off by one, the defect D9 is real
            assert not any(trained[t] for t in starts)
            assert all(trained[t + 1] for t in ends if t + 1 < length)


def test_collate_packs_whole_samples_and_cuts_the_last(tmp_path):
    for index, length in enumerate([11, 21, 31]):
        write_sample(tmp_path / f"data_{index}.pt", sample(length, index))
    dataset = Eagle3SampleFileDataset(40, datapath=str(tmp_path))
    collate = create_collate_fn(40)
    row = collate([dataset[0], dataset[1], dataset[2]])
    assert row["lengths"].tolist() == [10, 20, 10]
    assert row["input_ids"].shape == (1, 40)
    assert row["hidden_states"].shape == (1, 40, 3 * HIDDEN)
    assert row["verifier_last_hidden_states"].shape == (1, 40, HIDDEN)
    assert row["position_ids"][0, :12].tolist() == list(range(1, 11)) + [1, 2]
    assert "skipped_samples" not in row  # 0.3.0's keys only when nothing was skipped
    short = collate([dataset[0]])
    assert short["lengths"].tolist() == [10]
    assert short["loss_mask"][0, 10:].sum() == 0 and short["input_ids"][0, 10:].sum() == 0


def test_unusable_samples_are_skipped_counted_and_named(tmp_path, caplog):
    write_sample(tmp_path / "data_0.pt", sample(12, 0))
    bad = sample(12, 1)
    bad["hidden_states"][1][3, 2] = float("nan")
    write_sample(tmp_path / "data_1.pt", bad)
    write_sample(tmp_path / "data_2.pt", sample(12, 2))
    (tmp_path / "data_3.pt").write_bytes(b"not a torch file")
    with caplog.at_level(logging.WARNING):
        dataset = Eagle3SampleFileDataset(64, datapath=str(tmp_path))
    assert [path.name for path, _ in dataset.unreadable] == ["data_3.pt"]
    assert "data_3.pt" in caplog.text
    assert len(dataset) == 3
    with caplog.at_level(logging.WARNING):
        items = [dataset[i] for i in range(3)]
    assert items[1] is None and "data_1.pt" in caplog.text and "NaN" in caplog.text
    row = create_collate_fn(64)(items)
    assert int(row["skipped_samples"]) == 1 and row["lengths"].tolist() == [11, 11]
    strict = Eagle3SampleFileDataset(
        64, file_list=[str(tmp_path / f"data_{i}.pt") for i in range(3)], strict=True
    )
    with pytest.raises(SampleFileError, match="data_1.pt"):
        strict[1]
    with pytest.raises(SampleFileError, match="cannot be read"):
        Eagle3SampleFileDataset(64, datapath=str(tmp_path), strict=True)


def test_noise_is_on_inputs_only_and_the_same_for_every_reader(tmp_path):
    write_sample(tmp_path / "data_0.pt", sample(30, 0))
    clean = Eagle3SampleFileDataset(64, datapath=str(tmp_path))[0]
    noisy = Eagle3SampleFileDataset(
        64, datapath=str(tmp_path), transform=AddUniformNoise(0.05), seed=5
    )
    first = noisy[0]
    torch.manual_seed(123)  # global RNG state must not matter
    again = noisy[0]
    assert torch.equal(first["hidden_states"], again["hidden_states"])
    difference = first["hidden_states"] - clean["hidden_states"]
    assert 0 < difference.abs().max() <= 0.05
    assert torch.equal(first["verifier_last_hidden_states"], clean["verifier_last_hidden_states"])
    noisy.set_epoch(1)
    assert not torch.equal(noisy[0]["hidden_states"], first["hidden_states"])


def test_output_dtype_rounds_the_finished_noisy_states_once(tmp_path):
    # bf16 rows for bf16 training: the noise is drawn and added in fp32 as before, and only the
    # result is rounded (what autocast does to fc's input), so the draft sees the same values.
    write_sample(tmp_path / "data_0.pt", sample(30, 0))
    noise = AddUniformNoise(0.05)
    full = Eagle3SampleFileDataset(64, datapath=str(tmp_path), transform=noise, seed=5)[0]
    small = Eagle3SampleFileDataset(
        64, datapath=str(tmp_path), transform=noise, seed=5, output_dtype=torch.bfloat16
    )[0]
    for key in ("hidden_states", "verifier_last_hidden_states"):
        assert small[key].dtype == torch.bfloat16
        assert torch.equal(small[key], full[key].to(torch.bfloat16))
    assert torch.equal(small["input_ids"], full["input_ids"])
    assert small["loss_mask"].dtype == full["loss_mask"].dtype


def test_split_items_over_indices_is_split_files_over_datagens_files(tmp_path):
    """Online training splits sample indices; it must pick the same samples as offline's split."""
    from speculators_vllm016.train.data import split_files, split_items

    for index in range(13):
        (tmp_path / f"data_{index}.pt").write_bytes(b"")
    (tmp_path / "data_config.json").write_text("{}")
    for seed in (0, 3):
        files = split_files(str(tmp_path), 0.75, seed)
        items = split_items(list(range(13)), 0.75, seed)
        assert [[int(f.stem.split("_")[1]) for f in part] for part in files] == [
            list(p) for p in items
        ]


# -- unusable rows and malformed samples: the data -> trainer contract when samples are bad -------


def test_a_row_of_only_unusable_samples_is_its_skip_count_alone():
    """The trainer's empty-row path takes over (no exception: the step still happens)."""
    row = create_collate_fn(16)([None, None])
    assert set(row) == {"skipped_samples"} and int(row["skipped_samples"]) == 2


def write_raw(path: Path, data: dict) -> None:
    """A sample file as a broken writer might leave it (`write_sample` may refuse the shapes)."""
    torch.save(data, path)


def bad_shape_files(folder: Path) -> dict[str, str]:
    """Good files 0 and 1; each other file one malformation; {file: words its error must hold}."""
    write_sample(folder / "data_0.pt", sample(12, 0))
    write_sample(folder / "data_1.pt", sample(12, 1))
    rows = sample(12, 2)
    rows["hidden_states"] = [torch.cat([layer, layer[:2]]) for layer in rows["hidden_states"]]
    write_raw(folder / "data_2.pt", rows)
    write_raw(folder / "data_3.pt", sample(12, 3, layers=5))
    write_raw(folder / "data_4.pt", sample(0, 4))
    short_mask = sample(12, 5)
    short_mask["loss_mask"] = short_mask["loss_mask"][:10]
    write_raw(folder / "data_5.pt", short_mask)
    return {"data_2.pt": "14", "data_3.pt": "32", "data_4.pt": "token", "data_5.pt": "loss_mask"}


def test_each_malformed_sample_is_refused_by_name_and_skipped(tmp_path, caplog):
    expected = bad_shape_files(tmp_path)
    dataset = Eagle3SampleFileDataset(16, datapath=str(tmp_path))
    assert dataset.widths == (3 * HIDDEN, HIDDEN)
    with caplog.at_level(logging.WARNING):
        items = [dataset[i] for i in range(len(dataset))]
    assert [item is None for item in items] == [False, False, True, True, True, True]
    for name, words in expected.items():
        line = next((m for m in caplog.messages if name in m), "")
        assert words in line, (name, caplog.messages)
    # The good samples pack as if the bad ones were never there (nothing shifted).
    row = create_collate_fn(32)(items)
    assert row["lengths"].tolist() == [11, 11] and int(row["skipped_samples"]) == 4
    alone = create_collate_fn(32)([items[0]])
    assert torch.equal(row["hidden_states"][0, :11], alone["hidden_states"][0, :11])
    assert torch.equal(row["input_ids"][0, 11:22], items[1]["input_ids"])
    strict = Eagle3SampleFileDataset(16, datapath=str(tmp_path), strict=True)
    for index, (name, words) in enumerate(expected.items(), start=2):
        assert strict.data[index].name == name
        with pytest.raises(SampleFileError, match=rf"{name}.*{words}"):
            strict[index]


def test_given_widths_are_the_yardstick_and_online_samples_are_checked_too(tmp_path):
    write_sample(tmp_path / "data_0.pt", sample(12, 0))
    wide = Eagle3SampleFileDataset(16, datapath=str(tmp_path), widths=(5 * HIDDEN, HIDDEN))
    assert wide[0] is None
    online = Eagle3SampleFileDataset(16, file_list=[str(tmp_path / "data_9.pt")], lengths=[11])
    assert online.widths is None  # the files need not exist yet: no yardstick is read
    with pytest.raises(SampleFileError, match="data_9.pt.*hidden_states"):
        broken = sample(12, 1)
        layers = broken["hidden_states"]
        broken["hidden_states"] = [layer[:11] for layer in layers[:-1]] + [layers[-1]]
        online.strict = True
        online.item(0, broken)


def poisoned_copy(data: Path, folder: Path) -> tuple[Path, list[Path]]:
    """The tiny verifier's sample folder (and vocab maps) with NaN states in its first training
    file and its first validation file."""
    import shutil

    copy = folder / "data"
    shutil.copytree(data, copy)
    for name in ("d2t.npy", "t2d.npy"):
        shutil.copy(data.parent / name, folder / name)
    train, val = split_files(str(copy), 0.9, 0)
    for path in (train[0], val[0]):
        raw = torch.load(path, weights_only=True)
        raw["hidden_states"][1][0, 0] = float("nan")
        write_sample(path, raw)
    return copy, [train[0], val[0]]


def test_training_steps_over_rows_whose_samples_are_all_unusable(
    tiny_llama, training_data, tmp_path, capsys
):
    """Every sample is longer than a row, so the NaN samples' rows hold nothing usable: in
    training and in validation. The run finishes, counts the skip, and keeps the plan's steps."""
    import json

    from speculators_vllm016.cli.train import main
    from speculators_vllm016.train.distributed_batch_sampler import (
        MultipackDistributedBatchSamplerV2,
    )
    from tests.training_fixtures import train_args

    data, poisoned = poisoned_copy(training_data, tmp_path)
    save = tmp_path / "ckpt"
    argv = train_args(tiny_llama, data, save, "--total-seq-len", "16", "--epochs", "1")
    assert main(argv) == 0, capsys.readouterr().err
    state = json.loads((save / "0" / "training_state.json").read_text())
    train, _ = split_files(str(data), 0.9, 0)
    lengths = Eagle3SampleFileDataset(16, file_list=[str(f) for f in train]).lengths
    plan = MultipackDistributedBatchSamplerV2(16, lengths, 1, 0, seed=0).batches(0)
    assert [len(step) for step in plan if train.index(poisoned[0]) in step] == [
        1
    ]  # alone in its row
    assert state["global_step"] == len(plan) and state["skipped_samples"] == 1
    lines = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    assert sum("train" in line for line in lines) == len(plan)
    usable = sum(min(n, 16) for i, n in enumerate(lengths) if train[i] != poisoned[0])
    assert sum(line["train"]["tokens"] for line in lines if "train" in line) == usable
    val = [line["val"] for line in lines if "val" in line]
    assert len(val) == 1 and torch.isfinite(torch.tensor(val[0]["loss_epoch"]))

    capsys.readouterr()
    assert main([*argv, "--strict-data", "--no-resume-from-checkpoint"]) != 0
    error = capsys.readouterr().err
    assert poisoned[0].name in error and "NaN" in error


def test_skipped_and_unreadable_samples_are_counted_in_the_state_the_metrics_and_the_last_line(
    tiny_llama, training_data, tmp_path, capsys
):
    """#37 item 18: one NaN sample in each split and one training file that cannot be read at
    all (left out when the data is listed). Each is named in the log and counted: the state,
    the metrics lines and the command's last line say how many."""
    import json

    from speculators_vllm016.cli.train import main
    from tests.training_fixtures import train_args

    data, poisoned = poisoned_copy(training_data, tmp_path)
    train, _ = split_files(str(data), 0.9, 0)
    broken = next(path for path in reversed(train) if path not in poisoned)
    broken.write_bytes(b"not a sample file")
    save = tmp_path / "ckpt"
    assert main(train_args(tiny_llama, data, save, "--epochs", "1")) == 0
    printed = capsys.readouterr()
    assert broken.name in printed.err and poisoned[0].name in printed.err
    state = json.loads((save / "0" / "training_state.json").read_text())
    assert state["skipped_samples"] == 1 and state["unreadable_files"] == 1
    lines = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    assert sum(line["train"].get("skipped_samples", 0) for line in lines if "train" in line) == 1
    assert [line["val"]["skipped_samples"] for line in lines if "val" in line] == [1]
    last = printed.out.strip().splitlines()[-1]
    assert "1 unusable sample skipped" in last and "1 unreadable sample file left out" in last, last
    # #37 item 22: the last line also gives the final loss, the validation tau_sim, the best checkpoint.
    final = [line["train"]["loss"] for line in lines if "train" in line][-1]
    tau = [line["val"]["tau_sim"] for line in lines if "val" in line][-1]
    assert f"last loss {final:.4f}" in last and f"validation tau_sim {tau:.3f}" in last, last
    assert f"best checkpoint {save / '0'} (tau_sim {tau:.3f})" in last, last


def tiny_trainer(
    verifier: Path, training_data: Path, save: Path, rows: list, val_rows: list, **config: Any
):
    """A CPU `Trainer` of the tiny verifier's draft over ready-made rows (`config`: more
    `TrainerConfig` fields)."""
    from torch.utils.data import DataLoader

    from speculators_vllm016.cli.train import build_model, build_parser, prepare
    from speculators_vllm016.train.trainer import Trainer, TrainerConfig
    from tests.training_fixtures import train_args

    args = build_parser().parse_args(train_args(verifier, training_data, save))
    model = build_model(args, prepare(args))
    config = TrainerConfig(
        lr=1e-3,
        num_epochs=1,
        save_path=str(save),
        device="cpu",
        show_progress=False,
        handle_sigterm=False,
        scheduler_type="none",
        val_call_kwargs={"ttt_steps": 3},
        **config,
    )
    loader = lambda items: DataLoader(items, batch_size=None)  # noqa: E731 - rows as they are
    return Trainer(model, config, loader(rows), loader(val_rows))


def test_validation_weighs_a_row_of_unusable_samples_zero(tiny_llama, training_data, tmp_path):
    files = sorted(training_data.glob("data_*.pt"))[:4]
    dataset = Eagle3SampleFileDataset(128, file_list=[str(f) for f in files])
    collate = create_collate_fn(128)
    good = [collate([dataset[0], dataset[1]]), collate([dataset[2], dataset[3]])]
    empty = collate([None])
    clean = tiny_trainer(tiny_llama, training_data, tmp_path / "a", good, good).val_epoch(0)
    mixed = tiny_trainer(tiny_llama, training_data, tmp_path / "b", good, [good[0], empty, good[1]])
    means = mixed.val_epoch(0)
    assert means.pop("skipped_samples") == 1  # counted in the validation record (#37 item 18)
    assert means == pytest.approx(clean, rel=1e-6)


def test_skipped_samples_averaged_over_three_ranks_count_exactly(
    tiny_llama, training_data, tmp_path
):
    """5 skipped on 3 ranks: each rank's mean (float32) times 3 is 4.9999998, which is 5 skips."""
    files = sorted(training_data.glob("data_*.pt"))[:1]
    row = create_collate_fn(128)(
        [Eagle3SampleFileDataset(128, file_list=[str(f) for f in files])[0]]
    )
    trainer = tiny_trainer(tiny_llama, training_data, tmp_path, [row], [])
    mean = (torch.tensor([5.0]) / 3).tolist()[0]  # what the all-reduce and its average give
    trainer.train_step = lambda batch: {
        "loss": 1.0,
        "tokens": 1.0,
        "lr": 0.0,
        "skipped_samples": mean * 3,
    }
    assert mean * 3 != 5
    trainer.train_epoch(0)
    assert trainer.state.skipped_samples == 5


def test_train_measures_widths_against_the_verifier_not_the_first_file_of_a_split(
    tiny_llama, training_data, tmp_path, capsys
):
    """The validation split's lowest-index file is the odd one: it alone is skipped, not the
    good files measured against it."""
    import json
    import shutil

    from speculators_vllm016.cli.train import main
    from tests.training_fixtures import train_args

    data = tmp_path / "data"
    shutil.copytree(training_data, data)
    for name in ("d2t.npy", "t2d.npy"):
        shutil.copy(training_data.parent / name, tmp_path / name)
    _, val = split_files(str(data), 0.9, 0)
    odd = min(val, key=lambda path: int(path.stem.split("_")[-1]))
    sample = torch.load(odd, weights_only=True)
    sample["hidden_states"] = [layer[:, :128] for layer in sample["hidden_states"]]
    torch.save(sample, odd)
    save = tmp_path / "ckpt"
    assert main(train_args(tiny_llama, data, save, "--epochs", "1")) == 0
    skipped = [line for line in capsys.readouterr().err.splitlines() if "skipping sample" in line]
    assert len(skipped) == 1 and odd.name in skipped[0], skipped
    assert json.loads((save / "0" / "training_state.json").read_text())["skipped_samples"] == 0


# -- #29 item 6: a datagen folder that lacks samples its run lists is refused -------------------


def datagen_folder(folder: Path, count: int, record_count: bool = True, start: int = 3) -> Path:
    """A folder as datagen leaves it: samples, their manifest lines and the run record."""
    from speculators_vllm016.data_generation.manifest import (
        ManifestWriter,
        SampleRecord,
        manifest_path,
    )
    from speculators_vllm016.data_generation.resume import RunIdentity, record_identity

    folder.mkdir()
    with ManifestWriter(manifest_path(folder, 0, 1)) as manifest:
        for index in range(start, start + count):
            size = write_sample(folder / f"data_{index}.pt", sample(4 + index, seed=index))
            manifest.append(SampleRecord(f"data_{index}.pt", index, 4 + index, size, None))
    details = {"num_samples": count} if record_count else {}
    record_identity(folder, RunIdentity({"start_idx": start, "output_format": "pt"}, details))
    return folder


def test_a_datagen_folder_missing_samples_its_run_lists_is_refused_in_one_line(tmp_path, capsys):
    from speculators_vllm016.cli.train import main
    from speculators_vllm016.train.data import IncompleteDataError

    whole = datagen_folder(tmp_path / "whole", 8)
    assert (
        len(list_files(whole)) == 8 and len(Eagle3SampleFileDataset(64, datapath=str(whole))) == 8
    )

    # Never written (a run stopped half-way): only the run record knows them.
    stopped = datagen_folder(tmp_path / "stopped", 8)
    for index in (5, 9, 10):
        (stopped / f"data_{index}.pt").unlink()
    lines = (stopped / "manifest" / "shard-0-of-1.jsonl").read_text().splitlines()
    (stopped / "manifest" / "shard-0-of-1.jsonl").write_text(
        "".join(line + "\n" for line in lines if '"index":5,' not in line)
    )
    expected = (
        rf"^{stopped} lacks 3 of the 8 sample files its datagen run lists \(data_5.pt, data_9.pt, "
        r"data_10.pt\); finish them by running the same `speculators datagen` command again"
    )
    for read in (
        lambda: list_files(stopped),
        lambda: split_files(str(stopped)),
        lambda: Eagle3SampleFileDataset(64, datapath=str(stopped)),
        lambda: list_files(tmp_path),  # a folder of datagen folders
    ):
        with pytest.raises(IncompleteDataError, match=expected):
            read()

    # Listed in the manifest only (a record of before the count, no data_config.json); many.
    lost = datagen_folder(tmp_path / "lost", 12, record_count=False)
    for index in range(4, 12):
        (lost / f"data_{index}.pt").unlink()
    with pytest.raises(
        IncompleteDataError,
        match=r"lacks 8 of the 12 .*\(data_4.pt, data_5.pt, "
        r"data_6.pt, data_7.pt, data_8.pt and 3 more\)",
    ):
        list_files(lost)

    # The train command says it in one line, before anything is written.
    save = tmp_path / "save"
    code = main(
        [
            "--verifier-name-or-path",
            str(tmp_path / "none"),
            "--data-path",
            str(stopped),
            "--save-path",
            str(save),
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1 and "lacks 3 of the 8 sample files" in err[0], err
    assert not save.exists()


def test_folders_without_a_run_list_are_taken_as_they_are(tmp_path):
    """0.3.0's layout (no record, no manifest) and a complete older record (count from
    data_config.json) train as before."""
    import json

    old = tmp_path / "old"
    old.mkdir()
    for index in (0, 1, 5):
        write_sample(old / f"data_{index}.pt", sample(6, seed=index))
    (old / "data_config.json").write_text(json.dumps({"data": {"num_samples": 10}}))
    assert len(list_files(old)) == 3

    older = datagen_folder(tmp_path / "older", 4, record_count=False, start=0)
    (older / "data_config.json").write_text(json.dumps({"data": {"num_samples": 4}}))
    assert len(list_files(older)) == 4
    (older / "data_config.json").write_text(json.dumps({"data": {"num_samples": 6}}))
    with pytest.raises(SampleFileError, match=r"lacks 2 of the 6 .*\(data_4.pt, data_5.pt\)"):
        list_files(older)
    assert len(list_files(older, check_complete=False)) == 4


def test_the_trainers_draft_pads_flex_rows_to_the_row_length(tiny_llama, training_data, tmp_path):
    """Every flex row of a run has --total-seq-len positions: one compiled shape for all its rows
    (a shorter row, the last of an epoch, recompiled the blocks before)."""
    from speculators_vllm016.cli.train import build_model, build_parser, prepare
    from tests.training_fixtures import train_args

    args = build_parser().parse_args(train_args(tiny_llama, training_data, tmp_path / "run"))
    assert build_model(args, prepare(args)).flex_row_length == 256
