"""The container files (docker/): compose.yaml, kubernetes.yaml, the Dockerfile and entrypoint.sh.

No Docker engine here: the YAML files are parsed and checked for what they promise, the Dockerfile's
instructions are read as text, and the entrypoint runs in its dry-run mode (it prints the command it would
exec), whose arguments must also parse with the real `paged-llm serve` argument parser.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from paged_llm.cli.arguments import build_parser

DOCKER = Path(__file__).resolve().parents[2] / "docker"
ENTRYPOINT = DOCKER / "entrypoint.sh"
BASH = shutil.which("bash") or "/bin/bash"
SERVER_PORTS = {9000, 8000, 8001, 8002}


# --- compose.yaml ---


@pytest.fixture(scope="module")
def service() -> dict[str, Any]:
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    assert list(compose["services"]) == ["paged-llm"]
    return compose["services"]["paged-llm"]


def test_compose_builds_the_dockerfile_from_the_repository_root(service: dict[str, Any]) -> None:
    assert service["build"] == {"context": "..", "dockerfile": "docker/Dockerfile"}
    assert service["restart"] == "unless-stopped"


def test_compose_publishes_every_port_on_loopback_only(service: dict[str, Any]) -> None:
    published = [str(entry).split(":") for entry in service["ports"]]
    assert all(len(parts) == 3 and parts[0] == "127.0.0.1" for parts in published), published
    assert {int(parts[2]) for parts in published} == SERVER_PORTS
    assert all(parts[1] == parts[2] for parts in published)


def test_compose_reserves_one_nvidia_gpu(service: dict[str, Any]) -> None:
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]


def test_compose_requires_an_api_key_and_mounts_the_checkpoint_read_only(service: dict[str, Any]) -> None:
    environment = service["environment"]
    assert environment["PAGED_LLM_API_KEY"].startswith("${PAGED_LLM_API_KEY:?")
    assert "PAGED_LLM_MODEL" in environment
    volumes = [str(volume) for volume in service["volumes"]]
    checkpoint = [volume for volume in volumes if volume.endswith(":/checkpoint:ro")]
    assert len(checkpoint) == 1, volumes
    assert environment["PAGED_LLM_MODEL"] == "${PAGED_LLM_MODEL:-/checkpoint}"
    assert any(volume.split(":")[1] == "/opt/paged_llm/cache" for volume in volumes), volumes


def test_compose_healthcheck_asks_the_openai_server(service: dict[str, Any]) -> None:
    test = service["healthcheck"]["test"]
    assert test[0] == "CMD"
    assert "http://127.0.0.1:9000/health" in " ".join(test)


# --- kubernetes.yaml ---


@pytest.fixture(scope="module")
def manifests() -> dict[str, dict[str, Any]]:
    documents = [doc for doc in yaml.safe_load_all((DOCKER / "kubernetes.yaml").read_text()) if doc]
    by_kind = {doc["kind"]: doc for doc in documents}
    assert sorted(by_kind) == ["Deployment", "Service"]
    return by_kind


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def test_deployment_runs_two_replicas_with_one_gpu_each(manifests: dict[str, dict[str, Any]]) -> None:
    deployment = manifests["Deployment"]
    assert deployment["apiVersion"] == "apps/v1"
    assert deployment["spec"]["replicas"] == 2
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert int(_container(deployment)["resources"]["limits"]["nvidia.com/gpu"]) == 1


def test_deployment_probes(manifests: dict[str, dict[str, Any]]) -> None:
    container = _container(manifests["Deployment"])
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": 9000}
    assert container["livenessProbe"]["tcpSocket"] == {"port": 8000}  # the launcher's guard


def test_deployment_takes_the_api_key_from_a_secret(manifests: dict[str, dict[str, Any]]) -> None:
    env = {entry["name"]: entry for entry in _container(manifests["Deployment"])["env"]}
    key = env["PAGED_LLM_API_KEY"]
    assert "value" not in key
    assert set(key["valueFrom"]["secretKeyRef"]) == {"name", "key"}


def test_deployment_mounts_the_checkpoint_claim_read_only(manifests: dict[str, dict[str, Any]]) -> None:
    deployment = manifests["Deployment"]
    container = _container(deployment)
    env = {entry["name"]: entry.get("value") for entry in container["env"]}
    claims = {
        volume["name"]: volume["persistentVolumeClaim"]
        for volume in deployment["spec"]["template"]["spec"]["volumes"]
        if "persistentVolumeClaim" in volume
    }
    mounts = [mount for mount in container["volumeMounts"] if mount["name"] in claims]
    assert len(mounts) == 1
    assert mounts[0]["readOnly"] is True
    assert claims[mounts[0]["name"]]["readOnly"] is True
    assert env["PAGED_LLM_MODEL"] == mounts[0]["mountPath"]


def test_service_sends_port_80_to_the_openai_server(manifests: dict[str, dict[str, Any]]) -> None:
    service = manifests["Service"]
    assert service["spec"]["type"] == "ClusterIP"
    pod_labels = manifests["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    ports = {port["name"]: port for port in service["spec"]["ports"]}
    assert (ports["openai"]["port"], ports["openai"]["targetPort"]) == (80, 9000)
    assert (ports["grpc"]["port"], ports["grpc"]["targetPort"]) == (8001, 8001)


# --- Dockerfile ---


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comments dropped."""
    text = "\n".join(
        line for line in (DOCKER / "Dockerfile").read_text().splitlines() if not line.lstrip().startswith("#")
    )
    joined = text.replace("\\\n", " ")
    pairs = []
    for line in joined.splitlines():
        if line.strip():
            keyword, _, arguments = line.strip().partition(" ")
            pairs.append((keyword.upper(), arguments.strip()))
    return pairs


