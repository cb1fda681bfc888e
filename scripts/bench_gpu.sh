#!/usr/bin/env bash
# Every GPU figure of docs/benchmarks.md in one go, on a CUDA host that has torch, triton and
# transformers (see ../shared/gpu-host.md); random-weight models are built first (no downloads).
#   scripts/bench_gpu.sh OUT_DIR            (PYTHON=python3, MODELS_DIR=/tmp/paged_llm_models)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/bench_out}"
MODELS="${MODELS_DIR:-/tmp/paged_llm_models}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT" "$MODELS"
export PYTHONPATH="$ROOT/backend_src${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
cd "$ROOT"
quiet() { grep -v -e "incorrect regex pattern" -e "Warning" || true; }

"$PY" scripts/make_random_model.py --shape qwen3-0.6b --out "$MODELS/qwen3-0.6b" --device cuda >/dev/null 2>&1
echo "== 1. offline throughput: 256 requests, input/output 100..1024, Qwen3-0.6B shape (bf16)"
"$PY" scripts/bench_offline.py --model "$MODELS/qwen3-0.6b" --num-requests 256 --input-len 100:1024 \
  --output-len 100:1024 --max-num-batched-tokens 16384 --max-model-len 2048 --hf-num-requests 32 \
  --no-progress --json "$OUT/offline_qwen3.json" 2>&1 | quiet | tail -6
echo "== 2a. batch-1 decode, 128-token prompt, 256 new tokens, Qwen3-0.6B shape"
"$PY" scripts/bench_decode.py --model "$MODELS/qwen3-0.6b" --hf --json "$OUT/decode_b1_qwen3.json" 2>&1 | quiet | tail -5
echo "== 3. decode sweep at 1k context, Qwen3-0.6B shape"
"$PY" scripts/bench_decode.py --model "$MODELS/qwen3-0.6b" --batch-sizes 1,16,64,256 --prompt-len 1024 \
  --new-tokens 64 --plot "$OUT/decode_sweep_qwen3.png" --json "$OUT/decode_sweep_qwen3.json" 2>&1 | quiet | tail -7
"$PY" scripts/make_random_model.py --shape llama3-8b --out "$MODELS/llama3-8b" --device cuda >/dev/null 2>&1
echo "== 2b. batch-1 decode, 128-token prompt, 256 new tokens, Llama-3-8B shape"
"$PY" scripts/bench_decode.py --model "$MODELS/llama3-8b" --hf --json "$OUT/decode_b1_llama8b.json" 2>&1 | quiet | tail -5
