"""A grammar compile worker: `python -m paged_llm.structured_output.compile_worker FD PARENT_PID THREADS`.

The engine core's GrammarCompiler (compiler.py) compiles its large constraints here, so that one
that overruns its time cap can be killed (small ones compile on the core's own threads). Over the
socket FD (pickled multiprocessing.connection messages):

    core -> worker   ("tokenizer_info", json)                     once, first
    worker -> core   ("ready",)
    core -> worker   ("compile", job_id, kind, spec, any_whitespace)
    worker -> core   ("done", job_id, ok, grammar json | error text, seconds, error field | None)
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
import warnings
from multiprocessing.connection import Connection

from paged_llm.processes import watch_parent


def main(argv: list[str]) -> int:
    fd, parent_pid = int(argv[0]), int(argv[1])
    # Background work: the step loop, the stubs and tritonserver on the same cores come first (a
    # large compile may run for the whole cap).
    os.nice(10)
    watch_parent(parent_pid, lambda: os._exit(0), "paged_llm-compile-watchdog")
    warnings.simplefilter("ignore")  # xgrammar warns about schema details on stderr, per compile
    import xgrammar

    from paged_llm.structured_output.compile import attempt_compile

    connection = Connection(socket.socket(fileno=fd).detach())
    message = connection.recv()
    assert message[0] == "tokenizer_info", message[0]
    info = xgrammar.TokenizerInfo.deserialize_json(message[1])
    # Our own cache is the core's (compiler.py); this process may be killed any time.
    compiler = xgrammar.GrammarCompiler(info, max_threads=int(argv[2]), cache_enabled=False)
    connection.send(("ready",))
    while True:
        try:
            message = connection.recv()
        except EOFError:
            return 0
        _, job_id, kind, spec, any_whitespace = message
        started = time.perf_counter()
        grammar, error, field = attempt_compile(compiler, kind, spec, any_whitespace)
        result = (True, grammar.serialize_json()) if grammar is not None else (False, error)
        connection.send(("done", job_id, *result, time.perf_counter() - started, field))


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the core stops it (Ctrl-C reaches the whole group)
    sys.exit(main(sys.argv[1:]))
