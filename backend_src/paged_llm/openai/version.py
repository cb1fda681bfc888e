"""The installed paged_llm version, as /version and the API page's title give it."""

from __future__ import annotations

import importlib.metadata

try:
    __version__ = importlib.metadata.version("paged_llm")
except importlib.metadata.PackageNotFoundError:  # running from a checkout that was not installed
    __version__ = "0+unknown"
