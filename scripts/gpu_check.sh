#!/usr/bin/env bash
# shellcheck disable=SC2317,SC2329  # the step_* functions are called indirectly, as "step_$name"
# The one prepared check for one GPU (at most 8 minutes, offline). It uses the machine's own
# CUDA torch (never pip installs anything) with PYTHONPATH at this repository, and writes
# everything to $LOG_DIR/gpu_check.log. Steps, each with its own time limit:
#   env        python, torch, the GPU, the packages the steps import
#   tests      the gpu-marked tests, file by file (one pytest run in a CPU rehearsal)
#   parity     CPU vs GPU training, 2,048 tokens per micro-batch, fp32 and bf16, ZeRO 0 and 3
#   recompute  recompute / P_a / offload / arena: peak memory, same gradients with dropout 0.1
#   syncs      host synchronisations per iteration of the real training loop
#   pretrain   hybrid.pretrain --bf16 on a 1.5B-class shape (zero-1.5b), dropout 0: tokens/s,
#              TFLOP/s, MFU and peak memory, beside the dry run's prediction of its memory (both
#              take the same attention core, SDPA without dropout; the summary names each), and
#              one iteration profiled: kernel time by class (GEMM, attention, elementwise,
#              collectives, copies) and kernels per step (scripts/gpu_profile_run.py)
#   llama      the same for --preset llama3-8b --num-layers 4 --seq-length 4096 --bf16, dropout 0
#   bench      scripts/bench_gpu.py: ours (ZeRO-0 bf16) vs a plain torch loop of the same model
#              (autocast + fused AdamW), the tokens/s ratio printed
#   attention  fused attention (SDPA) vs the explicit softmax path (dropout on)
#
# Environment:
#   PYTHON           interpreter (default python3; .venv/bin/python in a rehearsal when present)
#   LOG_DIR          where the log and the run's files go (default runs/gpu_check)
#   GPU_CHECK_CPU=1  CPU rehearsal: tiny shapes on CPU, every step that can run without a GPU
#   GPU_CHECK_STEPS  the steps to run, space-separated (default: all, in the order above)
#   GPU_CHECK_BUDGET_S  the whole check's time limit (default 480; 1500 in a CPU rehearsal); a
#                    step gets the smaller of its own limit and what is left
#   GPU_CHECK_LIMIT_SCALE  multiplies every step's own limit (default 1; 5 in a CPU rehearsal,
#                    whose tiny steps on a loaded 2-core machine take several times a GPU's)
# Extra arguments go to the real hybrid.pretrain run (e.g. --micro-batch-size 8).
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 2
CPU=${GPU_CHECK_CPU:-0}
if [ -z "${PYTHON:-}" ]; then
    PYTHON=python3
    if [ "$CPU" = 1 ] && [ -x "$ROOT/.venv/bin/python" ]; then
        PYTHON=$ROOT/.venv/bin/python
    fi
fi
LOG_DIR=${LOG_DIR:-$ROOT/runs/gpu_check}
STEPS=${GPU_CHECK_STEPS:-env tests parity recompute syncs pretrain llama bench attention}
export PYTHON LOG_DIR
mkdir -p "$LOG_DIR"
LOG=$LOG_DIR/gpu_check.log

# offline: no package index, no hub, no wandb
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export PIP_NO_INDEX=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export WANDB_MODE=disabled

if [ "$CPU" = 1 ]; then
    DEVICE=cpu
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} CUDA_VISIBLE_DEVICES=""
    PARITY=(--cpu --layers 2 --hidden 64 --heads 4 --vocab 512 --seq-length 64 --threads 1)
    ACT=(--device cpu --num-layers 2 --hidden-size 32 --heads 4 --seq-length 16
         --micro-batch-size 2 --micro-batches 1 --vocab-size 101)
    SHAPE=(--num-layers 2 --hidden-size 64 --num-attention-heads 4 --vocab-size 512
           --seq-length 64 --micro-batch-size 2 --global-batch-size 4 --train-iters 4
           --log-interval 2)
    LLAMA=(--preset llama3-8b --num-layers 1 --hidden-size 64 --num-attention-heads 4
           --num-query-groups 2 --vocab-size 512 --seq-length 64 --micro-batch-size 1
           --global-batch-size 2 --train-iters 4 --log-interval 2)
    PROFILE_AT=(2 2)  # the iteration profiled: pretrain, llama
    BENCH=(--smoke --skip-activations)
    ATTN=(--cpu --attn-shape 2 4 128 16 --reps 2)
