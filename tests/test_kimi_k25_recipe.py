"""The Kimi-K2.5 recipe (docs/kimi-k2.5.md) runs as written, on a tiny Kimi-K2.5 and on the
DeepSeek-V3 inside it.

The block's five commands are read from the recipe's section of docs/kimi-k2.5.md (as
tests/test_readme_commands.py reads the tutorial's section) and run in order, once with `moonshotai/Kimi-K2.5` replaced by the taught tiny Kimi-K2.5
(conftest: a DeepSeek-V3 trained briefly on the demo conversations, inside the multimodal wrapper
with the real folder's `auto_map` and no modeling file) and once by that DeepSeek-V3 itself, each
run in its own folder. The only other changes:

- PLACEHOLDERS: the chat data becomes demo conversations: `chat.jsonl` the first CONVERSATIONS,
  `heldout.jsonl` the CONVERSATIONS after them;
- SCALED_DOWN: per (flag, recipe value), the 8-GPU sizes made tiny for a 2-core CPU (tensor
  parallel 1, one torchrun process, 128-token samples and rows, a 64-token draft vocabulary,
  3 epochs, 8 prompts);
- `vllm serve`: vLLM's CPU build cannot speculate, so the serve command's own arguments are parsed
  by vLLM's serve parser and its engine configuration built (`create_engine_config`, which loads
  vLLM's general plugins, ours among them), in a fresh process, without starting the server.

Every assertion shares the two runs, one untrained draft, and one online training on the tiny
Kimi-K2.5 (`--online --extraction-ranks 1` under torchrun). The DeepSeek-V3 run stops after
training (its checkpoints must be the Kimi run's); what its eval and serve steps checked is held
where each belongs:
- a draft measures the same on the wrapper as on its language model:
  tests/cli/test_eval_kimi.py::test_a_draft_measures_the_same_on_the_kimi_wrapper_as_on_its_language_model;
- vLLM takes an EAGLE-3 draft of the DeepSeek-V3 through the plugin (model class with EAGLE-3,
  the draft's aux ids): tests/vllm_plugin/test_plugin_registration.py::
  test_speculative_config_accepts_a_draft_for_the_target.
In-process `--online` on the wrapper extracts with the same `OnlineExtractor` as the extraction
rank (train/online/extraction_rank.py), and in-process online equals offline on the Llama
(tests/train/online/test_loader.py::test_online_steps_equal_offline_steps_on_datagens_files).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.test_readme_commands import section_commands
from tests.train.online.test_loader import assert_same_weights
from tests.training_fixtures import cli_env, free_port

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "docs" / "kimi-k2.5.md"
RECIPE_SECTION = "## The recipe: 8x RTX PRO 6000 (96 GB each, one host)"
KIMI = "moonshotai/Kimi-K2.5"
CHAT_DATA = ("chat.jsonl", "heldout.jsonl")  # files of the `chats` folder
CONVERSATIONS = 40
SCALED_DOWN = {
    ("--tensor-parallel-size", "8"): "1",
    ("--nproc-per-node", "8"): "1",
    ("--seq-length", "4096"): "128",
    ("--draft-vocab-size", "32000"): "64",
    ("--epochs", "10"): "3",
    ("--total-seq-len", "8192"): "128",
    ("--max-prompts", "200"): "8",
}
STEPS = [
    ["speculators", "datagen"],
    ["speculators", "vocab-mapping"],
    ["torchrun", "--nproc-per-node"],
    ["speculators", "eval"],
    ["vllm", "serve"],
]
EPOCHS = ("0", "1", "2")
TRAINED = STEPS.index(["torchrun", "--nproc-per-node"]) + 1  # the steps up to training

# `vllm serve ARGS` up to the server: vLLM's own serve parser and engine configuration.
SERVE_CONFIG = """
import json, sys
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.model_executor.models import ModelRegistry
from vllm.model_executor.models.interfaces import supports_eagle3
from vllm.usage.usage_lib import UsageContext
from vllm.utils.argparse_utils import FlexibleArgumentParser

args = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])
validate_parsed_serve_args(args)
args.model = args.model_tag
config = AsyncEngineArgs.from_cli_args(args).create_engine_config(UsageContext.OPENAI_API_SERVER)
spec = config.speculative_config
target, architecture = ModelRegistry.resolve_model_cls(config.model_config.architectures, config.model_config)
print("SERVE_CONFIG " + json.dumps({
    "method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens,
    "aux_layer_ids": spec.draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids,
    "architecture": architecture, "target_supports_eagle3": bool(supports_eagle3(target)),
}))
"""


def kimi_block() -> list[list[str]]:
    """The argv of each command of the recipe's Kimi-K2.5 block."""
    blocks = section_commands(RECIPE.read_text(encoding="utf-8"), RECIPE_SECTION)
    found = [block for block in blocks if any(KIMI in argv for argv in block)]
    assert len(found) == 1, "one bash block of the section names Kimi-K2.5"
    return found[0]


def substituted(argv: list[str], target: Path, chats: Path) -> list[str]:
    out = []
    for i, token in enumerate(argv):
        flag = argv[i - 1] if i else ""
        if token == KIMI:
            token = str(target)
        elif token in CHAT_DATA:
            token = str(chats / token)
        elif (flag, token) in SCALED_DOWN:
            token = SCALED_DOWN[(flag, token)]
        out.append(token)
    if out[0] == "speculators":
        return [sys.executable, "-m", "speculators_vllm016", *out[1:]]
    if out[0] == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *out[1:]]
    if out[:2] == ["vllm", "serve"]:
        return [sys.executable, "-c", SERVE_CONFIG, *out[2:]]
    return out


def run_env() -> dict[str, str]:
    """This checkout's package; torchrun on a free port (its default, 29500, may be taken)."""
    env = cli_env()
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env["PYTHONPATH"]
    env["PET_MASTER_PORT"] = str(free_port())
    return env


def run(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        command, cwd=cwd, env=run_env(), capture_output=True, text=True, timeout=900
    )


def failure(argv: list[str], done: subprocess.CompletedProcess) -> str:
    return f"{' '.join(argv[:3])} exited {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


@dataclass
class RecipeRun:
    """The block run in `folder` on one target: each command's result, in order."""

    folder: Path
    target: Path
    chats: Path
    argv: list[list[str]] = field(default_factory=list)
    results: list[subprocess.CompletedProcess] = field(default_factory=list)

    def step(self, name: str) -> tuple[list[str], subprocess.CompletedProcess]:
        index = [" ".join(s) for s in STEPS].index(name)
        return self.argv[index], self.results[index]

    def require(self, *names: str) -> None:
        for name in names:
            argv, done = self.step(name)
            assert done.returncode == 0, failure(argv, done)

    @property
    def save(self) -> Path:
        argv, _ = self.step("torchrun --nproc-per-node")
        return self.folder / argv[argv.index("--save-path") + 1]

    def eval_report(self) -> dict:
        argv, _ = self.step("speculators eval")
        return json.loads((self.folder / argv[argv.index("--output-json") + 1]).read_text())


