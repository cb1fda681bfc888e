"""A dead engine core process restarted in place by AsyncLLM: in-flight requests fail once each,
new ones are refused with a retry hint meanwhile, a fresh core serves afterwards; past the
restart limit the stub gives up. Shared cores (several stubs) come back as one."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import replace

import pytest

from paged_llm.config import CacheConfig, EngineConfig, ModelConfig
from paged_llm.engine.async_llm import AsyncLLM
from paged_llm.errors import EngineCoreDiedError, EngineDeadError
from tests.integration.test_shared_core import Collector, greedy

RESTART_BOUND_S = 60.0


def _config(tiny_model_dir, **serving) -> EngineConfig:
    config = EngineConfig(
        model=ModelConfig(model=str(tiny_model_dir), dtype="float32"), cache=CacheConfig(num_blocks=512)
    )
    return replace(config, serving=replace(config.serving, **serving))


def _wait(condition: Callable[[], bool], timeout_s: float = RESTART_BOUND_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def _kill_core(engine: AsyncLLM) -> int:
    pid = engine.client.pid
    os.kill(pid, signal.SIGKILL)
    return pid


def _restarted(engine: AsyncLLM, old_pid: int) -> bool:
    """A new core serves (the death of the old one may not have been noticed yet)."""
    return engine.is_serving and engine.client.pid != old_pid


def _serves(engine: AsyncLLM, outputs: Collector, request_id: str, prompt: list[int]) -> bool:
    engine.add_request(request_id, prompt, greedy(3))
    return outputs.wait_final(request_id).error is None


def test_a_killed_core_fails_its_requests_once_then_a_fresh_core_serves(tiny_model_dir, prompts):
    outputs = Collector()
    engine = AsyncLLM(_config(tiny_model_dir), outputs, core_mode="process")
    try:
        for index in range(3):
            engine.add_request(f"r{index}", prompts[index], greedy(4000, ignore_eos=True))
        assert _wait(lambda: all(outputs.outputs.get(f"r{i}") for i in range(3)))
        assert _wait(lambda: engine.stats.snapshot().num_running == 3, 10.0)
        old_pid = _kill_core(engine)
        for index in range(3):
            final = outputs.wait_final(f"r{index}")
            assert isinstance(final.error, EngineCoreDiedError)
            assert "killed by SIGKILL" in str(final.error) and str(old_pid) not in str(final.error)
        assert len([o for o in outputs.outputs["r0"] if o.finished]) == 1
        snapshot = engine.stats.snapshot()  # not frozen at its last values while no core serves
        assert not snapshot.engine_up and snapshot.num_running == 0 and snapshot.kv_usage == 0.0
        with pytest.raises(EngineDeadError, match="retry in a few seconds"):
            engine.add_request("meanwhile", prompts[3], greedy(2))
        assert engine.is_accepting and not engine.is_serving  # (the unload watch must still see us)
        assert _wait(lambda: _restarted(engine, old_pid)), engine.dead_reason
        assert engine.stats.snapshot().engine_up
        assert _serves(engine, outputs, "after", prompts[4])
    finally:
        engine.shutdown(grace_s=0.0)


def test_past_the_restart_limit_the_stub_gives_up_and_says_so(tiny_model_dir, prompts):
    outputs = Collector()
    gave_up: list[str] = []
    done = threading.Event()

    def on_give_up(reason: str) -> None:
        gave_up.append(reason)
        done.set()

    config = _config(tiny_model_dir, engine_max_restarts=1, engine_restart_window_s=600.0)
    engine = AsyncLLM(config, outputs, core_mode="process", on_give_up=on_give_up)
    try:
        first_pid = _kill_core(engine)
        assert _wait(lambda: _restarted(engine, first_pid)), engine.dead_reason  # the one restart allowed
        _kill_core(engine)
        assert done.wait(RESTART_BOUND_S)
        assert "not restarted" in gave_up[0] and "engine_max_restarts 1" in gave_up[0]
        assert not engine.is_accepting and not engine.stats.snapshot().engine_up
        with pytest.raises(EngineDeadError, match="not restarted"):
            engine.add_request("late", prompts[0], greedy(2))
    finally:
        engine.shutdown(grace_s=0.0)


def test_stubs_sharing_a_killed_core_come_back_on_one_new_core(tiny_model_dir, prompts):
    config = _config(tiny_model_dir)
    name = f"test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    first_outputs, second_outputs = Collector(), Collector()
    first = AsyncLLM(config, first_outputs, core_mode="process", share_name=name)
    second = AsyncLLM(config, second_outputs, core_mode="process", share_name=name)
    try:
        second.add_request("long", prompts[0], greedy(4000, ignore_eos=True))
        assert _wait(lambda: bool(second_outputs.outputs.get("long")))
        old_pid = _kill_core(first)
        assert isinstance(second_outputs.wait_final("long").error, EngineCoreDiedError)
        owner = lambda: first if first.owns_core else second  # noqa: E731
        assert _wait(lambda: _restarted(owner(), old_pid) and first.is_serving and second.is_serving), (
            first.dead_reason,
            second.dead_reason,
        )
        assert [first.owns_core, second.owns_core].count(True) == 1  # one started it, one attached
        assert first.stats.snapshot().owns_core == first.owns_core
        assert _serves(first, first_outputs, "a", prompts[1])
        assert _serves(second, second_outputs, "b", prompts[2])
    finally:
        second.shutdown(grace_s=0.0)
        first.shutdown(grace_s=0.0)


def test_a_restart_that_fails_counts_and_the_next_attempt_serves(tiny_model_dir, prompts, tmp_path):
    """The core's interpreter (engine_python) is a script that exits 1 while a file exists: the
    first restart fails (counted: a longer backoff, the reason without details), the next serves."""
    broken = tmp_path / "broken"
    script = tmp_path / "python"
    script.write_text(f'#!/bin/sh\n[ -e "{broken}" ] && exit 1\nexec "{sys.executable}" "$@"\n')
    script.chmod(0o755)
    outputs = Collector()
    gave_up: list[str] = []
    config = _config(tiny_model_dir, engine_python=str(script), engine_max_restarts=2)
    engine = AsyncLLM(config, outputs, core_mode="process", on_give_up=gave_up.append)
    try:
        broken.touch()
        old_pid = _kill_core(engine)
        assert _wait(lambda: "could not be restarted" in (engine.dead_reason or "")), engine.dead_reason
        with pytest.raises(EngineDeadError, match="retry in a few seconds") as refused:
            engine.add_request("meanwhile", prompts[0], greedy(2))
        assert "the server log says why" in str(refused.value)
        broken.unlink()
        assert _wait(lambda: _restarted(engine, old_pid)), engine.dead_reason
        assert _serves(engine, outputs, "after", prompts[1]) and not gave_up
    finally:
        engine.shutdown(grace_s=0.0)
