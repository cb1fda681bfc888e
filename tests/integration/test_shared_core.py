"""Several stubs (AsyncLLMs, as several Triton instances of one model) sharing one engine core
process (engine/engine_core/stub_links.py): routing, detaching, the core's owner stopping, and who may attach
(engine/attach_gate.py, engine/share_files.py)."""

from __future__ import annotations

import os
import stat
import threading
import uuid
from collections.abc import Iterator

import pytest

from paged_llm.config import CacheConfig, EngineConfig, ModelConfig, ServingConfig
from paged_llm.engine.async_llm import AsyncLLM
from paged_llm.engine.attach_gate import hello
from paged_llm.engine.core_process_client import AttachedCoreClient, ProcessCoreClient, connect_engine_core
from paged_llm.engine.share_files import ShareFiles
from paged_llm.errors import EngineDeadError, RequestAbortedError
from paged_llm.sampling_params import SamplingParams
from tests.integration.conftest import make_engine, run_to_completion
from tests.integration.peers import (
    NOBODY_UID,
    evil_frame,
    run_in_child,
    send_and_wait_for_close,
    wait_until,
)


class Collector:
    """on_outputs of one stub: every RequestOutput by request id."""

    def __init__(self) -> None:
        self.outputs: dict[str, list] = {}
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)

    def __call__(self, outputs) -> None:
        with self._changed:
            for output in outputs:
                self.outputs.setdefault(output.request_id, []).append(output)
            self._changed.notify_all()

    def wait_final(self, request_id: str, timeout_s: float = 60.0):
        with self._changed:
            assert self._changed.wait_for(
                lambda: any(o.finished for o in self.outputs.get(request_id, [])), timeout_s
            ), f"no final output for {request_id}"
            return [o for o in self.outputs[request_id] if o.finished][-1]

    def token_ids(self, request_id: str) -> list[int]:
        with self._lock:
            return [
                t for o in self.outputs[request_id] for s in o.sequences if s.index == 0 for t in s.token_ids
            ]


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


@pytest.fixture
def share_name() -> str:
    return f"test-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def stubs(tiny_model_dir, share_name) -> Iterator[tuple[AsyncLLM, Collector, AsyncLLM, Collector]]:
    config = EngineConfig(
        model=ModelConfig(model=str(tiny_model_dir), dtype="float32"), cache=CacheConfig(num_blocks=512)
    )
    name = share_name
    first_outputs, second_outputs = Collector(), Collector()
    first = AsyncLLM(config, first_outputs, core_mode="process", share_name=name)
    try:
        second = AsyncLLM(config, second_outputs, core_mode="process", share_name=name)
    except BaseException:
        first.shutdown(grace_s=0.0)
        raise
    try:
        yield first, first_outputs, second, second_outputs
    finally:
        second.shutdown(grace_s=0.0)
        first.shutdown(grace_s=0.0)


def test_stubs_share_one_core_and_each_gets_its_own_tokens(stubs, tiny_model_dir, prompts):
    first, first_outputs, second, second_outputs = stubs
    assert isinstance(first.client, ProcessCoreClient) and first.owns_core
    assert isinstance(second.client, AttachedCoreClient) and not second.owns_core
    assert second.client.request_id_prefix == "1:"
    reference = run_to_completion(make_engine(tiny_model_dir), prompts[:6], greedy(12))
    # The same request ids on both stubs: the core tells them apart by the attached prefix.
    for index in range(6):
        (first if index % 2 else second).add_request(f"r{index}", prompts[index], greedy(12))
        (second if index % 2 else first).add_request(f"r{index}", prompts[index], greedy(12))
    for index in range(6):
        for outputs in (first_outputs, second_outputs):
            final = outputs.wait_final(f"r{index}")
            assert final.error is None
            assert outputs.token_ids(f"r{index}") == reference[index][0].token_ids
    assert first.stats.snapshot().num_generation_tokens_total == 6 * 12
    assert second.stats.snapshot().num_generation_tokens_total == 6 * 12


