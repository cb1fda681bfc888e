"""GrammarCompiler: compiles constraints off the engine core's step loop and keeps the compiled
grammars (an LRU of `cache_entries`, keyed by kind, text and whitespace mode).

Two routes, by the constraint's size:
- up to `inprocess_max_bytes` (a typical schema, regex or choice list): on a thread of this process
  (xgrammar releases the GIL and spreads the work over `compile_threads`), as vLLM does. A 10-property
  schema compiles in tens of ms; moving it between processes would cost more than the compile (its
  serialized form is ~1 MB). A compile past `timeout_s` fails its request, and its thread is left
  to finish; while such a thread still runs, every compile takes the second route.
- larger ones, and everything while an abandoned thread runs: in worker processes (compile_worker.py),
  `num_workers` of them, started with the first such job. One that overruns `timeout_s` is killed
  (a thread can only be abandoned: a 1 MB schema took minutes, burning a core) and replaced.
The xgrammar tokenizer info is built once, at the first compile, and sent to each worker as it starts.

The core asks `cached(key)` first, `submit(key)` on a miss, and collects `take_results()` between
steps; `on_done` tells it (from a compiling thread) that a result is waiting.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import xgrammar

from paged_llm.processes import parent_death_signal, spawn_module
from paged_llm.structured_output.compile import attempt_compile, error_text

logger = logging.getLogger(__name__)
WORKER_MODULE = "paged_llm.structured_output.compile_worker"
WORKER_START_TIMEOUT_S = 300.0  # imports torch and xgrammar; slow on a loaded 2-core machine

GrammarKey = tuple[str, str, bool]  # kind, spec, any_whitespace


@dataclass
class CompileResult:
    key: GrammarKey
    grammar: xgrammar.CompiledGrammar | None  # None: `error` says why
    error: str | None
    seconds: float  # from the job's start in a worker to its result (the compile alone when it ran)
    timed_out: bool = False
    error_field: str | None = None  # where in the constraint the error is, when the check knows


class GrammarCompiler:
    def __init__(
        self,
        tokenizer_info: Callable[[], xgrammar.TokenizerInfo],
        num_workers: int,
        timeout_s: float,
        cache_entries: int,
        on_done: Callable[[], None] = lambda: None,
        inprocess_max_bytes: int = 16384,
        compile_threads: int = 8,
    ) -> None:
        self._make_tokenizer_info = tokenizer_info
        self._info: xgrammar.TokenizerInfo | None = None
        self._info_json: str | None = None
        self._info_lock = threading.Lock()
        self.timeout_s = timeout_s
        self.cache_entries = cache_entries
        self.on_done = on_done
        self._cache: collections.OrderedDict[GrammarKey, xgrammar.CompiledGrammar] = collections.OrderedDict()
        self._lock = threading.Lock()  # the cache and the results
        self._results: list[CompileResult] = []
        self._results_ready = threading.Condition(self._lock)
        self._jobs: queue.SimpleQueue[GrammarKey | None] = queue.SimpleQueue()
        self._num_workers = num_workers
        self._threads: list[threading.Thread] = []
        self._processes: dict[int, subprocess.Popen] = {}  # dispatcher index -> its live worker
        self._closed = False
        self.inprocess_max_bytes = inprocess_max_bytes
        self.compile_threads = max(1, min(compile_threads, os.cpu_count() or 1))
        self._local_jobs: queue.SimpleQueue[GrammarKey | None] = queue.SimpleQueue()
        self._local_threads: list[threading.Thread] = []
        self._local_compiler: xgrammar.GrammarCompiler | None = None
        self._num_abandoned = 0  # in-process compiles past the cap, still running

    # ----------------------------------------------------------------------------- the core's side
    @property
    def tokenizer_info(self) -> xgrammar.TokenizerInfo:
        """Built on first use (the tokenizer load takes a second or two)."""
        with self._info_lock:
            if self._info is None:
                started = time.perf_counter()
                self._info = self._make_tokenizer_info()
                logger.info("xgrammar tokenizer info built in %.2f s", time.perf_counter() - started)
            return self._info

    def cached(self, key: GrammarKey) -> xgrammar.CompiledGrammar | None:
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
            return grammar

    def submit(self, key: GrammarKey) -> None:
        """Compiles `key` (on a thread here or in a worker process: the module docstring); its
        CompileResult comes from take_results(). The caller submits a key once however many
        requests wait for it."""
        assert not self._closed, "the grammar compiler is closed"
        with self._lock:
            local = len(key[1].encode()) <= self.inprocess_max_bytes and self._num_abandoned == 0
        if local:
            self._start_threads(self._local_threads, self._dispatch_local, "paged_llm-grammar-local")
            self._local_jobs.put(key)
        else:  # the first such job starts every worker, so none starts under a later job
            self._start_threads(self._threads, self._dispatch, "paged_llm-grammar")
            self._jobs.put(key)

    def _start_threads(
        self, threads: list[threading.Thread], target: Callable[[int], None], name: str
    ) -> None:
        if threads:
            return
        for index in range(self._num_workers):
            thread = threading.Thread(target=target, args=(index,), name=f"{name}-{index}", daemon=True)
            threads.append(thread)
            thread.start()

    def take_results(self) -> list[CompileResult]:
        with self._lock:
            results, self._results = self._results, []
            return results

    def wait_for_results(self, timeout_s: float) -> bool:
        """Blocks until a result waits (or `timeout_s` passed); True if one does."""
        with self._results_ready:
            return self._results_ready.wait_for(lambda: bool(self._results), timeout_s)

    def close(self) -> None:
        """Stops the workers (a compile in progress is killed); no result comes after this."""
        self._closed = True
        for _ in self._threads:
            self._jobs.put(None)
        for _ in self._local_threads:
            self._local_jobs.put(None)
        for process in list(self._processes.values()):
            _kill(process)

    # ----------------------------------------------------------------------------- dispatchers
    def _dispatch(self, index: int) -> None:
        worker: tuple[subprocess.Popen, Connection] | None = None
        startup_error = None
        try:
            worker = self._start_worker(index)
        except Exception as error:  # its first job fails below (and the next one tries again)
            startup_error = error
        while True:
            key = self._jobs.get()
            if key is None or self._closed:
                if worker is not None:
                    _kill(worker[0])
                return
            started = time.perf_counter()
            try:
                if startup_error is not None:
                    error, startup_error = startup_error, None
                    raise error
                if worker is None:
                    worker = self._start_worker(index)
                result, worker = self._run(worker, key, started)
            except Exception as error:  # the worker would not start, or broke: this job fails, not the core
                if self._closed:
                    return  # close() killed it
                logger.exception("grammar compile worker %d failed", index)
                if worker is not None:
                    _kill(worker[0])
                worker = None
                result = CompileResult(
                    key, None, f"the grammar compiler failed ({error})", time.perf_counter() - started
                )
            self._publish(result)

    def _publish(self, result: CompileResult) -> None:
        with self._results_ready:
            if result.grammar is not None:
                self._cache[result.key] = result.grammar
                while len(self._cache) > self.cache_entries:
                    self._cache.popitem(last=False)
            self._results.append(result)
            self._results_ready.notify_all()
        self.on_done()

    def _dispatch_local(self, index: int) -> None:
        """Compiles on a thread of its own per job, waiting at most `timeout_s` for it."""
        while True:
            key = self._local_jobs.get()
            if key is None or self._closed:
                return
            try:  # built once (the tokenizer load: 5-10 s), before the clock starts: not the grammar's time
                compiler = self._in_process_compiler()
            except Exception as failure:  # the tokenizer info would not build: this job fails, not the core
                if not self._closed:
                    self._publish(CompileResult(key, None, error_text(failure), 0.0))
                continue
            started = time.perf_counter()
            job = _LocalJob(key)
            thread = threading.Thread(
                target=self._compile_here, args=(job, compiler), name="paged_llm-grammar-job", daemon=True
            )
            thread.start()
            if job.done.wait(self.timeout_s):
                result = job.result
                assert result is not None
            else:
                with self._lock:
                    if job.result is None:  # still compiling: left to finish, its result dropped
                        job.abandoned = True
                        self._num_abandoned += 1
                if job.abandoned:
                    logger.warning(
                        "a %s grammar of %d characters overran the %.1f s compile cap (left to finish "
                        "on its thread; compiles go to worker processes until it does)",
                        key[0],
                        len(key[1]),
                        self.timeout_s,
                    )
                    result = _timed_out(key, time.perf_counter() - started, self.timeout_s)
                else:
                    result = job.result
                    assert result is not None
            if not self._closed:
                self._publish(result)

    def _compile_here(self, job: _LocalJob, compiler: xgrammar.GrammarCompiler) -> None:
        started = time.perf_counter()
        grammar, error, field = attempt_compile(compiler, *job.key)  # a compile error is the request's
        result = CompileResult(job.key, grammar, error, time.perf_counter() - started, error_field=field)
        with self._lock:
            job.result = result
            if job.abandoned:
                self._num_abandoned -= 1
        job.done.set()

    def _in_process_compiler(self) -> xgrammar.GrammarCompiler:
        info = self.tokenizer_info
        with self._info_lock:
            if self._local_compiler is None:
                # Our own cache is the LRU above (xgrammar's would keep every grammar ever compiled).
                self._local_compiler = xgrammar.GrammarCompiler(
                    info, max_threads=self.compile_threads, cache_enabled=False
                )
            return self._local_compiler

    def _run(
        self, worker: tuple[subprocess.Popen, Connection], key: GrammarKey, started: float
    ) -> tuple[CompileResult, tuple[subprocess.Popen, Connection] | None]:
        process, connection = worker
        connection.send(("compile", 0, *key))
        if not connection.poll(self.timeout_s):
            _kill(process)
            logger.warning(
                "a %s grammar of %d characters overran the %.1f s compile cap (its worker was killed)",
                key[0],
                len(key[1]),
                self.timeout_s,
            )
            return _timed_out(key, time.perf_counter() - started, self.timeout_s), None
        _, _job, ok, payload, seconds, field = connection.recv()
        if not ok:
            return CompileResult(key, None, payload, seconds, error_field=field), worker
        grammar = xgrammar.CompiledGrammar.deserialize_json(payload, self.tokenizer_info)
        return CompileResult(key, grammar, None, seconds), worker

    def _start_worker(self, index: int) -> tuple[subprocess.Popen, Connection]:
        info = self.tokenizer_info
        with self._info_lock:
            if self._info_json is None:
                self._info_json = info.serialize_json()
        ours, theirs = socket.socketpair()
        try:
            process = spawn_module(
                WORKER_MODULE,
                # One thread: a worker's compile is a large one, which must not crowd the cores that
                # serve while it runs (up to the cap); small ones (on the core's threads) get them all.
                [str(theirs.fileno()), str(os.getpid()), "1"],
                pass_fds=[theirs.fileno()],
                preexec_fn=parent_death_signal(signal.SIGKILL),  # the core killed hard
            )
        finally:
            theirs.close()
        self._processes[index] = process
        connection = Connection(ours.detach())
        connection.send(("tokenizer_info", self._info_json))
        if not connection.poll(WORKER_START_TIMEOUT_S):
            _kill(process)
            raise RuntimeError(f"the compile worker did not start within {WORKER_START_TIMEOUT_S:g} s")
        assert connection.recv() == ("ready",)
        return process, connection


@dataclass
class _LocalJob:
    key: GrammarKey
    result: CompileResult | None = None
    abandoned: bool = False  # its request failed at the cap; the compile still runs
    done: threading.Event = field(default_factory=threading.Event)


def _timed_out(key: GrammarKey, seconds: float, timeout_s: float) -> CompileResult:
    error = (
        f"compiling the grammar took longer than this server's grammar_compile_timeout_s ({timeout_s:g} s)"
    )
    return CompileResult(key, None, error, seconds, timed_out=True)


def _kill(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
    process.wait()
