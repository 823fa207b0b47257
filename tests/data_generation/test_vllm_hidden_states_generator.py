"""The generator on the real vLLM 0.16 engine (CPU build), checked against transformers.

Each class shares one engine between its tests (class-scoped fixture), so engines start once and
are gone before the next class starts.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch

from speculators_vllm016.data_generation.vllm_hidden_states_generator import (
    HiddenStatesResult,
    VllmHiddenStatesGenerator,
)
from tests.hf_reference import (
    TOLERANCE,
    HFReference,
    assert_matches_reference,
    mixed_batch,
    relative_error,
)

pytestmark = pytest.mark.engine

VOCAB = 512


def live_children() -> list[psutil.Process]:
    children = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            # multiprocessing's resource tracker lives as long as this process, by design.
            if any("resource_tracker" in part for part in child.cmdline()):
                continue
            children.append(child)
        except psutil.NoSuchProcess:
            pass
    return children


def wait_for_no_children(timeout: float = 20.0) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while (children := live_children()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return children


# -- Llama, tensor parallel 1, heavy batching -----------------------------------------------------

LLAMA_LAYERS = [0, 1, 2, 3]  # every layer of the 4-layer model, the last one included
LLAMA_MAX_MODEL_LEN = 512
# The tiny Llama's whole context (max_position_embeddings): the heavy-batching engine is asked for
# one position more, as `datagen --seq-length 1024` asks, so that a sample of it all fits.
LLAMA_CONTEXT = 1024
FULL_CONTEXT_MAX_MODEL_LEN = LLAMA_CONTEXT + 1


@pytest.fixture(scope="class")
def llama_generator(tiny_llama):
    with VllmHiddenStatesGenerator(
        str(tiny_llama),
        layer_ids=LLAMA_LAYERS,
        max_model_len=FULL_CONTEXT_MAX_MODEL_LEN,
        dtype="float32",
        max_num_seqs=8,
        max_num_batched_tokens=128,
    ) as generator:
        yield generator


@pytest.fixture(scope="module")
def llama_reference(tiny_llama):
    return HFReference(tiny_llama)


class TestLlama:
    def test_heavy_batch_matches_transformers(self, llama_generator, llama_reference):
        # 44 sequences (> max_num_seqs=8), many longer than the 128-token step budget (chunked
        # prefill), from 1 token to the model's whole context (max_model_len - 1).
        lengths = [1, LLAMA_CONTEXT, 2, 300, 17, 129, 128, 127, 64, 5]
        lengths += [3 + (37 * i) % 250 for i in range(34)]
        batch = mixed_batch(VOCAB, lengths, seed=0)
        results = llama_generator.generate(batch)
        assert_matches_reference(results, batch, llama_reference, LLAMA_LAYERS)

    def test_repeated_calls_are_independent(self, llama_generator, llama_reference):
        first = mixed_batch(VOCAB, [40, 3, 200, 90], seed=1)
        second = mixed_batch(VOCAB, [7, 150, 150], seed=2)
        results_first = llama_generator.generate(first)
        results_second = llama_generator.generate(second)
        results_again = llama_generator.generate(first)
        assert_matches_reference(results_second, second, llama_reference, LLAMA_LAYERS)
        assert len(results_first) == len(results_again) == len(first)
        for a, b in zip(results_first, results_again):
            assert len(a["hidden_states"]) == len(b["hidden_states"]) == len(LLAMA_LAYERS)
            for layer_a, layer_b in zip(a["hidden_states"], b["hidden_states"]):
                assert torch.equal(layer_a, layer_b)
        assert_matches_reference(results_again, first, llama_reference, LLAMA_LAYERS)

    def test_shared_prefixes_and_duplicates(self, llama_generator, llama_reference):
        system = mixed_batch(VOCAB, [96], seed=3)[0]  # six full KV blocks shared by all
        tails = mixed_batch(VOCAB, [5, 40, 1, 70, 33], seed=4)
        batch = [system + tail for tail in tails]
        batch += [batch[1], batch[1], system, system]  # exact duplicates in one call
        results = llama_generator.generate(batch)
        assert_matches_reference(results, batch, llama_reference, LLAMA_LAYERS)
        assert torch.equal(results[1]["hidden_states"][2], results[5]["hidden_states"][2])

    def test_single_token_and_tensor_input(self, llama_generator, llama_reference):
        batch = torch.tensor([[17], [400]])
        results = llama_generator.generate(batch)
        assert_matches_reference(results, batch.tolist(), llama_reference, LLAMA_LAYERS)

    @pytest.mark.parametrize(
        ("bad_input", "message"),
        [
            ([], "empty"),
            ([[1, 2], []], "sequence 1 is empty"),
            ([[1, 2, VOCAB]], f"token id {VOCAB} is outside the vocabulary"),
            ([[1, -1]], "token id -1 is outside the vocabulary"),
            ([[1] * (LLAMA_CONTEXT + 1)], f"at most max_model_len - 1 = {LLAMA_CONTEXT}"),
            ([[1, 2.5]], "is not an int"),
            (torch.tensor([1, 2, 3]), "must be 2-D"),
        ],
    )
    def test_bad_input_raises_and_generator_stays_usable(
        self, llama_generator, llama_reference, bad_input, message
    ):
        with pytest.raises(ValueError, match=message):
            llama_generator.generate(bad_input)
        batch = [[5, 6, 7]]
        assert_matches_reference(
            llama_generator.generate(batch), batch, llama_reference, LLAMA_LAYERS
        )

    def test_stream_yields_every_input_once_and_can_stop_early(
        self, llama_generator, llama_reference
    ):
        batch = mixed_batch(VOCAB, [300, 5, 77, 1, 150, 40, 260, 9, 120, 33], seed=12)
        seen = {}
        for index, result in llama_generator.generate_stream(batch):
            assert index not in seen
            assert isinstance(result, HiddenStatesResult)
            seen[index] = result.to_dict()
        assert sorted(seen) == list(range(len(batch)))
        assert_matches_reference(
            [seen[i] for i in range(len(batch))], batch, llama_reference, LLAMA_LAYERS
        )
        stream = llama_generator.generate_stream(batch)
        next(stream)
        stream.close()  # abandon the rest: they are aborted, nothing leaks
        assert not llama_generator._scheduler.has_requests()
        assert llama_generator._transfer.request_files() == []
        small = [[3, 4, 5]]
        assert_matches_reference(
            llama_generator.generate(small), small, llama_reference, LLAMA_LAYERS
        )

    def test_transfer_files_are_removed(self, llama_generator):
        llama_generator.generate([[1, 2, 3], [4, 5]])
        assert llama_generator._transfer.request_files() == []


# -- Qwen3 with prefix caching on, negative layer ids ----------------------------------------------

QWEN_LAYERS = [1, -2, -1]


@pytest.fixture(scope="class")
def transfer_root(tmp_path_factory):
    return tmp_path_factory.mktemp("transfer_root")


@pytest.fixture(scope="class")
def qwen_generator(tiny_qwen3, transfer_root):
    with VllmHiddenStatesGenerator(
        str(tiny_qwen3),
        layer_ids=QWEN_LAYERS,
        max_model_len=512,
        dtype="float32",
        max_num_seqs=8,
        max_num_batched_tokens=128,
        enable_prefix_caching=True,
        transfer_root=transfer_root,
    ) as generator:
        yield generator
    assert list(transfer_root.iterdir()) == [], "close() left the transfer directory behind"


class TestQwen3PrefixCaching:
    def test_negative_layer_ids_count_from_the_end(self, qwen_generator):
        assert qwen_generator.layer_ids == [1, 2, 3]
        assert qwen_generator._block_hasher is not None  # prefix caching on: hasher built

    def test_transfer_files_go_under_transfer_root(self, qwen_generator, transfer_root):
        assert qwen_generator._transfer.path.parent == transfer_root
        seen = []
        for _index, _ in qwen_generator.generate_stream(
            mixed_batch(VOCAB, [300, 200, 100, 50], seed=15)
        ):
            seen.extend(p.name for p in qwen_generator._transfer.request_files())
        assert seen, "no transfer file was ever under transfer_root"
        assert qwen_generator._transfer.request_files() == []

    def test_heavy_batch_with_cached_prefixes_matches_transformers(
        self, qwen_generator, tiny_qwen3
    ):
        reference = HFReference(tiny_qwen3)
        system = mixed_batch(VOCAB, [160], seed=5)[0]
        tails = mixed_batch(VOCAB, [3 + (29 * i) % 200 for i in range(36)], seed=6)
        batch = [system + tail for tail in tails] + [system, system + tails[0]]
        batch += mixed_batch(VOCAB, [1, 511, 77, 128], seed=7)
        # Run twice: the second call finds every block of the first already in the cache.
        first = qwen_generator.generate(batch)
        second = qwen_generator.generate(batch)
        assert_matches_reference(second, batch, reference, [1, 2, 3])
        assert len(first) == len(second) == len(batch)
        for a, b in zip(first, second):
            assert len(a["hidden_states"]) == len(b["hidden_states"]) == len(QWEN_LAYERS)
            for layer_a, layer_b in zip(a["hidden_states"], b["hidden_states"]):
                assert torch.equal(layer_a, layer_b)


# -- Tensor parallel 2 (one engine: Qwen3, whose q/k norms are sharded too) ------------------------


@pytest.fixture(scope="class")
def qwen_tp2_generator(tiny_qwen3, monkeypatch_class):
    # No thread binding given: the generator must choose one that lets two CPU workers start,
    # and take it back afterwards so that later single-worker engines are not bound to one core.
    monkeypatch_class.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    generator = VllmHiddenStatesGenerator(
        str(tiny_qwen3),
        layer_ids=[0, 3],
        max_model_len=512,
        dtype="float32",
        tensor_parallel_size=2,
        max_num_seqs=4,
        max_num_batched_tokens=128,
    )
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
    yield generator
    generator.close()


@pytest.fixture(scope="class")
def monkeypatch_class():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


class TestTensorParallel:
    def test_matches_transformers(self, qwen_tp2_generator, tiny_qwen3):
        batch = mixed_batch(VOCAB, [1, 511, 200, 64, 65, 17, 300, 128], seed=13)
        results = qwen_tp2_generator.generate(batch)
        assert_matches_reference(results, batch, HFReference(tiny_qwen3), [0, 3])

    def test_close_stops_every_worker(self, qwen_tp2_generator):
        assert len(live_children()) >= 2
        qwen_tp2_generator.close()
        assert wait_for_no_children() == []
        qwen_tp2_generator.close()  # a second close is harmless
        with pytest.raises(RuntimeError, match="closed"):
            qwen_tp2_generator.generate([[1, 2]])


class TestLlamaPipelineParallel:
    def test_each_stage_captures_its_own_layers_with_batches_in_flight(
        self, tiny_llama, llama_reference
    ):
        batch = mixed_batch(VOCAB, [1, 511, 90, 130, 7, 300, 64, 65, 12, 250], seed=14)
        with VllmHiddenStatesGenerator(
            str(tiny_llama),
            layer_ids=LLAMA_LAYERS,  # layers 0-1 live on stage 0, layers 2-3 on stage 1
            max_model_len=LLAMA_MAX_MODEL_LEN,
            dtype="float32",
            pipeline_parallel_size=2,
            max_num_seqs=4,
            max_num_batched_tokens=128,
        ) as generator:
            steps = []
            step_fn = generator._step_fn

            def recording_step():
                steps.append(step_fn())
                return steps[-1]

            generator._step_fn = recording_step
            results = generator.generate(batch)
            # As vLLM's engine: one batch per stage in flight, so stage 0 never idles while
            # stage 1 runs the previous batch.
            assert max(step.num_tokens_in_flight for step in steps) > 0
            assert not generator._batch_queue  # drained: nothing left in flight
        assert_matches_reference(results, batch, llama_reference, LLAMA_LAYERS)


# -- DeepSeek-V3 (the Kimi-K2 architecture) and Kimi-K2.5 ---------------------------------------


DEEPSEEK_LAYERS = [0, 1, 2]  # dense layer 0, MoE layers 1 and 2 (the last)


@pytest.fixture(scope="class")
def deepseek_generator(tiny_deepseek_v3):
    with VllmHiddenStatesGenerator(
        str(tiny_deepseek_v3),
        layer_ids=DEEPSEEK_LAYERS,
        max_model_len=512,
        dtype="float32",
        max_num_seqs=8,
        max_num_batched_tokens=128,
    ) as generator:
        yield generator


@pytest.fixture(scope="module")
def deepseek_reference(tiny_deepseek_v3):
    return HFReference(tiny_deepseek_v3)


DEEPSEEK_BATCH_LENGTHS = [1, 511, 2, 300, 17, 129, 128, 64] + [
    3 + (41 * i) % 240 for i in range(34)
]


class TestDeepseekV3:
    def test_every_layer_captured_and_batching_changes_nothing(self, deepseek_generator):
        batch = mixed_batch(VOCAB, DEEPSEEK_BATCH_LENGTHS, seed=9)
        batched = deepseek_generator.generate(batch)
        assert len(batched) == len(batch)
        for index in range(0, len(batch), 5):
            alone = deepseek_generator.generate([batch[index]])[0]
            assert len(batched[index]["hidden_states"]) == len(DEEPSEEK_LAYERS)
            assert len(alone["hidden_states"]) == len(DEEPSEEK_LAYERS)
            for layer, got, want in zip(
                DEEPSEEK_LAYERS, batched[index]["hidden_states"], alone["hidden_states"]
            ):
                error = relative_error(got, want)
                assert error <= TOLERANCE, f"sample {index} layer {layer}: {error:.2e}"

    def test_matches_transformers(self, deepseek_generator, deepseek_reference):
        batch = mixed_batch(VOCAB, DEEPSEEK_BATCH_LENGTHS[:12], seed=10)
        results = deepseek_generator.generate(batch)
        assert_matches_reference(results, batch, deepseek_reference, DEEPSEEK_LAYERS)


class TestDeepseekV3Float16:
    def test_residual_rescaling_is_undone(self, tiny_deepseek_v3, deepseek_reference):
        """In float16 vLLM divides DeepSeek's residual stream by routed_scaling_factor (2.5 here)
        from layer 0 on; the captured states must be the model's own (transformers, float32)."""
        batch = mixed_batch(VOCAB, [1, 200, 31, 90, 5, 140], seed=11)
        with VllmHiddenStatesGenerator(
            str(tiny_deepseek_v3),
            layer_ids=DEEPSEEK_LAYERS,
            max_model_len=512,
            dtype="float16",
            max_num_seqs=4,
            max_num_batched_tokens=128,
        ) as generator:
            results = generator.generate(batch)
        assert len(results) == len(batch)
        for index, (result, ids) in enumerate(zip(results, batch)):
            assert result["input_ids"].tolist() == ids
            expected = deepseek_reference.streams(ids, DEEPSEEK_LAYERS)
            assert len(result["hidden_states"]) == len(DEEPSEEK_LAYERS)
            for layer, got, want in zip(DEEPSEEK_LAYERS, result["hidden_states"], expected):
                assert got.dtype == torch.float16 and got.shape == want.shape
                got = got.to(torch.float64)
                want = want.to(torch.float64)
                per_token = (got - want).norm(dim=-1) / want.norm(dim=-1)
                if layer == 0:  # dense: float16 rounding only
                    assert float(per_token.max()) <= 1e-2, f"sample {index} layer 0"
                # MoE layers: float16 routing may pick another of two near-tied experts (or
                # expert groups) for some tokens, which changes those tokens' states; most
                # tokens match. Left scaled, every token would be off by 1 - 1/2.5 = 60%.
                median = float(per_token.median())
                assert median <= 1e-2, f"sample {index} layer {layer}: median error {median:.2e}"


