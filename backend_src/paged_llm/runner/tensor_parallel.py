"""Tensor-parallel worker processes: one per extra device, each running its rank's share of the model.

Rank 0 is the engine core's own ModelRunner: it keeps the scheduler, the KV cache manager and the
sampler. Each step it broadcasts what the model needs (the same for every rank), then all ranks run
the forward together, meeting in the collectives (layers/parallel.py):

    rank 0 (engine core)                              ranks 1..N-1 (TensorParallelWorker)
    buffers.prepare(scheduler output)
    header [command, T, B, W, S, ...], host to   -->  header, on the host (its only wait)
      host (gloo, the control group)
    broadcast payload (ids, positions, slots,    -->  payload, unpacked into views
      query starts, context lengths, tables, rows)
    forward (CUDA graph or eager) <== all-reduce / all-gather ==> the same forward
    sample, verify                                    (logits dropped)

The header goes host to host, so a worker learns the next step as soon as rank 0 schedules it and
enqueues that step behind the one its device still runs: with asynchronous scheduling no rank's
device waits for its host between steps. (Sent through the device, the header reached a worker's
host only after its previous step had finished, and every step began with rank 0 waiting in the
first collective for that worker to launch.) The payload is a device broadcast enqueued on rank 0's
stream like any kernel, so it may hold the tokens sampled by the step before, still on the device.
Every rank chooses the same path (decode graph bucket, mixed-step graph or eager) from the same
numbers, so their collectives pair up. The header also carries the start-up commands (profile
memory, allocate the KV cache and capture graphs) and shutdown.

Timeouts: a worker's wait for the next header has none (it waits for as long as the engine is
idle). Everything else times out after tp_channel.collective_timeout_s() (600 s, PAGED_LLM_TP_TIMEOUT_S):
joining, every collective of a step, and rank 0's header send, which returns only once every
worker has taken the header (gloo), so a worker that is alive but stuck stops the engine with an
error instead of holding it.

Workers are fresh interpreters (`python -m paged_llm.runner.tp_worker`, never forked: CUDA),
given their runner's arguments on stdin; they exit when rank 0's process is gone. This module is
rank 0's side (TensorParallelWorkers) and what every rank shares to join the group; a worker's
own loop is runner/tp_worker.py.
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from paged_llm.errors import WorkerDiedError
from paged_llm.processes import spawn_module
from paged_llm.runner.tp_channel import (
    CMD_SHUTDOWN,
    Channel,
    StepHeader,
    collective_timeout,
    pack_lora_step,
    pack_step,
)

if TYPE_CHECKING:
    from paged_llm.config import EngineConfig
    from paged_llm.models.hf_config import ModelSpec
    from paged_llm.runner.device import Device
    from paged_llm.runner.input_buffers import StepInputs

logger = logging.getLogger(__name__)

WORKER_MODULE = "paged_llm.runner.tp_worker"  # what a worker process runs (`python -m`)
SHUTDOWN_TIMEOUT_S = 10.0


def check_tensor_parallel(config: EngineConfig, spec: ModelSpec, device: Device) -> None:
    """Startup fails here, before any process starts, when tensor parallelism cannot run."""
    from paged_llm.config import ConfigError
    from paged_llm.layers.parallel import check_divisible

    world_size = config.device.tensor_parallel_size
    if world_size == 1:
        return
    check_divisible(spec, world_size)
    if not (device.is_cuda or device.is_cpu):
        raise ConfigError(f"tensor_parallel_size > 1 is supported on cuda and cpu, not {device.kind}")
    if device.is_cuda:
        first = device.index or 0
        available = torch.cuda.device_count()
        if first + world_size > available:
            raise ConfigError(
                f"tensor_parallel_size {world_size} from cuda:{first} needs {first + world_size} GPUs, "
                f"{available} visible"
            )
    if config.speculative.enabled and config.speculative.speculative_method == "draft_model":
        raise ConfigError("speculative_method draft_model does not run with tensor_parallel_size > 1")


def distributed_backend(device: Device) -> str:
    if device.is_cuda:
        return "nccl"
    if device.is_cpu:
        return "gloo"
    raise ValueError(f"tensor parallelism is not supported on {device.kind}")


def rank_device(device: Device, rank: int) -> Device:
    """Rank r runs on the r-th device after the engine's own (cuda:2 with 2 ranks: cuda:2, cuda:3)."""
    from paged_llm.runner.device import Device

    if device.is_cpu:
        return device
    return Device(device.kind, (device.index or 0) + rank)


STORE_HOST = "127.0.0.1"  # the ranks meet through rank 0's TCP store, on loopback only


def open_store(rank: int, world_size: int, port: int = 0) -> torch.distributed.TCPStore:
    """Rank 0 serves the rendezvous store on a free port (port 0: the kernel picks; no file is left
    behind by a process that exits without cleaning up); the workers connect to its port."""
    timeout = collective_timeout()
    return torch.distributed.TCPStore(
        STORE_HOST, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False
    )


