#!/usr/bin/env bash
# The two entry points of the README: `demo` (the main job on the embedded default) and `test`
# (the whole test suite). Both set up .venv first (a no-op when it is current).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
venv="${SPECULATORS_VENV:-$root/.venv}"
what="${1:-}"
shift || true
case "$what" in
  demo)
    exec "$venv/bin/speculators" demo "$@"
    ;;
  test)
    # Lint and format are part of the suite: a tree ruff would change does not pass.
    "$venv/bin/ruff" check .
    "$venv/bin/ruff" format --check .
    set +e
    "$venv/bin/python" -m pytest "$@"
    rc=$?
    # pytest's 5 means it collected nothing: that is a failure here, not a pass.
    exit $rc
    ;;
  *)
    echo "usage: scripts/run.sh demo|test [args...]" >&2
    exit 2
    ;;
esac
