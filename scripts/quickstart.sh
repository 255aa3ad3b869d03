#!/usr/bin/env bash
# The front door: on a fresh machine, set up .venv, build the embedded corpus (Python's own
# docstrings: no network), train a tokenizer, preprocess, and pretrain a small GPT on 4 CPU
# processes with tp=2 x dp=2 and ZeRO stage 2; then plot the loss curves.
#   RUN_DIR     where data, metrics and plots go (default runs/quickstart)
#   TRAIN_ITERS optimizer steps (default 300)
# Extra arguments go to hybrid.pretrain and override the defaults below.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
RUN_DIR=${RUN_DIR:-runs/quickstart}
T0=$(date +%s)

bash scripts/setup_env.sh
export PYTHON=$ROOT/.venv/bin/python WANDB_MODE=${WANDB_MODE:-offline}

DATA_DIR=$RUN_DIR/data VOCAB_SIZE=${VOCAB_SIZE:-4096} OUTPUT=$RUN_DIR/data/stdlib \
  bash scripts/preprocess_data.sh

rm -f "$RUN_DIR/metrics.jsonl"
GPUS_PER_NODE=4 bash scripts/pretrain_gpt.sh \
  --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 \
  --tensor-model-parallel-size 2 --zero-stage 2 \
  --micro-batch-size 4 --global-batch-size 16 \
  --train-iters "${TRAIN_ITERS:-300}" --lr 2e-3 --min-lr 2e-4 --lr-warmup-fraction 0.07 --lr-decay-style cosine \
  --hidden-dropout 0.0 --attention-dropout 0.0 --weight-decay 0.1 --clip-grad 1.0 \
  --data-path "$RUN_DIR/data/stdlib_text_document" --tokenizer-model "$RUN_DIR/data/tokenizer.model" \
  --split 90,8,2 --eval-interval 50 --eval-iters 4 --log-interval 10 \
  --metrics-file "$RUN_DIR/metrics.jsonl" "$@"

"$PYTHON" -m hybrid.plot_metrics "$RUN_DIR/metrics.jsonl" --output-dir "$RUN_DIR/plots"
echo "quickstart done in $(( $(date +%s) - T0 )) s: metrics $RUN_DIR/metrics.jsonl, plots $RUN_DIR/plots/"
