"""Runs a real tritonserver (from the nvidia-pytriton wheel) on a model repository.

One place knows how to turn the wheel into a working server, so `make serve`, the end-to-end test
fixture and the benchmark scripts start it the same way:

* a backend directory = the wheel's `backends/python` + the stub built for this Python version;
* the environment: this venv's `bin/` first on PATH (the stub runs the first `python3` it finds) and
  this Python's own LIBDIR first on LD_LIBRARY_PATH (otherwise the stub links the system
  libpython3.11 and importing `ssl` fails with `undefined symbol: _PyModule_Add`);
* perf_analyzer's libraries: `libcudart.so.12` from the `nvidia-cuda-runtime-cu12` wheel and, when
  Debian's libb64-0d is missing, the copy of libb64 bundled in the pytriton wheel.

Usage: `python -m paged_llm.launcher.launch prepare` or
`python -m paged_llm.launcher.launch serve [--model-repository DIR] [--http-port N] ...`.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from paged_llm.launcher import private_files, triton_args
from paged_llm.launcher.guard_process import guarded_ports, start_guard, stop_guard
from paged_llm.launcher.supervise import run_supervised
from paged_llm.paths import model_repository_template, paged_llm_home


def _site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def triton_root() -> Path:
    """The directory holding `pytriton/tritonserver` and `nvidia_pytriton.libs`: $PAGED_LLM_TRITON_ROOT
    (a trimmed copy, as on the GPU hosts), else this environment's site-packages, else any sys.path
    entry that has them (an environment layered over another with a .pth file)."""
    configured = os.environ.get("PAGED_LLM_TRITON_ROOT")
    candidates = [Path(configured)] if configured else [_site_packages(), *map(Path, sys.path)]
    for candidate in candidates:
        if (candidate / "pytriton" / "tritonserver" / "bin" / "tritonserver").is_file():
            return candidate
    where = configured or "this Python environment"
    raise FileNotFoundError(
        f"no pytriton/tritonserver in {where}: install nvidia-pytriton==0.7.0 (run scripts/setup.sh)"
    )


def pytriton_dir() -> Path:
    return triton_root() / "pytriton" / "tritonserver"


def pytriton_libs_dir() -> Path:
    return triton_root() / "nvidia_pytriton.libs"


def python_version_tag() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


# Bumped whenever prepare_backend_dir changes what it writes, so old copies are rebuilt.
_BACKEND_LAYOUT = "p1"

# Appended to our copy of the backend's triton_python_backend_utils.py. The stub builds every BYTES
# output through this function; the original walks the array with np.nditer, which costs ~50 us even
# for the one-element text arrays of a streamed response (measured: 71-77 us per BYTES tensor on a
# 2-core machine, against ~20 us for an INT32 one). Same bytes out, for object arrays only.
_FAST_SERIALIZE = """

# --- added by paged_llm (paged_llm.launcher.launch.prepare_backend_dir) ---
_nditer_serialize_byte_tensor = serialize_byte_tensor


def serialize_byte_tensor(input_tensor):
    if input_tensor.dtype != np.object_ or input_tensor.size == 0:
        return _nditer_serialize_byte_tensor(input_tensor)
    parts = []
    for item in input_tensor.reshape(-1):  # C order, as np.nditer(order="C")
        data = item if type(item) == bytes else str(item).encode("utf-8")  # noqa: E721
        parts.append(struct.pack("<I", len(data)))
        parts.append(data)
    return b"".join(parts)
"""


def backend_dir() -> Path:
    """Backend directory for `--backend-directory` (created by `prepare_backend_dir`)."""
    return paged_llm_home() / f"triton-2.51-py{python_version_tag()}-{_BACKEND_LAYOUT}" / "backends"


def tool_lib_dir() -> Path:
    return paged_llm_home() / "lib"


def prepare_backend_dir() -> Path:
    """Copies the wheel's python backend and puts the stub for this Python inside it."""
    target = backend_dir() / "python"
    stub = target / "triton_python_backend_stub"
    if stub.is_file():
        return backend_dir()
    source = pytriton_dir()
    staging = target.with_name("python.partial")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(source / "backends" / "python", staging, ignore=shutil.ignore_patterns("__pycache__"))
    stub_source = source / "python_backend_stubs" / python_version_tag() / "triton_python_backend_stub"
    shutil.copy2(stub_source, staging / "triton_python_backend_stub")
    utils = staging / "triton_python_backend_utils.py"
    utils.write_text(utils.read_text() + _FAST_SERIALIZE)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return backend_dir()


