"""Runs two of vllm_backend's CI tests, unchanged, against `paged-llm serve`, each run on a fresh server.

  upstream file (branch)                                                    test cases
  ci/L0_backend_vllm/metrics_test/vllm_metrics_test.py (main)               test_vllm_metrics,
                                                                            test_custom_sampling_params
  ci/L0_backend_vllm/request_cancellation/request_cancellation_test.py      test_request_cancellation
  (r24.10)

Step 1, the user's (no upstream code is committed to this repository): copy the files out of a clone
of triton-inference-server/vllm_backend (here a bare mirror). Both tests import ci/common/test_util.py,
so it comes too (main's and r24.10's are the same file):

  M=/work/.mirror/triton-inference-server+vllm_backend/repo
  mkdir -p /tmp/vllm_upstream
  git -C "$M" show main:ci/L0_backend_vllm/metrics_test/vllm_metrics_test.py \\
      > /tmp/vllm_upstream/vllm_metrics_test.py
  git -C "$M" show r24.10:ci/L0_backend_vllm/request_cancellation/request_cancellation_test.py \\
      > /tmp/vllm_upstream/request_cancellation_test.py
  git -C "$M" show main:ci/common/test_util.py > /tmp/vllm_upstream/test_util.py

Step 2:

  .venv/bin/python scripts/compat/run_vllm_backend_tests.py --upstream /tmp/vllm_upstream \\
      --runs 10 --which both --json /tmp/vllm_backend_tests.json

What one run of a case does, as the upstream test.sh does (one server per test case):
- lays out upstream's directories under the work directory (RUN/ci/L0_backend_vllm/<test dir>/ with
  the test file, RUN/ci/common/test_util.py), so the file's `sys.path.append("../../common")` works;
- starts `paged-llm serve MODEL --served-model-name vllm_opt` with gRPC on 8001 and metrics on 8002
  (the tests hard-code localhost:8001 and :8002; both must be free) and HTTP and the OpenAI API on
  free ports; its output (tritonserver's log) goes to the server log name test.sh uses, in the
  test's directory, where the cancellation test reads it;
- waits until the model is ready on Triton HTTP, the gRPC and metrics ports accept connections and
  the OpenAI server's /health answers 200;
- runs `python -m unittest -v MODULE[.CLASS.TEST]` in the test's directory, the file unchanged; the
  run passes when it exits 0 and its test_results.txt says 1 test, 0 errors, 0 failures (test.sh's
  check_test_results), and no process of the server is left afterwards;
- stops the server by pid (SIGTERM; SIGKILL to its process group after --exit-timeout-s) and checks
  that no process of its group, nor any process it had started, is left, and that 8001 and 8002
  are free again.

The metrics cases serve a copy of the built-in tiny model whose tokenizer.json prepends
<|endoftext|> to a text prompt (as OPT's tokenizer prepends its BOS): upstream's 5-word prompts are
then 6 tokens each, as it expects. The repository's tiny model is not changed. The cancellation case
serves tiny-qwen3 as it is.

Exit status: 0 when every run passed, 1 otherwise. The work directory (--work-dir, default a new
temporary one) keeps every run's server and client logs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from paged_llm.launcher.launch import port_bind_error
from paged_llm.launcher.procfs import descendants, process_group_members
from paged_llm.models.tiny_model import ENDOFTEXT_ID, ensure_tiny_model
from paged_llm.processes import parent_death_signal, process_is_alive
from paged_llm.testing.server_process import free_ports

MODEL_NAME = "vllm_opt"  # the tests' model name
ADDRESS = "127.0.0.1"
GRPC_PORT, METRICS_PORT = 8001, 8002  # hard-coded in the upstream tests (localhost:8001, :8002)
TEST_UTIL = "test_util.py"
BOS_TOKEN = "<|endoftext|>"


@dataclass(frozen=True)
class Case:
    name: str
    which: str  # the --which group it belongs to
    test_dir: str  # upstream's directory of the test file
    file: str
    test_id: str | None  # CLASS.TEST, or None: the whole file
    server_log: str  # test.sh's SERVER_LOG name
    client_log: str
    bos_model: bool  # serve the tiny model with a BOS-prepending tokenizer


CASES = (
    Case(
        "metrics.test_vllm_metrics",
        "metrics",
        "ci/L0_backend_vllm/metrics_test",
        "vllm_metrics_test.py",
        "VLLMTritonMetricsTest.test_vllm_metrics",
        "vllm_metrics_server.log",
        "vllm_metrics_client.log",
        True,
    ),
    Case(
        "metrics.test_custom_sampling_params",
        "metrics",
        "ci/L0_backend_vllm/metrics_test",
        "vllm_metrics_test.py",
        "VLLMTritonMetricsTest.test_custom_sampling_params",
        "vllm_metrics_server.log",
        "vllm_metrics_client.log",
        True,
    ),
    Case(
        "cancellation.test_request_cancellation",
        "cancellation",
        "ci/L0_backend_vllm/request_cancellation",
        "request_cancellation_test.py",
        None,
        "request_cancellation_server.log",
        "request_cancellation_client.log",
        False,
    ),
)


@dataclass
class RunResult:
    case: str
    run: int
    passed: bool = False
    reason: str = ""
    client_rc: int | None = None
    test_results: dict[str, int] | None = None
    startup_s: float = 0.0
    test_s: float = 0.0
    stop_s: float = 0.0
    server_exit: int | None = None
    killed: bool = False
    left_processes: list[int] = field(default_factory=list)
    run_dir: str = ""


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def make_bos_model(target: Path) -> Path:
    """A copy of the built-in tiny model whose tokenizer prepends <|endoftext|> to a text prompt."""
    from tokenizers import Tokenizer, processors

    source = ensure_tiny_model()
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target)
    tokenizer = Tokenizer.from_file(str(target / "tokenizer.json"))
    if tokenizer.token_to_id(BOS_TOKEN) != ENDOFTEXT_ID:
        raise RuntimeError(f"{BOS_TOKEN} is not token {ENDOFTEXT_ID} in {source}")
    steps = [tokenizer.post_processor] if tokenizer.post_processor is not None else []
    steps.append(
        processors.TemplateProcessing(
            single=f"{BOS_TOKEN} $A",
            pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
            special_tokens=[(BOS_TOKEN, ENDOFTEXT_ID)],
        )
    )
    tokenizer.post_processor = processors.Sequence(steps)
    tokenizer.save(str(target / "tokenizer.json"), pretty=True)
    check = Tokenizer.from_file(str(target / "tokenizer.json"))
    ids = check.encode_batch(["The capital of France is"], add_special_tokens=True)[0].ids
    if len(ids) != 6 or ids[0] != ENDOFTEXT_ID:
        raise RuntimeError(f"the BOS tokenizer gives {ids} for upstream's prompt, not 6 tokens from BOS")
    return target


def lay_out_run(run_dir: Path, upstream: Path, case: Case) -> Path:
    """Upstream's layout for one run; returns the test's directory (the client's working directory)."""
    test_dir = run_dir / case.test_dir
    test_dir.mkdir(parents=True)
    shutil.copy2(upstream / case.file, test_dir / case.file)
    common = run_dir / "ci" / "common"
    common.mkdir(parents=True)
    shutil.copy2(upstream / TEST_UTIL, common / TEST_UTIL)
    return test_dir


def paged_llm_command() -> str:
    beside = Path(sys.executable).parent / "paged-llm"
    found = str(beside) if beside.is_file() else shutil.which("paged-llm")
    if not found:
        raise SystemExit("error: no paged-llm executable (run `make setup`, then use .venv/bin/python)")
    return found


def http_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except Exception:
        return None


def port_accepts(port: int) -> bool:
    try:
        with socket.create_connection((ADDRESS, port), timeout=2):
            return True
    except OSError:
        return False


def wait_for_free_ports(ports: tuple[int, ...], timeout_s: float) -> list[int]:
    """The ports still not bindable after `timeout_s` (empty: all free)."""
    deadline = time.monotonic() + timeout_s
    while True:
        busy = [port for port in ports if port_bind_error(ADDRESS, port) is not None]
        if not busy or time.monotonic() >= deadline:
            return busy
        time.sleep(1.0)


class Server:
    """`paged-llm serve` in a process group of its own, its output in `log_path`."""

    def __init__(self, model: str, run_dir: Path, log_path: Path) -> None:
        self.http_port, self.openai_port = free_ports(2)
        command = [
            paged_llm_command(), "serve", model,
            "--served-model-name", MODEL_NAME,
            "--address", ADDRESS,
            "--port", str(self.openai_port),
            "--http-port", str(self.http_port),
            "--grpc-port", str(GRPC_PORT),
            "--metrics-port", str(METRICS_PORT),
            "--model-repository-dir", str(run_dir / "models"),
            "--openai-workers", "1",
            "--max-restarts", "0",
        ]  # fmt: skip
        self.log_path = log_path
        self.log_file = open(log_path, "w")  # closed in stop()
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: what is left of it can be found
            preexec_fn=parent_death_signal(signal.SIGTERM),  # this script killed hard
        )
        self.started: set[int] = set()  # every process seen below it

    def note_descendants(self) -> None:
        self.started.update(descendants(self.process.pid))

    def wait_ready(self, timeout_s: float) -> str | None:
        """None once everything serves; else why not."""
        ready_url = f"http://{ADDRESS}:{self.http_port}/v2/models/{MODEL_NAME}/ready"
        health_url = f"http://{ADDRESS}:{self.openai_port}/health"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.note_descendants()
            if self.process.poll() is not None:
                return f"paged-llm serve exited with {self.process.returncode} before it was ready"
            if (
                http_status(ready_url) == 200
                and port_accepts(GRPC_PORT)
                and port_accepts(METRICS_PORT)
                and http_status(health_url) == 200
            ):
                self.note_descendants()
                return None
            time.sleep(0.5)
        return f"not ready after {timeout_s:.0f} s"

    def stop(self, exit_timeout_s: float, result: RunResult) -> None:
        """SIGTERM to the pid; SIGKILL to the group after `exit_timeout_s`. Records what was left."""
        self.note_descendants()
        group = self.process.pid
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=exit_timeout_s)
            except subprocess.TimeoutExpired:
                result.killed = True
                _kill_group(group)
                self.process.wait(timeout=30)
        result.server_exit = self.process.returncode
        deadline = time.monotonic() + 15.0  # the rest of the group may outlive the launcher by seconds
        while self._left(group) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = self._left(group)
        if left:
            result.left_processes = left
            _kill_group(group)
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.log_file.close()

    def _left(self, group: int) -> list[int]:
        return sorted(set(process_group_members(group)) | {p for p in self.started if process_is_alive(p)})


