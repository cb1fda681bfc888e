"""The OpenAI server's figures across worker processes (--workers > 1): each worker writes its own
to the shared metrics directory every second (and once more at exit), and /metrics in any of them
adds the others' to its own."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path

from paged_llm.openai.metrics import OpenAIMetrics
from paged_llm.processes import process_is_alive

logger = logging.getLogger(__name__)
PUBLISH_S = 1.0


def write_own(metrics: OpenAIMetrics, directory: Path) -> None:
    path = directory / f"{os.getpid()}.json"
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(metrics.to_dict()))
    temporary.replace(path)  # atomic: a reader never sees half a file


async def publish(metrics: OpenAIMetrics, directory: Path) -> None:
    while True:
        try:
            write_own(metrics, directory)
        except OSError as error:
            logger.warning("could not publish this worker's metrics: %s", error)
        await asyncio.sleep(PUBLISH_S)


def other_workers(directory: Path | None) -> list[dict]:
    """The figures the other workers last wrote (none without a directory: a single worker)."""
    if directory is None:
        return []
    states = []
    for path in directory.glob("*.json"):
        if path.stem != str(os.getpid()):
            try:
                state = json.loads(path.read_text())
            except (OSError, ValueError):
                continue  # a worker replacing its file right now
            if not process_is_alive(int(path.stem)):
                state["in_flight"] = 0  # a worker that died: its counts stay, its streams do not
            states.append(state)
    return states
