"""The Triton side of the requests in flight: turning RequestOutputs into responses on the request's
response sender, and cancellation polling.

AsyncLLM's output thread calls `on_outputs` once per pass with one RequestOutput per request that
has news. With `num_send_threads` threads (`response_send_threads`, 8 by default) it only adds the
output to the stream's accumulator and puts the stream (once) on its send thread's queue; that thread
builds the response from everything pending when it gets to the stream and sends it. A send is a
round trip to the server with the GIL released, so several in flight keep streamed responses small
(config.py: ServingConfig gives the figures), and a send thread that lags behind a stream sends it one
larger response instead of a queue of one-token ones that each wait their turn. With 0 the output
thread builds and sends the responses itself.

A sender is touched under its stream's lock, and never once the FINAL response is out (`closed`):
Triton frees the request's response factory with the FINAL, and is_cancelled() on it afterwards
crashes tritonserver 2.51 (TRITONBACKEND_ResponseFactoryIsCancelled).

No `triton_python_backend_utils` import here: llm_model.py passes the module in.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from paged_llm.engine.outputs import RequestOutput
from paged_llm.engine.stats import EngineStats
from paged_llm.errors import (
    EngineDeadError,
    InvalidRequestError,
    QueueFullError,
    RequestAbortedError,
    SessionNotFoundError,
    wire_text,
)
from paged_llm.triton_model.cancel_pacing import CancelPollPacing
from paged_llm.triton_model.response_accumulator import Response, ResponseAccumulator
from paged_llm.triton_model.triton_codec import FORWARDED_ERROR_OUTPUT, encode_forwarded_error

logger = logging.getLogger(__name__)
# vllm_backend's log lines for a request its client cancelled (its tests and log-based alerts look
# for them): written when the cancellation is seen and when the CANCELLED final has gone out.
CANCELLING_LOG_LINE = "[vllm] Cancelling the request"
CANCELLED_LOG_LINE = "[vllm] Successfully cancelled the request"
AbortFn = Callable[[str, BaseException], None]


def error_code(pb_utils: Any, error: BaseException) -> tuple[Any, str]:
    """Triton status code for an error, and its label in paged_llm_final_responses_total."""
    if isinstance(error, InvalidRequestError):
        return pb_utils.TritonError.INVALID_ARG, "invalid_arg"
    if isinstance(error, QueueFullError | EngineDeadError):
        return pb_utils.TritonError.UNAVAILABLE, "unavailable"
    if isinstance(error, RequestAbortedError):
        return pb_utils.TritonError.CANCELLED, "cancelled"
    if isinstance(error, SessionNotFoundError):
        return pb_utils.TritonError.NOT_FOUND, "not_found"
    return pb_utils.TritonError.INTERNAL, "internal"  # EngineStepError (a model fault, a dead core)


@dataclass
class Stream:
    """One in-flight Triton request."""

    request_id: str
    sender: Any  # pb_utils.InferenceResponseSender
    accumulator: ResponseAccumulator
    cancelled: bool = False  # the client cancelled: no more data, one CANCELLED final
    closed: bool = False  # the FINAL response went out (or is going out)
    lock: threading.Lock = field(default_factory=threading.Lock)
    triton_request_id: str = ""  # the id the client gave the request (llm_trtllm: for its aborts)
    errors_as_output: bool = False  # its error goes as FORWARDED_ERROR_OUTPUT (triton_codec.py)
    queued: bool = False  # on its send thread's queue: that thread takes what is pending when it gets there


@dataclass
class _Outgoing:
    stream: Stream
    response: Any  # pb_utils.InferenceResponse (None for an error final)
    flags: int
    num_tokens: int  # streamed tokens in it, for the tokens-per-response histogram
    error: BaseException | None = None  # an error FINAL: sent by send_error, after the data before it


class ResponseStreams:
    def __init__(
        self, pb_utils: Any, metrics: Any, stats: EngineStats, abort: AbortFn, num_send_threads: int = 0
    ) -> None:
        """`num_send_threads` 0: the output thread builds and sends the responses; N: N threads do
        (a stream always through the same one, so its responses keep their order)."""
        self._pb = pb_utils
        self._metrics = metrics
        self._stats = stats
        self._abort = abort
        self._streams: dict[str, Stream] = {}
        self._lock = threading.Lock()
        self._cancel_pacing = CancelPollPacing()
        self._send_queues: list[queue.SimpleQueue[Stream | None]] = [
            queue.SimpleQueue() for _ in range(num_send_threads)
        ]
        self._send_threads = [
            threading.Thread(target=self._send_loop, args=(q,), name=f"paged_llm-send-{i}", daemon=True)
            for i, q in enumerate(self._send_queues)
        ]
        for thread in self._send_threads:
            thread.start()

    # ----------------------------------------------------------------------------- any thread
    def open(
        self,
        request_id: str,
        sender: Any,
        accumulator: ResponseAccumulator,
        triton_request_id: str = "",
        errors_as_output: bool = False,
    ) -> Stream:
        stream = Stream(
            request_id,
            sender,
            accumulator,
            triton_request_id=triton_request_id,
            errors_as_output=errors_as_output,
        )
        with self._lock:
            self._streams[request_id] = stream
        return stream

    def find_by_triton_request_id(self, triton_request_id: str) -> Stream | None:
        """The open stream of the request the client gave that id (a scan: aborts are rare)."""
        with self._lock:
            return next((s for s in self._streams.values() if s.triton_request_id == triton_request_id), None)

    def fail(self, stream: Stream, error: BaseException) -> None:
        """Ends a stream that never reached the engine. Its error final is transmitted here, on the
        caller's thread, by the same code as every other final: nothing of the stream can be queued
        on a send thread yet, and the caller (Triton's execute) must not return before it is out."""
        with stream.lock:
            if stream.closed:
                return
            self._close(stream)
        self._transmit(_Outgoing(stream, None, 0, 0, error))

    def send_error(
        self, sender: Any, error: BaseException, as_output: bool = False, counted: bool = True
    ) -> bool:
        """An error as the request's FINAL response (for a sender that has no Stream, too). To
        llm_trtllm and clients that ask (`as_output`) it goes as an ordinary response holding
        FORWARDED_ERROR_OUTPUT: Triton 2.51's BLS loses an error response that follows data, and its
        gRPC stream loses the status code (triton_codec.py)."""
        code, label = error_code(self._pb, error)
        if counted:
            self._metrics.count_final(label)
        if as_output:
            tensor = self._pb.Tensor(FORWARDED_ERROR_OUTPUT, encode_forwarded_error(label, str(error)))
            response = self._pb.InferenceResponse(output_tensors=[tensor])
        else:
            response = self._pb.InferenceResponse(error=self._pb.TritonError(wire_text(str(error)), code))
        try:
            sender.send(response, flags=self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as send_error:  # the client may be gone already
            logger.info("could not send an error response: %s", send_error)
            return False
        return True

    @property
    def num_open(self) -> int:
        return len(self._streams)

    # ------------------------------------------------------------------------- output thread
    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if not self._send_queues:
                stream.accumulator.add(output)
                self._send_pending(stream)
                continue
            with stream.lock:
                stream.accumulator.add(output)
                if stream.queued:  # its send thread has not taken what was pending yet
                    continue
                stream.queued = True
            self._send_queues[hash(stream.request_id) % len(self._send_queues)].put(stream)

    def _send_pending(self, stream: Stream) -> None:
        """Sends what the stream has pending: one response, several when more than max_merged_steps
        are waiting (on the thread that calls: the output thread, or the stream's send thread)."""
        while True:
            outgoing, more = self._next_response(stream)
            if outgoing is None:
                return
            # A failed send marks the stream cancelled: what is still pending is then dropped, but
            # its final (already here when more than max_merged_steps were waiting) must still go.
            self._transmit(outgoing)
            if not more:
                return

    def _next_response(self, stream: Stream) -> tuple[_Outgoing | None, bool]:
        """The stream's next response, built from everything pending (up to max_merged_steps), and
        whether more is pending after it."""
        with stream.lock:
            stream.queued = False
            if stream.closed:
                return None, False
            response = stream.accumulator.take(discard_data=stream.cancelled)
            if response is None:
                return None, False
            if response.is_final:
                self._close(stream)
                if stream.cancelled and response.error is None:  # finished before the abort landed
                    response = Response(None, True, RequestAbortedError("cancelled by the client"))
            more = not response.is_final and stream.accumulator.has_pending
        # Built and sent outside the lock, so the cancellation poller never waits on a send.
        if response.error is not None:
            return _Outgoing(stream, None, 0, 0, response.error), False
        pb = self._pb
        tensors = [pb.Tensor(name, array) for name, array in response.tensors.items()]
        if response.is_final:
            self._metrics.count_final("success")
        outgoing = _Outgoing(
            stream,
            pb.InferenceResponse(output_tensors=tensors),
            pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if response.is_final else 0,
            response.num_tokens if stream.accumulator.parsed.stream else 0,
        )
        return outgoing, more

    def _send_loop(self, inbox: queue.SimpleQueue[Stream | None]) -> None:
        while (stream := inbox.get()) is not None:
            self._send_pending(stream)

    def _transmit(self, outgoing: _Outgoing) -> None:
        """The round trip to the server (it releases the GIL). A failed send of data cancels the stream."""
        stream = outgoing.stream
        if outgoing.flags or outgoing.error is not None:
            # The request's counters first: a client that reads /metrics once it has its last
            # response finds the request counted. Its histograms too when no other stream is open
            # (this stub goes idle): waiting for them here with streams open holds up their tokens.
            self._metrics.before_final(wait_for_histograms=not self._streams)
        if outgoing.error is not None:
            sent = self.send_error(stream.sender, outgoing.error, stream.errors_as_output)
            if sent and stream.cancelled and isinstance(outgoing.error, RequestAbortedError):
                logger.info("%s (request %s)", CANCELLED_LOG_LINE, stream.request_id)
            return
        try:
            stream.sender.send(outgoing.response, flags=outgoing.flags)
        except Exception as send_error:  # the client went away: stop generating for it
            if outgoing.flags:  # the final itself: nothing is left to stop
                logger.info(
                    "request %s: the final response could not be sent (%s)", stream.request_id, send_error
                )
                return
            with stream.lock:
                newly_cancelled = not stream.cancelled and not stream.closed
                stream.cancelled = True
                if newly_cancelled:
                    logger.info(
                        "%s (request %s: a send failed, %s)",
                        CANCELLING_LOG_LINE,
                        stream.request_id,
                        send_error,
                    )
            if newly_cancelled:
                self._abort(
                    stream.request_id, RequestAbortedError(f"response could not be sent ({send_error})")
                )
            return
        if outgoing.num_tokens:
            self._stats.on_streamed_response(outgoing.num_tokens)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Sends what is queued, then stops the send threads (if any)."""
        for inbox in self._send_queues:
            inbox.put(None)
        for thread in self._send_threads:
            thread.join(timeout=timeout_s)

    def _close(self, stream: Stream) -> None:
        """Call with stream.lock held: the FINAL goes out next; nothing may touch the sender after."""
        stream.closed = True
        with self._lock:
            self._streams.pop(stream.request_id, None)

    # ------------------------------------------------------------------------------ housekeeping
    def poll_cancellations(self) -> float:
        """Asks every open stream whether its client cancelled; returns the seconds until the next
        poll should start (triton_model/cancel_pacing.py)."""
        start = time.monotonic()
        num_checks = 0
        with self._lock:
            streams = [s for s in self._streams.values() if not s.cancelled]
        for stream in streams:
            with stream.lock:
                if stream.closed or stream.cancelled:
                    continue
                try:
                    cancelled = stream.sender.is_cancelled()
                except Exception:  # a sender that cannot answer belongs to a request Triton dropped
                    cancelled = True
                num_checks += 1
                if cancelled:  # logged before the output thread can send the CANCELLED final
                    logger.info(
                        "%s (request %s: its client cancelled)", CANCELLING_LOG_LINE, stream.request_id
                    )
                stream.cancelled = cancelled
            if cancelled:
                self._abort(stream.request_id, RequestAbortedError("cancelled by the client"))
        elapsed = time.monotonic() - start
        self._stats.on_cancellation_poll(num_checks, elapsed)
        return self._cancel_pacing.next_interval_s(elapsed, num_checks, len(self._streams))
