"""Same API, same behaviour as speculators 0.3.0 (issue 12, part 1): configs and registries.

Model-level parity (EAGLE-1 files, verifier attachment) is in tests/models/test_eagle_parity.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import ClassVar, Literal

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from speculators_vllm016.config import (
    SpeculatorModelConfig,
    SpeculatorsConfig,
    TokenProposalConfig,
    VerifierConfig,
    reload_and_populate_configs,
)
from speculators_vllm016.model import SpeculatorModel
from speculators_vllm016.proposals import GreedyTokenProposalConfig

REPO = Path(__file__).resolve().parents[1]

GREEDY = {
    "proposal_type": "greedy",
    "speculative_tokens": 2,
    "verifier_accept_k": 1,
    "accept_tolerance": 0.0,
}
EAGLE3_DICT = {
    "speculators_model_type": "eagle3",
    "draft_vocab_size": 64,
    "transformer_layer_config": {
        "model_type": "llama",
        "hidden_size": 64,
        "num_attention_heads": 2,
        "num_hidden_layers": 1,
        "intermediate_size": 128,
        "vocab_size": 128,
    },
    "speculators_config": {
        "algorithm": "eagle3",
        "proposal_methods": [GREEDY],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": None, "architectures": ["LlamaForCausalLM"]},
    },
}

# Run in a fresh interpreter: what `import speculators` alone sets up, in the order user code
# written for 0.3.0 meets it.
FRESH_PROCESS_CHECKS = r"""
import json, sys
import speculators
from speculators import SpeculatorModelConfig, TokenProposalConfig, reload_and_populate_configs
from speculators.models import Eagle3SpeculatorConfig
from speculators.proposals import GreedyTokenProposalConfig

data = json.loads(sys.argv[1])
greedy = data["speculators_config"]["proposal_methods"][0]
report = {
    "proposal_registry": sorted(TokenProposalConfig.registry or []),
    "model_registry": sorted(SpeculatorModelConfig.registry or []),
    "validate_proposal": type(TokenProposalConfig.model_validate(greedy)).__name__,
    "validate_config": type(SpeculatorModelConfig.model_validate(data)).__name__,
}

def proposal_types():
    built = Eagle3SpeculatorConfig(**{k: v for k, v in data.items() if k != "speculators_model_type"})
    return [
        type(SpeculatorModelConfig.from_dict(data).speculators_config.proposal_methods[0]).__name__,
        type(SpeculatorModelConfig.model_validate(data).speculators_config.proposal_methods[0]).__name__,
        type(built.speculators_config.proposal_methods[0]).__name__,
    ]

