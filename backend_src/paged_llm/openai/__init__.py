"""OpenAI-compatible HTTP server in front of tritonserver (its own process; talks to Triton over
gRPC streams and HTTP generate_stream).

The engine package never imports this one: web code stays here. Modules:
  server.py         command line (python -m paged_llm.openai); workers.py runs several processes
  settings.py       what the command line gives each worker's app
  app.py            create_app: the routes, API keys and error shapes assembled
  state.py          AppState, what the routes share, and the lifespan that builds and warms it
  routes/           one module per route family (routes/__init__.py lists them)
  edge.py           API keys, the body cap, noticing a client that left
  protocol.py       request bodies (pydantic), validated at the edge, -> the llm model's sampling_parameters
  session_headers.py the X-Session-* headers of a request that is a turn of a session
  chat_template.py  the checkpoint's chat template (tokenizer_config.json) and generation defaults
  model_list.py     which models the routes may send to
  generation.py     a request's choices as its Triton streams fill them
  responses.py      OpenAI response bodies and SSE chunks (completions, chat, logprobs, usage)
  sse_stream.py     the body of a streamed response
  triton_client.py  the client of tritonserver behind the routes: transport, errors, models, health
  triton_request.py one generation request and its responses, whatever the transport
  triton_grpc.py    a request over a gRPC ModelStreamInfer call of its own
  triton_http.py    a streamed request over Triton's HTTP generate_stream
  http1.py          the small HTTP/1.1 client under it (kept-alive connections, httptools)
  fast_json.py      orjson on the hot path, the standard library for what orjson refuses
  metrics.py        the server's own Prometheus counters; worker_metrics.py sums them over workers
  version.py        the installed version (/version)
"""
