"""Everything a training job checks before anything is written.

`prepare(config)` makes every check that can be made before anything is written (the flags, the
data or the online set-up, the verifier, the vocabulary maps) and returns a `TrainSetup`;
`draft_build.build_model(config, setup)` then builds the draft with its initial weights.
`speculators train`, `gen-and-train`, the demo and `train.jobs.job.run_train_job` all go through
these two.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from speculators_vllm016.train.jobs.data_folder import DataFolder, read_data_folder
from speculators_vllm016.train.jobs.draft_arch import check_draft_arch, check_pretrained_arch
from speculators_vllm016.train.jobs.draft_match import RunFacts, check_draft_fits, eagle31_flags
from speculators_vllm016.train.jobs.job_config import TrainJobConfig, TrainSetupError
from speculators_vllm016.train.jobs.pretrained_draft import (
    check_draft_weights,
    draft_vocab_maps,
    read_pretrained_draft,
)
from speculators_vllm016.train.jobs.verifier_identity import (
    check_same_verifier,
    fingerprint_of_verifier,
    read_verifier,
    recorded_verifier_path,
)
from speculators_vllm016.train.vocab_maps import (
    D2T_FILE,
    T2D_FILE,
    VocabMaps,
    load_vocab_maps,
    resolve_vocab_paths,
)
from speculators_vllm016.utils.errors import first_line
from speculators_vllm016.utils.layer_ids import datagen_to_vllm_layer_ids

if TYPE_CHECKING:
    from datasets import Dataset
    from transformers import PretrainedConfig

    from speculators_vllm016.data_generation.offline import DatagenOptions
    from speculators_vllm016.data_generation.preflight import ModelFacts
    from speculators_vllm016.train.jobs.devices import TrainDevices
    from speculators_vllm016.train.jobs.pretrained_draft import PretrainedDraft, ResearchReader
    from speculators_vllm016.utils.verifier_weights import VerifierInfo

__all__ = [
    "OnlineSetup",
    "TrainSetup",
    "TrainSetupError",
    "prepare",
    "verifier_text_config",
]


@dataclass
class OnlineSetup:
    """What `--online` checked and preprocessed before the engine starts."""

    options: DatagenOptions
    """Datagen's options for the extraction (`--cache-dir` as its output folder)."""
    facts: ModelFacts
    """The target model as datagen inspected it (resolved layer ids, hidden size)."""
    dataset: Dataset
    """Datagen's preprocessed samples (input_ids, loss_mask), row i is sample start_idx + i."""
    devices: TrainDevices | None = None
    """From --train-devices; None: trainer and engine time-share the devices."""


@dataclass
class TrainSetup:
    """What `prepare` checked and read before anything is written."""

    data_path: Path
    save_path: Path
    verifier_config: PretrainedConfig
    text_config: PretrainedConfig
    """The verifier's language-model config (nested in a multimodal config)."""
    standardize: Callable[[dict], dict]
    """Reads a sample file's dict in --data-format-version's layout."""
    layer_ids: list[int] | None
    """The captured layers (datagen's numbering): data_config.json's or --layer-ids."""
    aux_ids: list[int] | None
    """The fused layers in vLLM's numbering, for the draft's config."""
    vocab: VocabMaps
    online: OnlineSetup | None = None
    """The online extraction set-up (`--online`), else None."""
    pretrained: PretrainedDraft | None = None
    """The draft a fresh run fine-tunes (`--from-pretrained`, checked against the run), else None."""
    verifier_fingerprint: str | None = None
    """The verifier's final norm and LM head, hashed: recorded in the draft for `eval`."""
    verifier: VerifierInfo | None = None
    """The verifier as the job read it once (its tensors are read from here, not again)."""
    data: DataFolder | None = None
    """--data-path as the job read it once (offline training), else None."""