def run_recipe(target: Path, folder: Path, chats: Path, steps: int = len(STEPS)) -> RecipeRun:
    """The block's first `steps` commands in order; a failed one leaves the later ones unrun
    (exit -1)."""
    folder.mkdir(parents=True, exist_ok=True)
    recipe = RecipeRun(folder=folder, target=target, chats=chats)
    failed = False
    for argv in kimi_block()[:steps]:
        recipe.argv.append(argv)
        if failed:
            recipe.results.append(
                subprocess.CompletedProcess(argv, -1, "", "an earlier command failed")
            )
            continue
        done = run(substituted(argv, target, chats), folder)
        recipe.results.append(done)
        failed = done.returncode != 0
    return recipe


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    """A folder with the recipe's two chat files, from the demo conversations."""
    from speculators_vllm016.demo import demo_conversations_path

    folder = tmp_path_factory.mktemp("kimi-chats")
    lines = demo_conversations_path().read_text(encoding="utf-8").splitlines()
    for index, name in enumerate(CHAT_DATA):
        part = lines[index * CONVERSATIONS : (index + 1) * CONVERSATIONS]
        (folder / name).write_text("\n".join(part) + "\n", encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def kimi_run(taught_kimi_k25, chats, tmp_path_factory) -> RecipeRun:
    return run_recipe(taught_kimi_k25, tmp_path_factory.mktemp("kimi-recipe"), chats)


@pytest.fixture(scope="module")
def deepseek_run(taught_deepseek_v3, chats, tmp_path_factory) -> RecipeRun:
    """The block up to training (datagen, vocab-mapping, torchrun): see the module docstring."""
    folder = tmp_path_factory.mktemp("deepseek-recipe")
    return run_recipe(taught_deepseek_v3, folder, chats, steps=TRAINED)


def train_options(recipe: RecipeRun) -> list[str]:
    """The recipe's training flags (substituted), after `-m speculators_vllm016 train`."""
    argv = substituted(recipe.step("torchrun --nproc-per-node")[0], recipe.target, recipe.chats)
    return argv[argv.index("train") + 1 :]


@pytest.fixture(scope="module")
def untrained_tau(kimi_run) -> dict:
    """The Kimi draft as training starts from it (the trainer's construction and seed), measured by
    the recipe's eval command with only `--draft` and `--output-json` changed."""
    from speculators_vllm016.cli.train import config_from_argv
    from speculators_vllm016.demo.draft_training import save_initial_draft

    kimi_run.require("speculators datagen", "speculators vocab-mapping")
    config, _ = config_from_argv(train_options(kimi_run))
    with contextlib.chdir(kimi_run.folder):
        save_initial_draft(config, kimi_run.folder / "untrained")
    argv = list(kimi_run.step("speculators eval")[0])
    argv[argv.index("--draft") + 1] = "untrained"
    argv[argv.index("--output-json") + 1] = "untrained.json"
    done = run(substituted(argv, kimi_run.target, kimi_run.chats), kimi_run.folder)
    assert done.returncode == 0, failure(argv, done)
    return json.loads((kimi_run.folder / "untrained.json").read_text())


def tau(report: dict) -> float:
    (draft,) = report["drafts"]
    return draft["acceptance_length"]


# ------------------------------------------------------------------------------------------------
# fast: the block itself


def test_the_block_holds_the_five_steps_and_every_substitution_applies():
    block = kimi_block()
    assert [argv[:2] for argv in block] == STEPS
    used = {(argv[i - 1], token) for argv in block for i, token in enumerate(argv) if i}
    assert set(SCALED_DOWN) <= used, set(SCALED_DOWN) - used
    assert {token for argv in block for token in argv if token in CHAT_DATA} == set(CHAT_DATA)
    serve = block[-1]
    spec = json.loads(serve[serve.index("--speculative-config") + 1])
    train = block[2]
    assert spec["method"] == "eagle3"
    assert spec["model"].startswith(train[train.index("--save-path") + 1] + "/")


# ------------------------------------------------------------------------------------------------
# engine: the block run on both targets


@pytest.mark.engine
@pytest.mark.slow
def test_the_block_runs_as_written_on_the_tiny_kimi_k25(kimi_run):
    for name in (" ".join(s) for s in STEPS):
        kimi_run.require(name)
    report = kimi_run.eval_report()
    assert report["engine"] == "hf" and report["num_prompts"] == 8
    # Before any long work, datagen and train say the draft will be servable (through the plugin).
    for name in ("speculators datagen", "torchrun --nproc-per-node"):
        _, done = kimi_run.step(name)
        assert "can serve an EAGLE-3 draft for this target with this package's plugin" in (
            done.stdout + done.stderr
        ), name


@pytest.mark.engine
@pytest.mark.slow
def test_vllm_serve_takes_the_trained_draft_with_the_plugin(kimi_run):
    """The draft folder the serve command names, accepted by vLLM as an EAGLE-3 draft of the
    target, whose model class (Kimi-K2.5's wrapper) then supports EAGLE-3 and is given the aux
    layers the draft was trained on (datagen's defaults in vLLM's numbering)."""
    kimi_run.require(*(" ".join(s) for s in STEPS))
    _, done = kimi_run.step("vllm serve")
    line = next(x for x in done.stdout.splitlines() if x.startswith("SERVE_CONFIG "))
    served = json.loads(line.removeprefix("SERVE_CONFIG "))
    assert served == {
        "method": "eagle3",
        "num_speculative_tokens": 3,
        "aux_layer_ids": [3, 4, 5],
        "architecture": "KimiK25ForConditionalGeneration",
        "target_supports_eagle3": True,
    }


@pytest.mark.engine
@pytest.mark.slow
def test_the_kimi_draft_is_the_deepseek_v3_draft(kimi_run, deepseek_run):
    """Same language model, same conversations, same seed: the wrapper changes nothing the draft
    sees. So both runs' vocabularies and checkpoints hold the same bytes and tensors bit for bit,
    epoch by epoch (that eval then measures the same on either target is
    tests/cli/test_eval_kimi.py's)."""
    for recipe in (kimi_run, deepseek_run):
        recipe.require(
            "speculators datagen", "speculators vocab-mapping", "torchrun --nproc-per-node"
        )
    for name in ("d2t.npy", "t2d.npy"):
        assert (kimi_run.folder / "kimi/vocab" / name).read_bytes() == (
            deepseek_run.folder / "kimi/vocab" / name
        ).read_bytes()
    for epoch in EPOCHS:
        assert_same_weights(kimi_run.save / epoch, deepseek_run.save / epoch)


@pytest.mark.engine
@pytest.mark.slow
def test_the_trained_kimi_draft_beats_the_untrained_one(kimi_run, untrained_tau):
    kimi_run.require("speculators eval")
    trained, untrained = tau(kimi_run.eval_report()), tau(untrained_tau)
    print(f"tau: trained {trained:.3f}, untrained {untrained:.3f}")
    assert untrained < 1.05, untrained  # the untrained draft guesses (almost) nothing
    assert trained > untrained + 0.15, (trained, untrained)


# ------------------------------------------------------------------------------------------------
# engine: online training on the tiny Kimi-K2.5 gives the offline draft


def online_argv(recipe: RecipeRun, save: str) -> list[str]:
    """The recipe's training flags, reading the conversations through the engine instead of
    datagen's folder (datagen's own flags: the same target, data and sample length)."""
    options = train_options(recipe)
    at = options.index("--data-path")
    del options[at : at + 2]
    options[options.index("--save-path") + 1] = save
    datagen = substituted(recipe.step("speculators datagen")[0], recipe.target, recipe.chats)
    seq_length = datagen[datagen.index("--seq-length") + 1]
    return [
        *options,
        "--online",
        "--trust-remote-code",
        "--train-data-path",
        str(recipe.chats / "chat.jsonl"),
        "--seq-length",
        seq_length,
        "--num-preprocessing-workers",
        "1",
    ]


def torchrun(processes: int, options: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(processes),
        "-m",
        "speculators_vllm016",
        "train",
        *options,
    ]


@pytest.mark.engine
@pytest.mark.slow
def test_an_extraction_rank_beside_the_training_rank_gives_the_offline_weights(kimi_run):
    kimi_run.require("speculators datagen", "torchrun --nproc-per-node")
    argv = [*online_argv(kimi_run, "split"), "--extraction-ranks", "1"]
    done = run(torchrun(2, argv), kimi_run.folder)
    assert done.returncode == 0, failure(["train", "--extraction-ranks"], done)
    for epoch in EPOCHS:
        assert_same_weights(kimi_run.folder / "split" / epoch, kimi_run.save / epoch)