def _system_has_library(soname: str) -> bool:
    try:
        listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return False
    return soname in listing


def prepare_tool_libs() -> Path:
    """Symlinks the shared libraries perf_analyzer needs into one directory."""
    lib_dir = tool_lib_dir()
    lib_dir.mkdir(parents=True, exist_ok=True)
    wanted: dict[str, Path | None] = {
        "libcudart.so.12": _site_packages() / "nvidia" / "cuda_runtime" / "lib" / "libcudart.so.12",
    }
    if not _system_has_library("libb64.so.0d"):
        bundled = sorted(pytriton_libs_dir().glob("libb64-*.so.0d"))
        wanted["libb64.so.0d"] = bundled[0] if bundled else None
    for soname, source in wanted.items():
        link = lib_dir / soname
        if source is None or not source.exists():
            continue
        if link.is_symlink() or link.exists():
            if link.resolve() == source.resolve():
                continue
            link.unlink()
        link.symlink_to(source)
    return lib_dir


def server_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for tritonserver and its Python stub (see the module docstring)."""
    env = dict(os.environ if base is None else base)
    # AIP_MODE=PREDICTION turns on tritonserver's Vertex AI endpoint (a port the launcher does not
    # guard, on all addresses) and turns HTTP and gRPC off.
    env.pop("AIP_MODE", None)
    venv_bin = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([venv_bin, env.get("PATH", "/usr/bin:/bin")])
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    lib_paths = [libdir, str(pytriton_libs_dir()), env.get("LD_LIBRARY_PATH", "")]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in lib_paths if p)
    return env


def perf_analyzer_env(base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    lib_paths = [str(prepare_tool_libs()), env.get("LD_LIBRARY_PATH", "")]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in lib_paths if p)
    return env


def perf_analyzer_path() -> Path:
    return Path(sys.executable).parent / "perf_analyzer"


@dataclass(frozen=True)
class ServerPorts:
    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002


def server_command(
    model_repository: Path,
    ports: ServerPorts,
    address: str = "127.0.0.1",
    exit_timeout_secs: int = 30,
    extra_args: list[str] | None = None,
    guarded: tuple[str, ...] = (),
) -> list[str]:
    """The tritonserver command line; binds every endpoint to `address` (loopback by default), but
    the `guarded` ones ("http", "metrics") to 127.0.0.1: the HTTP guard serves them on `address`
    (launcher/guard_process.py). It runs through private_files.py: what the server's processes create
    is theirs alone (umask 077, the Python backend's shared memory 0600)."""
    http_address = "127.0.0.1" if "http" in guarded else address
    metrics_address = "127.0.0.1" if "metrics" in guarded else address
    return [
        *private_files.command_prefix(),
        str(pytriton_dir() / "bin" / "tritonserver"),
        f"--model-repository={model_repository}",
        f"--backend-directory={prepare_backend_dir()}",
        f"--http-address={http_address}",
        f"--http-port={ports.http}",
        f"--grpc-address={address}",
        f"--grpc-port={ports.grpc}",
        f"--metrics-address={metrics_address}",
        f"--metrics-port={ports.metrics}",
        f"--exit-timeout-secs={exit_timeout_secs}",
        "--allow-gpu-metrics=false" if not has_nvidia_gpu() else "--allow-gpu-metrics=true",
        *(extra_args or []),
    ]


def has_nvidia_gpu() -> bool:
    return Path("/dev/nvidiactl").exists()


def prepare() -> None:
    from paged_llm.models.tiny_model import ensure_tiny_model

    print(f"[setup] Triton backend directory: {prepare_backend_dir()}", file=sys.stderr)
    print(f"[setup] perf_analyzer libraries: {prepare_tool_libs()}", file=sys.stderr)
    print(f"[setup] built-in tiny model: {ensure_tiny_model()}", file=sys.stderr)


# Set by the launcher itself (the guard in front of HTTP and metrics depends on them): from extra
# arguments they would silently move an endpoint off the guard.
LAUNCHER_OPTIONS = (
    "http-address", "http-port", "grpc-address", "grpc-port", "metrics-address", "metrics-port",
)  # fmt: skip
# Ports the launcher does not guard (SageMaker's can load models; both bind their own address).
_UNGUARDED_ENDPOINTS = ("sagemaker", "vertex-ai")


def endpoint_disabled(extra_args: list[str], endpoint: str) -> bool:
    """True when a tritonserver argument list turns `endpoint` ("http", "grpc", "metrics") off, read
    as tritonserver reads it (launcher/triton_args.py): `--allow-metrics=false`, `--allow-metrics 0`,
    `--allow-met=off`; the last one wins. False for a list tritonserver would refuse."""
    try:
        options = triton_args.parse(extra_args)
        value = triton_args.last_value(options, f"allow-{endpoint}")
        return value is not None and not triton_args.parse_bool(value, f"allow-{endpoint}")
    except triton_args.TritonArgError:
        return False


def guarded_endpoints(extra_args: list[str] | None = None) -> tuple[str, ...]:
    """The endpoints the HTTP guard fronts: HTTP and metrics, those of them that are on."""
    return tuple(name for name in ("http", "metrics") if not endpoint_disabled(extra_args or [], name))


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def _check_launcher_owned(options: list[tuple[str, str | None]]) -> None:
    owned = [name for name in LAUNCHER_OPTIONS if triton_args.values(options, name)]
    if owned:
        raise triton_args.TritonArgError(
            f"--{owned[0]} is the launcher's: use its own --address / --http-port / ... options"
        )
    for endpoint in _UNGUARDED_ENDPOINTS:
        value = triton_args.last_value(options, f"allow-{endpoint}")
        if value is not None and triton_args.parse_bool(value, f"allow-{endpoint}"):
            raise triton_args.TritonArgError(
                f"--allow-{endpoint}: the launcher serves HTTP, gRPC and metrics only"
            )


def exposure_error(address: str, extra_args: list[str]) -> str | None:
    """Why serving with the tritonserver arguments `extra_args` on `address` would be unsafe or
    would not start, or None. The arguments are read as tritonserver reads them (any unique
    prefix, either value form, case-insensitive mode, last one wins). Explicit model control lets
    anyone who reaches the server load a model, i.e. run its Python as the server's user; on an
    address other machines can reach, the repository API must then be restricted with a key on
    every protocol that is on (HTTP counts while it is on: the guard forwards it). Poll mode is
    allowed: Triton refuses load/unload requests in it, so only who can write the repository
    (the server's own user) adds models."""
    try:
        options = triton_args.parse(extra_args)
        _check_launcher_owned(options)
        mode = (triton_args.last_value(options, "model-control-mode") or "none").lower()
        if mode not in ("none", "poll", "explicit"):
            raise triton_args.TritonArgError(f"--model-control-mode: {mode!r} is not none, poll or explicit")
        http_restricted = triton_args.restricted_apis(options, "http-restricted-api")
        grpc_restricted = triton_args.restricted_apis(options, "grpc-restricted-protocol")
    except triton_args.TritonArgError as error:
        return f"refusing to start tritonserver: {error}"
    if mode != "explicit" or _is_loopback(address):
        return None
    missing = [
        f"--{flag}"
        for flag, endpoint, restricted in (
            ("http-restricted-api", "http", http_restricted),
            ("grpc-restricted-protocol", "grpc", grpc_restricted),
        )
        if "model-repository" not in restricted and not endpoint_disabled(extra_args, endpoint)
    ]
    if not missing:
        return None
    return (
        f"refusing to serve with --model-control-mode=explicit on {address}: anyone who reaches it "
        "could load a model and run its Python. Restrict the repository API with a key: "
        + " ".join(f"{flag}=model-repository:admin-key=SECRET" for flag in missing)
        + " (or bind 127.0.0.1)"
    )


def http_host(address: str) -> str:
    """Where a client on this machine reaches a server bound to `address`."""
    if address in ("0.0.0.0", "127.0.0.1"):
        return "127.0.0.1"
    if address in ("::", "::1"):
        return "[::1]"
    return f"[{address}]" if ":" in address else address


def busy_ports(address: str, ports: ServerPorts, extra_args: list[str] | None = None) -> list[str]:
    """The endpoints whose port cannot be bound on `address` now ("HTTP port 8000 ..."), checked
    before tritonserver loads any model: it binds its ports only after loading them all, and a
    server that failed on a busy port used to leave a loaded stub behind."""
    busy = []
    endpoints = (("HTTP", "http", ports.http), ("gRPC", "grpc", ports.grpc))
    for name, flag, port in (*endpoints, ("metrics", "metrics", ports.metrics)):
        if endpoint_disabled(extra_args or [], flag):
            continue  # that endpoint is off
        error = port_bind_error(address, port)
        if error is not None:
            busy.append(f"{name} port {port} on {address} ({error})")
    return busy


def port_bind_error(address: str, port: int) -> str | None:
    """Why `port` cannot be bound on `address` now, or None when it is free. As servers do, a port
    held only by closed connections (TIME_WAIT) is free; a listener is not, even one that set
    SO_REUSEPORT (gRPC does; without the check a second server would share its port and take half
    of its connections)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((address, port))
        except OSError as error:
            return error.strerror or str(error)
    return None


def _serve(args: argparse.Namespace) -> int:
    error = exposure_error(args.address, args.extra)
    if error is not None:
        print(f"error: {error}", file=sys.stderr)
        return 2
    ports = ServerPorts(args.http_port, args.grpc_port, args.metrics_port)
    busy = busy_ports(args.address, ports, args.extra)
    if busy:
        print(
            f"error: cannot serve: {'; '.join(busy)}. Another server is running there? Stop it, or pick "
            "other ports (make serve HTTP_PORT=... GRPC_PORT=... METRICS_PORT=...).",
            file=sys.stderr,
        )
        return 2
    guard_ports = guarded_ports(ports, guarded_endpoints(args.extra))
    command = server_command(
        Path(args.model_repository).resolve(),
        guard_ports.triton,
        args.address,
        args.exit_timeout_secs,
        args.extra,
        guarded=guard_ports.guarded,
    )
    try:
        guard = start_guard(args.address, guard_ports, args.http_max_body_bytes)
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    host = http_host(args.address)
    print(
        f"Starting tritonserver on {args.address} "
        f"(HTTP {ports.http}, gRPC {ports.grpc}, metrics {ports.metrics}).\n"
        "Once it logs 'Started GRPCInferenceService', send a request:\n"
        f'  .venv/bin/python clients/generate.py --url {host}:{ports.grpc} "What is a paged KV cache?"\n'
        f"  curl -s -X POST {host}:{ports.http}/v2/models/llm/generate "
        '-d \'{"text_input": "Hello", "max_tokens": 16}\'\n',
        file=sys.stderr,
        flush=True,
    )
    try:
        return run_supervised(
            command, server_env(), args.exit_timeout_secs, http_url=guard_ports.triton_http_url
        )
    finally:
        stop_guard(guard)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m paged_llm.launcher.launch")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("prepare", help="build the backend directory, tool libraries and the tiny model")
    serve = sub.add_parser("serve", help="run tritonserver on a model repository")
    serve.add_argument("--model-repository", default=str(model_repository_template()))
    serve.add_argument("--address", default=os.environ.get("TRITON_ADDRESS", "127.0.0.1"))
    serve.add_argument("--http-port", type=int, default=int(os.environ.get("HTTP_PORT", 8000)))
    serve.add_argument("--grpc-port", type=int, default=int(os.environ.get("GRPC_PORT", 8001)))
    serve.add_argument("--metrics-port", type=int, default=int(os.environ.get("METRICS_PORT", 8002)))
    serve.add_argument(
        "--exit-timeout-secs", type=int, default=5, help="how long the server waits for models to unload"
    )
    serve.add_argument(
        "--http-max-body-bytes",
        type=int,
        default=64 * 1024 * 1024,
        help="the HTTP guard answers 413 to a request body over this (launcher/http_guard.py)",
    )
    serve.add_argument("extra", nargs="*", help="extra tritonserver arguments (after --)")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        prepare()
        return 0
    return _serve(args)


if __name__ == "__main__":
    raise SystemExit(main())
