"""Where paged_llm keeps built artifacts (backend directory, tool libraries, the built-in tiny model)."""

from __future__ import annotations

import os
from pathlib import Path


def paged_llm_home() -> Path:
    """`$PAGED_LLM_HOME`, else `~/.cache/paged_llm`: a user-level cache like Hugging Face's."""
    configured = os.environ.get("PAGED_LLM_HOME")
    return Path(configured) if configured else Path.home() / ".cache" / "paged_llm"


def repo_root() -> Path:
    """The checkout this package was installed from (editable install: backend_src/paged_llm/..)."""
    return Path(__file__).resolve().parents[2]
