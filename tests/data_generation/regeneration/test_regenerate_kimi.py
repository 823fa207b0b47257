"""Regeneration on the users' target: the tiny Kimi-K2.5 (a DeepSeek-V3 inside the multimodal
wrapper) with a chat template that has a thinking switch, on the real vLLM 0.16 CPU engine.

The two commands of docs/kimi-k2.5.md's on-policy section (thinking off, thinking on) run as the
page writes them, with tiny sizes and temperature 0, through datagen's own parser and
`run_datagen_regenerating`, on one hidden-states generator that both share (the CLI would start
one per command). Checked against transformers' greedy generation from the same weights (the
wrapped DeepSeek-V3 checkpoint) rendered with the same template arguments.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from speculators_vllm016.data_generation.sample_io import load_sample
from tests.test_readme_commands import section_commands
from tests.tiny_models import copy_with_thinking_template

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[3]
PAGE = REPO / "docs" / "kimi-k2.5.md"
SECTION = "## On-policy data: Kimi-K2.5 answers the turns first (thinking on or off)"
KIMI = "moonshotai/Kimi-K2.5"
SEQ_LENGTH, MAX_PROMPT_TOKENS, MAX_TOKENS = 256, 192, 12
SCALED_DOWN = {
    ("--tensor-parallel-size", "8"): "1",
    ("--seq-length", "4096"): str(SEQ_LENGTH),
    ("--seq-length", "8192"): str(SEQ_LENGTH),
    ("--max-prompt-tokens", "2048"): str(MAX_PROMPT_TOKENS),
    ("--max-tokens", "2048"): str(MAX_TOKENS),
    ("--max-tokens", "6144"): str(MAX_TOKENS),
    ("--temperature", "0.6"): "0",
    ("--temperature", "1.0"): "0",
}
ROWS = [
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "a shipped answer"},
        {"role": "user", "content": "Write a short poem about the sea."},
        {"role": "assistant", "content": "another shipped answer"},
    ],
    [
        {"role": "user", "content": "Numbers 0 1 2 3"},
        {"role": "assistant", "content": "a shipped answer"},
    ],
    [
        {"role": "user", "content": "The quick brown fox"},
        {"role": "assistant", "content": "a shipped answer"},
        {"role": "user", "content": "What comes next?"},
        {"role": "assistant", "content": "another shipped answer"},
    ],
    [
        {"role": "user", "content": "Hidden states teach the draft."},
        {"role": "assistant", "content": "a shipped answer"},
    ],
]


def page_commands() -> list[list[str]]:
    """The section's datagen commands (argv after `speculators datagen`), substituted later."""
    (block,) = section_commands(PAGE.read_text(encoding="utf-8"), SECTION)
    assert [argv[:2] for argv in block] == [["speculators", "datagen"]] * 2
    return [argv[2:] for argv in block]


def substituted(argv: list[str], target: Path, folder: Path) -> list[str]:
    out = []
    for i, token in enumerate(argv):
        flag = argv[i - 1] if i else ""
        if token == KIMI:
            token = str(target)
        elif token == "chat.jsonl" or flag == "--output-dir":
            token = str(folder / token)
        elif (flag, token) in SCALED_DOWN:
            token = SCALED_DOWN[(flag, token)]
        out.append(token)
    # fp32 as the transformers reference (the wrapper's `auto` is bf16 on the CPU build)
    return [*out, "--dtype", "float32", "--no-progress", "--num-preprocessing-workers", "1"]


@dataclass
class Run:
    kwargs: dict
    output_dir: Path
    regenerated: list[list[dict]]  # the conversations, in data order


@pytest.fixture(scope="module")
def kimi_thinking(tiny_kimi_k25, tmp_path_factory) -> Path:
    return copy_with_thinking_template(tiny_kimi_k25, tmp_path_factory.mktemp("kimi") / "model")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The working folder of the page's commands, with their chat.jsonl."""
    folder = tmp_path_factory.mktemp("kimi-regen")
    (folder / "chat.jsonl").write_text("".join(json.dumps({"messages": r}) + "\n" for r in ROWS))
    return folder


def parsed_page_commands(target: Path, folder: Path, *extra: str) -> list:
    """The page's commands as datagen's parser reads them, `extra` flags added."""
    from speculators_vllm016.cli.datagen import build_parser

    return [
        build_parser().parse_args([*substituted(argv, target, folder), *extra])
        for argv in page_commands()
    ]


