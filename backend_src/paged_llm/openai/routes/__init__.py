"""The OpenAI server's routes, one module each; app.py mounts them. They reach the worker's state
through state.app_state(request).

  status.py           GET /health (readiness) and GET /version
  prometheus.py       GET /metrics (this worker's figures, plus the other workers')
  models.py           GET /v1/models and /v1/models/{model}
  completions.py      POST /v1/completions
  chat.py             POST /v1/chat/completions
  lora_adapters.py    POST /v1/load_lora_adapter and /v1/unload_lora_adapter (runtime LoRA updates)
  generation_flow.py  what the two generation routes share: counting a request, sampling defaults,
                      collecting a non-streamed answer, the SSE response, closing the Triton
                      streams of a client that left
"""
