"""The engine core's restart policy (backoff, the window that counts failures), the statistics a
dead core leaves (gauges to 0, totals kept), and the settings that configure them."""

from __future__ import annotations

import pytest

from paged_llm.config import ConfigError, EngineConfig
from paged_llm.core.scheduler import SchedulerStats
from paged_llm.core.sessions import SessionStats
from paged_llm.engine.restart_policy import RestartPolicy
from paged_llm.engine.stats import EngineStats
from paged_llm.engine.step_times import StepTimes
from paged_llm.gc_pauses import GcPauses


def test_each_failure_within_the_window_doubles_the_delay_until_the_policy_gives_up():
    policy = RestartPolicy(max_restarts=3, window_s=300.0, base_delay_s=1.0, max_delay_s=30.0)
    assert [policy.on_failure(t) for t in (0.0, 10.0, 20.0)] == [1.0, 2.0, 4.0]
    assert policy.on_failure(30.0) is None  # a fourth failure within 300 s


def test_failures_older_than_the_window_no_longer_count():
    policy = RestartPolicy(max_restarts=2, window_s=60.0, base_delay_s=0.5)
    assert policy.on_failure(0.0) == 0.5
    assert policy.on_failure(50.0) == 1.0
    assert policy.on_failure(100.0) == 1.0  # the first one is 100 s old: two in the window
    assert policy.failures_in_window == 2
    assert policy.on_failure(150.0) == 1.0  # 100 and 150
    assert policy.on_failure(151.0) is None  # 100, 150, 151


def test_the_delay_is_capped_and_zero_restarts_gives_up_at_the_first_death():
    policy = RestartPolicy(max_restarts=10, window_s=1e9, base_delay_s=1.0, max_delay_s=5.0)
    assert [policy.on_failure(float(t)) for t in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert RestartPolicy(max_restarts=0).on_failure(0.0) is None


def _scheduler_stats(running: int, preemptions: int, queried: int) -> SchedulerStats:
    return SchedulerStats(
        num_running=running,
        num_waiting=1,
        kv_usage=0.5,
        num_preemptions_total=preemptions,
        prefix_cache_queried_tokens=queried,
        prefix_cache_hit_tokens=queried // 2,
        prompt_tokens_computed=7,
    )


def test_a_lost_core_reads_zero_in_the_gauges_and_its_totals_carry_over_to_the_next_one():
    stats = EngineStats()
    sessions = SessionStats(num_open=3, num_holding_kv=2, num_evicted_total=1, num_expired_total=0,
                            num_truncated_total=4, reused_tokens_total=100)  # fmt: skip
    stats.update_scheduler(
        _scheduler_stats(5, 2, 40), 1, GcPauses(10, 0.5, 1, 0.1), sessions, StepTimes(7, 0.07, 1, 0.02)
    )
    stats.on_core_lost(counted_its_totals=True)
    down = stats.snapshot()
    assert not down.engine_up
    assert (down.num_running, down.num_waiting, down.kv_usage, down.sessions.num_open) == (0, 0, 0.0, 0)
    # Totals do not go back while no core reports.
    assert down.num_preemptions_total == 2 and down.prefix_cache_queried_tokens == 40
    assert down.prompt_tokens_computed == 7 and down.num_step_faults == 1
    assert down.engine_gc.num_collections == 10 and down.sessions.reused_tokens_total == 100
    assert down.engine_steps == StepTimes(7, 0.07, 1, 0.02)
    stats.on_core_up(owns_core=True)
    fresh_sessions = SessionStats(1, 0, 0, 0, 1, 5)
    stats.update_scheduler(
        _scheduler_stats(1, 1, 8), 0, GcPauses(2, 0.1, 0, 0.2), fresh_sessions, StepTimes(3, 0.03, 0, 0.0)
    )
    up = stats.snapshot()
    assert up.engine_up and up.num_running == 1 and up.kv_usage == 0.5 and up.sessions.num_open == 1
    assert up.num_preemptions_total == 3 and up.prefix_cache_queried_tokens == 48
    assert up.prefix_cache_hit_tokens == 24 and up.prompt_tokens_computed == 14
    assert up.engine_gc.num_collections == 12 and up.engine_gc.longest_pause_s == 0.2
    assert up.sessions.num_truncated_total == 5 and up.sessions.reused_tokens_total == 105
    assert up.engine_steps.num_decode_steps == 10 and up.engine_steps.num_prefill_steps == 1
    assert up.engine_steps.decode_seconds == pytest.approx(0.10)


def test_a_stub_that_did_not_report_the_lost_core_keeps_no_base_of_its_totals():
    stats = EngineStats()
    stats.on_core_up(owns_core=False)
    stats.update_scheduler(_scheduler_stats(2, 9, 90), 0)
    stats.on_core_lost(counted_its_totals=False)
    stats.on_core_up(owns_core=True)  # the restarted core is this stub's now
    stats.update_scheduler(_scheduler_stats(1, 1, 10), 0)
    snapshot = stats.snapshot()
    assert snapshot.owns_core and snapshot.num_preemptions_total == 1
    assert snapshot.prefix_cache_queried_tokens == 10


def test_restart_settings_are_read_from_config_pbtxt_and_checked():
    serving = EngineConfig.from_parameters(
        {"engine_max_restarts": "5", "engine_restart_window_s": "60"}
    ).serving
    assert serving.engine_max_restarts == 5 and serving.engine_restart_window_s == 60.0
    defaults = EngineConfig().serving
    assert defaults.engine_max_restarts == 3 and defaults.engine_restart_window_s == 300.0
    with pytest.raises(ConfigError, match="engine_max_restarts must be in"):
        EngineConfig.from_parameters({"engine_max_restarts": "-1"})
    with pytest.raises(ConfigError, match="engine_restart_window_s must be > 0"):
        EngineConfig.from_parameters({"engine_restart_window_s": "0"})
