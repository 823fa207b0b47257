"""`speculators train`: train an EAGLE-3 draft on datagen's hidden states.

The flags of 0.3.0's `scripts/train.py` keep their names and defaults; everything 0.3.0 hard-coded
is a flag too. One process trains on one device (a GPU, else the CPU); under
`torchrun --nproc-per-node N -m speculators_vllm016 train ...` N processes train data-parallel
(FSDP2 or DDP; NCCL on GPUs, gloo on CPUs). Every input is checked before anything is written.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speculators_vllm016.utils.errors import first_line, type_and_first_line

__all__ = ["TrainSetup", "TrainSetupError", "build_model", "build_parser", "main", "prepare"]

logger = logging.getLogger("speculators")

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


class TrainSetupError(ValueError):
    """Bad input found before training starts; the message names the fix."""


def build_parser(prog: str = "speculators train") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=(
            "Train an EAGLE-3 draft on hidden states written by `speculators datagen`. "
            "Multi-process: torchrun --nproc-per-node N -m speculators_vllm016 train ..."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    io = parser.add_argument_group("data and output (0.3.0)")
    io.add_argument("--verifier-name-or-path", required=True,
                    help="the target model that generated the data (local folder or hub id)")
    io.add_argument("--data-path", default="./data", help="datagen's output folder")
    io.add_argument("--save-path", default="./checkpoints", help="checkpoints go to <save>/<epoch>/")
    io.add_argument("--no-resume-from-checkpoint", action="store_true",
                    help="start from scratch even if --save-path has checkpoints")
    io.add_argument("--data-format-version", type=int, choices=[0, 1], default=1,
                    help="1: datagen's files; 0: legacy hidden_state/target keys")
    io.add_argument("--d2t-path", default="d2t.npy", help="draft->target offsets (.npy)")
    io.add_argument("--t2d-path", default="t2d.npy", help="target->draft mask (.npy)")
    io.add_argument("--draft-vocab-size", type=int, default=None,
                    help="build d2t/t2d from token counts when the .npy files do not exist")
    io.add_argument("--token-freq-path", default=None,
                    help="token counts for --draft-vocab-size (default: token_freq*.pt in --data-path)")
    io.add_argument("--train-ratio", type=float, default=0.9,
                    help="share of sample files used for training; the rest validates")
    io.add_argument("--split-seed", type=int, default=0, help="seed of the train/validation split")
    io.add_argument("--strict-data", action="store_true",
                    help="stop at the first unreadable or non-finite sample instead of skipping it")

    _add_online_arguments(parser)

    model = parser.add_argument_group("model (0.3.0)")
    model.add_argument("--num-layers", type=int, default=1, help="decoder layers of the draft")
    model.add_argument("--ttt-steps", type=int, default=3, help="test-time-training steps")
    model.add_argument("--ttt-step-loss-decay", type=float, default=1.0,
                       help="loss weight of TTT step k is decay**k")
    model.add_argument("--norm-before-residual", action=argparse.BooleanOptionalAction, default=True,
                       help="normalize the fused hidden state before the residual add")

    optim = parser.add_argument_group("optimization")
    optim.add_argument("--epochs", type=int, default=20)
    optim.add_argument("--lr", type=float, default=1e-4)
    optim.add_argument("--total-seq-len", type=int, default=8192, help="tokens per packed row")
    optim.add_argument("--weight-decay", type=float, default=0.01)
    optim.add_argument("--max-grad-norm", type=float, default=1.0)
    optim.add_argument("--scheduler-type", choices=["linear", "cosine", "none"], default="linear")
    optim.add_argument("--scheduler-warmup-steps", type=int, default=None,
                       help="default: 1%% of the steps trained (epochs x steps per epoch, capped at --max-steps)")
    optim.add_argument("--scheduler-total-steps", type=int, default=None, help="default: all steps")
    optim.add_argument("--scheduler-num-cosine-cycles", type=float, default=0.5)
    optim.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    optim.add_argument("--seed", type=int, default=0, help="seeds init, shuffling and noise")
    optim.add_argument("--noise-type", choices=["uniform", "gaussian", "none"], default="uniform",
                       help="noise on the fused input states")
    optim.add_argument("--noise-std", type=float, default=0.05,
                       help="noise scale (half-width for uniform noise, as 0.3.0)")
    optim.add_argument("--teacher-forcing", action=argparse.BooleanOptionalAction, default=True,
                       help="later TTT steps read the true next tokens (D7, as upstream later "
                            "fixed it); --no-teacher-forcing feeds the draft's own predictions, "
                            "as 0.3.0 did")

    runtime = parser.add_argument_group("runtime")
    runtime.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                         help="auto: bf16 compute with fp32 master weights on GPU, fp32 on CPU")
    runtime.add_argument("--parallel", choices=["fsdp", "ddp"], default="fsdp",
                         help="data parallelism under torchrun")
    runtime.add_argument("--fsdp-bf16-params", action="store_true",
                         help="--parallel fsdp: gather bf16 copies of the weights, not the fp32 "
                         "masters (half the traffic: for slow links; norms then use bf16 weights, "
                         "so the numerics differ slightly from one-GPU training)")
    runtime.add_argument("--deterministic", action="store_true",
                         help="GPU runs reproducible bit for bit, resumed or not: compiled blocks "
                         "take symbolic shapes from the first step and skip autotuning that "
                         "changes rounding (about 7%% slower a step on an H200); CPU runs always are")
    runtime.add_argument("--device", default=None, help="cpu or cuda (default: GPU if present)")
    runtime.add_argument("--num-workers", type=int, default=None,
                         help="loader processes (default: min(12, CPUs); 0.3.0 used 12)")
    runtime.add_argument("--prefetch-factor", type=int, default=4)
    runtime.add_argument("--checkpoint-freq", type=float, default=None,
                         help="also checkpoint every this fraction of an epoch (0.25: 4 per epoch)")
    runtime.add_argument("--keep-mid-epoch-checkpoints", type=int, default=1,
                         help="mid-epoch checkpoints (--checkpoint-freq, SIGTERM, --max-steps) kept "
                              "after the newest epoch checkpoint; the one just written is always "
                              "kept, so 0 behaves like 1")
    runtime.add_argument("--checkpoint-dtype", choices=sorted(DTYPES), default="bf16",
                         help="dtype of the served model.safetensors")

    logs = parser.add_argument_group("logging (0.3.0)")
    logs.add_argument("--logger", default="", help="comma list of tensorboard, wandb, trackio")
    logs.add_argument("--log-dir", default="./logs")
    logs.add_argument("--run-name", default=None)
    logs.add_argument("--no-progress", action="store_true", help="no progress bars")
    logs.add_argument("--debug", action="store_true", help="show tracebacks on errors")

    legacy = parser.add_argument_group("0.3.0 behaviour (each changes the trained weights)")
    legacy.add_argument("--no-verifier-norm", action="store_true",
                        help="score targets without the verifier's final norm (D1)")
    legacy.add_argument("--noise-on-targets", action="store_true",
                        help="also add noise to the teacher's states (D3)")
    legacy.add_argument("--legacy-loss-mask-shift", action="store_true",
                        help="take the loss mask one token ahead instead of two (D9)")
    legacy.add_argument("--bf16-optimizer-state", action="store_true",
                        help="save the optimizer state in bf16 (D2)")
    return parser


@dataclass
class OnlineSetup:
    options: Any  # DatagenOptions
    facts: Any  # ModelFacts
    dataset: Any  # datagen's preprocessed samples
    devices: Any = None  # TrainDevices from --train-devices, else None (time-shared)


def _check_train_devices(args: argparse.Namespace) -> Any:
    """`--train-devices` against the GPUs and the training processes of this node."""
    from speculators_vllm016.train.devices import TrainDevicesError, parse_train_devices, visible_gpus

    if args.train_devices is None:
        return None
    if args.device is not None:
        raise TrainSetupError("give --train-devices or --device, not both (--train-devices places the trainer)")
    try:
        return parse_train_devices(
            args.train_devices, visible=visible_gpus(),
            local_processes=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
            engine_gpus_needed=args.tensor_parallel_size * args.pipeline_parallel_size,
        )
    except TrainDevicesError as error:
        raise TrainSetupError(str(error)) from None


def _check_online(args: argparse.Namespace) -> OnlineSetup:
    """Datagen's checks on the online flags, then datagen's preprocessing (nothing is written)."""
    from speculators_vllm016.data_generation.offline import DatagenOptions, preprocess_samples
    from speculators_vllm016.data_generation.preflight import inspect_model
    from speculators_vllm016.data_generation.transfer import check_transfer_space

    if args.train_data_path is None:
        raise TrainSetupError("--online needs --train-data-path (the chat data datagen would read)")
    if args.online_queue_size < 1:
        raise TrainSetupError("--online-queue-size must be at least 1")
    devices = _check_train_devices(args)
    options = DatagenOptions.from_args(  # train's --seed, --token-freq-path, --no-progress are its own
        args,
        target_model_path=args.target_model_path or args.verifier_name_or_path,
        output_dir=args.cache_dir or "",
        seed=args.data_seed,
        token_freq_path=None,
        show_progress=False,
    )
    try:
        options.validate()
        facts = inspect_model(options.target_model_path, options.layer_ids, options.trust_remote_code)
        check_transfer_space(options, facts)
    except ValueError as error:
        raise TrainSetupError(first_line(error)) from None
    if args.cache_dir and Path(args.cache_dir).exists() and not Path(args.cache_dir).is_dir():
        raise TrainSetupError(f"--cache-dir {args.cache_dir} is a file; name a folder")
    dataset = preprocess_samples(options, facts).dataset
    if len(dataset) == 0:
        raise TrainSetupError(f"--train-data-path {args.train_data_path} gives no usable samples")
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


def _add_online_arguments(parser: argparse.ArgumentParser) -> None:
    """`--online`: datagen's own target-model and preprocessing flags, and the queue/cache."""
    from speculators_vllm016.cli.datagen import (
        add_preprocessing_arguments,
        add_sample_file_arguments,
        add_target_model_arguments,
    )

    online = parser.add_argument_group(
        "online training (--online): hidden states extracted live, datagen's flags"
    )
    online.add_argument("--online", action="store_true",
                        help="extract hidden states with the target model while training, instead "
                             "of reading --data-path; the batches equal offline training's on "
                             "datagen's files of the same samples. Under torchrun, rank 0 runs "
                             "the engine and sends each rank its samples")
    online.add_argument("--cache-dir", default=None,
                        help="hybrid mode: also write every extracted sample here as a datagen "
                             "folder; later epochs (and later runs) read it and start no engine")
    online.add_argument("--online-queue-size", type=int, default=4,
                        help="packed rows extracted ahead of the trainer (bounds memory)")
    online.add_argument("--train-devices", default=None,
                        help="where the draft trains: cuda:N (one per training process, e.g. "
                             "cuda:6,cuda:7 under torchrun --nproc-per-node 2) or cpu; the target "
                             "model's engine gets every other visible GPU (CUDA_VISIBLE_DEVICES). "
                             "Default: both time-share the same devices")
    add_target_model_arguments(online, required=False)
    add_preprocessing_arguments(online, required=False, seed_flag="--data-seed", token_freq=False)
    add_sample_file_arguments(online)


