"""The three ways of computing prefill compared by the suite, each timed the same way.

(a) `extraction`: our VllmHiddenStatesGenerator end to end, sample files written by a writer
    thread pool exactly as `speculators datagen` writes them (speculators_vllm016.data_generation).
(b) `vllm_prefill`: vLLM's own `LLM.generate` with `max_tokens=1` on the same engine settings, the
    ceiling (a) should come close to.
(c) `hf_forward`: transformers' forward with `output_hidden_states=True`, one sequence at a time,
    each sample saved the same way: the extraction path of the original EAGLE scripts.

Every path has `start()` (untimed: engine or model loading, plus a short warm-up), `run()` (timed:
the whole workload, wall clock) and `close()`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.presets import BenchSettings

__all__ = ["PATHS", "BenchPath", "Measurement", "make_path"]

WARMUP_SEQUENCES = 4


@dataclass
class Measurement:
    path: str
    repeat: int
    tokens: int
    seconds: float  # wall clock: what throughput means
    # CPU time of this process and all its live descendants (engine workers) during the run:
    # steadier than wall clock on a shared machine, and it shows time lost to busy-waiting.
    cpu_seconds: float | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def process_tree_cpu_seconds() -> float:
    """User + system CPU seconds of this process and its live descendants so far."""
    import psutil

    total = 0.0
    me = psutil.Process()
    for process in [me, *me.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


class Stopwatch:
    """Wall clock and process-tree CPU time of one timed run."""

    def __enter__(self) -> Stopwatch:
        self.cpu_started = process_tree_cpu_seconds()
        self.started = time.perf_counter()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.seconds = time.perf_counter() - self.started
        self.cpu_seconds = process_tree_cpu_seconds() - self.cpu_started


def _torch_dtype(dtype: str) -> Any:
    return "auto" if dtype == "auto" else getattr(torch, dtype)


class BenchPath:
    """One way to compute the workload; subclasses fill in start/run/close."""

    key = ""
    label = ""

    def __init__(self, settings: BenchSettings, model: str, samples_root: Path) -> None:
        self.settings = settings
        self.preset = settings.preset
        self.model = model
        self.samples_root = samples_root

    def start(self, warmup: list[list[int]]) -> None:
        raise NotImplementedError

    def run(self, sequences: list[list[int]], repeat: int) -> Measurement:
        raise NotImplementedError

    def prime(self, sequence: list[int]) -> None:
        """An untimed tiny request just before a timed run, so no idle back-off delays it."""

    def close(self) -> None:
        raise NotImplementedError

    def _fresh_samples_dir(self) -> Path:
        self.samples_root.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f"{self.key}-", dir=self.samples_root))


class ExtractionPath(BenchPath):
    """(a) VllmHiddenStatesGenerator + datagen's sample writer."""

    key = "extraction"
    label = "(a) extraction: VllmHiddenStatesGenerator + sample files"

    def start(self, warmup: list[list[int]]) -> None:
        from speculators_vllm016.data_generation.vllm_hidden_states_generator import (
            VllmHiddenStatesGenerator,
        )

        preset = self.preset
        self.generator = VllmHiddenStatesGenerator(
            self.model,
            layer_ids=list(preset.layer_ids) if preset.layer_ids is not None else None,
            max_model_len=preset.max_model_len,
            gpu_memory_utilization=preset.gpu_memory_utilization,
            tensor_parallel_size=preset.tensor_parallel_size,
            pipeline_parallel_size=preset.pipeline_parallel_size,
            dtype=preset.dtype,
            max_num_seqs=preset.max_num_seqs,
            max_num_batched_tokens=preset.max_num_batched_tokens,
            trust_remote_code=True,  # as path (b); the generator's default is off since 0.3.0
        )
        self.generator.generate(warmup)

    def prime(self, sequence: list[int]) -> None:
        # With VLLM_SLEEP_WHEN_IDLE the worker polls every 0.1 s after 3 s idle; wake it up.
        self.generator.generate([sequence])

    def run(self, sequences: list[list[int]], repeat: int) -> Measurement:
        from speculators_vllm016.data_generation.extraction import SampleRequest, extract_and_write

        directory = self._fresh_samples_dir()
        preset = self.preset
        batch_size = preset.batch_size

        def batches():
            for first in range(0, len(sequences), batch_size):
                yield [
                    SampleRequest(first + offset, ids, torch.ones(len(ids), dtype=torch.long))
                    for offset, ids in enumerate(sequences[first : first + batch_size])
                ]

        try:
            with Stopwatch() as watch:
                # Exactly datagen's loop (the same function `speculators datagen` runs).
                extract_and_write(
                    self.generator,
                    batches(),
                    directory,
                    preset.output_format,
                    batch_size=batch_size,
                    num_writer_threads=preset.num_writer_threads,
                    show_progress=False,
                )
            written = len(os.listdir(directory))
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        if written != len(sequences):
            raise RuntimeError(f"(a) wrote {written} sample files for {len(sequences)} sequences")
        return Measurement(
            self.key, repeat, sum(map(len, sequences)), watch.seconds, watch.cpu_seconds
        )

    def close(self) -> None:
        generator = getattr(self, "generator", None)
        if generator is not None:
            generator.close()
            self.generator = None


