"""core_mode="auto": the engine core in its own process on an accelerator, stepped in-process on a CPU."""

from __future__ import annotations

import pytest
import torch

from paged_llm.config import EngineConfig
from paged_llm.engine.core_client import resolve_core_mode


@pytest.mark.parametrize("mode", ["process", "thread", "inprocess"])
def test_a_named_mode_is_kept(mode: str) -> None:
    assert resolve_core_mode(EngineConfig.from_parameters({"device": "cpu"}), mode) == mode


def test_auto_on_a_cpu_steps_the_core_in_process() -> None:
    assert resolve_core_mode(EngineConfig.from_parameters({"device": "cpu"}), "auto") == "inprocess"


def test_auto_on_cuda_runs_the_core_in_its_own_process(monkeypatch: pytest.MonkeyPatch) -> None:
    # Only the device probe is replaced: the rule reads the device the config would resolve to.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_core_mode(EngineConfig.from_parameters({"device": "auto"}), "auto") == "process"
    assert resolve_core_mode(EngineConfig.from_parameters({"device": "cuda"}), "auto") == "process"
