"""Compatibility tests run against the same kind of server as the end-to-end tests (its fixtures)."""

from tests.e2e.conftest import no_shared_memory_left_behind, no_stub_crashed, server

__all__ = ["no_shared_memory_left_behind", "no_stub_crashed", "server"]
