#!/usr/bin/env bash
# Multi-GPU parity check for one node of 8 GPUs (NCCL needs one GPU per rank, so the one-GPU
# scripts/gpu_check.sh cannot run these). Offline, with the machine's own CUDA torch (never pip
# installs anything), PYTHONPATH at this repository, everything to $LOG_DIR/gpu_multi_check.log.
#
# The same GPT (fp32, dropout 0, mock data, seed 1234, global batch 16) trains 10 iterations as
#   ref       1 rank                        (1 GPU: 8 micro-batches per step)
#   1x8       tp 1 x dp 8, ZeRO-3            (1 micro-batch per rank)
#   2x4+SP    tp 2 x dp 4, ZeRO-3, --sequence-parallel
#   8x1       tp 8 x dp 1, ZeRO-1
# and every layout's per-iteration loss must equal the single rank's within 1e-4 relative (the
# collectives sum in another order than one GPU; fp32 differences are ~1e-6), and its grad norm
# within 1e-3 relative.
#
# Environment:
#   PYTHON    interpreter (default python3)
#   LOG_DIR   where the log and the metrics files go (default runs/gpu_multi_check)
#   NGPUS     GPUs of the node (default 8; the layouts above need 8)
# Extra arguments go to every hybrid.pretrain run.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 2
PYTHON=${PYTHON:-python3}
LOG_DIR=${LOG_DIR:-$ROOT/runs/gpu_multi_check}
NGPUS=${NGPUS:-8}
mkdir -p "$LOG_DIR"
LOG=$LOG_DIR/gpu_multi_check.log
: >"$LOG"
exec > >(tee -a "$LOG") 2>&1

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export PIP_NO_INDEX=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export WANDB_MODE=disabled

if [ "$NGPUS" -lt 8 ]; then
    echo "gpu_multi_check: needs 8 GPUs (NGPUS=$NGPUS); use scripts/gpu_check.sh on one GPU"
    exit 2
fi

MODEL=(--mock-data --vocab-size 4096 --num-layers 4 --hidden-size 512 --num-attention-heads 8
       --seq-length 1024 --hidden-dropout 0 --attention-dropout 0 --micro-batch-size 2
       --global-batch-size 16 --train-iters 10 --lr 3e-4 --min-lr 3e-5 --log-interval 1
       --eval-iters 0 --seed 1234)
FAILED=0

# launch NAME NPROC FLAGS...: one torchrun job of NPROC ranks writing $LOG_DIR/NAME.jsonl
launch() {
    local name=$1 nproc=$2
    shift 2
    echo "=== $name: $nproc ranks: $*"
    rm -f "$LOG_DIR/$name.jsonl"
    timeout --kill-after=10 600 "$PYTHON" -m torch.distributed.run --standalone \
        --nproc-per-node "$nproc" -m hybrid.pretrain "${MODEL[@]}" "$@" \
        --metrics-file "$LOG_DIR/$name.jsonl" || FAILED=1
}

echo "gpu_multi_check: $(date -u +%FT%TZ), log $LOG"
launch ref 1 --tensor-model-parallel-size 1 --zero-stage 0 "$@"
launch 1x8 8 --tensor-model-parallel-size 1 --zero-stage 3 "$@"
launch 2x4sp 8 --tensor-model-parallel-size 2 --zero-stage 3 --sequence-parallel "$@"
launch 8x1 8 --tensor-model-parallel-size 8 --zero-stage 1 "$@"

"$PYTHON" - "$LOG_DIR" <<'EOF' || FAILED=1
import json, sys
from pathlib import Path

d = Path(sys.argv[1])
def records(name):
    p = d / f"{name}.jsonl"
    if not p.exists():
        return None
    return {r["iteration"]: r for r in map(json.loads, p.read_text().splitlines())
            if "lm_loss" in r and "split" not in r and "iteration" in r}
ref = records("ref")
ok = bool(ref)
for name in ("1x8", "2x4sp", "8x1"):
    got = records(name)
    if not got or not ref or set(got) != set(ref):
        print(f"{name}: missing or incomplete metrics: FAIL")
        ok = False
        continue
    dl = max(abs(got[i]["lm_loss"] - ref[i]["lm_loss"]) / abs(ref[i]["lm_loss"]) for i in ref)
    dn = max(abs(got[i]["grad_norm"] - ref[i]["grad_norm"]) / abs(ref[i]["grad_norm"])
             for i in ref)
    good = dl <= 1e-4 and dn <= 1e-3
    ok &= good
    last = max(ref)
    print(f"{name}: max rel loss diff {dl:.2e} (<= 1e-4), max rel grad-norm diff {dn:.2e} "
          f"(<= 1e-3), tokens/s {got[last]['tokens_per_sec']:,.0f} vs one rank "
          f"{ref[last]['tokens_per_sec']:,.0f}: {'OK' if good else 'FAIL'}")
sys.exit(0 if ok else 1)
EOF

echo "=== gpu_multi_check: $([ "$FAILED" = 0 ] && echo OK || echo FAIL)"
exit "$FAILED"
