"""run_supervised's exit status for a child that ends on its own (a real child process, no server)."""

from __future__ import annotations

import os
import signal
import sys

import pytest

from paged_llm.tools.supervise import run_supervised


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
