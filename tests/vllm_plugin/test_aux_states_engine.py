"""The plugin's EAGLE-3 aux states on the real vLLM 0.16 engine (CPU build), TP1 and TP2.

One engine per (model, tensor parallel size): the hidden-states generator's, with the plugin
loaded by vLLM itself in every worker (the installed `vllm.general_plugins` entry point). The aux
states the patched model returns (see aux_recorder.py for how they are taken out) must be, for
aux id i + 1, exactly the states the generator extracts for datagen layer i (the numbering our
draft configs record), and transformers' on the same weights; aux id 0 is the embedding rows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from speculators_vllm016.data_generation.vllm_hidden_states_generator import (
    VllmHiddenStatesGenerator,
)
from speculators_vllm016.utils.layer_ids import datagen_to_vllm_layer_ids
from tests.hf_reference import HFReference, assert_matches_reference, mixed_batch, relative_error
from tests.vllm_plugin import aux_recorder

pytestmark = pytest.mark.engine

VOCAB = 512
DATAGEN_LAYERS = [0, 1, 2]  # every layer of the tiny DeepSeek-V3: dense 0, MoE 1 and 2 (the last)
AUX_IDS = [0, *datagen_to_vllm_layer_ids(DATAGEN_LAYERS)]  # [0, 1, 2, 3]: embeddings included
EXPECTED_CLASS = {
    "deepseek_v3": "Eagle3DeepseekV3ForCausalLM",
    "kimi_k25": "Eagle3KimiK25ForConditionalGeneration",
}


@pytest.fixture(scope="module")
def deepseek_reference(tiny_deepseek_v3):
    return HFReference(tiny_deepseek_v3)


def embedding_table(folder: Path, prefix: str) -> torch.Tensor:
    tensors = load_file(str(folder / "model.safetensors"))
    return tensors[f"{prefix}model.embed_tokens.weight"]


CASES = [
    ("deepseek_v3", 1, "float32"),
    ("kimi_k25", 1, "float32"),
    ("deepseek_v3", 2, "float32"),
    ("kimi_k25", 2, "float32"),
    # vLLM's float16 DeepSeek path divides the stream by routed_scaling_factor (2.5 here): the aux
    # states must be multiplied back, as the generator's are (its own test checks those against
    # transformers).
    ("deepseek_v3", 1, "float16"),
]


@pytest.mark.parametrize(
    ("target", "tp", "dtype"), CASES, ids=["-".join(map(str, c)) for c in CASES]
)
def test_aux_states_equal_the_generators_and_transformers(
    target, tp, dtype, request, deepseek_reference, monkeypatch
):
    folder: Path = request.getfixturevalue(f"tiny_{target}")
    if tp > 1:
        monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)  # the generator picks one
    batch = mixed_batch(VOCAB, [1, 200, 31, 90, 5, 140, 64, 17], seed=21)
    with VllmHiddenStatesGenerator(
        str(folder),
        layer_ids=DATAGEN_LAYERS,
        max_model_len=512,
        dtype=dtype,
        tensor_parallel_size=tp,
        max_num_seqs=4,
        max_num_batched_tokens=128,
    ) as generator:
        executor = generator._executor
        setups = executor.collective_rpc(aux_recorder.install, args=(AUX_IDS,))
        results = generator.generate(batch)
        records = executor.collective_rpc(aux_recorder.collect)
        # No layers set: the forward must return vLLM's plain hidden states again.
        executor.collective_rpc(aux_recorder.set_layers, args=([],))
        generator.generate(batch[:3])
        plain = executor.collective_rpc(aux_recorder.collect)

    model_class = EXPECTED_CLASS[target]
    assert [s["tp_rank"] for s in setups] == list(range(tp))
    for setup in setups:
        assert setup["model_class"] == model_class and setup["supports_eagle3"]
        assert setup["inner_class"] == "Eagle3DeepseekV2Model"
        assert setup["default_layers"] == (2, 1, 0)  # vLLM's Llama default for 3 layers
    for record in records:
        assert record["returned_pair"] and all(record["returned_pair"])
        assert all(record["final_equal"]), "final hidden states differ from vLLM's own forward"
    for record in plain:
        assert record["returned_pair"] and not any(record["returned_pair"])
        assert all(record["final_equal"])
    assert all(not r["rows"] for r in records[1:])  # rank 0 files the rows

    rows = records[0]["rows"]
    assert len(rows) == len({tuple(ids) for ids in batch})
    table = embedding_table(folder, "language_model." if target == "kimi_k25" else "")
    if dtype == "float32":
        assert_matches_reference(results, batch, deepseek_reference, DATAGEN_LAYERS)
    for index, (ids, result) in enumerate(zip(batch, results)):
        aux = rows[tuple(ids)]
        assert aux.shape == (len(AUX_IDS), len(ids), generator.hidden_size)
        assert not torch.isnan(aux).any(), f"sample {index}: positions never returned"
        embeddings = table[ids].to(getattr(torch, dtype)).float()
        assert torch.equal(aux[0], embeddings), f"sample {index}: aux id 0 is not the embeddings"
        for slot, layer in enumerate(DATAGEN_LAYERS, start=1):
            extracted = result["hidden_states"][layer].float()
            assert torch.equal(aux[slot], extracted), (
                f"sample {index}: aux id {AUX_IDS[slot]} differs from datagen layer {layer} "
                f"(relative error {relative_error(aux[slot], extracted):.2e})"
            )
