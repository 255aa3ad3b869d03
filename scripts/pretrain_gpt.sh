#!/usr/bin/env bash
# Launch GPT pretraining with torchrun on one node or many. Every setting comes from the
# environment; every extra argument goes to hybrid.pretrain (Megatron-LM flag names).
#
#   GPUS_PER_NODE   processes per node (default: number of GPUs, else 4 CPU processes)
#   NNODES          nodes (default 1)             NODE_RANK  this node's index (default 0)
#   MASTER_ADDR     rendezvous host (default 127.0.0.1)  MASTER_PORT (default 29500)
#   PYTHON          interpreter (default .venv/bin/python, else python3)
#   SAVE_DIR        checkpoint directory: adds --save and --load, so a restarted job resumes
#                   from the latest complete checkpoint (SIGTERM or Ctrl-C saves, exits 0)
#
# Example, 2 nodes x 8 GPUs, tp=8 inside each node, ZeRO-2 across them:
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 bash scripts/pretrain_gpt.sh \
#     --preset gpt3-13b --tensor-model-parallel-size 8 --zero-stage 2 --bf16 \
#     --micro-batch-size 1 --global-batch-size 512 --data-path data/mycorpus_text_document \
#     --tokenizer-model data/tokenizer.model --train-iters 100000
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-$([ -x "$ROOT/.venv/bin/python" ] && echo "$ROOT/.venv/bin/python" || echo python3)}
if [ -z "${GPUS_PER_NODE:-}" ]; then
  GPUS_PER_NODE=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() or 4)')
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
cd "$ROOT"
CKPT=()
if [ -n "${SAVE_DIR:-}" ]; then CKPT=(--save "$SAVE_DIR" --load "$SAVE_DIR"); fi
# hybrid.pretrain with torchrun's options is the launcher (hybrid/job/launch.py): it checks the
# flags once (a bad one is one line and exit 2), then runs torchrun so that SIGTERM / Ctrl-C reach
# the workers only: they finish the iteration, save (however long it takes) and exit 0.
exec "$PYTHON" -m hybrid.pretrain \
  --nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}" --nproc-per-node "$GPUS_PER_NODE" \
  --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29500}" \
  "${CKPT[@]}" "$@"