@dataclass
class VocabMaps:
    d2t: Any  # torch.LongTensor [draft_vocab]
    t2d: Any  # torch.BoolTensor [target_vocab]
    built_from: str | None  # token counts they were built from, or None when loaded


def _check_save_path(save_path: Path) -> None:
    if save_path.exists() and not save_path.is_dir():
        raise TrainSetupError(f"--save-path {save_path} is a file; give a folder")
    probe = save_path
    while not probe.exists():
        probe = probe.parent
    if not os.access(probe, os.W_OK | os.X_OK):
        raise TrainSetupError(f"--save-path {save_path} is not writable ({probe}); choose another folder")


def _verifier_text_config(path: str) -> Any:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    except Exception as error:  # noqa: BLE001 - any failure means: not a usable verifier
        raise TrainSetupError(
            f"cannot read the verifier config at {path!r} ({first_line(error)}); "
            "--verifier-name-or-path must be the target model folder"
        ) from None
    from speculators_vllm016.utils.text_config import text_config_of

    return config, text_config_of(config)


def _data_layer_ids(data_path: Path) -> list[int] | None:
    config_file = data_path / "data_config.json"
    if not config_file.is_file():
        return None
    try:
        return list(json.loads(config_file.read_text())["hidden_states"]["layer_ids"])
    except (KeyError, TypeError, json.JSONDecodeError):
        return None


