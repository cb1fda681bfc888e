"""Front end <-> engine core transport: FramedSocket (socketpair), multiprocessing.Pipe and pyzmq PAIR.

Two real processes (multiprocessing 'spawn'); the payload is an EngineCoreOutputs of a decode step of
B sequences (one new token each, scheduler stats set). Per transport and B: round-trip latency
(parent sends the step, the child unpickles it and answers a small ack) and one-way throughput (the
parent sends N steps back to back; timed until the child has unpickled them all and says so).
pyzmq is measured only if `import zmq` works. Pipe pickles with its default protocol (4).

    PYTHONPATH=backend_src .venv/bin/python scripts/bench_ipc.py \
        --batch-sizes 1,64,256 --num-messages 20000 --rtt-iters 2000 --json ipc.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import pickle
import socket
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from tqdm import tqdm

from paged_llm.core.scheduler import SchedulerStats
from paged_llm.engine.core_types import EngineCoreOutputs
from paged_llm.engine.ipc import FramedSocket

_ACK = 0  # FramedSocket messages are never None


class Endpoint(Protocol):
    def send(self, message: Any) -> None: ...
    def recv(self) -> Any: ...
    def close(self) -> None: ...


class ZmqEndpoint:
    def __init__(self, address: str, bind: bool) -> None:
        import zmq

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PAIR)
        self.sock.setsockopt(zmq.LINGER, 1000)  # the last ack must get out before close
        (self.sock.bind if bind else self.sock.connect)(address)

    def send(self, message: Any) -> None:
        self.sock.send_pyobj(message, protocol=5)

    def recv(self) -> Any:
        return self.sock.recv_pyobj()

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


@dataclass
class Result:
    transport: str
    batch: int
    payload_bytes: int
    rtt_p50_us: float
    rtt_p99_us: float
    msgs_per_s: float


def make_step(batch: int, step: int = 1) -> EngineCoreOutputs:
    """A decode step as EngineCore.take_outputs() returns it: one row per running sequence."""
    return EngineCoreOutputs(
        request_ids=[f"req-{1000 + i}-0" for i in range(batch)],
        seq_indices=[0] * batch,
        new_token_ids=[(7919 * (i + step)) % 151_936 for i in range(batch)],
        scheduler_stats=SchedulerStats(
            num_running=batch,
            num_waiting=3,
            kv_usage=0.42,
            num_preemptions_total=0,
            prefix_cache_queried_tokens=123_456,
            prefix_cache_hit_tokens=65_536,
        ),
        num_steps=step,
    )


def child_main(transport: str, arg: Any) -> None:
    """Answers ("rtt", n): n pings, each acked; ("bulk", n): n steps, then one ack with the row count."""
    if transport == "framed_socket":
        endpoint: Any = FramedSocket(arg)
    elif transport == "zmq_pair":
        endpoint = ZmqEndpoint(arg, bind=False)
    else:
        endpoint = arg
    while True:
        command, count = endpoint.recv()
        if command == "stop":
            break
        if command == "rtt":
            for _ in range(count):
                endpoint.recv()
                endpoint.send(_ACK)
        else:
            rows = sum(endpoint.recv().num_rows for _ in range(count))
            endpoint.send(rows)
    endpoint.send(_ACK)
    endpoint.close()


def open_transport(transport: str, tmp_dir: str) -> tuple[Endpoint, Any, Any]:
    """(parent endpoint, what the child opens its end from, what to close in the parent)."""
    if transport == "framed_socket":
        parent_sock, child_sock = socket.socketpair()
        return FramedSocket(parent_sock), child_sock, child_sock
    if transport == "mp_pipe":
        parent_conn, child_conn = mp.Pipe(duplex=True)
        return parent_conn, child_conn, child_conn
    address = f"ipc://{tmp_dir}/bench_ipc.sock"
    return ZmqEndpoint(address, bind=True), address, None


def measure_rtt(endpoint: Endpoint, step: EngineCoreOutputs, iters: int) -> tuple[float, float]:
    warmup = min(200, iters)
    endpoint.send(("rtt", warmup + iters))
    samples_ns: list[int] = []
    for i in range(warmup + iters):
        start = time.perf_counter_ns()
        endpoint.send(step)
        endpoint.recv()
        if i >= warmup:
            samples_ns.append(time.perf_counter_ns() - start)
    samples_ns.sort()
    return samples_ns[len(samples_ns) // 2] / 1e3, samples_ns[min(iters - 1, int(iters * 0.99))] / 1e3


def measure_throughput(endpoint: Endpoint, step: EngineCoreOutputs, num_messages: int) -> float:
    endpoint.send(("bulk", num_messages))
    start = time.perf_counter_ns()
    for _ in range(num_messages):
        endpoint.send(step)
    rows = endpoint.recv()
    elapsed_s = (time.perf_counter_ns() - start) / 1e9
    assert rows == num_messages * step.num_rows, f"child saw {rows} rows"
    return num_messages / elapsed_s


def bench_transport(transport: str, args: argparse.Namespace, progress: tqdm) -> list[Result]:
    ctx = mp.get_context("spawn")
    results = []
    with tempfile.TemporaryDirectory() as tmp_dir:
        endpoint, child_arg, child_end = open_transport(transport, tmp_dir)
        child = ctx.Process(target=child_main, args=(transport, child_arg), daemon=True)
        child.start()
        if child_end is not None:
            child_end.close()  # the child has its own copy now
        for batch in args.batch_sizes:
            step = make_step(batch)
            rtt_p50, rtt_p99 = measure_rtt(endpoint, step, args.rtt_iters)
            rate = measure_throughput(endpoint, step, args.num_messages)
            size = len(pickle.dumps(step, protocol=5))
            results.append(Result(transport, batch, size, rtt_p50, rtt_p99, rate))
            progress.update(1)
        endpoint.send(("stop", 0))
        endpoint.recv()
        child.join(timeout=10)
        endpoint.close()
    return results


def print_table(results: list[Result]) -> None:
    header = ["transport", "batch", "payload bytes", "RTT p50 us", "RTT p99 us", "one-way msgs/s"]
    rows = [header, ["---"] + ["---:"] * 5]
    for r in results:
        rows.append([r.transport, str(r.batch), str(r.payload_bytes), f"{r.rtt_p50_us:.1f}"])
        rows[-1] += [f"{r.rtt_p99_us:.1f}", f"{r.msgs_per_s:,.0f}"]
    print("\n".join("| " + " | ".join(row) + " |" for row in rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--batch-sizes", type=lambda s: [int(b) for b in s.split(",")], default=[1, 64, 256])
    parser.add_argument("--num-messages", type=int, default=20000, help="one-way messages per case")
    parser.add_argument("--rtt-iters", type=int, default=2000, help="timed round trips per case")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    transports = ["framed_socket", "mp_pipe"]
    try:
        import zmq  # noqa: F401

        transports.append("zmq_pair")
    except ImportError:
        print("pyzmq not installed: zmq_pair skipped")
    results: list[Result] = []
    with tqdm(total=len(transports) * len(args.batch_sizes), desc="cases") as progress:
        for transport in transports:
            results += bench_transport(transport, args, progress)
    print_table(results)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
