#!/usr/bin/env bash
# The image's entrypoint: `paged-llm serve` on $PAGED_LLM_MODEL (a checkpoint directory, default the
# built-in tiny-qwen3). Runs outside a container too:
#   PAGED_LLM_ADDRESS=127.0.0.1 PAGED_LLM_MODEL=~/models/Qwen3-0.6B docker/entrypoint.sh --max-model-len 4096
#   docker/entrypoint.sh --print-command ...   # print the command instead of running it (or PAGED_LLM_DRY_RUN=1)
# Ports: OPENAI_PORT, HTTP_PORT, GRPC_PORT, METRICS_PORT (default 9000, 8000, 8001, 8002). Arguments go on
# to `paged-llm serve` after these flags (argparse keeps the last value, so they can override them).
# Without `paged-llm` on PATH it runs `$PYTHON -m paged_llm.cli serve` (PYTHON: default python3).
set -euo pipefail

dry_run="${PAGED_LLM_DRY_RUN:-0}"
if [ "${1:-}" = "--print-command" ]; then
  dry_run=1
  shift
fi

if command -v paged-llm >/dev/null 2>&1; then
  cmd=(paged-llm serve)
else
  cmd=("${PYTHON:-python3}" -m paged_llm.cli serve)
fi
# Inside a container every server must listen on all addresses for `docker run -p` to reach it; publish
# the ports on 127.0.0.1 of the host unless you mean to expose them. Outside a container, set
# PAGED_LLM_ADDRESS=127.0.0.1 to keep them on loopback.
cmd+=(
  "${PAGED_LLM_MODEL:-tiny-qwen3}" --address "${PAGED_LLM_ADDRESS:-0.0.0.0}"
  --port "${OPENAI_PORT:-9000}" --http-port "${HTTP_PORT:-8000}"
  --grpc-port "${GRPC_PORT:-8001}" --metrics-port "${METRICS_PORT:-8002}"
  "$@"
)

if [ "$dry_run" = 1 ]; then
  printf '%q' "${cmd[0]}"
  printf ' %q' "${cmd[@]:1}"
  printf '\n'
  exit 0
fi
exec "${cmd[@]}"
