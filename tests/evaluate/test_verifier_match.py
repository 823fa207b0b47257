"""Evaluating a draft with a verifier it was not trained for fails in one line naming what
differs, before any model loads (issue #29 item 8), instead of an IndexError or a shape error
from deep inside generation."""

from __future__ import annotations

import json

import pytest

from speculators_vllm016.evaluate.runner import EvalOptions, run_evaluation
from tests.evaluate.drafts import build_draft

CHAT = {
    "conversations": [
        {"from": "human", "value": "What is the capital of France?"},
        {"from": "gpt", "value": "Paris."},
    ]
}


@pytest.fixture(scope="module")
def draft_and_data(tmp_path_factory, tiny_llama):
    root = tmp_path_factory.mktemp("verifier_match")
    build_draft(str(tiny_llama)).save_pretrained(root / "draft")
    (root / "chat.jsonl").write_text(json.dumps(CHAT) + "\n")
    return root


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"num_hidden_layers": 3}, "it fuses layers [1, 2, 3], the verifier has 3 layers"),
        (
            {"hidden_size": 128, "intermediate_size": 256},
            "hidden states 256 wide, the verifier's are 128 wide",
        ),
        ({"vocab_size": 384}, "a vocabulary of 512 tokens, the verifier's has 384"),
    ],
)
def test_a_verifier_the_draft_was_not_trained_for_is_named_in_one_line(
    draft_and_data, models_dir, change, named
):
    from speculators_vllm016.tiny_models import build_tiny_llama

    name = "-".join(f"{key}{value}" for key, value in change.items())
    verifier = build_tiny_llama(models_dir / f"llama-{name}", **change)
    options = EvalOptions(
        drafts=[str(draft_and_data / "draft")],
        data_path=str(draft_and_data / "chat.jsonl"),
        verifier=str(verifier),
        max_prompts=1,
        max_new_tokens=4,
        engine="hf",
        device="cpu",
        show_progress=False,
    )
    with pytest.raises(ValueError, match="does not match the verifier") as raised:
        run_evaluation(options)
    message = str(raised.value)
    assert named in message and "\n" not in message, message
    assert str(draft_and_data / "draft") in message and str(verifier) in message


def test_the_draft_s_own_verifier_passes_the_check(draft_and_data, tiny_llama):
    from speculators_vllm016.evaluate.runner import draft_settings
    from speculators_vllm016.evaluate.verifier_match import check_verifier_matches
    from speculators_vllm016.utils.verifier_config import load_verifier_config_dict

    settings = draft_settings(str(draft_and_data / "draft"))
    assert settings.expects.aux_layer_ids == (1, 2, 3)
    check_verifier_matches(
        "draft", settings.expects, str(tiny_llama), load_verifier_config_dict(str(tiny_llama))
    )


def test_the_check_reads_the_verifiers_width_not_the_draft_layers(tmp_path, tiny_llama, models_dir):
    # A draft whose layer is narrower (128) than the verifier it reads (256, target_hidden_size):
    # its real verifier passes, a verifier of the draft layer's own width is refused.
    from speculators_vllm016.evaluate.runner import draft_settings
    from speculators_vllm016.evaluate.verifier_match import check_verifier_matches
    from speculators_vllm016.tiny_models import build_tiny_llama
    from speculators_vllm016.utils.verifier_config import load_verifier_config_dict

    config = build_draft(str(tiny_llama)).config
    config.transformer_layer_config.hidden_size = 128
    config.target_hidden_size = 256
    config.save_pretrained(tmp_path / "narrow-draft")
    expects = draft_settings(str(tmp_path / "narrow-draft")).expects
    assert expects.hidden_size == 256
    check_verifier_matches(
        "draft", expects, str(tiny_llama), load_verifier_config_dict(str(tiny_llama))
    )
    narrow = build_tiny_llama(
        models_dir / "llama-hidden_size128-intermediate_size256",
        hidden_size=128,
        intermediate_size=256,
    )
    with pytest.raises(ValueError, match="hidden states 256 wide, the verifier's are 128 wide"):
        check_verifier_matches(
            "draft", expects, str(narrow), load_verifier_config_dict(str(narrow))
        )