def _check_train_devices(config: TrainJobConfig) -> TrainDevices | None:
    """`--train-devices` against the GPUs and the training processes of this node."""
    from speculators_vllm016.train.jobs.devices import (
        TrainDevicesError,
        parse_train_devices,
        visible_gpus,
    )

    online, engine = config.online, config.online.engine
    if online.train_devices is None:
        return None
    if config.runtime.device is not None:
        raise TrainSetupError(
            "give --train-devices or --device, not both (--train-devices places the trainer)"
        )
    try:
        return parse_train_devices(
            online.train_devices,
            visible=visible_gpus(),
            local_processes=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
            engine_gpus_needed=engine.tensor_parallel_size * engine.pipeline_parallel_size,
        )
    except TrainDevicesError as error:
        raise TrainSetupError(str(error)) from None


def _check_extraction_ranks(config: TrainJobConfig) -> None:
    """`--extraction-ranks` needs --online and torchrun; the layout itself is checked where the
    ranks are known (`rank_layout.plan_rank_layout`)."""
    online = config.online
    if online.extraction_ranks == 0:
        return
    if online.extraction_ranks < 0:
        raise TrainSetupError(
            f"--extraction-ranks must be at least 1, got {online.extraction_ranks}"
        )
    if not online.enabled:
        raise TrainSetupError("--extraction-ranks splits the ranks of --online; add --online")
    if online.train_devices is not None:
        raise TrainSetupError(
            "give --extraction-ranks or --train-devices, not both (--train-devices places one node's "
            "trainer beside its engine; --extraction-ranks gives the engines ranks of their own)"
        )
    if "LOCAL_RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise TrainSetupError(
            "--extraction-ranks needs torchrun (extraction and training ranks are its processes), e.g. "
            "torchrun --nproc-per-node 3 -m speculators_vllm016 train --online --extraction-ranks 1 ..."
        )


def _check_online(config: TrainJobConfig) -> OnlineSetup:
    """Datagen's checks on the online flags, then datagen's preprocessing (nothing is written)."""
    from speculators_vllm016.data_generation.offline import preprocess_samples
    from speculators_vllm016.data_generation.preflight import inspect_model
    from speculators_vllm016.data_generation.transfer import check_transfer_space

    online = config.online
    train_data_path = online.preprocessing.train_data_path
    if train_data_path is None:
        raise TrainSetupError("--online needs --train-data-path (the chat data datagen would read)")
    if Path(train_data_path).is_dir():
        raise TrainSetupError(
            f"--train-data-path {train_data_path} is a folder; name the .json/.jsonl chat "
            "file in it (or 'sharegpt' / 'ultrachat')"
        )
    if online.online_queue_size < 1:
        raise TrainSetupError("--online-queue-size must be at least 1")
    sessions, row = online.preprocessing.session_tokens, config.training.total_seq_len
    if sessions > row:
        raise TrainSetupError(
            f"--session-tokens {sessions} is over --total-seq-len {row}: each session would be cut "
            "in its packed row; raise --total-seq-len or lower --session-tokens"
        )
    devices = _check_train_devices(config)
    options = online.datagen_options(config.model.verifier_name_or_path)
    try:
        options.validate()
        facts = inspect_model(
            options.target_model_path, options.layer_ids, options.trust_remote_code
        )
        check_transfer_space(options, facts)
    except ValueError as error:
        raise TrainSetupError(first_line(error)) from None
    cache_dir = online.cache_dir
    if cache_dir and Path(cache_dir).exists() and not Path(cache_dir).is_dir():
        raise TrainSetupError(f"--cache-dir {cache_dir} is a file; name a folder")
    try:
        dataset = preprocess_samples(options, facts).dataset
    except ValueError as error:  # the chat data: unknown, not UTF-8, not JSON
        raise TrainSetupError(first_line(error)) from None
    if len(dataset) == 0:
        raise TrainSetupError(f"--train-data-path {train_data_path} gives no usable samples")
    return OnlineSetup(options=options, facts=facts, dataset=dataset, devices=devices)


def _check_online_model(online: OnlineSetup, hidden_size: int) -> list[int]:
    """The target's layers and width against the draft's needs (what `_check_sample` checks)."""
    if int(online.facts.hidden_size) != hidden_size:
        raise TrainSetupError(
            f"the target's hidden size {online.facts.hidden_size} differs from the verifier's "
            f"{hidden_size}: --target-model-path must be --verifier-name-or-path's model"
        )
    if len(online.facts.layer_ids) != 4:
        raise TrainSetupError(
            f"{len(online.facts.layer_ids)} --layer-ids; an EAGLE-3 draft needs 4 (3 fused + the last)"
        )
    return list(online.facts.layer_ids)


