"""Test model repositories and servers (the tools live in paged_llm.tools.server_process)."""

from __future__ import annotations

from paged_llm.tools.server_process import RunningServer, free_ports, make_model_repository, start_server

__all__ = ["RunningServer", "free_ports", "make_model_repository", "start_server"]
