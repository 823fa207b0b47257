"""Eval's set-up reads its inputs once (#49 item 2): each draft's config.json once
(`draft_settings`; the hf engine loads the draft with that config), the verifier's config.json
once (`run_evaluation`: every check, the hf engine's verifier and the vLLM engine's CPU defaults
use that reading), the verifier's safetensors listed once and its final norm and LM head read
once (the fingerprint check), then its weights once by the engine.

Counted with `tests.reads_once.counting`; the hf engine's whole run (tiny models, a few tokens),
the vLLM engine's set-up up to where the verifier goes to vLLM (`vllm.LLM`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from speculators_vllm016.demo import demo_conversations_path
from speculators_vllm016.evaluate.runner import EvalOptions, run_evaluation
from speculators_vllm016.utils.verifier_weights import verifier_fingerprint
from tests.evaluate.drafts import build_draft
from tests.reads_once import assert_counts, counting


@pytest.fixture(scope="module")
def inputs(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    """A draft that records its verifier's fingerprint (so eval checks it), and chat data."""
    root = tmp_path_factory.mktemp("eval_reads")
    data = root / "chats.jsonl"
    data.write_text("\n".join(demo_conversations_path().read_text().splitlines()[:3]) + "\n")
    draft = build_draft(str(tiny_llama))
    recorded = draft.config.speculators_config.verifier
    recorded.weights_fingerprint = verifier_fingerprint(str(tiny_llama))
    draft.save_pretrained(root / "draft")
    return {"verifier": Path(tiny_llama), "draft": root / "draft", "data": data}


def _options(inputs, tmp_path, engine: str) -> EvalOptions:
    return EvalOptions(
        drafts=[str(inputs["draft"])],
        data_path=str(inputs["data"]),
        engine=engine,
        device="cpu",
        max_prompts=2,
        max_new_tokens=4,
        hf_cache_dir=str(tmp_path / "hf"),
        show_progress=False,
    )


# The verifier's tokenizer (one AutoTokenizer.from_pretrained) and the prompts (one
# load_dataset), as those libraries read them; ours: the data file's own check.
TOKENIZER = {"verifier:tokenizer_config.json": 3, "verifier:chat_template.jinja": 1}
SET_UP = {
    # config.json once; the safetensors listed once, then the final norm and LM head once
    "ours": {"data": 1, "verifier:model.safetensors": 2},
    # transformers' readings on our behalf: each config.json once (ours through
    # `PretrainedConfig.get_config_dict` / `SpeculatorModelConfig.from_pretrained`)
    "transformers": {**TOKENIZER, "verifier:config.json": 1, "draft:config.json": 1},
    "datasets": {"data": 6},
}


def test_an_hf_evaluation_reads_its_draft_and_verifier_once(inputs, tmp_path):
    with counting(inputs) as seen:
        report = run_evaluation(_options(inputs, tmp_path, "hf"))
    assert report.drafts and report.engine == "hf"
    engine_reads = {
        # the verifier's weights and the draft's, each loaded once by transformers (whose
        # loader opens a safetensors file four times itself), and their generation configs
        "verifier:model.safetensors": 4,
        "verifier:generation_config.json": 1,
        "draft:model.safetensors": 4,
        "draft:generation_config.json": 1,
    }
    assert_counts(seen, {**SET_UP, "transformers": {**SET_UP["transformers"], **engine_reads}})


class HandedToVllm(Exception):
    """Raised where the evaluation hands the verifier and the draft to vLLM."""


def test_a_vllm_evaluation_reads_nothing_again_before_the_engine(inputs, tmp_path, monkeypatch):
    """Up to `vllm.LLM`: the CPU defaults use the config the set-up read (they read it again)."""
    import vllm

    from speculators_vllm016.evaluate import vllm_engine

    if vllm_engine.speculative_decoding_unavailable() is not None:
        pytest.skip("vLLM cannot speculate here")

    def stop(*args, **kwargs):
        raise HandedToVllm

    monkeypatch.setattr(vllm, "LLM", stop)
    monkeypatch.setattr(vllm_engine, "on_cpu_build", lambda: True)  # its CPU defaults run
    with counting(inputs) as seen, pytest.raises(HandedToVllm):
        run_evaluation(_options(inputs, tmp_path, "vllm"))
    assert_counts(seen, SET_UP)
