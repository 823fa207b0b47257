"""The trainer's modules exist at 0.3.0's paths and import no vLLM (it trains where vLLM is absent)."""

from __future__ import annotations

import subprocess
import sys

MODULES = [
    "checkpointer",
    "data",
    "distributed_batch_sampler",
    "logger",
    "noise_transforms",
    "trainer",
    "utils",
    "vocab_mapping",
]

NAMES = {
    "checkpointer": [
        "BaseCheckpointer",
        "SingleGPUCheckpointer",
        "DistributedCheckpointer",
        "convert_float_dtype",
        "load_safetensors_state_dict",
    ],
    "data": [
        "list_files",
        "slice_and_pad_to_length",
        "shift_batch",
        "split_files",
        "standardize_data_v0",
        "standardize_data_v1",
        "Eagle3SampleFileDataset",
        "create_collate_fn",
    ],
    "distributed_batch_sampler": ["MultipackDistributedBatchSamplerV2"],
    "logger": [
        "IsMappingFilter",
        "IsRank0Filter",
        "FormatDictFilter",
        "TensorBoardHandler",
        "WandbHandler",
        "TrackioHandler",
        "setup_root_logger",
        "setup_metric_logger",
    ],
    "noise_transforms": ["TransformTensors", "AddGaussianNoise", "AddUniformNoise"],
    "trainer": ["TrainerConfig", "Trainer"],
    "utils": ["maybe_setup_distributed", "maybe_destroy_distributed", "apply_fully_sharded"],
}


def test_trainer_imports_no_vllm():
    code = (
        "import sys\n"
        + "".join(f"import speculators_vllm016.train.{m}\n" for m in MODULES)
        + "import speculators_vllm016.cli.train, speculators_vllm016.models.eagle3\n"
        "import speculators_vllm016.cli.train as c; c.build_parser()\n"
        "bad = sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.'))\n"
        "assert not bad, bad[:5]\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]


def test_030_module_paths_and_names():
    import importlib

    for module, names in NAMES.items():
        ours = importlib.import_module(f"speculators_vllm016.train.{module}")
        alias = importlib.import_module(f"speculators.train.{module}")
        assert alias is ours
        for name in names:
            assert callable(getattr(ours, name)), f"{module}.{name}"
    config = importlib.import_module("speculators.train.trainer").TrainerConfig(
        lr=1e-4, num_epochs=1, save_path="x"
    )
    assert config.scheduler_type == "linear" and config.train_call_kwargs == {}
    assert config._replace(lr=2e-4).lr == 2e-4