def _check_save_path(save_path: Path) -> None:
    from speculators_vllm016.data_generation.folder_kinds import refuse_other_command_folder
    from speculators_vllm016.utils.output_paths import check_output_folder

    try:
        check_output_folder(save_path, "--save-path")
        refuse_other_command_folder(save_path, "--save-path", "train")
    except ValueError as error:
        raise TrainSetupError(str(error)) from None


def verifier_text_config(
    path: str, trust_remote_code: bool = False
) -> tuple[PretrainedConfig, PretrainedConfig]:
    """The verifier's config as vLLM 0.16 reads it (its own classes know `kimi_k25`,
    `deepseek_v32`, ...; the folder's code runs only with `trust_remote_code`), and its language
    model's config (nested in a multimodal config)."""
    from speculators_vllm016.utils.text_config import text_config_of
    from speculators_vllm016.utils.verifier_config import load_verifier_config

    try:
        config = load_verifier_config(path, trust_remote_code=trust_remote_code)
    except ValueError as error:
        raise TrainSetupError(
            f"{first_line(error)}; --verifier-name-or-path must be the target model folder"
        ) from None
    text_config = text_config_of(config)
    for name in ("hidden_size", "vocab_size", "num_hidden_layers"):
        if not isinstance(getattr(text_config, name, None), int):
            raise TrainSetupError(
                f"the config of {path} has no usable {name} for its language model; "
                "--verifier-name-or-path must be a decoder language model (or a wrapper of one)"
            )
    return config, text_config


def _offline_layer_ids(data: DataFolder, flag: list[int] | None) -> list[int]:
    """The captured layers of --data-path: data_config.json's, else --layer-ids. Never unknown:
    a draft whose config names no layers is fed other layers by vLLM than it was trained on."""
    data_path, recorded = data.path, data.layer_ids
    if recorded is None and flag is None:
        raise TrainSetupError(
            f"{data_path} has no data_config.json naming the layers its hidden states come from; "
            "give them with --layer-ids (datagen's numbering, 4 ids: 3 fused + the last)"
        )
    if recorded is not None and flag is not None and list(flag) != recorded:
        raise TrainSetupError(
            f"--layer-ids {' '.join(map(str, flag))} differ from the layers {recorded} that "
            f"{data_path}/data_config.json records; leave --layer-ids out for this data"
        )
    layer_ids = recorded if recorded is not None else list(flag)  # type: ignore[arg-type]
    if len(layer_ids) != 4 or min(layer_ids) < 0:
        raise TrainSetupError(
            f"--layer-ids {layer_ids}: an EAGLE-3 draft needs 4 layer ids of 0 or more (3 fused + the last)"
        )
    return layer_ids


def _check_sample(
    path: Path, sample: dict, standardize: Callable[[dict], dict], hidden_size: int
) -> None:
    """The first sample's shapes (`sample`, read from `path`) against the verifier: fused width
    3*H and teacher width H."""
    if "hidden_states" in sample and isinstance(sample["hidden_states"], (list, tuple)):
        layers = sample["hidden_states"]
        widths = {int(layer.shape[-1]) for layer in layers}
        if widths != {hidden_size}:
            raise TrainSetupError(
                f"the data's hidden size {sorted(widths)} differs from the verifier's {hidden_size}: "
                "--verifier-name-or-path must be the model that generated --data-path"
            )
        if len(layers) != 4:
            raise TrainSetupError(
                f"the data has {len(layers)} captured layers; an EAGLE-3 draft needs 4 "
                "(3 fused + the last): regenerate it with 4 --layer-ids (the default)"
            )
    standardized = standardize(sample)
    fused = int(standardized["hidden_states"].shape[-1])
    last = int(standardized["verifier_last_hidden_states"].shape[-1])
    if fused != 3 * hidden_size or last != hidden_size:
        raise TrainSetupError(
            f"sample {path.name} has fused width {fused} and teacher width {last}; the verifier's "
            f"hidden size {hidden_size} needs {3 * hidden_size} and {hidden_size}"
        )


