#!/usr/bin/env bash
# Build the data a training run reads: corpus (if missing) -> tokenizer (if missing) -> .bin/.idx.
# Defaults use the embedded stdlib-docstring corpus, so it works with no network.
#   PYTHON      interpreter (default .venv/bin/python, else python3)
#   DATA_DIR    where everything goes (default runs/data)
#   CORPUS      input for both steps: files/globs, a saved dataset dir or a hub name
#               (default $DATA_DIR/stdlib_docs.jsonl, built by data.build_corpus if missing)
#   JSON_KEYS   text column(s) (default text)
#   VOCAB_SIZE  tokenizer vocabulary (default 8000)      MODEL_TYPE  bpe | unigram (default bpe)
#   TOKENIZER_TYPE  SentencePieceTokenizer (default) or HuggingFaceTokenizer, passed to
#               data.preprocess as Megatron-LM's --tokenizer-type
#   TOKENIZER   SentencePieceTokenizer: prefix (default $DATA_DIR/tokenizer; trained if
#               <prefix>.model is missing); HuggingFaceTokenizer: an existing tokenizer directory
#   OUTPUT      output prefix (default $DATA_DIR/stdlib -> ${OUTPUT}_text_document.bin/.idx)
#   WORKERS     tokenizer processes (default 2)
# Extra arguments go to data.preprocess (e.g. --dataset-config, --split, --chunk-documents).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
DATA_DIR=${DATA_DIR:-runs/data}
CORPUS=${CORPUS:-$DATA_DIR/stdlib_docs.jsonl}
JSON_KEYS=${JSON_KEYS:-text}
VOCAB_SIZE=${VOCAB_SIZE:-8000}
MODEL_TYPE=${MODEL_TYPE:-bpe}
TOKENIZER=${TOKENIZER:-$DATA_DIR/tokenizer}
TOKENIZER_TYPE=${TOKENIZER_TYPE:-SentencePieceTokenizer}
OUTPUT=${OUTPUT:-$DATA_DIR/stdlib}
WORKERS=${WORKERS:-2}
mkdir -p "$DATA_DIR"

if [ "$CORPUS" = "$DATA_DIR/stdlib_docs.jsonl" ] && [ ! -f "$CORPUS" ]; then
  "$PYTHON" -m data.build_corpus --output "$CORPUS"
fi
if [ "$TOKENIZER_TYPE" = HuggingFaceTokenizer ]; then
  TOKENIZER_MODEL=$TOKENIZER  # a directory (tokenizer.json + tokenizer_config.json): not trained here
else
  TOKENIZER_MODEL=$TOKENIZER.model
  if [ ! -f "$TOKENIZER_MODEL" ]; then
    # shellcheck disable=SC2086  # CORPUS and JSON_KEYS may hold several words
    "$PYTHON" -m data.train_tokenizer --input $CORPUS --json-keys $JSON_KEYS \
      --vocab-size "$VOCAB_SIZE" --model-type "$MODEL_TYPE" --model-prefix "$TOKENIZER"
  fi
fi
# shellcheck disable=SC2086
exec "$PYTHON" -m data.preprocess --input $CORPUS --json-keys $JSON_KEYS \
  --tokenizer-type "$TOKENIZER_TYPE" --tokenizer-model "$TOKENIZER_MODEL" \
  --output-prefix "$OUTPUT" --workers "$WORKERS" --append-eod "$@"