def init_process_group(
    device: Device, rank: int, world_size: int, store: torch.distributed.Store
) -> torch.distributed.ProcessGroup:
    """Joins the ranks' group (NCCL on CUDA, gloo on CPU) and returns the control group (gloo,
    host memory) that carries the step headers. Every rank calls it, in the same order."""
    if torch.distributed.is_initialized():
        raise RuntimeError("a tensor-parallel engine already runs in this process (one per process)")
    timeout = collective_timeout()
    # Gloo (the control group; the default group on CPU) finds its interface from the host name,
    # which a container may not resolve: every rank is on this host, so loopback.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    kwargs: dict[str, Any] = {}
    if device.is_cuda:
        kwargs["device_id"] = torch.device("cuda", device.index or 0)
    torch.distributed.init_process_group(
        distributed_backend(device),
        store=store,
        rank=rank,
        world_size=world_size,
        # Joining, and the first command after it, wait for every rank's start and weight loading;
        # a rank that never comes ends the wait with an error after this long instead of never.
        timeout=timeout,
        **kwargs,
    )
    # Created with the start-up timeout (a rank lost while joining ends it with an error); only a
    # worker's wait for the next header is unbounded (Channel.receive_header).
    return torch.distributed.new_group(backend="gloo", timeout=timeout)


class TensorParallelWorkers:
    """Rank 0's handle on ranks 1..N-1: starts them, sends them each step and command, stops them."""

    def __init__(self, runner_kwargs: dict[str, Any], device: Device, world_size: int) -> None:
        self.world_size = world_size
        self.device = device
        self._closed = False
        self._store = open_store(0, world_size)
        self.processes: list[subprocess.Popen] = []
        try:
            self._start_workers(runner_kwargs)
            control = init_process_group(device, 0, world_size, self._store)
        except BaseException:
            self.close(abort=True)
            raise
        self.channel = Channel(device.torch_device, control)
        logger.info(
            "tensor parallelism: %d ranks (%s), worker pids %s",
            world_size,
            distributed_backend(device),
            [process.pid for process in self.processes],
        )

    def _start_workers(self, runner_kwargs: dict[str, Any]) -> None:
        """One interpreter per rank (inside Triton's stub sys.executable is the stub binary: the
        engine core's own way of finding python3 is used), this package first on its path."""
        arguments = pickle.dumps(runner_kwargs)
        for rank in range(1, self.world_size):
            args = [str(rank), str(self.world_size), str(self._store.port), str(os.getpid())]
            process = spawn_module(WORKER_MODULE, args, stdin=subprocess.PIPE)
            self.processes.append(process)
            assert process.stdin is not None
            process.stdin.write(arguments)
            process.stdin.close()

    def send_step(self, inputs: StepInputs) -> None:
        header, payload = pack_step(inputs)
        self.channel.send(header, payload)

    def send_lora_step(self, rows: list[tuple[int, int]], loads: list[tuple[int, int]]) -> None:
        """The next step's LoRA rows and slot loads (before send_step; only with adapters)."""
        header, payload = pack_lora_step(rows, loads, self.channel.device)
        self.channel.send(header, payload)

    def send_command(self, command: int, argument: int = 0) -> None:
        self.channel.send(StepHeader(command, argument=argument))

    def check_alive(self) -> None:
        """Raises WorkerDiedError once a worker has exited (before rank 0 waits for it for ever)."""
        dead = self.dead_workers()
        if dead and not self._closed:
            raise WorkerDiedError(f"tensor-parallel worker {', '.join(dead)} exited: the engine stops")

    def watch(self, on_death: Callable[[str], None], interval_s: float = 0.5) -> None:
        """Calls `on_death(message)` from a thread when a worker exits before close(): rank 0 may be
        blocked in a device wait that the dead rank's collective never completes (NCCL)."""

        def poll() -> None:
            while not self._closed:
                time.sleep(interval_s)
                dead = self.dead_workers()
                if dead and not self._closed:
                    on_death(f"tensor-parallel worker {', '.join(dead)} exited")
                    return

        threading.Thread(target=poll, name="paged_llm-tp-watch", daemon=True).start()

    def dead_workers(self) -> list[str]:
        return [
            f"rank {rank} (exit code {process.returncode})"
            for rank, process in enumerate(self.processes, start=1)
            if process.poll() is not None
        ]

    def close(self, abort: bool = False) -> None:
        """Tells the workers to stop and leaves the group together with them (NCCL's teardown
        pairs up across ranks: a rank that waited for its peers to exit before leaving would wait
        for ever), then waits for them and kills what is left. `abort`: the ranks may be inside
        different collectives (rank 0 failed partway): kill the workers first."""
        if self._closed:
            return
        self._closed = True
        if abort:
            for process in self.processes:
                process.kill()
        elif torch.distributed.is_initialized() and hasattr(self, "channel"):
            try:
                if not self.dead_workers():
                    self.send_command(CMD_SHUTDOWN)
                    bounded(self.device.synchronize, SHUTDOWN_TIMEOUT_S, "finishing the last steps")
            except Exception:  # a broken group: the workers are killed below
                logger.exception("could not send the shutdown command to the tensor-parallel workers")
        if torch.distributed.is_initialized() and hasattr(self, "channel"):
            bounded(torch.distributed.destroy_process_group, SHUTDOWN_TIMEOUT_S, "leaving the group")
        deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
        for rank, process in enumerate(self.processes, start=1):
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("tensor-parallel worker of rank %d did not stop: killing it", rank)
                process.kill()
                process.wait(timeout=5.0)


def bounded(call: Callable[[], object], timeout_s: float, what: str) -> None:
    """Runs `call` on a thread and gives up waiting after `timeout_s` (a peer that died can leave a
    device wait or NCCL's teardown hanging)."""
    done = threading.Event()

    def run() -> None:
        try:
            call()
        except Exception:
            logger.exception("tensor parallelism: %s failed", what)
        done.set()

    threading.Thread(target=run, name="paged_llm-tp-bounded", daemon=True).start()
    if not done.wait(timeout_s):
        logger.warning("tensor parallelism: %s took over %.0f s: given up", what, timeout_s)
