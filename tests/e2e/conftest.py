from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.server import RunningServer, make_model_repository, start_server


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir) -> Iterator[RunningServer]:
    """One tritonserver on the project's model repository (tiny model), shared by the e2e tests."""
    root = tmp_path_factory.mktemp("triton")
    repository = make_model_repository(root / "models")
    running = start_server(repository, root / "server.log")
    yield running
    running.stop()
