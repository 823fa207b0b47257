"""Datagen's checks before any work: they read config.json and the flags only, so a mistake is
found in a second, without torch or vLLM loaded (pure logic; a fresh process to see imports)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

_PROBE = """
import json, sys
from speculators_vllm016.data_generation.preflight import inspect_model
facts = inspect_model(sys.argv[1], None)
loaded = [name for name in ("torch", "vllm", "transformers") if name in sys.modules]
print(json.dumps({"layer_ids": facts.layer_ids, "loaded": loaded}))
"""


def test_inspecting_a_model_folder_loads_no_torch_nor_vllm(tmp_path: Path):
    config = {"model_type": "llama", "num_hidden_layers": 8, "hidden_size": 64}
    (tmp_path / "config.json").write_text(json.dumps(config))
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"layer_ids": [2, 4, 5, 7], "loaded": []}
