"""OpenAI-compatible HTTP server in front of tritonserver (its own process; talks to Triton over
gRPC streams and HTTP generate_stream).

The engine package never imports this one: web code stays here. Modules:
  protocol.py       request bodies (pydantic), validated at the edge, -> the llm model's sampling_parameters
  triton_request.py one generation request and its responses, whatever the transport
  triton_grpc.py    a request over a gRPC ModelStreamInfer call of its own
  triton_http.py    a streamed request over Triton's HTTP generate_stream
  http1.py          the small HTTP/1.1 client under it (kept-alive connections, httptools)
  fast_json.py      orjson on the hot path, the standard library for what orjson refuses
  triton_client.py  the client of tritonserver behind the routes: transport, errors, models, health
  chat_template.py  the checkpoint's chat template (tokenizer_config.json)
  responses.py      OpenAI response bodies and SSE chunks (completions, chat, logprobs, usage)
  app.py            FastAPI routes, API keys, body cap, disconnect -> cancel
  metrics.py        the server's own Prometheus counters
  server.py         command line (python -m paged_llm.openai)
"""
