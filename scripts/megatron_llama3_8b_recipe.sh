#!/bin/bash
# Megatron-LM's examples/llama/train_llama3_8b_h100_fp8.sh, its flag arrays verbatim, run by
# hybrid.pretrain. Changed, and only these (docs/training.md, "Megatron-LM's Llama-3 recipe"):
#   - model size: 2 layers of width 64 (4 heads, 2 query groups, 16 channels each, FFN 128),
#     sequence 128; the vocabulary (128256) and every architecture flag are the script's;
#   - batch and iterations: global batch 8, 320 training samples (40 iterations), warmup and
#     decay samples scaled, --eval-iters 2, --eval-interval 20;
#   - paths: under $OUT (default runs/llama3_recipe); processes: $NPROC (default 2, on CPU);
#   - the FP8 flags (DTYPE_ARGS) are left out: no FP8 here;
#   - --ckpt-format torch_dist is left out: Megatron-LM's format is not implemented here (refused);
#     the checkpoints are this trainer's safetensors format;
#   - TP_SIZE may come from the environment (default the script's 1; TP_SIZE=2 NPROC=2 is the
#     script's tp 2 with its --sequence-parallel).
# Usage: [TP_SIZE=2] NPROC=2 bash scripts/megatron_llama3_8b_recipe.sh [more hybrid.pretrain flags]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-$([ -x "$ROOT/.venv/bin/python" ] && echo "$ROOT/.venv/bin/python" || echo python3)}
OUT=${OUT:-runs/llama3_recipe}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
cd "$ROOT"

CHECKPOINT_PATH="$OUT/checkpoints/llama3_8b_fp8"
TENSORBOARD_LOGS_PATH="$OUT/tensorboard_logs/llama3_8b_fp8"
mkdir -p "$(dirname "$CHECKPOINT_PATH")" "$(dirname "$TENSORBOARD_LOGS_PATH")"

GPUS_PER_NODE=${NPROC:-2}
NUM_NODES=1
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-29500}
NODE_RANK=${NODE_RANK:-0}

TP_SIZE=${TP_SIZE:-1}
CP_SIZE=1
MICRO_BATCH_SIZE=1
GLOBAL_BATCH_SIZE=8
NUM_LAYERS=2
SEQ_LENGTH=128
MAX_POSITION_EMBEDDINGS=128
DATA_CACHE_PATH="$OUT/benchmark_cache_llama3_8b_fp8"
mkdir -p "$DATA_CACHE_PATH"

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NUM_NODES
    --node_rank $NODE_RANK
    --master_addr $MASTER_ADDR
    --master_port $MASTER_PORT
)

MODEL_ARGS=(
    --use-mcore-models
    --num-layers $NUM_LAYERS
    --hidden-size 64
    --ffn-hidden-size 128
    --num-attention-heads 4
    --group-query-attention
    --num-query-groups 2
    --kv-channels 16
    --seq-length $SEQ_LENGTH
    --max-position-embeddings $MAX_POSITION_EMBEDDINGS
    --position-embedding-type rope
    --rotary-base 1000000 
    --rotary-percent 1.0
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --swiglu
    --normalization RMSNorm
    --init-method-std 0.0134
    --attention-backend fused
    --apply-layernorm-1p 
    --untie-embeddings-and-output-weights
    --disable-bias-linear 
)

TRAINING_ARGS=(
    --micro-batch-size $MICRO_BATCH_SIZE
    --global-batch-size $GLOBAL_BATCH_SIZE
    --train-samples 320
    --lr-decay-samples 318
    --lr-warmup-samples 16
    --lr 0.00015
    --min-lr 0.00001
    --decoupled-lr 5.0e-4      # Specific to decoupled AdamW, ensure optimizer is compatible
    --decoupled-min-lr 4.5e-5  # Specific to decoupled AdamW
    --lr-decay-style cosine
    --clip-grad 1.0
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --bf16
    --grad-reduce-in-bf16
    --cross-entropy-loss-fusion
    --calculate-per-token-loss 
    --manual-gc 
    --empty-unused-memory-level 1 
    --exit-duration-in-mins 235 
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size $TP_SIZE
    --context-parallel-size $CP_SIZE
    --sequence-parallel  # Always enable sequence parallelism with TP_SIZE=2
)

DDP_ARGS=(
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
)
TRAINING_ARGS+=("${DDP_ARGS[@]}")

DATA_ARGS_LIST=(
    "--mock-data"
    "--tokenizer-type NullTokenizer"
    "--vocab-size 128256" 
    "--data-cache-path ${DATA_CACHE_PATH}"
    "--tiktoken-pattern v2" 
    "--split '99,1,0'"
    "--no-create-attention-mask-in-dataloader"
    "--no-mmap-bin-files"
    "--num-workers 1"
)

EVAL_AND_LOGGING_ARGS=(
    --log-interval 1
    --eval-iters 2
    --eval-interval 20
    --save-interval 1000
    --log-throughput
    --profile
    --profile-step-start 4
    --profile-step-end 6
    --distributed-timeout-minutes 60
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH" 
    --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
)

"$PYTHON" -m hybrid.pretrain ${DISTRIBUTED_ARGS[@]} \
    ${MODEL_ARGS[@]} \
    ${TRAINING_ARGS[@]} \
    ${MODEL_PARALLEL_ARGS[@]} \
    ${DATA_ARGS_LIST[@]} \
    ${EVAL_AND_LOGGING_ARGS[@]} "$@"