@pytest.fixture(scope="module")
def generator(kimi_thinking, folder):
    """One hidden-states generator for every command of the module, as the page's first command
    starts it (with a context long enough for both halves of every command)."""
    from speculators_vllm016.cli.datagen import options_from_args
    from speculators_vllm016.data_generation.offline import start_generator
    from speculators_vllm016.data_generation.preflight import inspect_model

    first = options_from_args(parsed_page_commands(kimi_thinking, folder)[0])
    first.engine.max_model_len = SEQ_LENGTH + 1
    engine = start_generator(first, inspect_model(str(kimi_thinking), None, True))
    yield engine
    engine.close()


def run_command(args, generator):
    """`speculators datagen --regenerate ...` as `main` runs it, on the shared generator."""
    from speculators_vllm016.cli.datagen import options_from_args, regeneration_options
    from speculators_vllm016.data_generation.regeneration.one_pass import (
        run_datagen_regenerating,
    )

    options = options_from_args(args)
    options.engine.max_model_len = SEQ_LENGTH + 1
    return run_datagen_regenerating(options, regeneration_options(args), generator=generator)


@pytest.fixture(scope="module")
def runs(kimi_thinking, folder, generator) -> dict[str, Run]:
    """Both commands of the page, in order; keyed "off" and "on"."""
    done = {}
    for name, args in zip(("off", "on"), parsed_page_commands(kimi_thinking, folder)):
        regenerated, _ = run_command(args, generator)
        assert regenerated.failed == 0, regenerated.describe()
        lines = Path(regenerated.output_file).read_text().splitlines()
        done[name] = Run(
            kwargs=json.loads(args.chat_template_kwargs),
            output_dir=Path(args.output_dir),
            regenerated=[json.loads(line)["messages"] for line in lines],
        )
    return done


@pytest.fixture(scope="module")
def reference_model(tiny_deepseek_v3):
    """The same weights as the tiny Kimi-K2.5's language model, in transformers (fp32)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_deepseek_v3, dtype=torch.float32).eval()


def greedy_turns(model, tokenizer, kwargs: dict) -> list[list[dict]]:
    """transformers' greedy answers, turn after turn, each prompt rendered with `kwargs`."""
    stop = tokenizer.eos_token_id
    regenerated = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # OpenMP's spinning threads make it 10x slower on a busy CPU
    try:
        for row in ROWS:
            regenerated.append(_greedy_row(model, tokenizer, row, kwargs, stop))
    finally:
        torch.set_num_threads(threads)
    return regenerated


def _greedy_row(model, tokenizer, row: list[dict], kwargs: dict, stop: int) -> list[dict]:
    """One row's assistant turns answered in order, each after the ones before it."""
    messages = [dict(turn) for turn in row]
    for position, turn in enumerate(messages):
        if turn["role"] != "assistant":
            continue
        text = tokenizer.apply_chat_template(
            messages[:position], tokenize=False, add_generation_prompt=True, **kwargs
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=[stop],
                pad_token_id=tokenizer.pad_token_id,
            )
        new = out[0, len(ids) :].tolist()
        new = new[:-1] if new and new[-1] == stop else new
        turn["content"] = tokenizer.decode(new, skip_special_tokens=False)
    return messages


@pytest.fixture(scope="module")
def tokenizer(kimi_thinking):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(kimi_thinking)


def sample_ids(folder: Path) -> list[list[int]]:
    return sorted(
        load_sample(path)["input_ids"].tolist() for path in sorted(folder.glob("data_*.pt"))
    )


def rendered_ids(tokenizer, conversations: list[list[dict]], kwargs: dict) -> list[list[int]]:
    """Each conversation rendered with `kwargs` and tokenized as datagen does, sorted."""
    out = []
    for messages in conversations:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"][:SEQ_LENGTH])
    return sorted(out)


@pytest.mark.parametrize("mode", ["off", "on"])
def test_greedy_turns_equal_transformers_with_the_same_template_arguments(
    runs, reference_model, tokenizer, mode
):
    run = runs[mode]
    assert run.regenerated == greedy_turns(reference_model, tokenizer, run.kwargs)
    answers = [turn["content"] for row in run.regenerated for turn in row[1:]]
    assert not any("shipped" in answer for answer in answers)


