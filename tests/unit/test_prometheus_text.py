"""paged_llm.testing.prometheus: the one reader of /metrics text for tests, benchmarks and soak."""

from __future__ import annotations

from paged_llm.testing.prometheus import parse, total, value

TEXT = """# HELP paged_llm_engine_steps_total Busy engine steps
# TYPE paged_llm_engine_steps_total counter
paged_llm_engine_steps_total{model="llm",version="1",instance="0",kind="decode"} 964
paged_llm_engine_steps_total{model="llm",version="1",instance="1",kind="decode"} 12
paged_llm_engine_steps_total{model="llm",version="1",instance="0",kind="prefill"} 90
paged_llm_engine_steps_total_extra{kind="decode"} 5
paged_llm_time_to_first_token_seconds_bucket{model="llm",le="+Inf"} 7
paged_llm_kv_cache_usage_ratio 0.25
nv_inference_request_failure{model="llm",version="1"} 0
"""


def test_series_of_a_name_add_up_over_the_labels_asked_for():
    assert value(TEXT, "paged_llm_engine_steps_total", kind="decode") == 976  # both instances
    assert value(TEXT, "paged_llm_engine_steps_total") == 1066
    assert value(TEXT, "paged_llm_engine_steps_total", kind="decode", instance="1") == 12
    assert value(TEXT, "paged_llm_kv_cache_usage_ratio") == 0.25  # no labels
    assert value(TEXT, "paged_llm_time_to_first_token_seconds_bucket", le="+Inf") == 7


def test_a_name_or_label_not_there_counts_zero_and_prefixes_do_not_match():
    samples = parse(TEXT)
    assert total(samples, "paged_llm_engine_steps") == 0
    assert total(samples, "paged_llm_engine_steps_total", kind="verify") == 0
    assert total(samples, "paged_llm_engine_steps_total_extra") == 5
    assert len(samples) == 7  # comments skipped