def test_a_detaching_stub_has_its_requests_aborted_and_the_other_keeps_serving(stubs, prompts):
    first, first_outputs, second, second_outputs = stubs
    second.add_request("long", prompts[0], greedy(4000, ignore_eos=True))
    first.add_request("long", prompts[1], greedy(40, ignore_eos=True))
    second.shutdown(grace_s=0.0)
    final = second_outputs.wait_final("long")
    assert isinstance(final.error, RequestAbortedError)
    assert first_outputs.wait_final("long").error is None
    assert len(first_outputs.token_ids("long")) == 40
    first.add_request("after", prompts[2], greedy(5))
    assert first_outputs.wait_final("after").error is None
    with pytest.raises(EngineDeadError):
        second.add_request("late", prompts[2], greedy(5))
    # The detached stub's sequence left the core: nothing runs any more.
    first.add_request("probe", prompts[3], greedy(1))
    first_outputs.wait_final("probe")
    snapshot = first.stats.snapshot()
    assert snapshot.num_running == 0 and snapshot.num_waiting == 0


def test_the_owner_stopping_ends_the_attached_stubs_requests(stubs, prompts):
    first, _, second, second_outputs = stubs
    second.add_request("long", prompts[0], greedy(4000, ignore_eos=True))
    pause = threading.Event()
    while not second_outputs.outputs.get("long"):
        pause.wait(0.01)  # it runs
    first.shutdown(grace_s=0.0)
    final = second_outputs.wait_final("long")
    assert final.error is not None and final.sequences[0].finish_reason == "abort"
    for _ in range(1000):  # the stub notices that the core closed the link
        if second.dead_reason is not None:
            break
        pause.wait(0.01)
    assert "shared engine core closed" in (second.dead_reason or "")
    with pytest.raises(EngineDeadError):
        second.add_request("late", prompts[1], greedy(2))


def assert_both_serve(stubs, prompts, request_id: str) -> None:
    first, first_outputs, second, second_outputs = stubs
    for engine, outputs in ((first, first_outputs), (second, second_outputs)):
        engine.add_request(request_id, prompts[0], greedy(3))
        assert outputs.wait_final(request_id).error is None


@pytest.mark.skipif(os.geteuid() != 0, reason="running a peer as another uid needs root")
def test_a_foreign_uid_cannot_reach_the_shared_core_and_its_frame_is_never_unpickled(
    stubs, share_name, prompts, tmp_path
):
    files = ShareFiles.for_name(share_name)
    directory = files.prefix.parent.stat()
    assert stat.S_IMODE(directory.st_mode) == 0o700 and directory.st_uid == os.geteuid()
    assert stat.S_ISSOCK(files.socket.stat().st_mode)
    marker = tmp_path / "unpickled"
    attack = evil_frame(marker)
    assert run_in_child(lambda: send_and_wait_for_close(files.socket, attack), uid=NOBODY_UID) == (
        "PermissionError"
    )
    assert not marker.exists()
    assert_both_serve(stubs, prompts, "after a foreign peer")


def test_a_peer_without_the_secret_or_not_of_the_server_is_refused_and_the_core_keeps_serving(
    stubs, share_name, prompts, tmp_path
):
    files = ShareFiles.for_name(share_name)
    marker = tmp_path / "unpickled"
    # From the process that started the core, which the peer check lets pass: the secret decides.
    assert send_and_wait_for_close(files.socket, evil_frame(marker)) == "closed"
    # Our uid and the secret, but not the core's owner nor a child of a server (none here).
    with_secret = hello(files.read_secret()) + evil_frame(marker)
    assert run_in_child(lambda: send_and_wait_for_close(files.socket, with_secret)) == "closed"
    assert not marker.exists()
    assert_both_serve(stubs, prompts, "after refused peers")


def test_the_secret_of_a_killed_core_does_not_outlive_it(stubs, share_name):
    first = stubs[0]
    files = ShareFiles.for_name(share_name)
    killed_secret = files.read_secret()

    def gone_or_replaced() -> bool:
        try:
            return files.read_secret() != killed_secret  # a core started since has its own
        except FileNotFoundError:
            return True

    first.client.process.kill()  # SIGKILL: the core removes nothing itself
    assert wait_until(gone_or_replaced)


def test_a_shared_core_that_fails_to_start_leaves_no_share_files(tmp_path, share_name, tiny_model_dir):
    failing = {
        "could not start the engine core process": EngineConfig(
            model=ModelConfig(model=str(tiny_model_dir), dtype="float32"),
            serving=ServingConfig(engine_python=str(tmp_path / "no-such-python")),
        ),
        "no-such-model": EngineConfig(
            model=ModelConfig(model=str(tmp_path / "no-such-model"), dtype="float32")
        ),
    }
    files = ShareFiles.for_name(share_name)
    for expected, config in failing.items():
        with pytest.raises(Exception, match=expected):
            connect_engine_core(config, None, share_name)
        assert not files.lock.exists() and not files.secret.exists() and not files.socket.exists()
