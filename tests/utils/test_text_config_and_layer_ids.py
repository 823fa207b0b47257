"""The single definitions of the text-config lookup and of the default layer ids."""

from __future__ import annotations

from transformers import LlamaConfig, LlavaConfig

from speculators_vllm016.convert.eagle.utils import find_vocab_size
from speculators_vllm016.data_generation.cpu_defaults import uses_mla
from speculators_vllm016.utils.layer_ids import default_layer_ids, eagle3_aux_layer_ids
from speculators_vllm016.utils.layer_ids import default_layer_ids as the_definition
from speculators_vllm016.utils.text_config import text_config_of


def test_text_config_of_dicts_and_objects() -> None:
    plain = {"vocab_size": 5, "num_hidden_layers": 2}
    wrapped = {"vocab_size": 9, "text_config": {"vocab_size": 7, "kv_lora_rank": 16}}
    assert text_config_of(plain) is plain
    assert text_config_of(wrapped) == {"vocab_size": 7, "kv_lora_rank": 16}
    assert text_config_of({"text_config": {}, "vocab_size": 3}) == {
        "text_config": {},
        "vocab_size": 3,
    }
    assert text_config_of({"llm_config": {"num_hidden_layers": 2}}) == {"num_hidden_layers": 2}
    llama = LlamaConfig(num_hidden_layers=3)
    assert text_config_of(llama) is llama
    llava = LlavaConfig(text_config=LlamaConfig(num_hidden_layers=5).to_dict())
    assert text_config_of(llava).num_hidden_layers == 5
    # Its users agree with it.
    assert find_vocab_size(wrapped) == 7 and find_vocab_size(plain) == 5
    assert uses_mla(wrapped) and not uses_mla(plain)


def test_default_layer_ids_have_one_definition() -> None:
    assert default_layer_ids is the_definition
    assert eagle3_aux_layer_ids(32) == [2, 16, 29]
    assert default_layer_ids(32) == [2, 16, 29, 31]
    assert default_layer_ids(4) == [2, 2, 1, 3]


def test_datagen_ids_count_outputs_and_vllm_ids_count_inputs() -> None:
    from speculators_vllm016.utils.layer_ids import datagen_to_vllm_layer_ids

    assert datagen_to_vllm_layer_ids([2, 16, 29]) == [3, 17, 30]
    assert datagen_to_vllm_layer_ids([]) == []
