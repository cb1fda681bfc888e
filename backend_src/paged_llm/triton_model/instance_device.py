"""Which device a Triton model instance runs on: `instance_group [{ kind: KIND_GPU, gpus: [...] }]`
gives one instance (one engine) per listed GPU, and Triton tells each its GPU.

With tensor parallelism an instance on GPU g uses g .. g + tensor_parallel_size - 1, so 2 instances
x 2 ranks on 4 GPUs list `gpus: [0, 2]`. KIND_MODEL (the default here) and KIND_CPU leave the
`device` parameter as configured."""

from __future__ import annotations

from dataclasses import replace

from paged_llm.config import ConfigError, EngineConfig


def instance_device(config: EngineConfig, instance_kind: str, device_id: str) -> EngineConfig:
    """`config` with the device of a KIND_GPU instance (Triton's model_instance_kind / _device_id)."""
    if instance_kind.upper() not in ("GPU", "KIND_GPU"):
        return config
    configured = config.device.device
    wanted = f"cuda:{int(device_id)}"
    if configured in ("auto", "cuda", wanted):
        return replace(config, device=replace(config.device, device=wanted))
    raise ConfigError(
        f"instance_group KIND_GPU puts this instance on GPU {device_id}, but the device parameter says "
        f"{configured!r}: leave device at auto or cuda (KIND_MODEL keeps the parameter's device)"
    )
