"""The Llama path (no q/k norm, untied LM head) against HF transformers on CPU."""

from __future__ import annotations

import pytest

from paged_llm.models.random_model import write_random_model
from paged_llm.sampling_params import SamplingParams
from tests.integration.conftest import HFReference, make_engine, run_to_completion


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return write_random_model(
        tmp_path_factory.mktemp("llama") / "tiny-llama", "tiny-llama", dtype="float32", seed=3
    )


def test_llama_greedy_matches_hf_with_preemption_and_chunking(llama_dir, prompts):
    reference = HFReference(llama_dir)
    expected = [reference.greedy(p, 12) for p in prompts]
    engine = make_engine(llama_dir, num_blocks=100, block_size_tokens=4, max_num_batched_tokens=64)
    results = run_to_completion(engine, prompts, SamplingParams(temperature=0.0, max_tokens=12))
    assert [r[0].token_ids for r in results] == expected
    assert engine.scheduler_stats().num_preemptions_total > 0
