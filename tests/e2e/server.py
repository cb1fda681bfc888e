"""Test model repositories: copies of the project's models with overridden config parameters."""

from __future__ import annotations

import shutil
from pathlib import Path

from paged_llm.paths import repo_root
from paged_llm.server_process import RunningServer, free_ports, start_server

__all__ = ["RunningServer", "free_ports", "make_model_repository", "start_server"]

REPO_MODELS = repo_root() / "model_repository"


def make_model_repository(
    target: Path, parameters: dict[str, str] | None = None, models: tuple[str, ...] = ("llm", "llm_trtllm")
) -> Path:
    """Copies the repository's models into `target`, overriding `parameters` of the llm model."""
    for name in models:
        shutil.copytree(REPO_MODELS / name, target / name, ignore=shutil.ignore_patterns("__pycache__"))
    if parameters:
        config_path = target / "llm" / "config.pbtxt"
        config = config_path.read_text()
        lines = [line for line in config.splitlines() if not any(f'key: "{k}"' in line for k in parameters)]
        for key, value in parameters.items():
            lines.append(f'parameters: {{ key: "{key}", value: {{ string_value: "{value}" }} }}')
        config_path.write_text("\n".join(lines) + "\n")
    return target