class TestKimiK25:
    def test_layers_found_inside_the_multimodal_wrapper(self, tiny_kimi_k25, deepseek_reference):
        with VllmHiddenStatesGenerator(
            str(tiny_kimi_k25),
            layer_ids=DEEPSEEK_LAYERS,
            max_model_len=512,
            dtype="float32",
            max_num_seqs=4,
            max_num_batched_tokens=64,
        ) as generator:
            # vLLM's class, or its EAGLE-3 subclass when this package's vLLM plugin is on.
            assert generator.model_class in {
                "KimiK25ForConditionalGeneration",
                "Eagle3KimiK25ForConditionalGeneration",
            }
            assert generator.layer_path == "language_model.model.layers"
            batch = mixed_batch(VOCAB, [1, 200, 31, 90, 5, 140], seed=11)
            results = generator.generate(batch)
        # Its language model is the tiny DeepSeek-V3: transformers on those weights is the truth.
        assert_matches_reference(results, batch, deepseek_reference, DEEPSEEK_LAYERS)


# -- start-up and shutdown ------------------------------------------------------------------------


def test_layer_ids_out_of_range_refused_before_any_worker_starts(tiny_llama):
    with pytest.raises(ValueError, match="layer id 4 is out of range"):
        VllmHiddenStatesGenerator(str(tiny_llama), layer_ids=[0, 4], max_model_len=64)
    with pytest.raises(ValueError, match="layer id -5 is out of range"):
        VllmHiddenStatesGenerator(str(tiny_llama), layer_ids=[-5], max_model_len=64)
    assert live_children() == []


