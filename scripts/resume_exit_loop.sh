#!/usr/bin/env bash
# Repeated resumed 2-rank runs: each run trains a tiny mock-data GPT with
# ZeRO-1 to iteration 3 with --save, then resumes with --load to iteration 6 (saving again, with
# an evaluation), and must exit 0 both times. Prints one line per run and a final count; exits 1
# if any launch failed (its stderr is kept under $LOG_DIR).
#   RUNS     number of save+resume pairs (default 50)
#   LOG_DIR  where each failing launch's output is kept (default ${TMPDIR:-/tmp}/resume_exit_loop)
#   PYTHON   interpreter (default .venv/bin/python, else python3)
# Extra arguments go to both launches of hybrid.pretrain.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PYTHON=${PYTHON:-$([ -x "$ROOT/.venv/bin/python" ] && echo "$ROOT/.venv/bin/python" || echo python3)}
RUNS=${RUNS:-50}
LOG_DIR=${LOG_DIR:-${TMPDIR:-/tmp}/resume_exit_loop}
mkdir -p "$LOG_DIR"
export OMP_NUM_THREADS=1 WANDB_MODE=${WANDB_MODE:-offline}
ARGS=(--mock-data --vocab-size 1000 --num-layers 2 --hidden-size 64 --num-attention-heads 4
      --seq-length 32 --micro-batch-size 2 --global-batch-size 8 --zero-stage 1 --lr 1e-3
      --min-lr 1e-4 --lr-decay-iters 6 --log-interval 1 --eval-interval 2 --eval-iters 1)
ok=0 failed=0
for i in $(seq 1 "$RUNS"); do
  ck=$(mktemp -d "$LOG_DIR/ck.XXXXXX")
  status=ok
  for iters in 3 6; do
    log="$LOG_DIR/run$i-to$iters.log"
    if ! "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 2 -m hybrid.pretrain \
        "${ARGS[@]}" --train-iters "$iters" --save "$ck" --load "$ck" "$@" >"$log" 2>&1; then
      status="FAILED (to $iters; see $log)"
      break
    fi
    rm -f "$log"
  done
  rm -rf "$ck"
  if [ "$status" = ok ]; then ok=$((ok + 1)); else failed=$((failed + 1)); fi
  echo "run $i/$RUNS: $status"
done
echo "resumed runs that exited 0: $ok of $((ok + failed))"
[ "$failed" -eq 0 ]
