#!/usr/bin/env bash
# Lint (ruff) and run the whole test suite (CPU, gloo, about 8 minutes on 2 idle cores); skip reasons
# are shown. Sets up .venv first if needed.
#   VENV   which environment (default .venv); extra arguments go to pytest.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
V=${VENV:-$ROOT/.venv}
[ -x "$V/bin/pytest" ] || VENV=$V bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} WANDB_MODE=${WANDB_MODE:-offline}
"$V/bin/ruff" check .
exec "$V/bin/python" -m pytest -q -rs "$@"