def _check_sample(path: Path, standardize: Any, hidden_size: int) -> None:
    """The first sample's shapes against the verifier: fused width 3*H and teacher width H."""
    from speculators_vllm016.data_generation.sample_io import load_sample

    try:
        sample = load_sample(path)
    except Exception as error:  # noqa: BLE001
        raise TrainSetupError(f"cannot read sample {path} ({error}); regenerate the data") from None
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


def _token_counts(token_freq_path: str | None, data_path: Path) -> tuple[dict[int, int], str]:
    """Token counts from --token-freq-path, else datagen's per-shard counts beside the data."""
    from speculators_vllm016.data_generation.token_counts import (
        TOKEN_FREQ_DIR,
        load_token_freq,
        read_token_counts,
    )

    path = Path(token_freq_path) if token_freq_path else data_path / "token_freq.pt"
    if token_freq_path is None and (data_path / TOKEN_FREQ_DIR).is_dir():
        try:
            return load_token_freq(data_path), str(data_path / TOKEN_FREQ_DIR)
        except (OSError, ValueError, RuntimeError) as error:
            raise TrainSetupError(f"cannot read token counts: {first_line(error)}") from None
    if path.is_file():
        try:
            return read_token_counts(path), str(path)
        except ValueError as error:
            raise TrainSetupError(
                f"cannot read token counts from {path} ({type_and_first_line(error.__cause__ or error)}); "
                "it must be a {token_id: count} mapping saved by datagen or vocab-mapping"
            ) from None
    raise TrainSetupError(
        "--draft-vocab-size needs token counts: give --token-freq-path, or point --data-path at "
        f"a datagen folder (it writes {TOKEN_FREQ_DIR}/ beside the samples); none in {data_path}"
    )