class VllmPrefillPath(BenchPath):
    """(b) vLLM's own prefill: `LLM.generate(max_tokens=1)`, prefix caching off."""

    key = "vllm_prefill"
    label = "(b) vLLM prefill: LLM.generate, max_tokens=1"

    def start(self, warmup: list[list[int]]) -> None:
        from vllm import LLM, SamplingParams

        from speculators_vllm016.data_generation.cpu_defaults import (
            apply_cpu_defaults,
            is_cpu_platform,
        )
        from speculators_vllm016.data_generation.engine_setup import TEXT_ONLY_MODALITIES

        preset = self.preset
        if is_cpu_platform():
            # The same environment (KV cache size, thread binding, MLA switch) as (a) gets.
            from transformers import PretrainedConfig

            config_dict, _ = PretrainedConfig.get_config_dict(self.model)
            apply_cpu_defaults(preset.world_size, config_dict)
        self.llm = LLM(
            model=self.model,
            dtype=preset.dtype,
            tensor_parallel_size=preset.tensor_parallel_size,
            pipeline_parallel_size=preset.pipeline_parallel_size,
            max_num_seqs=preset.max_num_seqs,
            max_num_batched_tokens=preset.max_num_batched_tokens,
            max_model_len=preset.max_model_len,
            gpu_memory_utilization=preset.gpu_memory_utilization,
            enforce_eager=True,
            enable_prefix_caching=False,
            enable_chunked_prefill=True,
            trust_remote_code=True,
            limit_mm_per_prompt=dict.fromkeys(TEXT_ONLY_MODALITIES, 0),
            disable_log_stats=True,
        )
        self.params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        self._generate(warmup)

    def prime(self, sequence: list[int]) -> None:
        self._generate([sequence])

    def _generate(self, sequences: list[list[int]]) -> list[Any]:
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in sequences]
        return self.llm.generate(prompts, self.params, use_tqdm=False)

    def run(self, sequences: list[list[int]], repeat: int) -> Measurement:
        with Stopwatch() as watch:
            outputs = self._generate(sequences)
        if len(outputs) != len(sequences) or any(
            len(output.prompt_token_ids) != len(ids) for output, ids in zip(outputs, sequences)
        ):
            raise RuntimeError("(b) vLLM returned outputs that do not match the prompts")
        return Measurement(
            self.key, repeat, sum(map(len, sequences)), watch.seconds, watch.cpu_seconds
        )

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        shutdown = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        try:
            if shutdown is not None:
                shutdown.shutdown()
        finally:
            del llm
            import gc

            gc.collect()


class HFForwardPath(BenchPath):
    """(c) transformers forward, `output_hidden_states=True`, batch 1, samples saved as in (a)."""

    key = "hf_forward"
    label = "(c) transformers forward, output_hidden_states=True + sample files"

    def start(self, warmup: list[list[int]]) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        from speculators_vllm016.utils.layer_ids import default_layer_ids, normalize_layer_ids
        from speculators_vllm016.utils.text_config import text_config_of

        preset = self.preset
        config = AutoConfig.from_pretrained(self.model, trust_remote_code=True)
        num_layers = int(text_config_of(config).num_hidden_layers)
        self.layer_ids = normalize_layer_ids(
            list(preset.layer_ids)
            if preset.layer_ids is not None
            else default_layer_ids(num_layers),
            num_layers,
        )
        kwargs: dict[str, Any] = {"dtype": _torch_dtype(preset.dtype), "trust_remote_code": True}
        if torch.cuda.is_available():
            kwargs["device_map"] = "auto" if preset.world_size > 1 else "cuda:0"
        self.hf_model = AutoModelForCausalLM.from_pretrained(self.model, **kwargs).eval()
        self.device = next(self.hf_model.parameters()).device
        self._forward(warmup)

    def _forward(
        self, sequences: list[list[int]], writer: Any = None, directory: Path | None = None
    ) -> None:
        from speculators_vllm016.data_generation.sample_io import sample_path

        for index, ids in enumerate(sequences):
            input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
            with torch.inference_mode():
                output = self.hf_model(input_ids=input_ids, output_hidden_states=True)
            # hidden_states[0] is the embedding output; [i + 1] follows decoder layer i.
            states = [output.hidden_states[i + 1][0].to("cpu") for i in self.layer_ids]
            if writer is not None and directory is not None:
                sample = {
                    "input_ids": input_ids[0].cpu(),
                    "hidden_states": states,
                    "loss_mask": torch.ones(len(ids), dtype=torch.long),
                }
                writer.submit(sample_path(directory, index, self.preset.output_format), sample)

    def run(self, sequences: list[list[int]], repeat: int) -> Measurement:
        from speculators_vllm016.data_generation.sample_writers import SampleWriterPool

        directory = self._fresh_samples_dir()
        try:
            with (
                Stopwatch() as watch,
                SampleWriterPool(
                    self.preset.num_writer_threads, self.preset.output_format, max_pending=64
                ) as writer,
            ):
                self._forward(sequences, writer, directory)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        return Measurement(
            self.key, repeat, sum(map(len, sequences)), watch.seconds, watch.cpu_seconds
        )

    def close(self) -> None:
        if getattr(self, "hf_model", None) is not None:
            self.hf_model = None
            import gc

            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


PATHS: dict[str, type[BenchPath]] = {
    path.key: path for path in (ExtractionPath, VllmPrefillPath, HFForwardPath)
}


def make_path(key: str, settings: BenchSettings, model: str, samples_root: Path) -> BenchPath:
    return PATHS[key](settings, model, samples_root)
