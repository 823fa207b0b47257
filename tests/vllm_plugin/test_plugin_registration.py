"""The plugin as vLLM 0.16 loads it: entry point, registry, the EAGLE-3 config check (no engine).

Clean processes (subprocesses) show what `register()` changes in a vLLM nobody touched yet, and
that `SPECULATORS_VLLM_PLUGIN=0` leaves vLLM as shipped. In this process the plugin is loaded as
vLLM loads it (`load_general_plugins`, run by `EngineArgs.create_engine_config`), and vLLM's own
config path (`tests/vllm_compat/harness.build_vllm_config`, what `vllm serve
--speculative-config` runs) accepts drafts made by our draft config writer for the tiny
DeepSeek-V3 and Kimi-K2.5, and resolves their targets to the plugin's EAGLE-3 classes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from speculators_vllm016.utils.layer_ids import datagen_to_vllm_layer_ids

ROOT = Path(__file__).resolve().parents[2]
PLUGIN_ARCHS = {"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration"}
# The Llama-layer draft's names in vLLM 0.16's registry: vLLM's class plus EAGLE-3.1.
DRAFT_ARCHS = {"Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle3"}
MLA_DRAFT_ARCHS = ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM")

# Runs in a fresh interpreter: vLLM's registry and EAGLE-3 list before and after register(), twice.
REGISTER_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from vllm.config.speculative import SpeculativeConfig
    from vllm.model_executor.models import ModelRegistry
    from speculators_vllm016.vllm_plugin import register
    from speculators_vllm016.vllm_plugin.speculative_types import eagle3_model_types_in

    def snapshot():
        return {
            arch: [getattr(m, "module_name", None), getattr(m, "class_name", None), type(m).__name__]
            for arch, m in ModelRegistry.models.items()
        }

    def types():
        return list(eagle3_model_types_in(SpeculativeConfig._verify_args.__code__) or ())

    before, types_before = snapshot(), types()
    results = [register(), register()]
    outcome = None
    if len(sys.argv) > 2:  # then vLLM's own config path (it loads the general plugins itself)
        from tests.vllm_compat.harness import build_vllm_config
        try:
            build_vllm_config(sys.argv[1], sys.argv[2], num_speculative_tokens=3)
            outcome = "accepted"
        except Exception as error:
            outcome = str(error)
    print("RESULT " + json.dumps({
        "before": before, "after": snapshot(), "types_before": types_before,
        "types_after": types(), "results": results, "outcome": outcome,
    }))
    """
)


def run_clean(script: str, *args: str, **env: str) -> dict:
    environment = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        env=environment,
        cwd=str(ROOT),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line.removeprefix("RESULT "))


def test_entry_point_is_installed():
    from importlib.metadata import entry_points

    ours = [e for e in entry_points(group="vllm.general_plugins") if e.name == "speculators_eagle3"]
    assert [e.value for e in ours] == ["speculators_vllm016.vllm_plugin:register"]


def test_register_changes_only_its_architectures_and_the_list_once():
    result = run_clean(REGISTER_SCRIPT)
    before, after = result["before"], result["after"]
    assert result["results"] == [True, True]
    # vLLM 0.16 has no MLA EAGLE-3 draft class: the plugin adds the two names vLLM >= 0.18 uses.
    assert set(after) - set(before) == set(MLA_DRAFT_ARCHS)
    for arch in MLA_DRAFT_ARCHS:
        assert after[arch][:2] == [
            "speculators_vllm016.vllm_plugin.mla_draft",
            "MLAEagle3DraftForCausalLM",
        ]
    changed = {arch for arch in before if before[arch] != after[arch]}
    assert changed == PLUGIN_ARCHS | DRAFT_ARCHS
    for arch in PLUGIN_ARCHS:
        assert after[arch][0] == "speculators_vllm016.vllm_plugin.deepseek_eagle3"
        assert after[arch][1] == "Eagle3" + arch
    for arch in DRAFT_ARCHS:
        assert before[arch][:2] == [
            "vllm.model_executor.models.llama_eagle3",
            "Eagle3LlamaForCausalLM",
        ]
        assert after[arch][:2] == [
            "speculators_vllm016.vllm_plugin.eagle31_llama",
            "Eagle31LlamaForCausalLM",
        ]
    assert before["LlamaForCausalLM"] == [
        "vllm.model_executor.models.llama",
        "LlamaForCausalLM",
        "_LazyRegisteredModel",
    ]
    # Only widened, once, although register() ran twice.
    assert result["types_after"] == result["types_before"] + [
        "deepseek_v2",
        "deepseek_v3",
        "kimi_k2",
    ]