def _load_vocab_maps(
    args: argparse.Namespace, target_vocab: int, data_path: Path, counts: dict[int, int] | None = None
) -> VocabMaps:
    import numpy as np
    import torch

    d2t_path, t2d_path = Path(args.d2t_path), Path(args.t2d_path)
    if d2t_path.is_file() and t2d_path.is_file():
        try:
            d2t = torch.from_numpy(np.load(d2t_path)).long()
            t2d = torch.from_numpy(np.load(t2d_path)).bool()
        except Exception as error:  # noqa: BLE001
            raise TrainSetupError(f"cannot read {d2t_path} / {t2d_path}: {error}") from None
        built_from = None
    elif args.draft_vocab_size:
        from speculators_vllm016.train.vocab_mapping import build_vocab_mappings_from_distribution

        if counts is not None and not args.token_freq_path:  # online: the preprocessed samples
            built_from = "the --train-data-path samples"
        else:
            counts, built_from = _token_counts(args.token_freq_path, data_path)
        try:
            d2t, t2d = build_vocab_mappings_from_distribution(counts, args.draft_vocab_size, target_vocab)
        except ValueError as error:
            raise TrainSetupError(f"--draft-vocab-size: {error}") from None
    else:
        raise TrainSetupError(
            f"no vocabulary maps: {d2t_path} / {t2d_path} do not exist; give --d2t-path/--t2d-path "
            "(speculators vocab-mapping writes them) or --draft-vocab-size with token counts"
        )
    if t2d.ndim != 1 or t2d.shape[0] != target_vocab:
        raise TrainSetupError(
            f"t2d has shape {tuple(t2d.shape)} but the verifier's vocabulary has {target_vocab} "
            "tokens: rebuild the maps with --target-vocab-size of this verifier"
        )
    if d2t.ndim != 1 or int(t2d.sum()) != d2t.shape[0]:
        raise TrainSetupError(
            f"d2t has {d2t.shape[0]} entries but t2d marks {int(t2d.sum())} tokens: the two files "
            "belong to different maps; rebuild both"
        )
    # d2t holds offsets: draft token i is target token i + d2t[i]. Those targets must be exactly
    # the tokens t2d marks (same-sized maps of two builds pass the count check above).
    targets = torch.arange(d2t.shape[0]) + d2t
    if bool((targets < 0).any() or (targets >= target_vocab).any()) or not bool(
        torch.equal(torch.sort(targets).values, torch.nonzero(t2d).flatten())
    ):
        raise TrainSetupError(
            "d2t's target tokens are not the tokens t2d marks: the two files belong to different "
            "maps (a rebuild replaced one of them?); rebuild both with speculators vocab-mapping"
        )
    return VocabMaps(d2t=d2t, t2d=t2d, built_from=built_from)


