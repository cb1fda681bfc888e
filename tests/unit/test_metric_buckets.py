"""vllm_backend's bucket rules for the vllm: series (vLLM's build_1_2_5_buckets)."""

from __future__ import annotations

from paged_llm.triton_model.histograms import buckets_1_2_5


def test_1_2_5_buckets_stop_at_the_upper_bound():
    assert buckets_1_2_5(4096) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
    assert buckets_1_2_5(5) == [1, 2, 5]
    assert buckets_1_2_5(1) == [1]
