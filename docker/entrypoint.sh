#!/usr/bin/env bash
# Starts tritonserver on /models; PAGED_LLM_MODEL overrides the llm model's checkpoint directory.
set -euo pipefail
if [ -n "${PAGED_LLM_MODEL:-}" ]; then
  sed -i "s|key: \"model\", value: { string_value: \"[^\"]*\" }|key: \"model\", value: { string_value: \"${PAGED_LLM_MODEL}\" }|" \
    /models/llm/config.pbtxt
fi
# Inside the container every interface must listen on all addresses for -p to reach it; publish the
# ports on 127.0.0.1 of the host (as in the example above) unless you mean to expose them.
exec tritonserver --model-repository=/models --http-address=0.0.0.0 --grpc-address=0.0.0.0 \
  --metrics-address=0.0.0.0 "$@"