def test_dockerfile_entrypoint_runs_the_installed_entrypoint_script() -> None:
    instructions = _instructions()
    copies = [args.split() for keyword, args in instructions if keyword == "COPY"]
    installed = [dest for source, dest in copies if source == "docker/entrypoint.sh"]
    assert len(installed) == 1
    entrypoints = [json.loads(args) for keyword, args in instructions if keyword == "ENTRYPOINT"]
    assert len(entrypoints) == 1
    assert installed[0] in entrypoints[0]


def test_dockerfile_exposes_the_openai_and_triton_ports() -> None:
    exposed = {int(port) for keyword, args in _instructions() if keyword == "EXPOSE" for port in args.split()}
    assert exposed == SERVER_PORTS


def test_dockerfile_installs_backend_src_as_a_plain_package() -> None:
    """Not editable: the model repository template ships as package data, nothing else is copied."""
    instructions = _instructions()
    copies = {tuple(args.split()) for keyword, args in instructions if keyword == "COPY"}
    assert ("backend_src", "/opt/paged_llm/backend_src") in copies
    assert not any(source == "model_repository" for source, *_ in copies)
    runs = " ".join(args for keyword, args in instructions if keyword == "RUN")
    assert "pip install --no-deps /opt/paged_llm/backend_src" in runs
    assert " -e " not in runs
    for package in ("fastapi==", "uvicorn==0.54.0", "tritonclient[grpc]==2.51.0"):
        assert package in runs


# --- entrypoint.sh ---


def test_entrypoint_is_valid_bash() -> None:
    done = subprocess.run([BASH, "-n", str(ENTRYPOINT)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


def _dry_run(path_dir: Path, *args: str, **env: str) -> list[str]:
    """The command the entrypoint prints, with PATH = `path_dir` only (the script needs no programs)."""
    base = {"PATH": str(path_dir), "PYTHON": sys.executable, "HOME": str(path_dir)}
    done = subprocess.run(
        [BASH, str(ENTRYPOINT), *args],
        env={**base, **env},
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return shlex.split(done.stdout)


@pytest.mark.parametrize("mode", ["--print-command", "PAGED_LLM_DRY_RUN"])
def test_entrypoint_dry_run_falls_back_to_python_m(tmp_path: Path, mode: str) -> None:
    if mode == "--print-command":
        command = _dry_run(tmp_path, "--print-command", PAGED_LLM_MODEL="/ckpt")
    else:
        command = _dry_run(tmp_path, PAGED_LLM_MODEL="/ckpt", PAGED_LLM_DRY_RUN="1")
    assert command[:3] == [sys.executable, "-m", "paged_llm.cli"]
    assert "serve /ckpt --address 0.0.0.0" in " ".join(command)
    args = build_parser().parse_args(command[3:])
    assert (args.model, args.address) == ("/ckpt", "0.0.0.0")
    assert (args.port, args.http_port, args.grpc_port, args.metrics_port) == (9000, 8000, 8001, 8002)


def test_entrypoint_passes_ports_and_extra_arguments_on(tmp_path: Path) -> None:
    command = _dry_run(
        tmp_path, "--print-command", "--max-model-len", "4096", "--engine-arg", "a=b c", OPENAI_PORT="9100"
    )
    assert command[command.index("serve") + 1] == "tiny-qwen3"  # the default model
    args = build_parser().parse_args(command[3:])
    assert (args.port, args.max_model_len, args.engine_arg) == (9100, 4096, ["a=b c"])


def test_entrypoint_prefers_paged_llm_on_path(tmp_path: Path) -> None:
    launcher = tmp_path / "paged-llm"
    launcher.write_text("#!/bin/sh\nexit 99\n")  # never run in dry-run mode
    launcher.chmod(0o755)
    command = _dry_run(tmp_path, PAGED_LLM_DRY_RUN="1")
    assert command[:3] == ["paged-llm", "serve", "tiny-qwen3"]


def test_entrypoint_execs_the_command(tmp_path: Path) -> None:
    launcher = tmp_path / "paged-llm"
    launcher.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')  # a stand-in that prints its arguments
    launcher.chmod(0o755)
    env = {"PATH": f"{tmp_path}{os.pathsep}/usr/bin{os.pathsep}/bin", "PAGED_LLM_MODEL": "/ckpt"}
    done = subprocess.run([BASH, str(ENTRYPOINT)], env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[:4] == ["serve", "/ckpt", "--address", "0.0.0.0"]
