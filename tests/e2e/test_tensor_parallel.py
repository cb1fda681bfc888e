"""Tensor parallelism through tritonserver (CPU, gloo): a server whose `llm` model sets
tensor_parallel_size 2 streams the default server's greedy tokens, and its worker process goes
with the server."""

from __future__ import annotations

from paged_llm.launcher.procfs import live_processes_running
from paged_llm.processes import process_is_alive
from paged_llm.runner.tensor_parallel import WORKER_MODULE
from tests.e2e.client import make_inputs, stream_many
from tests.e2e.metrics import wait_idle
from tests.e2e.server import make_model_repository, start_server

GREEDY = {"max_tokens": 24, "ignore_eos": True, "temperature": 0}


def worker_pids() -> list[int]:
    """Live tensor-parallel worker processes on this machine."""
    return live_processes_running(WORKER_MODULE.encode())


def _output_ids(results) -> list[list[int]]:
    return [[int(t) for r in result.responses for t in r.as_numpy("output_ids")] for result in results]


def test_two_ranks_stream_the_default_servers_tokens(server, prompts, tmp_path):
    before = set(worker_pids())
    repository = make_model_repository(tmp_path / "models", {"tensor_parallel_size": "2"}, models=("llm",))
    running = start_server(repository, tmp_path / "server.log")
    try:
        workers = set(worker_pids()) - before
        assert len(workers) == 1, f"expected one worker process, found {workers}"
        requests = [make_inputs(p, stream=True, sampling_parameters=GREEDY) for p in prompts[:6]]
        expected = stream_many(server.grpc_url, requests)
        got = stream_many(running.grpc_url, requests)
        assert all(not r.errors and r.finals == 1 for r in [*expected, *got])
        assert _output_ids(got) == _output_ids(expected)
        wait_idle(running)
    finally:
        running.stop()
    assert not [pid for pid in workers if process_is_alive(pid)], "a worker outlived its server"
