"""The engine core's side of its stubs: one that started it, and any that attached later.

Triton's Python backend sends a model instance's responses from that instance's stub process, and
one stub sends at most ~7,000-8,000 responses/s (measured on an H100 host: at 64 streams and
~15k tok/s the responses carried 2 tokens each; with two instances, 1.0-1.1). So several instances
of the `llm` model (`instance_group { count: N }`) share one engine core on a device: the first one
starts the core process with a listening socket (engine/core_process_client.py: `connect_engine_core`),
the others connect to it, and each that the gate lets in (only processes of the same server that
hold the share's secret) is a stub with its own requests:

    stub 0 (started the core) ──socketpair────────────────┐
    stub 1 ───────unix socket──> gate (attach_gate.py) ──┐ │
    stub 2 ───────unix socket──> gate ───────────────────┼─┴─> inbox ─> busy loop ─> publish(outputs)
                                                         │                              │ by request id
                                                         └────────── frames <───────────┘

An attached stub's request ids start with "<stub_id>:" (stub 0's have no colon),
which is all the routing needs: each step's outputs are split by that prefix, and a stub
gets a frame only when it has news (stub 0 gets every step's, with the scheduler stats).
A stub that detaches (Shutdown) or goes away (EOF) has its requests aborted; the core stops
only when stub 0 asks (it is the core's parent).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from dataclasses import replace

from paged_llm.engine.attach_gate import AttachGate
from paged_llm.engine.core_types import (
    AbortRequest,
    AbortStub,
    AttachStub,
    CoreInput,
    EngineCoreInfo,
    EngineCoreOutputs,
    EngineCoreRequest,
    Shutdown,
    StubAttached,
    UtilityCall,
)
from paged_llm.engine.ipc import FramedSocket, encode_frame

logger = logging.getLogger(__name__)
ATTACH_TIMEOUT_S = 10.0  # a connection that does not say AttachStub by then is dropped
_FIRST_FORWARDED_CALL_ID = 1 << 40  # utility calls of attached stubs, renumbered above this


def stub_of(request_id: str) -> int:
    """0 for the stub that started the core, N for request ids "N:..."."""
    prefix, colon, _ = request_id.partition(":")
    return int(prefix) if colon and prefix.isdigit() else 0


def split_outputs(
    outputs: EngineCoreOutputs, call_routes: dict[int, tuple[int, int]]
) -> dict[int, EngineCoreOutputs]:
    """One EngineCoreOutputs per stub that has news in `outputs` (stub 0 always gets one:
    it carries the step's scheduler stats). `call_routes`: the core's utility call id -> (stub, that
    stub's own call id); calls not in it are stub 0's."""

    parts: dict[int, EngineCoreOutputs] = {}

    def part(stub: int) -> EngineCoreOutputs:
        found = parts.get(stub)
        if found is None:
            found = parts[stub] = EngineCoreOutputs(
                scheduler_stats=outputs.scheduler_stats,
                session_stats=outputs.session_stats,
                num_step_faults=outputs.num_step_faults,
                gc_pauses=outputs.gc_pauses,
                num_steps=outputs.num_steps,
                step_times=outputs.step_times,
            )
        return found

    # Stub 0 reports the core's structured output counters (its compile times once).
    part(0).structured_output_stats = outputs.structured_output_stats
    for row, request_id in enumerate(outputs.request_ids):
        target = part(stub_of(request_id))
        logprobs = outputs.logprobs.get(row)
        if logprobs is not None:
            target.logprobs[target.num_rows] = logprobs
        target.request_ids.append(request_id)
        target.seq_indices.append(outputs.seq_indices[row])
        target.new_token_ids.append(outputs.new_token_ids[row])
    for finished in outputs.finished_sequences:
        part(stub_of(finished.request_id)).finished_sequences.append(finished)
    for request in outputs.finished_requests:
        part(stub_of(request.request_id)).finished_requests.append(request)
    for request_id, num_dropped in outputs.history_truncated.items():
        part(stub_of(request_id)).history_truncated[request_id] = num_dropped
    for call_id, result in outputs.utility_results.items():
        stub, own_call_id = call_routes.get(call_id, (0, call_id))
        part(stub).utility_results[own_call_id] = result
    return parts


class LinkPublisher:
    """Sends frames to one stub without blocking the busy loop: a non-blocking send, and only
    what does not fit in the socket buffer (the stub is behind) goes to a writer thread, with
    later frames queued behind it in order."""

    def __init__(self, link: FramedSocket) -> None:
        self._link = link
        self._lock = threading.Lock()
        self._num_queued = 0  # frames (or frame tails) handed to the writer and not yet sent
        self._queue: queue.SimpleQueue[bytes | memoryview | None] = queue.SimpleQueue()
        self.broken = False
        self._writer = threading.Thread(target=self._write, name="paged_llm-core-out", daemon=True)
        self._writer.start()

    def publish(self, outputs: EngineCoreOutputs) -> None:
        if self.broken:
            return  # the stub is gone; its reader sees EOF
        frame: bytes | memoryview = encode_frame(outputs)
        with self._lock:
            if self._num_queued == 0:
                try:
                    num_sent = self._link.send_bytes_nowait(frame)
                except OSError:
                    self.broken = True
                    return
                if num_sent == len(frame):
                    return
                frame = memoryview(frame)[num_sent:]
            self._num_queued += 1
        self._queue.put(frame)

    def close(self, timeout_s: float) -> None:
        self._queue.put(None)
        self._writer.join(timeout=timeout_s)

    def _write(self) -> None:
        while (frame := self._queue.get()) is not None:
            try:
                self._link.send_bytes(frame)
            except OSError:
                self.broken = True
            with self._lock:
                self._num_queued -= 1


class StubLinks:
    """Every stub of one core: `publish` routes a step's outputs; `accept_from` serves a
    listening socket on which further stubs attach (started once the core is ready)."""

    def __init__(
        self, first: FramedSocket, inbox: queue.SimpleQueue[CoreInput], info: EngineCoreInfo
    ) -> None:
        self._inbox = inbox
        self._info = info
        self._first = LinkPublisher(first)
        self._attached: dict[int, LinkPublisher] = {}
        self._call_routes: dict[int, tuple[int, int]] = {}  # see split_outputs
        self._lock = threading.Lock()
        self._stub_ids = itertools.count(1)
        self._call_id_counter = itertools.count(_FIRST_FORWARDED_CALL_ID)

    # ---------------------------------------------------------------------------- busy loop
    def publish(self, outputs: EngineCoreOutputs) -> None:
        if not self._attached:  # one stub: no splitting
            self._first.publish(outputs)
            return
        with self._lock:
            attached = dict(self._attached)
            parts = split_outputs(outputs, self._call_routes)
            for call_id in outputs.utility_results:
                self._call_routes.pop(call_id, None)
        for stub, part in parts.items():
            publisher = self._first if stub == 0 else attached.get(stub)
            if publisher is not None:
                publisher.publish(part)

    def close(self, timeout_s: float) -> None:
        with self._lock:
            publishers = [self._first, *self._attached.values()]
        for publisher in publishers:
            publisher.close(timeout_s)

    # ------------------------------------------------------------------ attached stubs
    def accept_from(self, gate: AttachGate) -> None:
        """Stubs that the gate let in (engine/attach_gate.py) attach from now on."""
        gate.serve_with(self._serve)

    def _serve(self, link: FramedSocket) -> None:
        """One attached stub: handshake, then its inputs until it detaches or goes away."""
        try:
            hello = link.recv(ATTACH_TIMEOUT_S)
        except (EOFError, OSError):
            hello = None
        if not isinstance(hello, AttachStub):
            logger.warning("dropped a connection to the engine core that did not attach (%r)", hello)
            link.close()
            return
        stub_id = next(self._stub_ids)
        prefix = f"{stub_id}:"
        publisher = LinkPublisher(link)
        try:
            link.send(StubAttached(self._info, stub_id))
        except OSError:
            link.close()
            return
        with self._lock:
            self._attached[stub_id] = publisher
        logger.info("stub %d (pid %d) attached to the engine core", stub_id, hello.pid)
        reason = "the stub detached"
        try:
            while True:
                item = link.recv()
                if isinstance(item, Shutdown):
                    break
                forwarded = self._check(item, stub_id, prefix)
                if forwarded is not None:
                    self._inbox.put(forwarded)
        except (EOFError, OSError) as error:
            reason = f"the stub went away ({error})"
        with self._lock:
            self._attached.pop(stub_id, None)
        self._inbox.put(AbortStub(prefix, reason))
        publisher.close(timeout_s=1.0)
        link.close()
        logger.info("stub %d left the engine core: %s", stub_id, reason)

    def _check(self, item: object, stub_id: int, prefix: str) -> CoreInput | None:
        """What an attached stub may send, with its utility call ids renumbered."""
        if isinstance(item, EngineCoreRequest | AbortRequest):
            if item.request_id.startswith(prefix):
                return item
            logger.error("stub %d sent request id %r without its prefix", stub_id, item.request_id)
            return None
        if isinstance(item, UtilityCall):
            call_id = next(self._call_id_counter)
            with self._lock:
                self._call_routes[call_id] = (stub_id, item.call_id)
            return replace(item, call_id=call_id)
        logger.error("stub %d sent an unexpected %s", stub_id, type(item).__name__)
        return None