def _check_numbers(config: TrainJobConfig) -> None:
    """The settings that are wrong whatever the data (each message names its flag)."""
    training, runtime, checkpoint = config.training, config.runtime, config.checkpoint
    at_least_one = (
        ("epochs", training.epochs),
        ("total_seq_len", training.total_seq_len),
        ("ttt_steps", config.model.ttt_steps),
        ("num_layers", config.model.num_layers),
        ("prefetch_factor", runtime.prefetch_factor),
    )
    for name, value in at_least_one:
        if value < 1:
            raise TrainSetupError(f"--{name.replace('_', '-')} must be at least 1")
    for name, value in (
        ("num_workers", runtime.num_workers),
        ("scheduler_warmup_steps", training.scheduler_warmup_steps),
        ("keep_mid_epoch_checkpoints", checkpoint.keep_mid_epoch_checkpoints),
    ):
        if value is not None and value < 0:
            raise TrainSetupError(f"--{name.replace('_', '-')} must be 0 or more")
    for name, value in (
        ("max_steps", training.max_steps),
        ("scheduler_total_steps", training.scheduler_total_steps),
    ):
        if value is not None and value < 1:
            raise TrainSetupError(
                f"--{name.replace('_', '-')} must be at least 1 (leave it out for all steps)"
            )
    if checkpoint.keep_last is not None and checkpoint.keep_last < 1:
        raise TrainSetupError("--keep-last must be at least 1 (leave it out to keep them all)")
    window, steps = config.model.sliding_window, config.model.ttt_steps
    if window is not None and window < steps:
        raise TrainSetupError(
            f"--sliding-window {window} is shorter than --ttt-steps {steps}: the last steps would "
            "see no context; give a window of at least the TTT steps"
        )
    if runtime.fsdp_bf16_params and runtime.parallel != "fsdp":
        raise TrainSetupError(
            "--fsdp-bf16-params applies to --parallel fsdp only (DDP gathers no weights)"
        )
    train_ratio = config.data.train_ratio
    if not 0 < train_ratio <= 1:
        raise TrainSetupError(
            f"--train-ratio {train_ratio} must be in (0, 1]: the share of sample files that "
            "trains (1 trains on all, with no validation)"
        )
    if training.lr <= 0:
        raise TrainSetupError("--lr must be positive")
    if config.model.fc_norm and config.model.norm_before_fc:
        raise TrainSetupError("--fc-norm and --norm-before-fc exclude each other: pick one")
    if checkpoint.checkpoint_freq is not None and not 0 < checkpoint.checkpoint_freq <= 1:
        raise TrainSetupError("--checkpoint-freq is a fraction of an epoch in (0, 1]")


def _pretrained_draft(
    config: TrainJobConfig, save_path: Path, research_reader: ResearchReader | None
) -> PretrainedDraft | None:
    """The `--from-pretrained` draft, read whole; None without one, and when the run resumes
    the checkpoints already in --save-path (the draft only seeds a fresh run)."""
    import logging

    from speculators_vllm016.train.checkpointer import find_checkpoints

    name = config.model.from_pretrained
    if not name:
        return None
    if not config.checkpoint.no_resume_from_checkpoint and find_checkpoints(save_path):
        logging.getLogger("speculators").info(
            "--save-path %s has checkpoints: resuming them; --from-pretrained %s only seeds a "
            "fresh run and is not read",
            save_path,
            name,
        )
        return None
    return read_pretrained_draft(
        name,
        config.model.verifier_name_or_path,
        norm_before_residual=config.model.norm_before_residual,
        research_reader=research_reader,
    )