else
    DEVICE=cuda
    PARITY=()
    ACT=(--num-layers 12 --hidden-size 1024 --heads 16 --seq-length 1024 --micro-batch-size 8
         --micro-batches 2)
    SHAPE=(--preset zero-1.5b --vocab-size 50257 --seq-length 1024 --micro-batch-size 4
           --global-batch-size 16
           --train-iters 12 --log-interval 4)
    LLAMA=(--preset llama3-8b --num-layers 4 --seq-length 4096 --vocab-size 128256
           --micro-batch-size 1 --global-batch-size 2 --train-iters 6 --log-interval 3)
    PROFILE_AT=(6 2)  # after the warm-up, outside the last log interval (whose MFU is printed)
    BENCH=(--model zero-1.5b --micro-batch-size 4 --steps 4 --warmup 2 --skip-activations)
    ATTN=()
fi

declare -a RESULTS=()
FAILED=0
if [ "$CPU" = 1 ]; then
    BUDGET=${GPU_CHECK_BUDGET_S:-1500}
    SCALE=${GPU_CHECK_LIMIT_SCALE:-5}
else
    BUDGET=${GPU_CHECK_BUDGET_S:-480}
    SCALE=${GPU_CHECK_LIMIT_SCALE:-1}
fi
DEADLINE=$(($(date +%s) + BUDGET))

# run NAME LIMIT_S [ARGS...]: step_NAME under a time limit, as this script run with --step (a
# shell function cannot run under timeout); its status goes to the summary
run() {
    local name=$1 limit=$2 start rc left
    shift 2
    start=$(date +%s)
    left=$((DEADLINE - start))
    if [ "$left" -lt 10 ]; then
        RESULTS+=("$name: FAIL, not run (the $BUDGET s budget is spent)")
        FAILED=1
        return
    fi
    limit=$((limit * SCALE))
    [ "$left" -lt "$limit" ] && limit=$left
    echo "=== $name (limit ${limit} s)"
    timeout --kill-after=10 "$limit" bash "$ROOT/scripts/gpu_check.sh" --step "$name" "$@"
    rc=$?
    local took=$(($(date +%s) - start))
    if [ "$rc" -eq 0 ]; then
        RESULTS+=("$name: OK (${took} s)")
    else
        [ "$rc" -eq 124 ] && echo "=== $name: timed out after ${limit} s"
        RESULTS+=("$name: FAIL, status $rc (${took} s)")
        FAILED=1
    fi
}

