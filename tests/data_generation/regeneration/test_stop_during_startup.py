"""Ctrl-C while `speculators regenerate` starts its vLLM engine stops the command at once.

vLLM 0.16's start-up swallows a KeyboardInterrupt during its handshake and then waits up to 10
minutes for the engine the same Ctrl-C ended (issue #50, item 1). One engine start, in a
subprocess: the terminal's Ctrl-C reaches the whole process group, engine processes included.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.engine

# A line the engine process logs once it loaded the weights, well before it reports ready.
STARTING = "Loading safetensors checkpoint shards: 100%"


def test_ctrl_c_during_the_engine_start_stops_with_130_and_one_line(tiny_llama, tmp_path):
    data = tmp_path / "chat.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
        for i in range(4)
    ]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out, log = tmp_path / "regen", tmp_path / "stderr.txt"
    command = [
        sys.executable, "-m", "speculators_vllm016", "regenerate",
        "--target-model-path", str(tiny_llama), "--train-data-path", str(data),
        "--output-dir", str(out), "--max-tokens", "4", "--max-prompt-tokens", "64",
        "--dtype", "float32", "--num-preprocessing-workers", "1", "--no-progress", "--verbose",
    ]  # fmt: skip
    with log.open("w") as stderr:
        process = subprocess.Popen(
            command, start_new_session=True, stdout=subprocess.DEVNULL, stderr=stderr
        )
    try:
        deadline = time.monotonic() + 300
        while STARTING not in log.read_text() and process.poll() is None:
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.05)
        assert process.poll() is None, log.read_text()[-2000:]
        os.killpg(process.pid, signal.SIGINT)
        returncode = process.wait(timeout=90)  # the hang waited 600 s
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    last = log.read_text().strip().splitlines()[-1]
    assert returncode == 130, log.read_text()[-3000:]
    assert last.startswith("stopped: Ctrl-C: regeneration stopped while the engine started"), last
    assert "Traceback" not in log.read_text()
    assert not out.exists()  # nothing was written: the same command starts it again