def build_draft_config(
    verifier_path: str, verifier_config: Any, text_config: Any, *, draft_vocab: int,
    num_layers: int, norm_before_residual: bool, ttt_steps: int, aux_layer_ids: list[int] | None,
) -> Any:
    """The EAGLE-3 draft's config: a Llama decoder layer shaped like the verifier."""
    from transformers import LlamaConfig

    from speculators_vllm016.config import SpeculatorsConfig, VerifierConfig
    from speculators_vllm016.models.eagle3 import Eagle3SpeculatorConfig
    from speculators_vllm016.proposals import GreedyTokenProposalConfig

    get = lambda name, default=None: getattr(text_config, name, default)  # noqa: E731
    heads = get("num_attention_heads")
    hidden = get("hidden_size")
    llama_like = get("model_type") in {"llama", "mistral", "qwen2", "qwen3"}
    layer = LlamaConfig(
        vocab_size=get("vocab_size"),
        hidden_size=hidden,
        intermediate_size=get("intermediate_size"),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=get("num_key_value_heads") or heads,
        head_dim=(get("head_dim") if llama_like else None) or hidden // heads,
        max_position_embeddings=get("max_position_embeddings", 4096),
        rms_norm_eps=get("rms_norm_eps", 1e-6),
        rope_theta=get("rope_theta", 10000.0),
        rope_scaling=get("rope_scaling") if llama_like else None,
        hidden_act="silu",
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    speculators_config = SpeculatorsConfig(
        algorithm="eagle3",
        proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=ttt_steps)],
        default_proposal_method="greedy",
        verifier=VerifierConfig(
            name_or_path=verifier_path,
            architectures=list(getattr(verifier_config, "architectures", None) or []),
        ),
    )
    return Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=draft_vocab,
        norm_before_residual=norm_before_residual,
        target_hidden_size=hidden,
        eagle_aux_hidden_state_layer_ids=aux_layer_ids,
        speculators_config=speculators_config,
    )


def _noise(args: argparse.Namespace) -> Any:
    from speculators_vllm016.train.noise_transforms import AddGaussianNoise, AddUniformNoise

    if args.noise_type == "none" or args.noise_std == 0:
        return None
    tensors = ("hidden_states", "verifier_last_hidden_states") if args.noise_on_targets else ("hidden_states",)
    cls = AddUniformNoise if args.noise_type == "uniform" else AddGaussianNoise
    return cls(std=args.noise_std, tensors=tensors)


@dataclass
class TrainSetup:
    """What `prepare` checked and read before anything is written."""

    data_path: Path
    save_path: Path
    verifier_config: Any
    text_config: Any
    standardize: Any
    layer_ids: list[int] | None
    aux_ids: list[int] | None
    vocab: VocabMaps
    online: Any = None  # the online extraction set-up (`--online`), else None


