"""The OpenAI server's model list: known models never wait for Triton, one fetch serves everyone."""

from __future__ import annotations

import asyncio

import pytest

from paged_llm.openai.errors import OpenAIError
from paged_llm.openai.model_list import ModelList


class Repository:
    """What Triton's repository index would answer, with a gate to hold the answer back."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.num_fetches = 0
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail = False

    async def ready_models(self) -> list[str]:
        self.num_fetches += 1
        await self.gate.wait()
        if self.fail:
            raise ConnectionError("connection refused")
        return list(self.names)


def test_a_listed_model_goes_on_while_one_background_fetch_renews_a_stale_list():
    async def scenario() -> None:
        repository = Repository(["llm"])
        models = ModelList(repository.ready_models, max_age_s=0.0)
        await models.check("llm")  # first sight: waits for the list
        assert repository.num_fetches == 1
        repository.gate.clear()  # Triton slow to answer from now on
        await asyncio.wait_for(asyncio.gather(*(models.check("llm") for _ in range(64))), timeout=5)
        await asyncio.sleep(0)
        assert repository.num_fetches == 2 and models.refreshing  # one renewal for the 64
        repository.names = ["llm", "other"]
        repository.gate.set()
        while models.refreshing:
            await asyncio.sleep(0)
        assert models.names == ("llm", "other")  # stored before the fetch is seen done

    asyncio.run(scenario())


def test_an_unlisted_name_waits_for_one_shared_fetch_then_404():
    async def scenario() -> None:
        repository = Repository(["llm"])
        models = ModelList(repository.ready_models, max_age_s=60.0)
        await models.check("llm")
        repository.gate.clear()
        waiting = [asyncio.ensure_future(models.check("new")) for _ in range(8)]
        await asyncio.sleep(0.01)
        assert not any(task.done() for task in waiting) and repository.num_fetches == 2
        repository.names = ["llm", "new"]  # loaded meanwhile
        repository.gate.set()
        await asyncio.gather(*waiting)
        with pytest.raises(OpenAIError) as info:
            await models.check("no-such-model")
        assert info.value.status_code == 404 and "does not exist" in info.value.message
        assert repository.num_fetches == 3

    asyncio.run(scenario())


def test_an_unreachable_triton_is_a_503_only_for_names_not_listed():
    async def scenario() -> None:
        repository = Repository(["llm"])
        models = ModelList(repository.ready_models, max_age_s=0.0)
        await models.check("llm")
        repository.fail = True
        await models.check("llm")  # stale: a renewal starts, and this request goes on
        assert models.refreshing
        while models.refreshing:
            await asyncio.sleep(0)
        assert repository.num_fetches == 2 and models.names == ("llm",)  # failed quietly, list kept
        await models.check("llm")
        with pytest.raises(OpenAIError) as info:
            await models.check("other")
        assert info.value.status_code == 503 and "not reachable" in info.value.message

    asyncio.run(scenario())


def test_a_cancelled_fetch_is_a_503_and_a_caller_that_leaves_does_not_cancel_it():
    async def scenario() -> None:
        repository = Repository(["llm"])
        repository.gate.clear()
        models = ModelList(repository.ready_models)
        leaving = asyncio.ensure_future(models.check("llm"))
        staying = asyncio.ensure_future(models.check("llm"))
        await asyncio.sleep(0.01)
        leaving.cancel()
        await asyncio.sleep(0.01)
        assert models.refreshing and not staying.done()  # the fetch goes on for the others
        models._refresh.cancel()  # e.g. the gRPC channel closing under it
        with pytest.raises(OpenAIError) as info:
            await staying
        assert info.value.status_code == 503
        assert leaving.cancelled() and repository.num_fetches == 1

    asyncio.run(scenario())
