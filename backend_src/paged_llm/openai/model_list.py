"""Which models the OpenAI routes may send to: Triton's ready models with vllm_backend's interface,
read once and renewed in the background, so a request for a known model never waits for Triton's
repository index (in a wave of 64 requests, each used to ask again once the list was 2 s old)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from paged_llm.openai.errors import OpenAIError

logger = logging.getLogger(__name__)


class ModelList:
    def __init__(self, fetch: Callable[[], Awaitable[list[str]]], max_age_s: float = 2.0) -> None:
        self._fetch = fetch  # Triton's ready models (TritonClient.ready_models)
        self.max_age_s = max_age_s
        self.names: tuple[str, ...] = ()
        self._read_at = float("-inf")
        self._refresh: asyncio.Future[None] | None = None

    async def check(self, model: str) -> None:
        """Returns at once for a listed model (renewing a list older than max_age_s in the
        background); for another name, waits for a fresh list and raises 404 if it is not there.
        A model unloaded since the list was read is refused by Triton itself (a 404 too)."""
        if model in self.names:
            if time.monotonic() - self._read_at > self.max_age_s:
                self._start()  # a failure is logged; the next stale check tries again
            return
        if model not in await self.refresh():
            raise OpenAIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")

    @property
    def refreshing(self) -> bool:
        return self._refresh is not None and not self._refresh.done()

    async def refresh(self) -> tuple[str, ...]:
        """A fresh list: one request to Triton however many callers wait for it."""
        fetch = self._start()
        try:
            await asyncio.shield(fetch)  # a caller that goes away leaves it running
        except Exception as error:  # (its text names the client library's status codes: the log's)
            logger.info("listing tritonserver's models failed: %s", error)
            raise OpenAIError(503, "tritonserver is not reachable") from None
        except asyncio.CancelledError:
            if fetch.cancelled():  # the fetch itself (e.g. the channel closing), not this caller
                raise OpenAIError(503, "tritonserver is not reachable: the request was cancelled") from None
            raise
        return self.names

    def _start(self) -> asyncio.Future[None]:
        """The fetch in flight, or a new one (started here, synchronously: single-flight)."""
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.ensure_future(self._fetch_and_store())
            self._refresh.add_done_callback(_retrieve)
        return self._refresh

    async def _fetch_and_store(self) -> None:
        names = await self._fetch()
        self.names, self._read_at = tuple(names), time.monotonic()  # before anyone sees it done


def _retrieve(fetch: asyncio.Future[None]) -> None:
    if not fetch.cancelled() and fetch.exception() is not None:
        logger.debug("refresh of the model list failed: %s", fetch.exception())
