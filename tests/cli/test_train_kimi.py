"""`speculators train` on the tiny Kimi-K2.5 (#36 item 1), as a user runs it: the draft's config
names the wrapper as vLLM loads it; a quantized LM head stops the run in one line."""

from __future__ import annotations

import json

from speculators_vllm016.cli.train import main
from tests.kimi_variants import int4_variant, with_remote_code
from tests.training_fixtures import train_args, write_dataset, write_vocab_maps


def test_train_on_the_kimi_wrapper_and_refuse_a_quantized_head(
    tiny_kimi_k25, tiny_deepseek_v3, tmp_path, capsys
):
    data = write_dataset(tiny_deepseek_v3, tmp_path / "data", [30, 45, 52], layer_ids=[0, 1, 1, 2])
    write_vocab_maps(data, 512, tmp_path)
    kimi = with_remote_code(tiny_kimi_k25, tmp_path / "kimi")
    save = tmp_path / "save"
    assert main(train_args(kimi, data, save, "--epochs", "1", "--max-steps", "1")) == 0
    config = json.loads((save / "0" / "config.json").read_text())
    verifier = config["speculators_config"]["verifier"]
    assert verifier["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert verifier["name_or_path"] == str(kimi)
    assert config["transformer_layer_config"]["vocab_size"] == 512  # the text config's vocabulary
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 2]  # vLLM's numbering
    capsys.readouterr()

    int4 = int4_variant(tiny_kimi_k25, tmp_path / "int4", pack_lm_head=True)
    refused = tmp_path / "refused"
    assert main(train_args(int4, data, refused)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1 and "LM head language_model.lm_head" in err[0] and "weight_packed" in err[0]
    ), err
    assert not refused.exists()
