"""Shared fixtures: tiny local checkpoints, an offline Hugging Face home, engine-friendly env."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

# Everything runs offline on models the tests build; keep Hugging Face's caches (remote-code
# modules included) inside the pytest temp area rather than the user's home.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# vLLM's CPU build would take half the RAM per worker for KV cache; the tests need very little.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# An engine a fixture keeps between tests waits on vLLM's shared-memory queues; by default each
# of its processes polls them without pause (a core each, taken from the test's own work on the
# 2-core CI machine). With this they poll every 0.1 s once idle for 3 s.
os.environ.setdefault("VLLM_SLEEP_WHEN_IDLE", "1")


@pytest.fixture(scope="session", autouse=True)
def _hf_home(tmp_path_factory: pytest.TempPathFactory) -> None:
    home = tmp_path_factory.mktemp("hf_home")
    os.environ["HF_HOME"] = str(home)
    os.environ["HF_MODULES_CACHE"] = str(home / "modules")


# Python's own handlers: Ctrl-C raises KeyboardInterrupt, SIGTERM ends the process. Not the ones
# pytest started with: a script's background job (`pytest ... &`, as CI wrappers start it) starts
# with SIGINT ignored (POSIX), and the Ctrl-C tests, in process or through the subprocesses they
# start (which inherit an ignored signal), would then fail however correct the trainer is.
_PYTHON_SIGNAL_HANDLERS = {
    signal.SIGINT: signal.default_int_handler,
    signal.SIGTERM: signal.SIG_DFL,
}


def _restore_python_signal_handlers() -> None:
    for sig, handler in _PYTHON_SIGNAL_HANDLERS.items():
        if signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)


@pytest.fixture(autouse=True)
def _signal_handlers_restored():
    """Each test runs with Python's own SIGINT and SIGTERM handlers, whatever the shell that
    started pytest set and whatever a library started in process (Ray's driver sets SIGTERM's)
    left behind: a test of Ctrl-C handling does not depend on how the suite was started or on
    which tests ran before it.
    """
    _restore_python_signal_handlers()
    yield
    _restore_python_signal_handlers()


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_llama(models_dir: Path) -> Path:
    from speculators_vllm016.tiny_models import build_tiny_llama

    return build_tiny_llama(models_dir / "llama")


@pytest.fixture(scope="session")
def tiny_qwen3(models_dir: Path) -> Path:
    from tests.tiny_models import build_tiny_qwen3

    return build_tiny_qwen3(models_dir / "qwen3")


@pytest.fixture(scope="session")
def tiny_deepseek_v3(models_dir: Path) -> Path:
    from tests.tiny_models import build_tiny_deepseek_v3

    return build_tiny_deepseek_v3(models_dir / "deepseek_v3")


@pytest.fixture(scope="session")
def tiny_kimi_k25(models_dir: Path, tiny_deepseek_v3: Path) -> Path:
    from tests.tiny_models import build_tiny_kimi_k25

    return build_tiny_kimi_k25(models_dir / "kimi_k25", language_model=tiny_deepseek_v3)


@pytest.fixture(scope="session")
def taught_deepseek_v3(models_dir: Path) -> Path:
    """A tiny DeepSeek-V3 trained briefly on the demo conversations (a draft can learn from it)."""
    from tests.tiny_models import build_taught_tiny_deepseek_v3

    return build_taught_tiny_deepseek_v3(models_dir / "deepseek_v3_taught")


@pytest.fixture(scope="session")
def taught_kimi_k25(models_dir: Path, taught_deepseek_v3: Path) -> Path:
    """The tiny Kimi-K2.5 wrapper around `taught_deepseek_v3` (the same weights inside)."""
    from tests.tiny_models import build_tiny_kimi_k25

    return build_tiny_kimi_k25(models_dir / "kimi_k25_taught", language_model=taught_deepseek_v3)


@pytest.fixture(scope="session")
def training_data(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """24 sample files of 20 to 90 tokens from the tiny Llama, with d2t/t2d maps beside the folder."""
    from tests.training_fixtures import write_dataset, write_vocab_maps

    lengths = [20 + (7 * i) % 71 for i in range(24)]
    root = tmp_path_factory.mktemp("training_data")
    data = write_dataset(tiny_llama, root / "data", lengths)
    write_vocab_maps(data, 512, root)
    return data


@pytest.fixture(scope="session")
def finished_run(
    tiny_llama: Path, training_data: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The save folder of one finished epoch of training on `training_data` (checkpoint `0`):
    shared, so copy it before a test changes it (`tests.training_fixtures.train_finished_run`)."""
    from tests.training_fixtures import train_finished_run

    return train_finished_run(
        tiny_llama, training_data, tmp_path_factory.mktemp("finished") / "ckpt"
    )
