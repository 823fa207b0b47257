"""`--compile-cache-dir` (`train.jobs.compiler.start_compiler`): torch's compile caches go to the
folder the user keeps, and a later compile of the same block reads them back."""

from __future__ import annotations

import pytest
import torch

from speculators_vllm016.train.jobs.compiler import start_compiler

pytestmark = pytest.mark.slow


def _block(x: torch.Tensor) -> torch.Tensor:
    return (x.float().pow(2).mean(-1, keepdim=True) + 1).rsqrt() * x


@pytest.fixture
def own_environment(monkeypatch):
    """The cache variables as they were, restored after the test (start_compiler sets them)."""
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    yield
    torch._dynamo.reset()


def test_the_compile_cache_is_written_to_the_folder_and_read_back(tmp_path, own_environment):
    from torch._dynamo.utils import counters

    folder = tmp_path / "compile-cache"
    start_compiler(str(folder), "cpu")
    assert folder.is_dir()
    x = torch.randn(8, 64)
    misses, hits = (
        counters["inductor"]["fxgraph_cache_miss"],
        counters["inductor"]["fxgraph_cache_hit"],
    )
    torch._dynamo.reset()
    first = torch.compile(_block)(x)
    assert counters["inductor"]["fxgraph_cache_miss"] > misses  # built, and written there
    assert any(path.is_file() for path in folder.rglob("*"))
    torch._dynamo.reset()  # a fresh compile, as a new process would make
    second = torch.compile(_block)(x)
    assert counters["inductor"]["fxgraph_cache_hit"] > hits  # read back from the folder
    assert torch.equal(first, second)


def test_without_a_folder_nothing_is_set(own_environment):
    import os

    start_compiler(None, "cpu")
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ and "TRITON_CACHE_DIR" not in os.environ


@pytest.mark.parametrize(("device", "started"), [("cuda:0", True), ("cuda", True), ("cpu", False)])
def test_the_compile_workers_start_with_a_gpu_job_only(monkeypatch, device, started):
    """On a GPU the job starts inductor's worker pool itself (`maybe_warm_pool`, stubbed here:
    starting real workers needs Triton), so the workers come up while the weights load."""
    import torch._inductor.async_compile as async_compile

    calls = []
    monkeypatch.setattr(async_compile, "maybe_warm_pool", lambda: calls.append(True))
    start_compiler(None, device)
    assert bool(calls) is started
