from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from paged_llm.tools.server_process import remove_orphaned_shm_regions
from tests.e2e.server import RunningServer, make_model_repository, start_server


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir) -> Iterator[RunningServer]:
    """One tritonserver on the project's model repository (tiny model), shared by the e2e tests."""
    root = tmp_path_factory.mktemp("triton")
    repository = make_model_repository(root / "models")
    running = start_server(repository, root / "server.log")
    yield running
    running.stop()


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_left_behind() -> Iterator[None]:
    """Servers that tests kill with SIGKILL cannot remove their Python-backend shared memory: after
    the session, remove the regions touched during it that no process uses any more."""
    started = time.time() - 1.0
    yield
    remove_orphaned_shm_regions(changed_since=started)
