"""ResponseStreams with send threads: a stream's send thread takes whatever is pending when it gets to
the stream, so a sender that lags sends fewer, larger responses instead of a queue of one-token ones,
and each stream's responses keep their order with exactly one FINAL.

pb_utils and the response senders are recorders here (unit level); tests/e2e stream through a real
tritonserver."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from paged_llm.engine.outputs import RequestOutput, SequenceDelta
from paged_llm.engine.stats import EngineStats
from paged_llm.errors import EngineStepError
from paged_llm.sampling_params import RequestLimits
from paged_llm.triton_model.response_accumulator import ResponseAccumulator
from paged_llm.triton_model.response_streams import ResponseStreams
from paged_llm.triton_model.triton_codec import parse_request

FINAL = 1


class _Response:
    def __init__(self, output_tensors: list[Any] | None = None, error: Any = None) -> None:
        self.tensors = {t.name: t.array for t in output_tensors or []}
        self.error = error


class _TritonError:
    INVALID_ARG, UNAVAILABLE, CANCELLED, NOT_FOUND, INTERNAL = range(5)

    def __init__(self, message: str, code: int | None = None) -> None:
        self.message, self.code = message, code


PB = SimpleNamespace(
    Tensor=lambda name, array: SimpleNamespace(name=name, array=array),
    InferenceResponse=_Response,
    TritonError=_TritonError,
    TRITONSERVER_RESPONSE_COMPLETE_FINAL=FINAL,
)


class _Metrics:
    def count_final(self, code: str) -> None:
        pass

    def __init__(self) -> None:
        self.waits: list[bool] = []  # per final: whether it waited for the histograms

    def before_final(self, wait_for_histograms: bool) -> None:
        self.waits.append(wait_for_histograms)


class _Sender:
    """Records (token ids, flags) per send; a send waits while `gate` is clear (a lagging server)."""

    def __init__(self, fail_at_send: int | None = None) -> None:
        self.sent: list[tuple[list[int] | str, int]] = []  # an error final: (its message, FINAL)
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.done = threading.Event()
        self.fail_at_send = fail_at_send  # this send (0-based) raises: the client went away
        self.num_sends = 0

    def send(self, response: _Response, flags: int = 0) -> None:
        self.entered.set()
        self.gate.wait(timeout=30)
        self.num_sends += 1
        if self.num_sends - 1 == self.fail_at_send:
            raise RuntimeError("the client is gone")
        if response.error is not None:
            self.sent.append((response.error.message, flags))
        else:
            self.sent.append((response.tensors["output_ids"].tolist(), flags))
        if flags == FINAL:
            self.done.set()

    def is_cancelled(self) -> bool:
        return False


def _streams(num_send_threads: int, metrics: _Metrics | None = None) -> ResponseStreams:
    return ResponseStreams(PB, metrics or _Metrics(), EngineStats(), lambda *_: None, num_send_threads)


def _open(streams: ResponseStreams, request_id: str, sender: _Sender | None = None) -> _Sender:
    inputs = {"text_input": np.array([b"p"], dtype=np.object_), "stream": np.array([True])}
    parsed = parse_request(inputs, None, RequestLimits())
    sender = sender or _Sender()
    streams.open(request_id, sender, ResponseAccumulator(parsed, "p", 1, max_merged_steps=16))
    return sender


def _token(request_id: str, token_id: int, finished: bool = False) -> RequestOutput:
    delta = SequenceDelta(0, str(token_id), [token_id], None, None, token_id, "length" if finished else None)
    return RequestOutput(request_id, 1, [delta], finished)


def _run_behind_a_blocked_send(
    streams: ResponseStreams, sender: _Sender, first: RequestOutput, later: list[RequestOutput]
) -> None:
    """`first` goes into a send the server holds; `later` arrive meanwhile; then the server answers.
    Returns once the stream's final is out and the send threads have stopped."""
    sender.gate.clear()
    streams.on_outputs([first])
    assert sender.entered.wait(timeout=30)  # the first response is in its (blocked) send
    for output in later:
        streams.on_outputs([output])
    sender.gate.set()
    assert sender.done.wait(timeout=30)
    streams.stop()


@pytest.mark.parametrize("num_send_threads", [1, 3])
def test_a_lagging_sender_gets_the_tokens_that_waited_in_one_response(num_send_threads: int):
    streams = _streams(num_send_threads)
    sender = _open(streams, "r")
    later = [_token("r", token_id) for token_id in range(2, 6)] + [_token("r", 6, finished=True)]
    _run_behind_a_blocked_send(streams, sender, _token("r", 1), later)
    assert sender.sent == [([1], 0), ([2, 3, 4, 5, 6], FINAL)]
    assert streams.num_open == 0


def test_streams_on_one_send_thread_keep_their_order_and_one_final_each():
    streams = _streams(2)
    senders = {f"r{i}": _open(streams, f"r{i}") for i in range(6)}
    for step in range(1, 41):
        streams.on_outputs([_token(request_id, step, finished=step == 40) for request_id in senders])
    for sender in senders.values():
        assert sender.done.wait(timeout=30)
    streams.stop()
    for sender in senders.values():
        tokens = [t for ids, _ in sender.sent for t in ids]
        assert tokens == list(range(1, 41))
        assert [flags for _, flags in sender.sent].count(FINAL) == 1 and sender.sent[-1][1] == FINAL


def test_without_send_threads_a_sender_that_keeps_up_gets_one_response_per_step():
    streams = _streams(0)
    sender = _open(streams, "r")
    for token_id in range(1, 4):
        streams.on_outputs([_token("r", token_id, finished=token_id == 3)])
    assert sender.sent == [([1], 0), ([2], 0), ([3], FINAL)]


def test_only_the_last_final_in_flight_waits_for_the_histograms():
    """A final that waits blocks its send thread: with other streams open their tokens would wait too
    (10-40 ms gaps at 16 streams on an H100). The last one waits, so /metrics read after a client's
    last response has every request's histograms."""
    metrics = _Metrics()
    streams = _streams(0, metrics)
    for request_id in ("a", "b", "c"):
        _open(streams, request_id)
    streams.on_outputs([_token("a", 1, finished=True), _token("b", 1)])
    streams.on_outputs([_token("b", 2, finished=True), _token("c", 1, finished=True)])
    assert metrics.waits == [False, False, True]


def test_data_that_waited_goes_out_before_an_error_final():
    streams = _streams(1)
    sender = _open(streams, "r")
    error = RequestOutput("r", 1, [], True, EngineStepError("the step failed"))
    _run_behind_a_blocked_send(streams, sender, _token("r", 1), [_token("r", 2), _token("r", 3), error])
    assert sender.sent == [([1], 0), ([2, 3], 0), ("the step failed", FINAL)]


def test_a_failed_send_still_lets_the_final_out_when_it_waited_past_the_merge_limit():
    """The client went away while 19 steps waited, the last one final: the engine has nothing more
    to say about the request, so only the send thread can close it."""
    streams = _streams(1)
    sender = _open(streams, "r", _Sender(fail_at_send=1))
    later = [_token("r", token_id) for token_id in range(1, 18)] + [_token("r", 18, finished=True)]
    _run_behind_a_blocked_send(streams, sender, _token("r", 0), later)
    assert sender.sent[0] == ([0], 0) and sender.sent[-1] == ("cancelled by the client", FINAL)
    assert len(sender.sent) == 2 and streams.num_open == 0
