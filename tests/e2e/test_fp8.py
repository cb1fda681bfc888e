"""FP8 through tritonserver: an FP8 checkpoint (compressed-tensors per-channel, the FP8-dynamic
layout) served with `kv_cache_dtype: fp8` in config.pbtxt streams the greedy tokens of the offline
engine with the same settings, and the server's log names the layout it detected."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from paged_llm.models.random_model import write_random_model
from paged_llm.sampling_params import SamplingParams
from tests.e2e.client import make_inputs, stream_many
from tests.e2e.server import RunningServer, make_model_repository, start_server
from tests.integration.conftest import make_engine, run_to_completion

GREEDY = {"max_tokens": 16, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fp8-checkpoint")
    return write_random_model(
        root / "tiny-llama-fp8", "tiny-llama", "bfloat16", seed=5, quantization="fp8-channel", std=0.05
    )


@pytest.fixture(scope="module")
def fp8_server(tmp_path_factory, fp8_checkpoint) -> Iterator[tuple[RunningServer, Path]]:
    root = tmp_path_factory.mktemp("fp8-server")
    parameters = {"model": str(fp8_checkpoint), "kv_cache_dtype": "fp8", "dtype": "float32"}
    repository = make_model_repository(root / "models", parameters, models=("llm",))
    log = root / "server.log"
    running = start_server(repository, log)
    yield running, log
    running.stop()


def test_an_fp8_checkpoint_with_an_fp8_cache_streams_the_offline_tokens(fp8_server, fp8_checkpoint, prompts):
    server, log = fp8_server
    chosen = prompts[:3]
    engine = make_engine(fp8_checkpoint, kv_cache_dtype="fp8")
    try:
        params = SamplingParams(temperature=0.0, max_tokens=GREEDY["max_tokens"], ignore_eos=True)
        expected = [r[0].token_ids for r in run_to_completion(engine, chosen, params)]
    finally:
        engine.shutdown()
    results = stream_many(
        server.grpc_url, [make_inputs(p, stream=True, sampling_parameters=GREEDY) for p in chosen]
    )
    assert all(not r.errors and r.finals == 1 for r in results)
    got = [[int(t) for r in result.responses for t in r.as_numpy("output_ids")] for result in results]
    assert got == expected
    text = log.read_text(errors="replace")
    assert "FP8 checkpoint: fp8-channel (compressed-tensors)" in text
    assert "dequantized at load" in text  # CPU: no FP8 kernels
