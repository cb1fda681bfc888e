"""All-reduce latency inside a CUDA graph on one host: NCCL (what the tensor-parallel engine uses)
against torch's symmetric-memory one-shot all-reduce (peer-to-peer loads, no NVLink multicast).

Each rank captures 64 bf16 all-reduces of one decode step's hidden-state size in one graph and
replays it; the figure is the time per all-reduce. Run with multicast off on shared hosts:

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    python scripts/bench_allreduce.py --gpus 2 --elements 4096,8192
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

OPS_PER_GRAPH = 64
REPLAYS = 20


def _time_in_graph(run: Callable[[], None]) -> float:
    """Microseconds per call of `run`, captured OPS_PER_GRAPH times in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(OPS_PER_GRAPH):
            run()
    torch.cuda.synchronize()
    dist.barrier()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(REPLAYS):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / REPLAYS / OPS_PER_GRAPH * 1e6


def _rank(rank: int, world_size: int, init_file: str, num_elements: int, results: mp.Queue) -> None:
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group(
        "nccl", init_method=f"file://{init_file}", rank=rank, world_size=world_size, device_id=device
    )
    hidden = torch.randn(num_elements, dtype=torch.bfloat16, device=device)
    figures: dict[str, object] = {"nccl_us": _time_in_graph(lambda: dist.all_reduce(hidden))}
    try:
        import torch.distributed._symmetric_memory as symm_mem

        group_name = dist.group.WORLD.group_name
        buffer = symm_mem.empty(num_elements, dtype=torch.bfloat16, device=device)
        symm_mem.rendezvous(buffer, group_name)
        out = torch.empty_like(buffer)

        def one_shot() -> None:
            buffer.copy_(hidden)
            torch.ops.symm_mem.one_shot_all_reduce_out(buffer, "sum", group_name, out)

        figures["one_shot_us"] = _time_in_graph(one_shot)
        expected = hidden.clone()
        dist.all_reduce(expected)
        one_shot()
        torch.cuda.synchronize()
        figures["one_shot_matches_nccl"] = bool(torch.allclose(out.float(), expected.float(), atol=0.1))
    except Exception as error:  # an older torch, or no peer access
        figures["one_shot_error"] = repr(error)[:300]
    if rank == 0:
        results.put(figures)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--elements", default="4096,8192", help="bf16 elements per all-reduce (hidden size)")
    args = parser.parse_args()
    context = mp.get_context("spawn")
    for num_elements in (int(n) for n in args.elements.split(",")):
        results = context.Queue()
        with tempfile.TemporaryDirectory() as scratch:
            processes = [
                context.Process(target=_rank, args=(r, args.gpus, f"{scratch}/init", num_elements, results))
                for r in range(args.gpus)
            ]
            for process in processes:
                process.start()
            print(f"{args.gpus} GPUs, {num_elements} elements: {results.get(timeout=300)}", flush=True)
            for process in processes:
                process.join(timeout=60)


if __name__ == "__main__":
    main()
