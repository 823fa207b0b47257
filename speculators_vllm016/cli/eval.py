"""`speculators eval`: acceptance of one or more drafts, measured as vLLM measures it."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import NoReturn

import typer

from speculators_vllm016.utils.command_errors import (
    EXIT_ERROR,
    EXPECTED_ERRORS,
    describe_error,
    error_line,
)
from speculators_vllm016.utils.errors import SpeculatorsError
from speculators_vllm016.utils.output_paths import check_output_file

__all__ = ["evaluate"]

EPILOG = (
    "tau = 1 + accepted / drafts (mean tokens per verifier pass); pos k = share of drafts whose "
    "k-th token was accepted. tau_sim = 1 + sum of the trainer's validation full_acc_k, shown when "
    "the draft folder (or the folder above it) holds metrics.jsonl. Outputs are the verifier's own "
    "greedy outputs whatever the draft proposes."
)


def evaluate(
    draft: list[str] = typer.Option(
        ..., "--draft", help="Draft folder (config.json + model.safetensors); repeat to compare."
    ),
    data_path: str = typer.Option(
        ...,
        "--data-path",
        help="Chat data as datagen reads it: .json/.jsonl (ShareGPT or messages), or "
        "'sharegpt' / 'ultrachat'. Prompt = the conversation up to its first assistant turn.",
    ),
    verifier: str | None = typer.Option(
        None, "--verifier", help="Target model (default: the verifier named in the draft config)."
    ),
    max_prompts: int = typer.Option(
        100, "--max-prompts", min=1, help="Prompts to use, in file order."
    ),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", min=1),
    num_speculative_tokens: int | None = typer.Option(
        None,
        "--num-speculative-tokens",
        min=1,
        help="Default: each draft config's speculative_tokens.",
    ),
    engine: str = typer.Option(
        "auto",
        "--engine",
        help="hf: transformers verifier + the draft (runs anywhere); vllm: vLLM 0.16 spec decode "
        "(GPU builds); auto: vllm where vLLM can speculate, else hf.",
    ),
    tensor_parallel_size: int = typer.Option(
        1,
        "--tensor-parallel-size",
        min=1,
        help="vllm: GPUs that hold the verifier (8 for Kimi-K2.5 on 8 GPUs); the hf engine takes 1.",
    ),
    batch_size: int = typer.Option(8, "--batch-size", min=1, help="hf: prompts per verifier pass."),
    device: str | None = typer.Option(
        None, "--device", help="hf: default cuda if available, else cpu."
    ),
    dtype: str = typer.Option(
        "auto",
        "--dtype",
        help="auto (float32 on cpu, the model's own otherwise), float32, bfloat16, float16.",
    ),
    ignore_eos: bool = typer.Option(
        False, "--ignore-eos", help="Generate --max-new-tokens for every prompt."
    ),
    max_prompt_tokens: int | None = typer.Option(
        None, "--max-prompt-tokens", min=1, help="Skip prompts longer than this."
    ),
    context_lengths: str | None = typer.Option(
        None,
        "--context-lengths",
        help="Measure at these prompt lengths in tokens, e.g. 0,1000,4000: each question asked "
        "after earlier turns of the data's other conversations, as many whole turns as fit "
        "(0: the question alone). One row per draft and length, with tau over its shortest.",
    ),
    hf_cache_dir: str | None = typer.Option(None, "--hf-cache-dir", help="datasets cache folder."),
    trust_remote_code: bool = typer.Option(
        False,
        "--trust-remote-code",
        help="Run Python code shipped in the verifier folder where vLLM and transformers have no "
        "class of their own for it (e.g. Kimi-K2.5's tokenizer); off by default.",
    ),
    output_json: Path | None = typer.Option(None, "--output-json", help="Write the results here."),
    plot: Path | None = typer.Option(
        None, "--plot", help="Write a PNG of per-position acceptance here (needs matplotlib)."
    ),
    no_progress: bool = typer.Option(False, "--no-progress", help="Hide progress bars."),
    allow_other_verifier: bool = typer.Option(
        False,
        "--allow-other-verifier",
        help="Measure a draft against a verifier whose final norm and LM head differ from those it "
        "was trained against (refused otherwise: usually a wrong --verifier).",
    ),
    debug: bool = typer.Option(False, "--debug", help="Show the full traceback of an error."),
) -> None:
    """Measure draft acceptance (per-position rates, tau, tokens/s) on chat prompts."""
    from speculators_vllm016.evaluate.context_prompts import parse_context_lengths
    from speculators_vllm016.evaluate.report import format_table, write_json, write_plot
    from speculators_vllm016.evaluate.runner import EvalOptions, run_evaluation

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            _fail("--plot needs matplotlib: pip install matplotlib (or leave out --plot)")
    lengths: list[int] = []
    if context_lengths is not None:
        try:
            lengths = parse_context_lengths(context_lengths)
        except SpeculatorsError as error:
            _fail(str(error))
    for flag, path in (("--output-json", output_json), ("--plot", plot)):
        # Checked before the evaluation (which can take long), not when writing after it.
        if path is not None:
            try:
                check_output_file(path, flag)
            except SpeculatorsError as error:
                _fail(str(error))
    options = EvalOptions(
        drafts=list(draft),
        data_path=data_path,
        verifier=verifier,
        max_prompts=max_prompts,
        max_new_tokens=max_new_tokens,
        num_speculative_tokens=num_speculative_tokens,
        engine=engine,
        tensor_parallel_size=tensor_parallel_size,
        batch_size=batch_size,
        device=device,
        dtype=dtype,
        ignore_eos=ignore_eos,
        max_prompt_tokens=max_prompt_tokens,
        hf_cache_dir=hf_cache_dir,
        trust_remote_code=trust_remote_code,
        show_progress=not no_progress,
        allow_other_verifier=allow_other_verifier,
        context_lengths=lengths,
    )
    try:
        report = run_evaluation(options)
    except EXPECTED_ERRORS as error:
        # OSError: transformers' answer to a tokenizer it cannot find (a folder without tokenizer
        # files, a hub id with no network); FileNotFoundError is one too.
        if debug:
            raise
        _fail(describe_error(error))
    typer.echo(
        f"{report.num_prompts} prompts from {report.data_path}, verifier {report.verifier}, "
        f"engine {report.engine}, up to {report.max_new_tokens} new tokens"
    )
    typer.echo(format_table(report.drafts))
    if output_json is not None:
        write_json(report, output_json)
        typer.echo(f"results: {output_json}")
    if plot is not None:
        write_plot(report.drafts, plot)
        typer.echo(f"plot: {plot}")


def _fail(message: str) -> NoReturn:
    typer.echo(error_line(message), err=True)
    raise typer.Exit(EXIT_ERROR)
