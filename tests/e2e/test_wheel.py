"""A wheel built from backend_src serves `paged-llm serve tiny-qwen3` from any directory: installed
into a virtual environment outside the checkout and run from an empty working directory, it answers
an OpenAI completion and a Triton request, and Triton's stub runs the wheel's code, not the checkout's.

Fast on purpose: the environment installs nothing but the wheel (`--no-deps`, no index); a .pth
file lets it see the project's .venv site-packages for the dependencies. That .pth holds a plain
path, which Python appends after the environment's own site-packages and does not scan for .pth
files of its own, so the project's editable install (a .pth hook there) never runs: the wheel's
paged_llm is the only one importable.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from paged_llm.paths import repo_root
from paged_llm.testing.server_process import free_ports, stop_process_group

pytestmark = pytest.mark.timeout(600)

_STARTUP_TIMEOUT_S = 300.0
_STOP_TIMEOUT_S = 20.0  # paged-llm's own exit timeout is 5 s per child


def _run(*command: str | Path, cwd: Path | None = None) -> str:
    done = subprocess.run([str(c) for c in command], cwd=cwd, capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"{command}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def _build_wheel(work: Path) -> Path:
    """From a copy of backend_src: an in-tree build would leave build/ and *.egg-info in the checkout
    (and a stale build/ could put deleted modules into the wheel)."""
    source = work / "backend_src"
    shutil.copytree(
        repo_root() / "backend_src",
        source,
        ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"),
    )
    wheels = work / "wheels"
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
         "-w", wheels, source)  # fmt: skip
    [wheel] = wheels.glob("paged_llm-*.whl")
    return wheel


def _make_venv(target: Path, wheel: Path) -> Path:
    _run(sys.executable, "-m", "venv", "--without-pip", target)
    python = target / "bin" / "python"
    site_packages = Path(
        _run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip()
    )
    (site_packages / "zz_paged_llm_project_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # pip itself comes from the project's site-packages (through the .pth); it installs into `target`.
    _run(python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel)
    return python


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return 0


def _post(port: int, path: str, body: dict) -> tuple[int, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def test_a_wheel_in_a_venv_outside_the_checkout_serves_from_a_temporary_directory(tmp_path, tiny_model_dir):
    checkout = repo_root().resolve()
    assert checkout not in tmp_path.resolve().parents, "the temporary directory must lie outside the checkout"
    python = _make_venv(tmp_path / "venv", _build_wheel(tmp_path / "build"))
    package_dir = Path(_run(python, "-c", "import paged_llm; print(paged_llm.__file__)").strip()).parent
    assert package_dir.is_relative_to(tmp_path / "venv"), (
        f"the editable paged_llm shadows the wheel's: {package_dir}"
    )

    workdir = tmp_path / "cwd"
    workdir.mkdir()
    port, http_port, grpc_port, metrics_port = free_ports(4)
    command = [
        tmp_path / "venv" / "bin" / "paged-llm", "serve", "tiny-qwen3",
        "--port", port, "--http-port", http_port, "--grpc-port", grpc_port, "--metrics-port", metrics_port,
        "--model-repository-dir", workdir / "models", "--openai-workers", "1",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [str(part) for part in command],
            cwd=workdir,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        while _status(f"http://127.0.0.1:{port}/health") != 200:
            assert process.poll() is None, (
                f"exited with {process.returncode}:\n{log_path.read_text()[-4000:]}"
            )
            assert time.monotonic() < deadline, f"not healthy:\n{log_path.read_text()[-4000:]}"
            time.sleep(0.25)

        status, completion = _post(
            port, "/v1/completions", {"model": "llm", "prompt": "Hello", "max_tokens": 4}
        )
        assert status == 200, completion
        assert completion["choices"][0]["finish_reason"] in ("length", "stop")
        status, generated = _post(
            http_port, "/v2/models/llm/generate", {"text_input": "Hello", "max_tokens": 4, "stream": False}
        )
        assert status == 200, generated
        assert isinstance(generated["text_output"], str)

        # The stub logs where its paged_llm comes from (llm_model.py): the wheel's, in the venv.
        lines = [line for line in log_path.read_text().splitlines() if "ready; paged_llm from " in line]
        assert lines, log_path.read_text()[-4000:]
        # Triton's log line quotes the message.
        served_from = Path(lines[-1].split("ready; paged_llm from ", 1)[1].strip().rstrip('"'))
        assert served_from == package_dir, lines
        assert checkout not in served_from.resolve().parents
    finally:
        stop_process_group(process, timeout_s=_STOP_TIMEOUT_S)
    assert process.returncode is not None
