"""StubWatch's decisions on made-up process listings and readiness answers (no server)."""

from __future__ import annotations

from paged_llm.launcher.stub_watch import StubInstance, StubWatch, parse_stub_cmdline

LLM = StubInstance("llm", "1", "llm_0_0")
TRT = StubInstance("llm_trtllm", "1", "llm_trtllm_0_0")


def stub_argv(model_py: str, instance: str) -> list[str]:
    return [
        "/cache/backends/python/triton_python_backend_stub", model_py, "triton_python_backend_shm_region_x",
        "1048576", "1048576", "1594", "/cache/backends/python", "336", instance, "DEFAULT",
    ]  # fmt: skip


def test_parse_stub_cmdline():
    assert parse_stub_cmdline(stub_argv("/repo/llm/1/model.py", "llm_0_0")) == LLM
    assert parse_stub_cmdline(["/usr/bin/python3", "-m", "paged_llm.engine.engine_core.process"]) is None
    assert parse_stub_cmdline(stub_argv("/repo/llm/1/model.py", "llm_0_0")[:5]) is None


class Fake:
    def __init__(self) -> None:
        self.stubs: dict[int, StubInstance] = {}
        self.ready: dict[StubInstance, bool | None] = {}

    def watch(self) -> StubWatch:
        return StubWatch(
            1, "http://x", lambda _pid: dict(self.stubs), lambda _url, stub: self.ready.get(stub)
        )


def test_a_stub_gone_under_a_ready_model_is_dead():
    fake = Fake()
    fake.stubs = {10: LLM, 11: TRT}
    fake.ready = {LLM: True, TRT: True}
    watch = fake.watch()
    assert watch.check() == []
    del fake.stubs[10]
    messages = watch.check()
    assert len(messages) == 1 and "llm_0_0" in messages[0] and "pid 10" in messages[0]
    assert watch.check() == []  # reported once


def test_unload_reload_and_an_unanswering_server_are_not_dead_stubs():
    fake = Fake()
    fake.stubs = {10: LLM, 11: TRT}
    fake.ready = {LLM: False, TRT: True}
    watch = fake.watch()
    watch.check()
    del fake.stubs[10]  # unloaded: the model is not ready
    assert watch.check() == []
    fake.stubs = {12: LLM, 11: TRT}  # loaded again: a new stub
    fake.ready[LLM] = True
    assert watch.check() == []
    fake.stubs = {13: LLM, 11: TRT}  # reloaded: new pid, same instance
    assert watch.check() == []
    fake.ready[TRT] = None  # the server does not answer (stopping): no verdict
    del fake.stubs[11]
    assert watch.check() == []


def test_a_stub_gone_while_the_server_did_not_answer_is_judged_once_it_answers():
    """A busy server's readiness check can time out: the dead stub must not be forgotten."""
    fake = Fake()
    fake.stubs = {10: LLM}
    fake.ready = {LLM: None}
    watch = fake.watch()
    watch.server_up = True  # seen ready
    watch.check()
    del fake.stubs[10]
    assert watch.check() == []  # no answer yet
    assert watch.check() == []
    fake.ready[LLM] = True
    messages = watch.check()
    assert len(messages) == 1 and "pid 10" in messages[0]
    assert watch.check() == []


def test_a_stub_that_vanishes_before_the_server_ever_answered_is_not_judged():
    """A loading server starts and ends stubs (model config completion) before it listens."""
    fake = Fake()
    fake.stubs = {10: LLM}
    fake.ready = {LLM: None}
    watch = fake.watch()
    watch.check()
    fake.stubs = {11: TRT}
    assert watch.check() == []
    fake.ready = {LLM: True, TRT: True}
    assert watch.check() == []
