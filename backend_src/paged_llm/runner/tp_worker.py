"""A tensor-parallel worker process: `python -m paged_llm.runner.tp_worker RANK WORLD PORT PARENT_PID`,
its runner's arguments pickled on stdin. It loads its rank's shard and follows rank 0's commands
(runner/tensor_parallel.py tells the protocol; TensorParallelWorkers starts these processes)."""

from __future__ import annotations

import logging
import os
import pickle
import sys
from typing import Any

import torch

from paged_llm.layers.parallel import TensorParallelGroup
from paged_llm.processes import watch_parent
from paged_llm.runner.model_runner import ModelRunner
from paged_llm.runner.tensor_parallel import (
    SHUTDOWN_TIMEOUT_S,
    bounded,
    init_process_group,
    open_store,
    rank_device,
)
from paged_llm.runner.tp_channel import (
    CMD_ALLOCATE,
    CMD_LORA_STEP,
    CMD_PROFILE,
    CMD_SHUTDOWN,
    CMD_STEP,
    Channel,
    lora_payload_size,
    payload_size,
    unpack_lora_step,
    unpack_step,
)


def run_worker(
    rank: int, world_size: int, store_port: int, runner_kwargs: dict[str, Any], parent_pid: int
) -> None:
    """Entry point of a worker process: load this rank's shard, then follow rank 0's commands."""
    # A worker must not outlive rank 0 (it would wait in a broadcast for ever).
    watch_parent(parent_pid, lambda: os._exit(1), "paged_llm-tp-watchdog")
    logging.basicConfig(level=logging.WARNING, format=f"paged_llm tp rank {rank} %(levelname)s: %(message)s")
    device = rank_device(runner_kwargs["device"], rank)
    device.activate()
    control = init_process_group(device, rank, world_size, open_store(rank, world_size, store_port))
    runner = ModelRunner(
        **{**runner_kwargs, "device": device}, parallel=TensorParallelGroup(rank, world_size)
    )
    runner.load(show_progress=False)
    channel = Channel(device.torch_device, control)
    with_host_lists = not device.supports_triton
    with torch.inference_mode():
        _follow(runner, channel, with_host_lists)
    runner.release_graphs()
    bounded(torch.distributed.destroy_process_group, SHUTDOWN_TIMEOUT_S, "leaving the group")
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown: CUDA graphs and NCCL state go with the process


def _follow(runner: ModelRunner, channel: Channel, with_host_lists: bool) -> None:
    """Runs rank 0's commands until it says shutdown."""
    while True:
        header = channel.receive_header()
        if header.command == CMD_STEP:
            payload = channel.receive_payload(payload_size(header))
            ids, positions, metadata, sample_indices = unpack_step(header, payload, with_host_lists)
            runner.forward_step(ids, positions, metadata, sample_indices)
        elif header.command == CMD_LORA_STEP:
            assert runner.lora is not None, "LoRA rows sent to a rank without adapters"
            rows, loads = unpack_lora_step(header, channel.receive_payload(lora_payload_size(header)))
            runner.set_lora_step(runner.lora.replay_step(rows, loads))
        elif header.command == CMD_PROFILE:
            runner.profile_free_kv_bytes(header.argument / 1e6)
        elif header.command == CMD_ALLOCATE:
            runner.allocate_kv_cache(header.argument)
        elif header.command == CMD_SHUTDOWN:
            return
        else:
            raise RuntimeError(f"unknown tensor-parallel command {header.command}")


def main() -> None:
    rank, world_size, store_port, parent_pid = (int(arg) for arg in sys.argv[1:5])
    runner_kwargs = pickle.loads(sys.stdin.buffer.read())
    run_worker(rank, world_size, store_port, runner_kwargs, parent_pid)


if __name__ == "__main__":
    main()