def _kill_group(group: int) -> None:
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_case(case: Case, run: int, args: argparse.Namespace, bos_model: Path | None) -> RunResult:
    result = RunResult(case.name, run)
    run_dir = args.work_dir / f"{case.name}.{run:02d}"
    result.run_dir = str(run_dir)
    test_dir = lay_out_run(run_dir, args.upstream, case)
    busy = wait_for_free_ports((GRPC_PORT, METRICS_PORT), args.port_wait_s)
    if busy:
        result.reason = f"ports {busy} busy: another server holds them"
        return result
    model = str(bos_model) if case.bos_model and bos_model is not None else "tiny-qwen3"
    started = time.monotonic()
    server = Server(model, run_dir, test_dir / case.server_log)
    try:
        not_ready = server.wait_ready(args.startup_timeout_s)
        result.startup_s = time.monotonic() - started
        if not_ready is not None:
            result.reason = f"server: {not_ready} (see {server.log_path})"
            return result
        module = case.file.removesuffix(".py")
        target = f"{module}.{case.test_id}" if case.test_id else module
        command = [sys.executable, "-m", "unittest", "-v", target]
        test_started = time.monotonic()
        with open(test_dir / case.client_log, "w") as client_log:
            try:
                done = subprocess.run(
                    command,
                    cwd=test_dir,
                    stdin=subprocess.DEVNULL,
                    stdout=client_log,
                    stderr=subprocess.STDOUT,
                    timeout=args.test_timeout_s,
                    check=False,
                )
                result.client_rc = done.returncode
            except subprocess.TimeoutExpired:
                result.reason = f"the test did not finish in {args.test_timeout_s:.0f} s"
        result.test_s = time.monotonic() - test_started
        results_file = test_dir / "test_results.txt"
        if results_file.is_file():
            result.test_results = json.loads(results_file.read_text())
        expected = {"total": 1, "errors": 0, "failures": 0}
        if not result.reason:
            if result.client_rc != 0:
                result.reason = f"unittest exited {result.client_rc} (see {test_dir / case.client_log})"
            elif result.test_results != expected:
                result.reason = f"test_results.txt: {result.test_results}, expected {expected}"
    finally:
        stop_started = time.monotonic()
        server.stop(args.exit_timeout_s, result)
        result.stop_s = time.monotonic() - stop_started
    if not result.reason and result.left_processes:
        result.reason = f"processes left after the server stopped: {result.left_processes}"
    if not result.reason:
        still_bound = wait_for_free_ports((GRPC_PORT, METRICS_PORT), 10.0)
        if still_bound:
            result.reason = f"ports {still_bound} still bound after the server stopped"
    result.passed = not result.reason
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--upstream", type=Path, required=True, help="directory of the copied upstream files")
    parser.add_argument("--runs", type=int, default=10, help="fresh-server runs of each test case")
    parser.add_argument("--which", choices=("metrics", "cancellation", "both"), default="both")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--work-dir", type=Path, help="where runs and logs go (default: a new temp dir)")
    parser.add_argument("--startup-timeout-s", type=float, default=900.0)
    parser.add_argument("--test-timeout-s", type=float, default=900.0, help="per run of a test file")
    parser.add_argument(
        "--exit-timeout-s",
        type=float,
        default=30.0,
        help="SIGTERM to SIGKILL (paged-llm serve itself kills tritonserver after 5 s plus a margin)",
    )
    parser.add_argument("--port-wait-s", type=float, default=60.0, help="wait for 8001/8002 to be free")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.upstream = args.upstream.resolve()
    cases = [case for case in CASES if args.which in ("both", case.which)]
    needed = sorted({case.file for case in cases} | {TEST_UTIL})
    missing = [name for name in needed if not (args.upstream / name).is_file()]
    if missing:
        lacking = ", ".join(missing)
        print(f"error: {args.upstream} lacks {lacking} (see this script's docstring)", file=sys.stderr)
        return 2
    args.work_dir = (
        args.work_dir.resolve() if args.work_dir else Path(tempfile.mkdtemp(prefix="vllm_backend_tests."))
    )
    args.work_dir.mkdir(parents=True, exist_ok=True)
    bos_model = make_bos_model(args.work_dir / "tiny-qwen3-bos") if any(c.bos_model for c in cases) else None
    started = time.monotonic()
    results: list[RunResult] = []
    with tqdm(total=len(cases) * args.runs, unit="run", file=sys.stderr) as progress:
        for run in range(1, args.runs + 1):
            for case in cases:
                progress.set_description(f"{case.name} #{run}")
                result = run_case(case, run, args, bos_model)
                results.append(result)
                if not result.passed:
                    tqdm.write(f"FAIL {case.name} run {run}: {result.reason}", file=sys.stderr)
                progress.update(1)
    wall_s = time.monotonic() - started
    summary = {
        case.name: {
            "passed": sum(r.passed for r in results if r.case == case.name),
            "runs": sum(r.case == case.name for r in results),
        }
        for case in cases
    }
    print(f"work directory: {args.work_dir}")
    for name, counts in summary.items():
        print(f"{name}: {counts['passed']}/{counts['runs']} passed")
    print(f"wall time: {wall_s:.0f} s")
    if args.json:
        report = {
            "upstream": {name: sha256(args.upstream / name) for name in needed},
            "runs_per_case": args.runs,
            "wall_s": round(wall_s, 1),
            "work_dir": str(args.work_dir),
            "summary": summary,
            "results": [asdict(result) for result in results],
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all(result.passed for result in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
