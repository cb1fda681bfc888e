from __future__ import annotations

import pytest

from paged_llm.config import ConfigError, EngineConfig


def test_parameters_from_config_pbtxt():
    config = EngineConfig.from_parameters(
        {
            "model": "/models/x",
            "max_model_len": "0",
            "num_kv_blocks": "128",
            "kv_cache_memory_bytes": "0",
            "enable_prefix_caching": "false",
            "max_num_seqs": "8",
            "gpu_memory_utilization": "0.8",
            "device": "cpu",
            "max_n": "4",
            "admission_policy": "reject",
            "queue_max_wait_s": "2.5",
        }
    )
    assert config.model.model == "/models/x" and config.model.max_model_len is None
    assert config.cache.num_blocks == 128 and config.cache.memory_bytes is None
    assert config.cache.enable_prefix_caching is False and config.cache.gpu_memory_utilization == 0.8
    assert config.scheduler.max_num_seqs == 8 and config.device.device == "cpu"
    assert config.limits.max_n == 4
    assert config.scheduler.admission_policy == "reject" and config.scheduler.queue_max_wait_s == 2.5


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"typo_setting": "1"}, "unknown parameter 'typo_setting'"),
        ({"dtype": "int8"}, "dtype must be"),
        ({"device": "tpu"}, "device must be"),
        ({"max_num_seqs": "0"}, "max_num_seqs must be >= 1"),
        ({"gpu_memory_utilization": "1.5"}, "gpu_memory_utilization"),
        ({"block_size_tokens": "abc"}, "block_size_tokens"),
        ({"admission_policy": "drop"}, "admission_policy must be queue or reject, got 'drop'"),
        ({"queue_max_wait_s": "-1"}, "queue_max_wait_s must be >= 0"),
        ({"grammar_fill_threads": "-1"}, r"grammar_fill_threads must be in \[0, 64\], got -1"),
    ],
)
def test_bad_parameters_fail_loading_with_a_clear_message(parameters, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_parameters(parameters)


def test_grammar_fill_threads_from_config_pbtxt():
    assert EngineConfig.from_parameters({}).structured_output.grammar_fill_threads == 0  # the rule
    config = EngineConfig.from_parameters({"grammar_fill_threads": "2"})
    assert config.structured_output.grammar_fill_threads == 2


def test_speculative_parameters_from_config_pbtxt_and_serve_flags():
    from paged_llm.cli.arguments import build_parser, engine_parameters

    config = EngineConfig.from_parameters(
        {"num_speculative_tokens": "4", "prompt_lookup_max": "3", "speculative_pause_below": "0"}
    )
    assert config.speculative.enabled and config.speculative.num_speculative_tokens == 4
    assert (config.speculative.prompt_lookup_max, config.speculative.speculative_pause_below) == (3, 0.0)
    assert not EngineConfig.from_parameters({}).speculative.enabled
    for bad, field_name in (
        ({"speculative_method": "medusa"}, "speculative_method"),
        ({"num_speculative_tokens": "99"}, "num_speculative_tokens"),
        ({"speculative_method": "draft_model", "num_speculative_tokens": "2"}, "speculative_model"),
        ({"prompt_lookup_min": "5", "prompt_lookup_max": "2"}, "prompt_lookup_min"),
    ):
        with pytest.raises(ConfigError, match=field_name):
            EngineConfig.from_parameters(bad)
    args = build_parser().parse_args(["serve", "--num-speculative-tokens", "3"])
    args.model_path = "tiny-qwen3"
    assert engine_parameters(args)["num_speculative_tokens"] == "3"


def test_tensor_parallel_and_load_format_from_config_pbtxt_and_serve_flags():
    from paged_llm.cli.arguments import build_parser, engine_parameters

    config = EngineConfig.from_parameters({"tensor_parallel_size": "4", "load_format": "dummy"})
    assert (config.device.tensor_parallel_size, config.model.load_format) == (4, "dummy")
    assert EngineConfig.from_parameters({}).device.tensor_parallel_size == 1
    assert EngineConfig.from_parameters({}).device.all_reduce == "auto"
    assert EngineConfig.from_parameters({"all_reduce": "nccl"}).device.all_reduce == "nccl"
    for bad, field_name in (
        ({"all_reduce": "ring"}, "all_reduce"),
        ({"tensor_parallel_size": "0"}, "tensor_parallel_size"),
        ({"tensor_parallel_size": "two"}, "tensor_parallel_size"),
        ({"load_format": "pt"}, "load_format"),
    ):
        with pytest.raises(ConfigError, match=field_name):
            EngineConfig.from_parameters(bad)
    args = build_parser().parse_args(["serve", "--tensor-parallel-size", "2", "--load-format", "dummy"])
    args.model_path = "tiny-qwen3"
    assert engine_parameters(args)["tensor_parallel_size"] == "2"
    assert engine_parameters(args)["load_format"] == "dummy"


def test_torch_compile_from_config_pbtxt():
    assert EngineConfig.from_parameters({}).device.torch_compile == ""
    for mode in ("default", "max-autotune"):
        assert EngineConfig.from_parameters({"torch_compile": mode}).device.torch_compile == mode
    with pytest.raises(
        ConfigError, match="torch_compile must be one of '', 'default', 'max-autotune', got 'fast'"
    ):
        EngineConfig.from_parameters({"torch_compile": "fast"})
    message = "torch_compile='default' is not supported with tensor_parallel_size 2"
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_parameters({"torch_compile": "default", "tensor_parallel_size": "2"})
