"""Tensor parallelism on CPU (gloo): 2 and 4 ranks give the tokens of one, and no worker outlives its engine.

The tiny models have 4 query heads and 2 KV heads, so 2 ranks split the KV heads and 4 ranks
replicate them (layers/parallel.py). Each rank is its own process, as on GPUs; only the collectives'
transport differs (gloo instead of NCCL). float32 sums in another order can change a logit's last
bits, never a greedy token of these prompts (fixed weights: the comparison is deterministic)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from paged_llm.config import ConfigError, DeviceConfig, EngineConfig, ModelConfig
from paged_llm.errors import EngineDeadError, TensorParallelError, WorkerDiedError
from paged_llm.launcher.procfs import live_processes_running
from paged_llm.models.hf_config import load_model_spec
from paged_llm.models.random_model import write_random_model
from paged_llm.processes import process_is_alive
from paged_llm.runner.device import Device
from paged_llm.runner.tensor_parallel import WORKER_MODULE, check_tensor_parallel
from paged_llm.sampling_params import SamplingParams
from tests.integration.conftest import make_engine, run_to_completion

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def odd_vocab_llama(tmp_path_factory):
    """Untied LM head and a vocabulary that 2 and 4 ranks cannot split evenly (151,939 rows)."""
    return write_random_model(
        tmp_path_factory.mktemp("tp") / "llama-odd-vocab",
        "tiny-llama",
        "float32",
        seed=11,
        std=0.05,
        config_overrides={"vocab_size": 151939},
    )


def _generate(model_dir, prompts, params, **overrides) -> tuple[list[list[int]], list[int]]:
    """(tokens of each prompt, the worker pids) of one engine, shut down before returning."""
    tokens, pids, _ = _generate_counted(model_dir, prompts, params, **overrides)
    return tokens, pids


def _generate_counted(model_dir, prompts, params, **overrides) -> tuple[list[list[int]], list[int], int]:
    """_generate, and the number of preemptions."""
    engine = make_engine(model_dir, **overrides)
    try:
        workers = engine.core.runner.workers
        pids = [p.pid for p in workers.processes] if workers is not None else []
        results = run_to_completion(engine, prompts, params)
        num_preemptions = engine.scheduler_stats().num_preemptions_total
    finally:
        engine.shutdown()
    return [r[0].token_ids for r in results], pids, num_preemptions


def _run_one_more(engine, prompt) -> None:
    """Adds a request and steps the engine until it is done (or a step raises)."""
    engine.add_request("after", prompt, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("tensor_parallel_size", [2, 4])
def test_greedy_tokens_equal_one_rank(tiny_model_dir, odd_vocab_llama, prompts, tensor_parallel_size):
    chosen = prompts[:6]
    for model_dir in (tiny_model_dir, odd_vocab_llama):
        expected, _ = _generate(model_dir, chosen, GREEDY)
        got, pids = _generate(model_dir, chosen, GREEDY, tensor_parallel_size=tensor_parallel_size)
        assert len(pids) == tensor_parallel_size - 1
        assert got == expected, model_dir.name
        assert not [pid for pid in pids if process_is_alive(pid)], "a worker outlived its engine"


def test_chunked_prefill_preemption_and_async_scheduling(tiny_model_dir, prompts):
    """A pool too small for all sequences (preemption), 16-token chunks, steps launched ahead."""
    chosen = prompts[:8]
    settings = dict(num_blocks=24, block_size_tokens=8, max_num_batched_tokens=16, async_scheduling="on")
    expected, _, _ = _generate_counted(tiny_model_dir, chosen, GREEDY, **settings)
    got, _, num_preemptions = _generate_counted(
        tiny_model_dir, chosen, GREEDY, tensor_parallel_size=2, **settings
    )
    assert num_preemptions > 0
    assert got == expected


def test_logprobs_are_close_and_seeded_sampling_matches(tiny_model_dir, prompts):
    """The full-vocabulary logits that rank 0 samples from equal one rank's up to rounding."""
    chosen = prompts[:4]
    params = [
        SamplingParams(temperature=0.0, max_tokens=8, logprobs=5),
        SamplingParams(temperature=0.8, top_k=50, seed=7, max_tokens=16),
    ]
    for param in params:
        runs = []
        for size in (1, 2):
            engine = make_engine(tiny_model_dir, tensor_parallel_size=size)
            try:
                for index, prompt in enumerate(chosen):
                    engine.add_request(f"r{index}", prompt, param)
                outputs = {}
                while engine.has_unfinished_requests():
                    for output in engine.step():
                        outputs.setdefault(output.request_id, []).extend(output.sequences)
                runs.append(outputs)
            finally:
                engine.shutdown()
        one, two = runs
        for request_id, deltas in one.items():
            assert [t for d in deltas for t in d.token_ids] == [
                t for d in two[request_id] for t in d.token_ids
            ]
            if param.logprobs:
                first = [lp for d in deltas for lp in (d.logprobs or [])]
                second = [lp for d in two[request_id] for lp in (d.logprobs or [])]
                assert len(first) == len(second) == 8
                for a, b in zip(first, second):
                    assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
                    assert [t.token_id for t in a.top] == [t.token_id for t in b.top]
                    assert [t.logprob for t in a.top] == pytest.approx([t.logprob for t in b.top], abs=1e-4)