def _check_resumed_draft(
    config: TrainJobConfig, save_path: Path, draft_vocab: int, aux_ids: list[int] | None
) -> None:
    """A resumed run's flags must describe the draft its checkpoint holds (`check_resumed_draft`)."""
    from speculators_vllm016.train.checkpointer import find_checkpoints
    from speculators_vllm016.train.jobs.resume import check_resumed_draft

    found = [] if config.checkpoint.no_resume_from_checkpoint else find_checkpoints(save_path)
    if found:
        check_resumed_draft(
            found[-1].path,
            num_layers=config.model.num_layers,
            norm_before_residual=config.model.norm_before_residual,
            draft_vocab=draft_vocab,
            aux_ids=aux_ids,
            sliding_window=config.model.sliding_window,
        )


def _names_no_maps(config: TrainJobConfig, save_path: Path) -> bool:
    """Neither the flags nor an earlier start of this run name vocabulary maps: a fine-tune
    then keeps the draft's own."""
    vocab = config.vocab
    named = vocab.d2t_path or vocab.t2d_path or vocab.draft_vocab_size
    return not named and not any((save_path / name).is_file() for name in (D2T_FILE, T2D_FILE))


def _run_vocab(
    config: TrainJobConfig,
    online: OnlineSetup | None,
    data_path: Path,
    save_path: Path,
    target_vocab: int,
    pretrained: PretrainedDraft | None,
) -> tuple[VocabMaps, str]:
    """The maps the run trains with, and where they come from (for messages): the flags', the
    run's own beside its checkpoints, built from counts, or a fine-tuned draft's own."""
    if pretrained is not None and _names_no_maps(config, save_path):
        return draft_vocab_maps(pretrained), "the draft's own"
    vocab_config = config.vocab
    counts = None
    if online is not None and vocab_config.draft_vocab_size and not vocab_config.token_freq_path:
        from speculators_vllm016.train.vocab_mapping import count_trained_tokens

        counts = {int(k): int(v) for k, v in dict(count_trained_tokens(online.dataset)).items()}
    d2t_path, t2d_path = resolve_vocab_paths(
        vocab_config.d2t_path, vocab_config.t2d_path, save_path, vocab_config.draft_vocab_size
    )
    vocab = load_vocab_maps(
        d2t_path,
        t2d_path,
        target_vocab,
        draft_vocab_size=vocab_config.draft_vocab_size,
        token_freq_path=vocab_config.token_freq_path,
        data_path=data_path,
        counts=counts,
    )
    return vocab, vocab.built_from or str(d2t_path)


def _check_runtime(config: TrainJobConfig) -> None:
    """--logger's names and --device against this machine (before the save path is touched)."""
    from speculators_vllm016.train.logger import logger_names

    try:
        logger_names(config.logging.logger)
    except ValueError as error:
        raise TrainSetupError(str(error)) from None
    device = config.runtime.device
    if device is None:
        return
    import torch

    try:
        wanted = torch.device(device)
    except RuntimeError:
        raise TrainSetupError(
            f"--device {device}: not a device; give cpu, cuda or cuda:N"
        ) from None
    if wanted.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise TrainSetupError(
                f"--device {device}: this machine has no usable GPU; use --device cpu"
            )
        if wanted.index is not None and wanted.index >= count:
            raise TrainSetupError(
                f"--device {device}: this machine has {count} GPU(s), cuda:0 to cuda:{count - 1}"
            )
    elif wanted.type != "cpu":
        raise TrainSetupError(f"--device {device}: training runs on cpu or cuda")


