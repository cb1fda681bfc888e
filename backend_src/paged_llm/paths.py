"""Where paged_llm keeps built artifacts (backend directory, tool libraries, the built-in tiny model),
and where its model repository template lies (package data: installed with the package)."""

from __future__ import annotations

import os
from pathlib import Path


def paged_llm_home() -> Path:
    """`$PAGED_LLM_HOME`, else `~/.cache/paged_llm`: a user-level cache like Hugging Face's."""
    configured = os.environ.get("PAGED_LLM_HOME")
    return Path(configured) if configured else Path.home() / ".cache" / "paged_llm"


def model_repository_template() -> Path:
    """The model repository shipped in the package (the checkout's top-level `model_repository` is a
    link to it): `paged-llm serve` and the test servers copy it, `tritonserver` can serve it as is."""
    return Path(__file__).resolve().parent / "model_repository"


def repo_root() -> Path:
    """The source checkout, for tests and scripts only (its scripts/ and clients/); the package
    itself never uses it, so that an installed wheel serves from any directory."""
    return Path(__file__).resolve().parents[2]
