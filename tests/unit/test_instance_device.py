"""A KIND_GPU model instance runs its engine on the GPU Triton gives it."""

from __future__ import annotations

import pytest

from paged_llm.config import ConfigError, DeviceConfig, EngineConfig
from paged_llm.triton_model.instance_device import instance_device


def _config(device: str, tensor_parallel_size: int = 1) -> EngineConfig:
    return EngineConfig(device=DeviceConfig(device=device, tensor_parallel_size=tensor_parallel_size))


@pytest.mark.parametrize("configured", ["auto", "cuda", "cuda:3"])
def test_a_gpu_instance_gets_its_gpu(configured):
    config = instance_device(_config(configured, 2), "GPU", "3")
    assert config.device.device == "cuda:3"
    assert config.device.tensor_parallel_size == 2


@pytest.mark.parametrize("kind", ["MODEL", "CPU", ""])
def test_other_kinds_keep_the_parameter(kind):
    assert instance_device(_config("cpu"), kind, "1").device.device == "cpu"
    assert instance_device(_config("cuda:1"), kind, "0").device.device == "cuda:1"


@pytest.mark.parametrize("configured", ["cpu", "cuda:0", "npu"])
def test_a_conflicting_device_parameter_is_an_error(configured):
    with pytest.raises(ConfigError, match="KIND_GPU puts this instance on GPU 2"):
        instance_device(_config(configured), "GPU", "2")


def test_make_repository_writes_a_gpu_instance_group(tmp_path):
    """The benchmark's repository for one engine per GPU: KIND_GPU with the listed GPUs, which
    tritonserver parses (the serving benchmark on the GPU host loads it)."""
    from paged_llm.launcher.repository import make_model_repository

    repository = make_model_repository(tmp_path, {"device": "cuda"}, models=("llm",), instance_count=3,
                                       instance_gpus=[0, 1])  # fmt: skip
    config = (repository / "llm" / "config.pbtxt").read_text()
    groups = [line for line in config.splitlines() if line.startswith("instance_group")]
    assert groups == ["instance_group [ { count: 3, kind: KIND_GPU, gpus: [ 0, 1 ] } ]"]
    repository = make_model_repository(tmp_path, None, models=("llm",), instance_count=2)
    config = (repository / "llm" / "config.pbtxt").read_text()
    assert "instance_group [ { count: 2, kind: KIND_MODEL } ]" in config