def test_startup_refuses_what_cannot_split(tiny_model_dir):
    spec = load_model_spec(tiny_model_dir)

    def config(size: int, device: str = "cpu") -> EngineConfig:
        return EngineConfig(
            model=ModelConfig(model=str(tiny_model_dir)),
            device=DeviceConfig(device=device, tensor_parallel_size=size),
        )

    with pytest.raises(ConfigError, match=r"tensor_parallel_size 3 does not divide .*4 attention heads"):
        check_tensor_parallel(config(3), spec, Device("cpu"))
    with pytest.raises(ConfigError, match=r"from cuda:7 needs 11 GPUs"):
        check_tensor_parallel(config(4), spec, Device("cuda", 7))
    with pytest.raises(ConfigError, match="tensor_parallel_size 3"):
        make_engine(tiny_model_dir, tensor_parallel_size=3)
    with pytest.raises(ConfigError, match="tensor_parallel_size must be >= 1"):
        DeviceConfig(tensor_parallel_size=0)


def test_dummy_weights_need_only_the_config(tmp_path):
    """load_format dummy (benchmarks of shapes too large to write): each rank draws its shard."""
    model_dir = write_random_model(tmp_path / "config-only", "tiny-llama", "float32", with_weights=False)
    assert not list(model_dir.glob("*.safetensors"))
    for size in (1, 2):
        settings = dict(load_format="dummy", tensor_parallel_size=size)
        tokens, _ = _generate(model_dir, [[1, 2, 3, 4]], GREEDY, **settings)
        assert len(tokens[0]) == MAX_TOKENS
    with pytest.raises(ConfigError, match=r"no \*\.safetensors weights"):
        make_engine(model_dir)


def test_a_dead_worker_stops_the_engine_with_a_clear_error(tiny_model_dir, prompts):
    """In-process core: the next step raises WorkerDiedError naming the rank; shutdown leaves nothing."""
    engine = make_engine(tiny_model_dir, tensor_parallel_size=2)
    try:
        (worker,) = engine.core.runner.workers.processes
        run_to_completion(engine, prompts[:2], GREEDY)
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(timeout=10)
        with pytest.raises(WorkerDiedError, match=r"worker rank 1 \(exit code -9\) exited"):
            _run_one_more(engine, prompts[0])
    finally:
        engine.shutdown()


def test_a_dead_worker_ends_the_core_process(engines, prompts):
    """Core in its own process (as served): it exits, and the engine reports it dead."""
    before = set(_worker_pids())
    engine = engines("process", tensor_parallel_size=2)
    (worker,) = set(_worker_pids()) - before
    run_to_completion(engine, prompts[:2], GREEDY)
    os.kill(worker, signal.SIGKILL)
    deadline = time.monotonic() + 30
    with pytest.raises(EngineDeadError):
        while time.monotonic() < deadline:
            engine.add_request(f"r{time.monotonic()}", prompts[0], GREEDY)
            while engine.has_unfinished_requests():
                engine.step()
            time.sleep(0.1)
    assert not set(_worker_pids()) - before


def _worker_pids() -> list[int]:
    """Live tensor-parallel worker processes on this machine."""
    return live_processes_running(WORKER_MODULE.encode())


def test_workers_exit_when_the_core_process_is_killed(engines, prompts):
    before = set(_worker_pids())
    engine = engines("process", tensor_parallel_size=2)
    workers = set(_worker_pids()) - before
    assert len(workers) == 1
    run_to_completion(engine, prompts[:1], GREEDY)
    os.kill(engine.client.pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and [pid for pid in workers if process_is_alive(pid)]:
        time.sleep(0.2)
    assert not [pid for pid in workers if process_is_alive(pid)], "a worker outlived its core"


def test_rank_zero_failing_inside_a_step_stops_the_engine(tiny_model_dir, prompts, monkeypatch):
    """The workers wait in a collective rank 0 never reaches: the engine stops (TensorParallelError)
    instead of serving on out of step, and shutdown kills the worker instead of hanging."""
    engine = make_engine(tiny_model_dir, tensor_parallel_size=2)
    try:
        (worker,) = engine.core.runner.workers.processes
        run_to_completion(engine, prompts[:1], GREEDY)

        def fail(*args, **kwargs):
            raise RuntimeError("out of memory (simulated on rank 0)")

        monkeypatch.setattr(engine.core.runner, "forward_step", fail)
        with pytest.raises(TensorParallelError, match=r"rank 0 failed inside a step.*simulated"):
            _run_one_more(engine, prompts[0])
    finally:
        engine.shutdown()
    assert worker.wait(timeout=30) is not None


def test_workers_wait_out_an_idle_engine(tiny_model_dir, prompts, monkeypatch):
    """A worker's wait for the next step's header has no timeout: an engine idle for longer than
    the collectives' timeout (shortened here) keeps serving. A worker that waited in a step
    collective died of that timeout."""
    monkeypatch.setenv("PAGED_LLM_TP_TIMEOUT_S", "40")  # room for a worker's start on a busy machine
    engine = make_engine(tiny_model_dir, tensor_parallel_size=2)
    try:
        first = run_to_completion(engine, prompts[:2], GREEDY)
        time.sleep(45)
        engine.core.runner.check_workers()  # raises WorkerDiedError if it died waiting
        again = run_to_completion(engine, prompts[:2], GREEDY)
    finally:
        engine.shutdown()
    assert [r[0].token_ids for r in again] == [r[0].token_ids for r in first]


def test_the_timeout_setting_is_checked(monkeypatch):
    from paged_llm.runner.tp_channel import DEFAULT_TIMEOUT_S, collective_timeout_s

    monkeypatch.delenv("PAGED_LLM_TP_TIMEOUT_S", raising=False)
    assert collective_timeout_s() == DEFAULT_TIMEOUT_S
    monkeypatch.setenv("PAGED_LLM_TP_TIMEOUT_S", "90.5")
    assert collective_timeout_s() == 90.5
    for bad in ("10m", "0", "-3"):
        monkeypatch.setenv("PAGED_LLM_TP_TIMEOUT_S", bad)
        with pytest.raises(ConfigError, match="PAGED_LLM_TP_TIMEOUT_S"):
            collective_timeout_s()