report["proposals"] = proposal_types()
reload_and_populate_configs()
report["proposals_after_reload"] = proposal_types()
print(json.dumps(report))
"""


def test_import_fills_registries_and_dicts_become_classes_in_a_fresh_process():
    """Items 1 and 2: registries filled by `import speculators`; proposals are classes, not dicts."""
    result = subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS_CHECKS, json.dumps(EAGLE3_DICT)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["proposal_registry"] == ["greedy"]
    assert {"eagle", "eagle3", "independent", "mlp"} <= set(report["model_registry"])
    assert report["validate_proposal"] == "GreedyTokenProposalConfig"
    assert report["validate_config"] == "Eagle3SpeculatorConfig"
    assert report["proposals"] == ["GreedyTokenProposalConfig"] * 3
    assert report["proposals_after_reload"] == ["GreedyTokenProposalConfig"] * 3


def test_loaded_config_file_has_proposal_classes(tmp_path: Path):
    """Item 1 through files: save, then load with SpeculatorModelConfig.from_pretrained."""
    config = SpeculatorModelConfig.from_dict(EAGLE3_DICT)
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["speculators_config"]["proposal_methods"] == [GREEDY]  # 0.3.0's file layout
    for loaded in (
        SpeculatorModelConfig.from_pretrained(tmp_path),
        SpeculatorModelConfig.from_dict(saved),
    ):
        method = loaded.speculators_config.proposal_methods[0]
        assert isinstance(method, GreedyTokenProposalConfig) and method.speculative_tokens == 2
    reload_and_populate_configs()
    again = SpeculatorModelConfig.from_pretrained(tmp_path)
    assert isinstance(again.speculators_config.proposal_methods[0], GreedyTokenProposalConfig)


def test_unknown_proposal_type_is_refused_with_the_known_ones():
    with pytest.raises(ValidationError, match="greedy"):
        TokenProposalConfig.model_validate({"proposal_type": "beam"})


# -------------------------------------------------- item 3: model class found by config class


@SpeculatorModelConfig.register("parity_test_config")
class ParityTestConfig(SpeculatorModelConfig):
    speculators_model_type: Literal["parity_test_config"] = "parity_test_config"
    width: int = 4


@SpeculatorModel.register("parity_model_registered_under_another_name")
class ParityTestModel(SpeculatorModel):
    config_class: ClassVar[type[ParityTestConfig]] = ParityTestConfig  # type: ignore[misc]

    def __init__(self, config, verifier=None, verifier_attachment_mode=None):
        super().__init__(
            config, verifier=verifier, verifier_attachment_mode=verifier_attachment_mode
        )
        self.proj = nn.Linear(config.width, config.width)
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            module.weight.data.normal_()
            module.bias.data.zero_()


def _speculators_config() -> SpeculatorsConfig:
    return SpeculatorsConfig(
        algorithm="test",
        proposal_methods=[GreedyTokenProposalConfig()],
        default_proposal_method="greedy",
        verifier=VerifierConfig(name_or_path=None, architectures=[]),
    )


def test_model_registered_under_another_name_loads_by_its_config_class(tmp_path: Path):
    config = ParityTestConfig(width=3, speculators_config=_speculators_config())
    assert SpeculatorModel.registered_model_class_from_config(config) is ParityTestModel
    model = ParityTestModel(config)
    model.save_pretrained(tmp_path)
    loaded = SpeculatorModel.from_pretrained(tmp_path)
    assert type(loaded) is ParityTestModel
    assert torch.equal(loaded.proj.weight, model.proj.weight)
    with pytest.raises(TypeError, match="base SpeculatorModelConfig"):
        SpeculatorModel.registered_model_class_from_config(
            SpeculatorModelConfig(speculators_model_type="parity_test_config")
        )

    class Unregistered(ParityTestConfig):
        pass

    with pytest.raises(ValueError, match="config_class Unregistered"):
        SpeculatorModel.registered_model_class_from_config(Unregistered())


# -------------------------------------------------------------------- item 8: greedy bounds


@pytest.mark.parametrize(
    "field, value",
    [
        ("speculative_tokens", 0),
        ("speculative_tokens", -3),
        ("verifier_accept_k", 0),
        ("accept_tolerance", -0.5),
    ],
)
def test_greedy_bounds_as_in_0_3_0(field: str, value: float):
    with pytest.raises(ValidationError, match=field):
        GreedyTokenProposalConfig(**{field: value})
    with pytest.raises(ValidationError):
        TokenProposalConfig.model_validate({"proposal_type": "greedy", field: value})
    assert GreedyTokenProposalConfig(
        speculative_tokens=1, verifier_accept_k=1, accept_tolerance=0.0
    )


# ----------------------------------------------------------- item 9: from_pretrained errors


def test_from_pretrained_argument_errors(tmp_path: Path):
    config = ParityTestConfig(speculators_config=_speculators_config())
    ParityTestModel(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="checkpoint path"):
        SpeculatorModel.from_pretrained(None)
    with pytest.raises(ValueError, match="state_dict"):
        SpeculatorModel.from_pretrained(None, config=config)
    with pytest.raises(TypeError, match="SpeculatorModelConfig.from_pretrained"):
        SpeculatorModel.from_pretrained(tmp_path, config=str(tmp_path))
    # A config and a state dict need no folder.
    state = ParityTestModel(config).state_dict()
    loaded = SpeculatorModel.from_pretrained(None, config=config, state_dict=state)
    assert torch.equal(loaded.proj.weight, state["proj.weight"])


# ------------------------------------------------- item 11: EagleConverter's 0.3.0 table


def test_eagle_converter_layernorm_mapping_of_0_3_0():
    from speculators.convert.eagle import EagleConverter

    assert EagleConverter.EAGLE_TO_SPECULATORS_LAYERNORM_MAPPINGS == {
        "embed_layernorm.weight": "embedding_layernorm.weight",
        "lm_head_layernorm.weight": "pre_lm_head_layernorm.weight",
    }
    renamed = EagleConverter.rename_weights(
        {
            "embed_layernorm.weight": torch.ones(2),
            "lm_head_layernorm.weight": torch.ones(2),
            "fc.weight": torch.ones(2, 4),
        },
        layernorms=True,
    )
    assert set(renamed) == {
        "embedding_layernorm.weight",
        "pre_lm_head_layernorm.weight",
        "fusion_fc.weight",
    }


# ------------------------------------------------ item 5: one verifier at a time (base class)


def test_a_draft_that_holds_nothing_of_its_verifier_takes_one_for_generate(tmp_path: Path):
    """EAGLE-3 drafts are built "train_only" (they copy what they need): they may then take a
    verifier for `generate`; a second one is refused until detached, as in 0.3.0."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from speculators_vllm016.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    layer = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_hidden_layers=1,
        vocab_size=64,
    )
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=16,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig()],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path="not/downloaded", architectures=[]),
        ),
    )
    draft = Eagle3DraftModel(config)
    assert draft.verifier_attachment_mode == "train_only" and draft.verifier is None
    verifier = LlamaForCausalLM(layer)
    draft.attach_verifier(verifier, mode="full")
    assert draft.verifier is verifier and draft.verifier_attachment_mode == "full"
    with pytest.raises(RuntimeError, match="detach_verifier"):
        draft.attach_verifier(verifier)
    draft.detach_verifier()
    assert draft.verifier is None and draft.verifier_attachment_mode == "detached"
