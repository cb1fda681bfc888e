"""GrammarCompiler's time cap counts the grammar's compile, not the one-time tokenizer load that the
first compile of a process waits for (5-10 s on a GPU host for Qwen's vocabulary)."""

from __future__ import annotations

import time

from paged_llm.structured_output.compiler import GrammarCompiler
from paged_llm.structured_output.tokenizer_info import build_tokenizer_info


def test_the_first_compile_is_not_charged_for_the_tokenizer_load(tiny_model_dir):
    load_s = 1.5

    def slow_tokenizer_info():
        time.sleep(load_s)
        return build_tokenizer_info(tiny_model_dir, 151936, [151645])

    compiler = GrammarCompiler(slow_tokenizer_info, num_workers=1, timeout_s=0.5, cache_entries=4)
    try:
        compiler.submit(("regex", "(yes|no)", False))
        deadline = time.monotonic() + 60
        results = []
        while not results and time.monotonic() < deadline:
            compiler.wait_for_results(1.0)
            results = compiler.take_results()
        [result] = results
        assert result.error is None and result.grammar is not None and not result.timed_out
        assert result.seconds < load_s
    finally:
        compiler.close()
