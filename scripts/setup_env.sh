#!/usr/bin/env bash
# Create (or update) the project's virtual environment and install hybrid-zero into it.
#   VENV        where (default: .venv in the repo root)
#   TORCH_SPEC  which torch to install first, also into an environment that has one (default:
#               torch==2.13.0 when the environment has none: the CPU build that this
#               project's machines keep on disk; on a GPU cluster set e.g. TORCH_SPEC='torch>=2.4'
#               and your CUDA index). Installing torch first, then the project constrained to
#               that version, keeps pip from swapping in a multi-GB CUDA build on a CPU machine.
#   EXTRAS      which optional dependency groups (default: test,plot,hf,tensorboard)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
V=${VENV:-$ROOT/.venv}
if [ ! -x "$V/bin/python" ]; then
  python3 -m venv "$V"
fi
"$V/bin/python" -m pip install -q --upgrade pip
if [ -n "${TORCH_SPEC:-}" ] || ! "$V/bin/python" -c 'import torch' 2>/dev/null; then
  # shellcheck disable=SC2086  # TORCH_SPEC may carry pip options such as --index-url
  "$V/bin/python" -m pip install -q ${TORCH_SPEC:-torch==2.13.0} numpy
fi
C=$(mktemp)
"$V/bin/python" -c 'import torch; print("torch==" + torch.__version__.split("+")[0])' > "$C"
# setuptools frames every editable install with an "Editable installation ... be careful with
# folders ... named as your package" banner: expected here (the repository is the package), so
# it is kept off the screen; every other warning still shows.
PYTHONWARNINGS="ignore:Editable installation" \
  "$V/bin/python" -m pip install -q -c "$C" -e "$ROOT[${EXTRAS:-test,plot,hf,tensorboard}]"
rm -f "$C"
echo "environment ready: $V (torch $("$V/bin/python" -c 'import torch; print(torch.__version__)'))"