# -- vLLM's own config path, in this process --------------------------------------------------


def write_draft(folder: Path, target: Path) -> Path:
    """A draft from our trainer's config writer, shaped for `target` (weights untrained)."""
    from transformers import DeepseekV3Config

    from speculators_vllm016.models.eagle3 import Eagle3DraftModel
    from speculators_vllm016.train.jobs.draft_build import build_draft_config
    from speculators_vllm016.train.vocab_mapping import build_vocab_mappings_from_distribution

    config = json.loads((target / "config.json").read_text())
    text = DeepseekV3Config(**config.get("text_config", config))
    draft_config = build_draft_config(
        str(target),
        SimpleNamespace(architectures=config["architectures"]),
        text,
        draft_vocab=128,
        num_layers=1,
        norm_before_residual=True,
        ttt_steps=3,
        aux_layer_ids=datagen_to_vllm_layer_ids([0, 1]),
    )
    d2t, t2d = build_vocab_mappings_from_distribution(
        {token: 1000 - token for token in range(0, 512, 3)}, 128, 512
    )
    torch.manual_seed(0)
    Eagle3DraftModel(draft_config, t2d=t2d, d2t=d2t).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def mla_disabled():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_MLA_DISABLE", "1")  # no MLA on the CPU build
        yield


@pytest.mark.parametrize(
    ("target", "model_class"),
    [
        ("tiny_deepseek_v3", "Eagle3DeepseekV3ForCausalLM"),
        ("tiny_kimi_k25", "Eagle3KimiK25ForConditionalGeneration"),
    ],
)
def test_speculative_config_accepts_a_draft_for_the_target(
    target, model_class, request, tmp_path, mla_disabled
):
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_eagle3

    from tests.vllm_compat.harness import build_vllm_config

    folder = request.getfixturevalue(target)
    draft = write_draft(tmp_path / "draft", folder)
    vllm_config = build_vllm_config(draft, folder, num_speculative_tokens=3)
    speculative = vllm_config.speculative_config
    assert speculative.method == "eagle3" and speculative.num_speculative_tokens == 3
    assert speculative.target_model_config.hf_text_config.model_type == "deepseek_v3"
    assert list(speculative.draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids) == [1, 2]
    model_config = vllm_config.model_config
    cls, _ = ModelRegistry.resolve_model_cls(model_config.architectures, model_config)
    assert cls.__name__ == model_class and supports_eagle3(cls)


def test_switched_off_changes_nothing_and_vllm_refuses_as_shipped(tiny_deepseek_v3, tmp_path):
    draft = write_draft(tmp_path / "draft", tiny_deepseek_v3)
    result = run_clean(
        REGISTER_SCRIPT,
        str(draft),
        str(tiny_deepseek_v3),
        SPECULATORS_VLLM_PLUGIN="0",
        VLLM_MLA_DISABLE="1",
    )
    assert result["results"] == [False, False]
    assert result["after"] == result["before"]
    assert result["types_after"] == result["types_before"]
    assert "deepseek_v3" not in result["types_after"]
    assert "Eagle3 is only supported for" in result["outcome"]
    assert "model_type='deepseek_v3'" in result["outcome"]


def test_llama_target_keeps_vllms_own_class(tiny_llama, tmp_path):
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.llama import LlamaForCausalLM

    from tests.vllm_compat.harness import build_vllm_config, write_reference_eagle3_checkpoint

    draft = write_reference_eagle3_checkpoint(tmp_path / "draft", tiny_llama)
    vllm_config = build_vllm_config(draft, tiny_llama)
    assert vllm_config.speculative_config.method == "eagle3"
    model_config = vllm_config.model_config
    cls, _ = ModelRegistry.resolve_model_cls(model_config.architectures, model_config)
    assert cls is LlamaForCausalLM
