"""Test model repositories and servers (the harness lives in paged_llm.testing.server_process)."""

from __future__ import annotations

from paged_llm.launcher.repository import make_model_repository
from paged_llm.testing.server_process import RunningServer, free_ports, start_server

__all__ = ["RunningServer", "free_ports", "make_model_repository", "start_server"]
