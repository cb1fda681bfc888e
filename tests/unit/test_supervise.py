"""run_supervised's exit status for a child that ends on its own (a real child process, no server)."""

from __future__ import annotations

import os
import signal
import sys

import pytest

from paged_llm.launcher.supervise import run_supervised


def _child(code: str) -> list[str]:
    return [sys.executable, "-c", code]


@pytest.mark.parametrize("status", [0, 1, 7])
def test_a_child_that_exits_passes_its_status_on(status):
    command = _child(f"raise SystemExit({status})")
    assert run_supervised(command, dict(os.environ), exit_timeout_s=1.0) == status


def test_a_child_ended_by_a_signal_gives_128_plus_the_signal_and_says_so(capfd):
    """tritonserver 2.51 aborts (SIGABRT) when a stub dies holding its shared-memory lock: the
    launcher exits 134, as a shell would report it, not Popen's -6 wrapped around to 250."""
    code = "import os, signal; os.kill(os.getpid(), signal.SIGABRT)"
    assert run_supervised(_child(code), dict(os.environ), exit_timeout_s=1.0) == 128 + signal.SIGABRT
    assert "tritonserver was ended by SIGABRT" in capfd.readouterr().err


def test_the_callers_signal_handlers_are_back_afterwards():
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    run_supervised(_child("pass"), dict(os.environ), exit_timeout_s=1.0)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_the_restart_budget_allows_limit_restarts_per_window():
    from paged_llm.launcher.supervise import RestartBudget

    now = [0.0]
    budget = RestartBudget(limit=2, window_s=60.0, clock=lambda: now[0])
    assert budget.take()
    now[0] = 30.0
    assert budget.take()
    assert not budget.take()  # a third within 60 s
    now[0] = 59.0
    assert not budget.take()
    now[0] = 60.0  # the first has left the window
    assert budget.take() and budget.used == 2
    assert not RestartBudget(limit=0, window_s=1.0).take()
