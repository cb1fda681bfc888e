"""Resolves the `model` setting: a checkpoint directory, or the name of a built-in model."""

from __future__ import annotations

from pathlib import Path

from paged_llm.config import ConfigError
from paged_llm.models.tiny_model import TINY_MODEL_NAME, ensure_tiny_model


def resolve_model_dir(model: str, base_dir: Path | None = None) -> Path:
    """`tiny-qwen3` builds (once) and returns the built-in tiny model; anything else is a directory,
    relative paths being taken from `base_dir` (the Triton model's directory) or the working directory."""
    if model == TINY_MODEL_NAME:
        return ensure_tiny_model()
    path = Path(model).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"model {model!r}: {path} is not an HF checkpoint directory (no config.json); "
            "use a local directory with config.json + *.safetensors + tokenizer files, "
            f"or {TINY_MODEL_NAME!r}"
        )
    return path.resolve()
