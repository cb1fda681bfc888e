from __future__ import annotations

import pytest

from paged_llm.cli.arguments import GPU_INSTANCE_COUNT, build_parser, engine_parameters, instance_count


def parse(*flags: str):
    args = build_parser().parse_args(["serve", "tiny-qwen3", *flags])
    args.model_path = args.model  # serve() resolves it before writing the repository
    return args


@pytest.mark.parametrize(
    ("flags", "has_gpu", "expected"),
    [
        ((), True, GPU_INSTANCE_COUNT),  # device auto on a GPU host: the engine runs on the GPU
        (("--device", "cuda"), True, GPU_INSTANCE_COUNT),
        (("--device", "cuda:1"), True, GPU_INSTANCE_COUNT),
        ((), False, 1),
        (("--device", "cpu"), True, 1),  # a GPU host serving on its CPU
        (("--instance-count", "2"), False, 2),  # an explicit count wins either way
        (("--instance-count", "1"), True, 1),
        # a core in the stub's process is not shared: three instances would be three engines
        (("--engine-arg", "engine_mode=thread"), True, 1),
        (("--engine-arg", "engine_mode=process"), True, GPU_INSTANCE_COUNT),
        (("--engine-arg", "device=cpu"), True, 1),  # the device given as a parameter counts too
    ],
)
def test_the_instance_count_follows_where_the_engine_runs(flags, has_gpu, expected) -> None:
    args = parse(*flags)
    assert instance_count(args, engine_parameters(args), has_gpu) == expected


def test_a_count_below_one_is_refused_naming_the_flag() -> None:
    with pytest.raises(SystemExit, match="--instance-count must be >= 1, got 0"):
        args = parse("--instance-count", "0")
        instance_count(args, engine_parameters(args), has_gpu=True)
