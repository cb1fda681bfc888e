"""What the llm model sets up for the Triton stub process it runs in, apart from serving requests:
its log (Triton's, or stderr once the server is gone), SIGINT, a stack dump when an unload hangs,
and the exit the launcher watches for once the engine core cannot be restarted.

No `triton_python_backend_utils` import here: llm_model.py passes `pb_utils.Logger` in.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
from typing import Any

from paged_llm.engine.restart_policy import GAVE_UP_EXIT_STATUS

_STUCK_SHUTDOWN_DUMP_S = 30.0  # an unload or finalize() still going after this writes every stack
logger = logging.getLogger("paged_llm")


class TritonLogHandler(logging.Handler):
    """Routes the package's `logging` records into Triton's log, or to stderr once the server is
    gone: a pb_utils.Logger call then blocks forever holding the GIL, and the stub cannot exit."""

    def __init__(self, triton_logger: Any) -> None:
        super().__init__()
        self._triton_logger = triton_logger
        self._server_pid = os.getppid()

    def emit(self, record: logging.LogRecord) -> None:
        message = self.format(record)
        if os.getppid() != self._server_pid:
            print(f"paged_llm: {message}", file=sys.stderr, flush=True)
        elif record.levelno >= logging.ERROR:
            self._triton_logger.log_error(message)
        elif record.levelno >= logging.WARNING:
            self._triton_logger.log_warn(message)
        else:
            self._triton_logger.log_info(message)


def log_to_triton(triton_logger: Any) -> None:
    """Once per stub: every instance of the model in this process shares the package's logger."""
    if not any(isinstance(h, TritonLogHandler) for h in logger.handlers):
        logger.addHandler(TritonLogHandler(triton_logger))
        logger.setLevel(logging.INFO)


def ignore_ctrl_c() -> None:
    """Ctrl-C on `make serve` sends SIGINT to the whole process group. tritonserver handles it by
    unloading its models, which calls finalize(); a KeyboardInterrupt raised in this stub at the
    same time would break that unload (the server then gives up on the model and crashes on exit),
    so the stub leaves SIGINT to the server. (The engine core process ignores it too.)"""
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: nothing raises KeyboardInterrupt here then either
        logger.info("initialize() does not run on the stub's main thread; SIGINT left as it is")


def exit_for_the_launcher(reason: str) -> None:
    """AsyncLLM gave up on its engine core (restarted too often): a stub that cannot serve must not
    look alive. Triton 2.51 keeps the model READY after its stub exits, which is exactly what the
    launcher's stub watch reports: it stops the server and exits non-zero (launcher/stub_watch.py)."""
    print(f"paged_llm: {reason}; the stub exits ({GAVE_UP_EXIT_STATUS})", file=sys.stderr, flush=True)
    os._exit(GAVE_UP_EXIT_STATUS)


def dump_stacks_if_stuck(grace_s: float) -> None:
    """Unloading must end in seconds: if it has not _STUCK_SHUTDOWN_DUMP_S after the grace period
    (finalize() never came, or hangs), every thread's stack goes to stderr (the server's log).
    finalize() cancels it (cancel_stack_dump) as it returns."""
    faulthandler.dump_traceback_later(grace_s + _STUCK_SHUTDOWN_DUMP_S, exit=False, file=sys.stderr)


def cancel_stack_dump() -> None:
    faulthandler.cancel_dump_traceback_later()