wanted() { case " $STEPS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

step_env() {
    "$PYTHON" - "$DEVICE" <<'EOF'
import importlib.util, sys
import torch
device = sys.argv[1]
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA build "
      f"{torch.version.cuda}, CUDA available {torch.cuda.is_available()}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"GPU 0: {p.name}, {p.total_memory / 2**30:.0f} GiB, {torch.cuda.device_count()} GPUs")
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.distributed.is_nccl_available() else "none"
    print(f"cuDNN {torch.backends.cudnn.version()}, NCCL {nccl}")
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile
    q = torch.randn(1, 8, 1024, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    F.scaled_dot_product_attention(q, q, q, is_causal=True)  # warm-up
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
        torch.cuda.synchronize()
    ops = sorted({e.name for e in prof.events() if e.name.startswith("aten::_") and
                  "attention" in e.name})
    print("SDPA backend chosen (causal bf16 [1, 8, 1024, 64], forward + backward): "
          + (", ".join(ops) or "none found"))
else:
    print(f"cuDNN {torch.backends.cudnn.version()}, NCCL none (no CUDA)")
need = ["numpy", "sentencepiece", "yaml", "tqdm", "safetensors", "pytest", "pytest_timeout"]
missing = [m for m in need if importlib.util.find_spec(m) is None]
print("missing packages: " + (", ".join(missing) if missing else "none"))
ok = not missing and (device == "cpu" or torch.cuda.is_available())
sys.exit(0 if ok else 1)
EOF
}

step_tests() {
    local f rc=0 files
    # every test file with a gpu-marked test, so a new one is never left out of the check
    mapfile -t files < <(grep -l "pytest.mark.gpu" tests/test_*.py)
    if [ "$CPU" = 1 ]; then  # every test skips on CPU: one interpreter collects every file
        "$PYTHON" -m pytest -q -rs -m gpu -p no:cacheprovider "${files[@]}"
        return
    fi
    for f in "${files[@]}"; do
        echo "--- $f"
        "$PYTHON" -m pytest -q -rs -m gpu -p no:cacheprovider "$f" || rc=1
    done
    return "$rc"
}

# pretrain_like NAME PROFILE_ITERATION FLAGS...: the dry run's prediction, the real run through
# torchrun with one iteration profiled, and the summary beside the prediction
pretrain_like() {
    local name=$1 at=$2
    shift 2
    local common=(--mock-data --bf16 --lr 1e-4 --min-lr 1e-5 --eval-iters 0 --seed 1234
                  --zero-stage 1 --hidden-dropout 0 --attention-dropout 0 "$@")
    echo "--- dry run (fake tensors on CPU): the prediction"
    "$PYTHON" -m hybrid.pretrain "${common[@]}" --dry-run-world-size 1 \
        | tee "$LOG_DIR/${name}_dry_run.txt" || return 1
    echo "--- the real run (iteration $at profiled)"
    rm -f "$LOG_DIR/$name.jsonl"
    "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 1 \
        scripts/gpu_profile_run.py --check-profile-iteration "$at" \
        --check-profile-json "$LOG_DIR/${name}_profile.json" \
        "${common[@]}" --metrics-file "$LOG_DIR/$name.jsonl" || return 1
    "$PYTHON" scripts/gpu_check_steps.py pretrain-summary --name "$name" \
        --metrics "$LOG_DIR/$name.jsonl" --dry-run-report "$LOG_DIR/${name}_dry_run.txt" \
        --profile-json "$LOG_DIR/${name}_profile.json" --device "$DEVICE" --attention-dropout 0
}

step_pretrain() { pretrain_like pretrain "${PROFILE_AT[0]}" "${SHAPE[@]}" "$@"; }
step_llama() { pretrain_like llama "${PROFILE_AT[1]}" "${LLAMA[@]}"; }
step_bench() { "$PYTHON" scripts/bench_gpu.py "${BENCH[@]}" --out "$LOG_DIR/bench"; }
step_parity() { "$PYTHON" scripts/gpu_check_steps.py parity "${PARITY[@]}"; }
step_recompute() { "$PYTHON" scripts/gpu_activation_memory.py "${ACT[@]}"; }
step_syncs() { "$PYTHON" scripts/gpu_sync_count.py --device "$DEVICE"; }
step_attention() { "$PYTHON" scripts/gpu_check_steps.py attention "${ATTN[@]}"; }

if [ "${1:-}" = --step ]; then  # one step, run by run() under its time limit
    name=$2
    shift 2
    "step_$name" "$@"
    exit
fi

: >"$LOG"
exec > >(tee -a "$LOG") 2>&1
echo "gpu_check: $(date -u +%FT%TZ), device $DEVICE, steps: $STEPS, log $LOG"
# Limits sum to the 480 s budget: on a GPU each step should take well under its own.
wanted env && run env 20
wanted tests && run tests 90
wanted parity && run parity 45
wanted recompute && run recompute 40
wanted syncs && run syncs 30
wanted pretrain && run pretrain 110 "$@"
wanted llama && run llama 90
wanted bench && run bench 40
wanted attention && run attention 15

echo "=== summary ($DEVICE)"
for r in "${RESULTS[@]}"; do
    echo "  $r"
done
exit "$FAILED"
