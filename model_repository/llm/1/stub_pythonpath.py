"""Imported by model.py before the paged_llm package: Triton's stub runs an isolated interpreter,
which ignores PYTHONPATH. Take it as python does, so that a stub started from a checkout runs that
checkout's package (and the engine core, started with the package the stub imported, too)."""

from __future__ import annotations

import os
import sys

sys.path[0:0] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