@pytest.mark.parametrize("mode", ["off", "on"])
def test_samples_are_the_conversations_rendered_with_the_commands_arguments(runs, tokenizer, mode):
    run = runs[mode]
    assert sample_ids(run.output_dir) == rendered_ids(tokenizer, run.regenerated, run.kwargs)
    config = json.loads((run.output_dir / "data_config.json").read_text())
    assert config["data"]["chat_template_kwargs"] == run.kwargs


def test_thinking_on_and_off_render_different_samples(runs, tokenizer):
    off, on = runs["off"], runs["on"]
    assert off.kwargs == {"thinking": False} and on.kwargs == {"thinking": True}
    empty_block = tokenizer("<think></think>", add_special_tokens=False)["input_ids"]

    def has_block(ids: list[int]) -> bool:
        return any(ids[i : i + len(empty_block)] == empty_block for i in range(len(ids)))

    assert all(has_block(ids) for ids in sample_ids(off.output_dir))
    assert not any(has_block(ids) for ids in sample_ids(on.output_dir))
    # The same conversations rendered the other way are other tokens: the switch is no no-op.
    assert rendered_ids(tokenizer, off.regenerated, on.kwargs) != sample_ids(off.output_dir)


def test_a_resume_with_other_template_arguments_is_refused(runs, kimi_thinking):
    """Plain datagen on the regenerated file into the thinking-off folder, thinking on: refused
    in one line naming the flag, before an engine starts, and the folder is left as it was."""
    from speculators_vllm016.data_generation.offline import run_datagen
    from speculators_vllm016.data_generation.options import DatagenOptions
    from speculators_vllm016.utils.errors import InvalidInputError

    off = runs["off"]
    before = sample_ids(off.output_dir)
    options = DatagenOptions(
        target_model_path=str(kimi_thinking),
        train_data_path=str(off.output_dir / "regenerated" / "conversations.jsonl"),
        output_dir=str(off.output_dir),
        seq_length=SEQ_LENGTH,
        batch_size=64,
        trust_remote_code=True,
        num_preprocessing_workers=1,
        show_progress=False,
        chat_template_kwargs='{"thinking": true}',
    )
    with pytest.raises(InvalidInputError, match="different run.*chat_template_kwargs"):
        run_datagen(options)
    assert sample_ids(off.output_dir) == before


def test_shards_of_a_one_pass_run_write_the_unsharded_runs_files(
    kimi_thinking, folder, generator, tmp_path
):
    """`datagen --regenerate --num-shards 2`: shard I regenerates rows I, I+2 and extracts
    samples I, I+2 of all the regenerated rows; together the shards write the unsharded run's
    sample files, conversations and token counts. Batches of one row, so every turn is computed
    in a batch of the same make-up either way (vLLM is not batch-invariant bit for bit).

    The shards run one after the other on the shared engine: shard 1's regeneration (the first
    half of its command) runs first, so shard 0 finds its rows and need not wait."""
    from speculators_vllm016.cli.datagen import regeneration_options
    from speculators_vllm016.data_generation.engine_sampling import capture_paused
    from speculators_vllm016.data_generation.regeneration.capture_engine import GeneratorEngine
    from speculators_vllm016.data_generation.regeneration.run import run_regeneration
    from speculators_vllm016.data_generation.token_counts import load_token_freq

    def command(output: str, *shard: str):
        off = parsed_page_commands(kimi_thinking, folder, "--batch-size", "1", *shard)[0]
        off.output_dir = str(tmp_path / output)
        return off

    run_command(command("whole"), generator)
    shards = [command("sharded", "--num-shards", "2", "--shard-index", str(i)) for i in (0, 1)]
    with capture_paused(generator):
        run_regeneration(regeneration_options(shards[1]), GeneratorEngine(generator))
    run_command(shards[0], generator)
    regenerated, extracted = run_command(shards[1], generator)
    assert regenerated.regenerated == 0 and extracted.samples_total == 2
    whole, sharded = tmp_path / "whole", tmp_path / "sharded"
    conversations = Path("regenerated") / "conversations.jsonl"
    assert (sharded / conversations).read_bytes() == (whole / conversations).read_bytes()
    files = sorted(path.name for path in whole.glob("data_*.pt"))
    assert len(files) == len(ROWS)
    assert sorted(path.name for path in sharded.glob("data_*.pt")) == files
    for name in files:
        assert (sharded / name).read_bytes() == (whole / name).read_bytes(), name
    assert load_token_freq(sharded) == load_token_freq(whole)
