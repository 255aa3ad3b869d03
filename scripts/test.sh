#!/usr/bin/env bash
# Run the whole test suite (CPU, gloo, a few minutes on 2 cores). Sets up .venv first if needed.
#   VENV   which environment (default .venv); extra arguments go to pytest.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
V=${VENV:-$ROOT/.venv}
[ -x "$V/bin/pytest" ] || VENV=$V bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} WANDB_MODE=${WANDB_MODE:-offline}
exec "$V/bin/python" -m pytest -q "$@"
