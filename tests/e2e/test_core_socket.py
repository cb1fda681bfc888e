"""Issue 41 row 4 on a real tritonserver: with instance_group count 2 the llm instances share one
engine core, whose socket lets in the server's own stubs and nobody else (engine/attach_gate.py).
Each refused peer sends a frame that would create a file if the core unpickled it."""

from __future__ import annotations

import os

from paged_llm.engine.attach_gate import hello
from paged_llm.engine.share_files import ShareFiles
from tests.e2e.client import stream
from tests.e2e.metrics import wait_for
from tests.e2e.server import make_model_repository, start_server
from tests.integration.peers import NOBODY_UID, evil_frame, run_in_child, send_and_wait_for_close

REFUSED = "refused a connection to the engine core"


def test_only_the_servers_own_stubs_reach_the_shared_engine_core(tmp_path):
    repository = make_model_repository(tmp_path / "models", models=("llm",), instance_count=2)
    running = start_server(repository, tmp_path / "server.log")
    try:
        assert "attached to the shared engine core" in running.log()  # the second stub got in
        files = ShareFiles.for_name(f"{running.process.pid}/llm/1/0")  # as model.py names it
        marker = tmp_path / "unpickled"
        attack = evil_frame(marker)
        if os.geteuid() == 0:  # the directory keeps another uid out before the core sees it
            assert run_in_child(lambda: send_and_wait_for_close(files.socket, attack), uid=NOBODY_UID) == (
                "PermissionError"
            )
        # Our uid, even with the secret, but not a process of this server: refused by the core.
        with_secret = hello(files.read_secret()) + attack
        assert run_in_child(lambda: send_and_wait_for_close(files.socket, with_secret)) == "closed"
        assert send_and_wait_for_close(files.socket, attack) == "closed"
        assert wait_for(lambda: running.log().count(REFUSED) >= 2, 10)
        assert not marker.exists()
        result = stream(running.grpc_url, "still serving", sampling_parameters={"max_tokens": 4})
        assert result.errors == [] and result.finals == 1 and "".join(result.texts())
    finally:
        running.stop()