def prepare(config: TrainJobConfig, research_reader: ResearchReader | None = None) -> TrainSetup:
    """Every check that can be made before anything is written; errors are `TrainSetupError`s.

    `research_reader`: how a research-format `--from-pretrained` draft is converted (the
    converter lives above this layer; `speculators train` passes it)."""
    from speculators_vllm016.train.data import standardize_data_v0, standardize_data_v1

    if not config.model.verifier_name_or_path:
        raise TrainSetupError("--verifier-name-or-path is required (the target model of the data)")
    _check_numbers(config)
    _check_runtime(config)
    data_path, save_path = Path(config.data.data_path), Path(config.checkpoint.save_path)
    if config.online.train_devices is not None and not config.online.enabled:
        raise TrainSetupError(
            "--train-devices places the trainer beside the engine of --online; use --device"
        )
    _check_extraction_ranks(config)
    online = _check_online(config) if config.online.enabled else None
    data = read_data_folder(data_path) if online is None else None
    _check_save_path(save_path)
    verifier = config.model.verifier_name_or_path
    verifier_config, text_config = verifier_text_config(
        verifier, config.online.engine.trust_remote_code
    )
    info = read_verifier(verifier, verifier_config, text_config)
    check_draft_arch(config, text_config)
    hidden_size, target_vocab = int(text_config.hidden_size), int(text_config.vocab_size)
    standardize = (
        standardize_data_v1 if config.data.data_format_version == 1 else standardize_data_v0
    )
    fingerprint = fingerprint_of_verifier(info)
    if data is not None:
        _check_sample(data.files[0], data.first_sample(), standardize, hidden_size)
        layer_ids = _offline_layer_ids(data, config.online.output.layer_ids)
        _check_data_verifier(config, data, fingerprint)
    else:
        layer_ids = _check_online_model(online, hidden_size)
        _check_online_verifier(config, online, fingerprint)
    aux_ids = _aux_layer_ids(layer_ids, text_config)
    pretrained = _pretrained_draft(config, save_path, research_reader)
    if pretrained is not None:
        check_pretrained_arch(config, pretrained)
    vocab, vocab_source = _run_vocab(config, online, data_path, save_path, target_vocab, pretrained)
    _check_resumed_draft(config, save_path, int(vocab.d2t.shape[0]), aux_ids)
    if pretrained is not None:
        check_draft_weights(pretrained)
        check_draft_fits(
            pretrained,
            RunFacts(
                verifier=verifier,
                architectures=list(getattr(verifier_config, "architectures", None) or []),
                hidden_size=hidden_size,
                vocab_size=target_vocab,
                vocab=vocab,
                vocab_source=vocab_source,
                layer_ids=layer_ids,
                aux_ids=aux_ids,
                num_layers=config.model.num_layers,
                norm_before_residual=config.model.norm_before_residual,
                embeddings=info.embeddings(),
                eagle31=eagle31_flags(config.model),
            ),
        )
    return TrainSetup(
        data_path=data_path,
        save_path=save_path,
        verifier_config=verifier_config,
        text_config=text_config,
        standardize=standardize,
        layer_ids=layer_ids,
        aux_ids=aux_ids,
        vocab=vocab,
        online=online,
        pretrained=pretrained,
        verifier_fingerprint=fingerprint,
        verifier=info,
        data=data,
    )


def _check_data_verifier(config: TrainJobConfig, data: DataFolder, fingerprint: str) -> None:
    """The verifier against the model `data_config.json` says the data comes from."""
    recorded, data_path = data.model, data.path
    if recorded is not None:
        check_same_verifier(
            config.model.verifier_name_or_path,
            fingerprint,
            recorded.target_model_path,
            recorded.verifier_fingerprint,
            f"{data_path}/data_config.json",
            config.model.allow_other_verifier,
        )


def _check_online_verifier(config: TrainJobConfig, online: OnlineSetup, fingerprint: str) -> None:
    """The verifier against --target-model-path, the model online training extracts from."""
    verifier, target = config.model.verifier_name_or_path, online.options.target_model_path
    if recorded_verifier_path(target) != recorded_verifier_path(verifier):
        check_same_verifier(
            verifier,
            fingerprint,
            target,
            fingerprint_of_verifier(target),
            "--target-model-path",
            config.model.allow_other_verifier,
        )


def _aux_layer_ids(layer_ids: list[int] | None, text_config: Any) -> list[int] | None:
    """The fused layers in vLLM's numbering (D8); the captured ids must exist in the verifier."""
    if layer_ids is None:
        return None
    num_target_layers = int(text_config.num_hidden_layers)
    if max(layer_ids) >= num_target_layers:
        raise TrainSetupError(
            f"the data's layer ids are {layer_ids}, but the verifier has "
            f"{num_target_layers} layers: --verifier-name-or-path must be the model of the data"
        )
    # The last captured layer is the teacher's; the others are fused.
    return datagen_to_vllm_layer_ids(layer_ids[:-1])