def prepare(args: argparse.Namespace) -> TrainSetup:
    """Every check that can be made before anything is written; errors are `TrainSetupError`s."""
    from speculators_vllm016.train.data import list_files, standardize_data_v0, standardize_data_v1

    # -- everything that can be checked before anything is written ------------------------------
    for name in ("epochs", "total_seq_len", "ttt_steps", "num_layers", "prefetch_factor"):
        if getattr(args, name) < 1:
            raise TrainSetupError(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("num_workers", "scheduler_warmup_steps", "keep_mid_epoch_checkpoints"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            raise TrainSetupError(f"--{name.replace('_', '-')} must be 0 or more")
    for name in ("max_steps", "scheduler_total_steps"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise TrainSetupError(f"--{name.replace('_', '-')} must be at least 1 (leave it out for all steps)")
    if args.fsdp_bf16_params and args.parallel != "fsdp":
        raise TrainSetupError("--fsdp-bf16-params applies to --parallel fsdp only (DDP gathers no weights)")
    if not 0 < args.train_ratio <= 1:
        raise TrainSetupError(
            f"--train-ratio {args.train_ratio} must be in (0, 1]: the share of sample files that "
            "trains (1 trains on all, with no validation)"
        )
    if args.lr <= 0:
        raise TrainSetupError("--lr must be positive")
    if args.checkpoint_freq is not None and not 0 < args.checkpoint_freq <= 1:
        raise TrainSetupError("--checkpoint-freq is a fraction of an epoch in (0, 1]")
    data_path, save_path = Path(args.data_path), Path(args.save_path)
    if args.train_devices is not None and not args.online:
        raise TrainSetupError("--train-devices places the trainer beside the engine of --online; use --device")
    online = _check_online(args) if args.online else None
    if online is None:
        if not data_path.is_dir():
            raise TrainSetupError(f"--data-path {data_path} is not a folder; run `speculators datagen` first")
        files = list_files(data_path)
        if not files:
            raise TrainSetupError(
                f"no sample files (data_<i>.pt / data_<i>.safetensors) under {data_path}; "
                "point --data-path at datagen's --output-dir"
            )
    _check_save_path(save_path)
    verifier_config, text_config = _verifier_text_config(args.verifier_name_or_path)
    hidden_size, target_vocab = int(text_config.hidden_size), int(text_config.vocab_size)
    standardize = standardize_data_v1 if args.data_format_version == 1 else standardize_data_v0
    if online is None:
        _check_sample(files[0], standardize, hidden_size)
        layer_ids = _data_layer_ids(data_path)
    else:
        layer_ids = _check_online_model(online, hidden_size)
    aux_ids = None
    if layer_ids is not None:
        num_target_layers = int(text_config.num_hidden_layers)
        if max(layer_ids) >= num_target_layers:
            raise TrainSetupError(
                f"data_config.json lists layer ids {layer_ids}, but the verifier has "
                f"{num_target_layers} layers: --verifier-name-or-path must be the model of the data"
            )
        # datagen's id i is the output of layer i; vLLM's aux id counts layer inputs (D8).
        aux_ids = [int(i) + 1 for i in layer_ids[:-1]]
    counts = None
    if online is not None and args.draft_vocab_size and not args.token_freq_path:
        from speculators_vllm016.train.vocab_mapping import count_trained_tokens

        counts = {int(k): int(v) for k, v in dict(count_trained_tokens(online.dataset)).items()}
    vocab = _load_vocab_maps(args, target_vocab, data_path, counts)
    return TrainSetup(
        data_path=data_path, save_path=save_path, verifier_config=verifier_config,
        text_config=text_config, standardize=standardize, layer_ids=layer_ids, aux_ids=aux_ids,
        vocab=vocab, online=online,
    )


def build_model(args: argparse.Namespace, setup: TrainSetup) -> Any:
    """The draft with its initial weights (seeded by --seed): what training starts from."""
    import torch

    from speculators_vllm016.models.eagle3 import Eagle3DraftModel

    torch.manual_seed(args.seed)
    config = build_draft_config(
        args.verifier_name_or_path, setup.verifier_config, setup.text_config,
        draft_vocab=int(setup.vocab.d2t.shape[0]), num_layers=args.num_layers,
        norm_before_residual=args.norm_before_residual, ttt_steps=args.ttt_steps,
        aux_layer_ids=setup.aux_ids,
    )
    model_kwargs = {}
    if args.no_verifier_norm:
        model_kwargs["use_verifier_norm"] = False
    model = Eagle3DraftModel(config, t2d=setup.vocab.t2d, d2t=setup.vocab.d2t, **model_kwargs)
    # Training reads only the loss: on CUDA each TTT step's layer skips the positions
    # whose output no loss term or metric reads (the draft tokens there are not needed).
    model.skip_unused_positions = None
    return model


def run(args: argparse.Namespace) -> int:
    import numpy as np
    import torch
    from torch.utils.data import DataLoader

    from speculators_vllm016.train.data import (
        Eagle3SampleFileDataset,
        create_collate_fn,
        split_files,
        split_items,
    )
    from speculators_vllm016.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2
    from speculators_vllm016.train.logger import METRICS_FILE, setup_metric_logger, setup_root_logger
    from speculators_vllm016.train.trainer import Trainer, TrainerConfig
    from speculators_vllm016.train.utils import (
        maybe_destroy_distributed,
        maybe_setup_distributed,
        training_device,
    )

    setup = prepare(args)
    data_path, save_path, vocab = setup.data_path, setup.save_path, setup.vocab
    standardize, layer_ids, online = setup.standardize, setup.layer_ids, setup.online

    # -- the run ---------------------------------------------------------------------------------
    if online is not None and online.devices is not None:
        args.device = online.devices.for_rank(int(os.environ.get("LOCAL_RANK", "0")))
    local_rank, world_size, rank, distributed = maybe_setup_distributed(args.device)
    closers: list[Any] = []
    failure: BaseException | None = None
    try:
        setup_root_logger("INFO")
        if layer_ids is None:
            logger.warning("no data_config.json in %s: eagle_aux_hidden_state_layer_ids not written", data_path)
        save_path.mkdir(parents=True, exist_ok=True)
        if rank == 0 and vocab.built_from:
            np.save(save_path / "d2t.npy", vocab.d2t.numpy())
            np.save(save_path / "t2d.npy", vocab.t2d.numpy())
            logger.info("vocabulary maps built from %s -> %s/{d2t,t2d}.npy", vocab.built_from, save_path)
        setup_metric_logger(args.logger, args.run_name, args.log_dir, jsonl_path=save_path / METRICS_FILE)
        model = build_model(args, setup)
        hidden_size = int(setup.text_config.hidden_size)

        workers = args.num_workers if args.num_workers is not None else min(12, os.cpu_count() or 1)
        device = training_device(local_rank, args.device)
        bf16 = args.precision == "bf16" or (args.precision == "auto" and device.type == "cuda")
        if online is not None:
            from speculators_vllm016.train.online import OnlineExtractor, OnlineLoader

            from speculators_vllm016.train.online import CacheFolderError, SampleExchange

            exchange = SampleExchange() if distributed else None  # rank 0 extracts for all
            try:
                extractor = OnlineExtractor(
                    online.options, online.facts, online.dataset,
                    Path(args.cache_dir) if args.cache_dir else None,
                    engine_devices=online.devices.engine_visible if online.devices else None,
                    writes_cache=rank == 0,
                )
            except CacheFolderError as error:
                raise TrainSetupError(str(error)) from None
            closers.append(extractor.close)
            train_items, val_items = split_items(extractor.indices, args.train_ratio, args.split_seed)
            train_files = [extractor.sample_path(index) for index in train_items]
            val_files = [extractor.sample_path(index) for index in val_items]
        else:
            train_files, val_files = split_files(str(data_path), args.train_ratio, args.split_seed)

        def loader(file_list: list[Path], transform: Any) -> DataLoader | None:
            if not file_list:
                return None
            lengths = None
            if online is not None:  # the sample index is in the (cache) file name
                items = [int(Path(f).stem.split("_")[-1]) for f in file_list]
                lengths = extractor.lengths(items)
            dataset = Eagle3SampleFileDataset(
                args.total_seq_len, file_list=[str(f) for f in file_list], transform=transform,
                standardize_fn=standardize, seed=args.seed, strict=args.strict_data,
                legacy_loss_mask_shift=args.legacy_loss_mask_shift, lengths=lengths,
                output_dtype=torch.bfloat16 if bf16 else None,
                # The verifier's widths are the yardstick: not whichever file comes first.
                widths=(3 * hidden_size, hidden_size),
            )
            sampler = MultipackDistributedBatchSamplerV2(
                args.total_seq_len, dataset.lengths, world_size, rank, seed=args.seed
            )
            if online is not None:
                return OnlineLoader(
                    extractor, dataset, items, sampler, create_collate_fn(args.total_seq_len),
                    args.online_queue_size, exchange,
                )
            return DataLoader(
                dataset, batch_sampler=sampler, collate_fn=create_collate_fn(args.total_seq_len),
                num_workers=workers, prefetch_factor=args.prefetch_factor if workers else None,
                pin_memory=device.type == "cuda",
            )

        train_loader = loader(train_files, _noise(args))
        if train_loader is None or len(train_loader) == 0:
            raise TrainSetupError(
                f"{len(train_files)} training samples make no step for {world_size} processes; "
                "generate more data or use fewer processes"
            )
        val_loader = loader(val_files, None)
        call = {"ttt_steps": args.ttt_steps, "ttt_step_loss_decay": args.ttt_step_loss_decay,
                "use_off_policy_tokens": args.teacher_forcing}
        trainer_config = TrainerConfig(
            lr=args.lr, num_epochs=args.epochs, save_path=str(save_path),
            resume_from_checkpoint=not args.no_resume_from_checkpoint,
            is_distributed=distributed, local_rank=local_rank,
            train_call_kwargs=call, val_call_kwargs=call,
            scheduler_type=args.scheduler_type, scheduler_warmup_steps=args.scheduler_warmup_steps,
            scheduler_total_steps=args.scheduler_total_steps,
            scheduler_num_cosine_cycles=args.scheduler_num_cosine_cycles,
            weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm, seed=args.seed,
            precision=args.precision, parallel=args.parallel, device=args.device,
            checkpoint_freq=args.checkpoint_freq, max_steps=args.max_steps,
            checkpoint_dtype=getattr(torch, DTYPES[args.checkpoint_dtype]),
            optimizer_state_dtype=torch.bfloat16 if args.bf16_optimizer_state else None,
            keep_mid_epoch_checkpoints=args.keep_mid_epoch_checkpoints,
            fsdp_bf16_params=args.fsdp_bf16_params, deterministic=args.deterministic,
            show_progress=not args.no_progress,
        )
        trainer = Trainer(model, trainer_config, train_loader, val_loader)
        state = trainer.run_training()
        if rank == 0:
            skipped = f", {state.skipped_samples} unusable samples skipped" if state.skipped_samples else ""
            if online is not None:
                stats = extractor.stats
                skipped += (f"; online: {stats.extracted_samples} samples extracted, "
                            f"{stats.cached_reads} read from the cache, engine started "
                            f"{stats.engine_starts} times")
            print(f"Done: {state.global_step} steps, checkpoints in {save_path}{skipped}")
    except BaseException as error:
        failure = error
        raise
    finally:
        _close_all([*closers, maybe_destroy_distributed], failure)
    return 0


def _close_all(closers: list[Any], failure: BaseException | None) -> None:
    """Call every closer, even after one failed. A closer's error never replaces the error
    already on its way out (`failure`): it is logged. Without one, the first is raised last."""
    first: Exception | None = None
    for close in closers:
        try:
            close()
        except Exception as error:  # noqa: BLE001 - logged or raised below
            if failure is None and first is None:
                first = error
            else:
                logger.error("while closing: %s: %s", type(error).__name__, error)
    if first is not None:
        raise first


def main(argv: Sequence[str] | None = None, prog: str = "speculators train") -> int:
    from speculators_vllm016.cli.errors import report_errors
    from speculators_vllm016.train.data import DataSourceError, SampleFileError
    from speculators_vllm016.train.trainer import TrainingInterrupted

    args = build_parser(prog).parse_args(argv)
    expected = (TrainSetupError, SampleFileError, DataSourceError, FileNotFoundError, ImportError)
    return report_errors(lambda: run(args), args.debug, expected, stopped=(TrainingInterrupted,))