def test_enforce_eager_false_refused_before_any_worker_starts(tiny_llama):
    with pytest.raises(ValueError, match="enforce_eager=False is not supported"):
        VllmHiddenStatesGenerator(str(tiny_llama), max_model_len=64, enforce_eager=False)
    assert live_children() == []


def test_failure_during_startup_leaves_no_worker(tiny_llama, monkeypatch):
    from speculators_vllm016.data_generation import engine_setup  # builds the generator's engine

    def broken_setup(*args):
        assert len(live_children()) >= 1  # the workers were running
        raise RuntimeError("injected start-up failure")

    monkeypatch.setattr(engine_setup, "setup_capture", broken_setup)
    with pytest.raises(RuntimeError, match="injected start-up failure"):
        VllmHiddenStatesGenerator(str(tiny_llama), max_model_len=64, dtype="float32")
    assert wait_for_no_children() == []


def test_needs_no_environment_and_workers_do_not_outlive_the_interpreter(tiny_llama, tmp_path):
    """A fresh interpreter with none of vLLM's CPU variables set (the test session presets
    VLLM_CPU_KVCACHE_SPACE for every other test): the generator picks the KV cache space itself,
    vLLM sizes the cache by it, and the workers die with the interpreter though close() is never
    called."""
    script = textwrap.dedent(
        f"""
        import logging, os
        import psutil
        from speculators_vllm016.data_generation import VllmHiddenStatesGenerator

        if __name__ == "__main__":
            logging.basicConfig(level=logging.INFO, format="LOG %(message)s")
            assert "VLLM_CPU_KVCACHE_SPACE" not in os.environ
            generator = VllmHiddenStatesGenerator({str(tiny_llama)!r}, max_model_len=64,
                                                  dtype="float32")
            assert "VLLM_CPU_KVCACHE_SPACE" not in os.environ, "the choice leaked out"
            states = generator.generate([[1, 2, 3]])[0]["hidden_states"]
            # 0.3.0's default layers for 4 layers are [2, 2, 1, 3]: layer 2 comes twice.
            assert generator.layer_ids == [2, 2, 1, 3], generator.layer_ids
            assert len(states) == 4 and (states[0] == states[1]).all()
            config = generator.vllm_config
            text = config.model_config.hf_text_config
            head_dim = text.hidden_size // text.num_attention_heads
            # K and V, every layer, float32, per block.
            block_bytes = 2 * text.num_hidden_layers * text.num_key_value_heads * head_dim * 4
            block_bytes *= config.cache_config.block_size
            print("KVBYTES", generator.num_kv_blocks * block_bytes, flush=True)
            pids = [
                p.pid
                for p in psutil.Process().children(recursive=True)
                if not any("resource_tracker" in part for part in p.cmdline())
            ]
            print("PIDS", *pids, flush=True)
            # exit without close()
        """
    )
    path = tmp_path / "leave_open.py"
    path.write_text(script)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_CPU_")}
    # This checkout's package, not whichever one the interpreter would find from the script's folder.
    repo = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([repo, *filter(None, [env.get("PYTHONPATH")])])
    completed = subprocess.run(
        [sys.executable, str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    output = completed.stdout + completed.stderr
    chosen = [line for line in output.splitlines() if "VLLM_CPU_KVCACHE_SPACE=" in line]
    assert chosen, "the generator did not say which KV cache space it chose"
    gib = int(chosen[0].split("VLLM_CPU_KVCACHE_SPACE=")[1].split()[0])
    # Bounded (vLLM's own default would take half the RAM), and what vLLM sized the cache by.
    assert 1 <= gib <= 8 and gib * 1024**3 <= psutil.virtual_memory().total / 4
    kv_bytes = int(
        next(x for x in completed.stdout.splitlines() if x.startswith("KVBYTES")).split()[1]
    )
    assert abs(kv_bytes - gib * 1024**3) <= 0.05 * gib * 1024**3, (kv_bytes, gib)
    line = next(x for x in completed.stdout.splitlines() if x.startswith("PIDS"))
    pids = [int(pid) for pid in line.split()[1:]]
    assert pids, "the generator started no worker process"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(psutil.pid_exists(pid) for pid in pids):
        time.sleep(0.2)
    survivors = [pid for pid in pids if psutil.pid_exists(pid)]
    assert survivors == [], f"worker processes {survivors} outlived the interpreter"
