"""OpenAI-compatible HTTP server in front of tritonserver (its own process, talks gRPC streaming).

The engine package never imports this one: web code stays here. Modules:
  protocol.py       request bodies (pydantic), validated at the edge, -> the llm model's sampling_parameters
  triton_backend.py one gRPC stream per request to a vllm_backend-compatible Triton model
  chat_template.py  the checkpoint's chat template (tokenizer_config.json)
  responses.py      OpenAI response bodies and SSE chunks (completions, chat, logprobs, usage)
  app.py            FastAPI routes, API keys, body cap, disconnect -> cancel
  metrics.py        the server's own Prometheus counters
  server.py         command line (python -m paged_llm.frontend)
"""
