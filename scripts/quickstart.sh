#!/usr/bin/env bash
# The front door: on a fresh machine, set up .venv, build the embedded corpus (Python's own
# docstrings: no network), train a tokenizer, preprocess, and pretrain a small GPT on 4 CPU
# processes with tp=2 x dp=2 and ZeRO stage 2; then plot the loss curves, export the model to a
# Hugging Face directory and print a short sample from it.
#   RUN_DIR     where data, metrics and plots go (default runs/quickstart)
#   TRAIN_ITERS optimizer steps (default 300)
#   PROMPT      the sample's prompt (default "Return the")
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

rm -rf "$RUN_DIR/metrics.jsonl" "$RUN_DIR/checkpoints" "$RUN_DIR/hf"
GPUS_PER_NODE=4 bash scripts/pretrain_gpt.sh \
  --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 \
  --tensor-model-parallel-size 2 --zero-stage 2 \
  --micro-batch-size 4 --global-batch-size 16 \
  --train-iters "${TRAIN_ITERS:-300}" --lr 2e-3 --min-lr 2e-4 --lr-warmup-iters 20 --lr-decay-style cosine \
  --hidden-dropout 0.0 --attention-dropout 0.0 --weight-decay 0.1 --clip-grad 1.0 \
  --data-path "$RUN_DIR/data/stdlib_text_document" --tokenizer-model "$RUN_DIR/data/tokenizer.model" \
  --split 90,8,2 --eval-interval 50 --eval-iters 4 --log-interval 10 \
  --metrics-file "$RUN_DIR/metrics.jsonl" --save "$RUN_DIR/checkpoints" "$@"

"$PYTHON" -m hybrid.plot_metrics "$RUN_DIR/metrics.jsonl" --output-dir "$RUN_DIR/plots"
# The trained model as a transformers directory (AutoModelForCausalLM / AutoTokenizer), and a sample.
"$PYTHON" -m hybrid.export_hf --load "$RUN_DIR/checkpoints" --output "$RUN_DIR/hf"
echo "--- sample (hybrid.generate --seed 1) ---"
"$PYTHON" -m hybrid.generate --hf-dir "$RUN_DIR/hf" --prompt "${PROMPT:-Return the}" --max-new-tokens 60 \
  --temperature 0.8 --top-k 40 --seed 1
echo "---"
echo "quickstart done in $(( $(date +%s) - T0 )) s: metrics $RUN_DIR/metrics.jsonl, plots $RUN_DIR/plots/, model $RUN_DIR/hf"
