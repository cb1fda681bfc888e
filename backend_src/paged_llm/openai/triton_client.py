"""The Triton server behind the OpenAI routes: which transport carries a request, what its
errors become (OpenAI statuses), which models the routes can send to, and whether one is healthy.

Streamed requests go over Triton's HTTP generate_stream when its HTTP endpoint is given
(triton_http.py: cheaper per response in Python); the others, and every request without it, over
gRPC (triton_grpc.py). What a request holds and what its responses become is theirs in common
(triton_request.py).

Our `llm` model is asked (request parameter `paged_llm_error_output`) to send its errors as an
ordinary final response holding `paged_llm_error` = "<label>\\t<message>": over a gRPC stream Triton
2.51 passes only an error's message, and the HTTP status depends on its code. Other models' errors
arrive as messages and are classified by their text.

Closing the async generator before the final response (the HTTP client went away) cancels the gRPC
call, or closes the HTTP connection; Triton then reports the request cancelled to the model, which
aborts it and frees its KV.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from paged_llm.openai.errors import OpenAIError
from paged_llm.openai.triton_grpc import GrpcStreams, channel_options
from paged_llm.openai.triton_http import GenerateStreams
from paged_llm.openai.triton_request import (
    ADD_SPECIAL_TOKENS_PARAMETER,
    CONTEXT_MUST_FIT_PARAMETER,
    ERROR_OUTPUT,
    ERROR_OUTPUT_PARAMETER,
    PAGED_LLM_OUTPUTS,
    TOTALS_ON_FINAL_PARAMETER,
    GenerationChunk,
    GenerationRequest,
    StreamRefused,
    TritonUnreachable,
    parse_outputs,
)

logger = logging.getLogger(__name__)
# /health sends no probe when the model answered a request this recently, and none failed meanwhile
PROBE_SKIP_S = 5.0
PROBE_TIMEOUT_S = 3.0  # below the usual 5 s of a readiness probe's own timeout
# Our llm model answers a request with this parameter from its own state (triton_model/health_probe.py):
# an empty final while its engine serves, its UNAVAILABLE error while not; no inference, no metrics.
HEALTH_PROBE_PARAMETER = "paged_llm_health_probe"
LORA_ADMIN_PARAMETER = "paged_llm_lora_admin"  # triton_model/lora_admin.py
# Our llm model's errors that say its engine does not serve (a dead or restarting core).
_ENGINE_DOWN_STATUSES = (500, 503)
# `paged_llm_error` labels (as in paged_llm_final_responses_total) -> HTTP status.
_STATUS_OF_LABEL = {
    "invalid_arg": 400,
    "not_found": 404,
    "unavailable": 503,
    "cancelled": 503,
    "internal": 500,
}


class BackendError(OpenAIError):
    """The model refused or failed the request."""

    from_model: bool = False  # sent by our llm model itself (the error output), not by Triton


def classify_error_message(message: str) -> BackendError:
    """A model's error that came as a message only (not from our llm model)."""
    lowered = message.lower()
    if "stub process" in lowered and "not healthy" in lowered:  # Triton 2.51: the model's stub died
        return BackendError(503, "the model is not healthy (its backend process stopped); retry later")
    if "unknown model" in lowered or "is not found" in lowered:
        return BackendError(404, message, "model", "model_not_found")
    if "unavailable" in lowered or "queue is full" in lowered or "retry later" in lowered:
        return BackendError(503, message)
    if "invalid" in lowered or "unexpected inference input" in lowered:
        return BackendError(400, message)
    return BackendError(500, message)


def error_from_output(values: list[str]) -> BackendError:
    label, _, message = values[0].partition("\t")
    status = _STATUS_OF_LABEL.get(label, 500)
    param = message.split(": ", 1)[0] if status == 400 and ": " in message else None
    error = BackendError(status, message, _openai_param(param))
    error.from_model = True
    return error


def _openai_param(engine_field: str | None) -> str | None:
    """The engine names sampling_parameters keys or the prompt input; say what the client sent."""
    if engine_field in (None, "text_input", "input_ids"):
        return "prompt" if engine_field else None
    if engine_field.startswith("sampling_parameters."):
        return engine_field.split(".", 1)[1]
    return engine_field


class TritonClient:
    """The Triton server behind the OpenAI routes (one aio gRPC channel for the generation streams,
    tritonclient's for the other calls, one HTTP connection pool)."""

    def __init__(self, url: str, api_key: str | None = None, http_url: str | None = None) -> None:
        import tritonclient.grpc.aio as grpcclient

        self.url = url
        # With Triton's HTTP endpoint given, streamed generation requests go there (triton_http.py
        # says why); the others, the model index, configs and readiness stay on gRPC.
        self._http = GenerateStreams(http_url, api_key) if http_url else None
        self._grpc = GrpcStreams(url, api_key)
        self._client = grpcclient.InferenceServerClient(url, channel_args=channel_options())
        self._kind_cache: dict[str, tuple[bool, bool]] = {}
        self._last_answer_at: dict[str, float] = {}  # model -> when it last sent a response
        self._last_failure_at: dict[str, float] = {}  # model -> when it last sent a 500/503 error
        self._probes: dict[str, asyncio.Future[bool]] = {}  # model -> the /health probe in flight

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
        await self._grpc.close()
        await self._client.close()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """The model's responses as chunks, the last one `is_final`; BackendError on failure."""
        parameters = {ERROR_OUTPUT_PARAMETER: True}
        outputs = None
        totals_on_final = False
        if await self._is_paged_llm(request.model):
            # Only what the routes read: the model then builds nothing else (no output_ids).
            outputs = (*PAGED_LLM_OUTPUTS, *(("logprobs",) if request.want_logprobs else ()))
            parameters[CONTEXT_MUST_FIT_PARAMETER] = True
            if isinstance(request.prompt, str):
                parameters[ADD_SPECIAL_TOKENS_PARAMETER] = request.add_special_tokens
            totals_on_final = request.stream and not request.want_logprobs
            if totals_on_final:
                parameters[TOTALS_ON_FINAL_PARAMETER] = True
        transport: GenerateStreams | GrpcStreams = self._grpc
        if self._http is not None and request.stream:
            # (A request that is not streamed stays on gRPC: Triton 2.51's HTTP server notices a
            # client that left only when it writes to it, and such a request has nothing to write
            # until it ends, so its cancellation would come too late. Its one response makes the
            # cost per response moot.)
            transport = self._http
        # A final response always comes over gRPC (Triton marks it), and from our llm model over
        # HTTP (finish_reason); other models' HTTP streams simply end.
        final_expected = transport is self._grpc or outputs is not None
        final_seen = False
        try:
            async with aclosing(transport.responses(request, outputs, parameters)) as responses:
                async for outputs_of, is_final in responses:
                    if ERROR_OUTPUT in outputs_of:
                        error = error_from_output(outputs_of[ERROR_OUTPUT])
                        if error.status_code in _ENGINE_DOWN_STATUSES:
                            self._last_failure_at[request.model] = time.monotonic()
                        raise error
                    self._last_answer_at[request.model] = time.monotonic()
                    final_seen = final_seen or is_final
                    yield parse_outputs(outputs_of, is_final, totals_on_final)
        except StreamRefused as error:
            raise classify_error_message(error.message) from None
        except TritonUnreachable as error:
            # (What the connection said is the log's: it names the client library's exceptions.)
            if not error.reached:
                logger.warning("cannot reach tritonserver at %s: %s", transport.url, error)
                raise BackendError(503, f"cannot reach tritonserver at {transport.url}") from None
            logger.warning("the stream from tritonserver at %s broke: %s", transport.url, error)
            raise BackendError(503, "the stream from tritonserver broke before its final response") from None
        if final_expected and not final_seen:
            raise BackendError(500, "tritonserver closed the stream before the final response")

    async def _kind(self, model: str) -> tuple[bool, bool] | None:
        """(has vllm_backend's interface, is our llm model), from the model's config (cached), or
        None while the config cannot be read."""
        known = self._kind_cache.get(model)
        if known is None:
            try:
                config = await self._client.get_model_config(model, as_json=True, client_timeout=5.0)
            except Exception:
                return None  # unknown for now (the request itself will say why); ask again next time
            config = config.get("config", config)
            inputs = {i.get("name") for i in config.get("input", [])}
            outputs = {o.get("name") for o in config.get("output", [])}
            known = ("sampling_parameters" in inputs and "text_output" in outputs, ERROR_OUTPUT in outputs)
            self._kind_cache[model] = known
        return known

    async def _is_paged_llm(self, model: str) -> bool:
        """Whether `model` is our llm model (it has the error output); other vllm_backend-style
        models get no requested outputs (they send theirs), so a name they lack cannot fail them."""
        kind = await self._kind(model)
        return kind is not None and kind[1]

    async def ready_models(self) -> list[str]:
        """The ready models with vllm_backend's request interface (the ones these routes can send
        to; e.g. the TensorRT-LLM convention's models are left out)."""
        index = await self._client.get_model_repository_index(as_json=True, client_timeout=5.0)
        ready = sorted({m["name"] for m in index.get("models", []) if m.get("state") == "READY"})
        kinds = [await self._kind(name) for name in ready]
        return [name for name, kind in zip(ready, kinds, strict=True) if kind is None or kind[0]]

    async def is_ready(self, model: str) -> bool:
        """Triton and the model say ready, and the model answers. Triton 2.51 keeps calling a model
        ready after its Python stub died (every request then fails "Stub process ... is not
        healthy"), and our llm model stays ready while its engine core is dead or restarting, so
        unless a response came from the model within the last PROBE_SKIP_S (and no engine error
        since), it is probed: our llm model answers HEALTH_PROBE_PARAMETER from its own state
        (healthy only while its engine serves); another model gets a one-token request, where any
        answer but Triton's "not healthy" means alive (today's rule for models that are not ours)."""
        try:
            ready = bool(await self._client.is_server_ready(client_timeout=2.0)) and bool(
                await self._client.is_model_ready(model, client_timeout=2.0)
            )
        except Exception:
            return False
        if not ready:
            return False
        now = time.monotonic()
        answered_recently = now - self._last_answer_at.get(model, -PROBE_SKIP_S) < PROBE_SKIP_S
        failed_recently = now - self._last_failure_at.get(model, -PROBE_SKIP_S) < PROBE_SKIP_S
        if answered_recently and not failed_recently:
            return True
        # One probe at a time per model, shared by every /health caller meanwhile.
        probe = self._probes.get(model)
        if probe is None or probe.done():
            probe = self._probes[model] = asyncio.ensure_future(self._probe(model))
        return await asyncio.shield(probe)

    async def _probe(self, model: str) -> bool:
        if await self._is_paged_llm(model):
            return await self._probe_paged_llm(model)
        request = GenerationRequest(model, [0], {"max_tokens": 1}, False, False, "paged_llm-health-probe")

        async def drain() -> None:
            async for _chunk in self.generate(request):
                pass

        try:
            await asyncio.wait_for(drain(), PROBE_TIMEOUT_S)
        except BackendError as error:
            # A message-only error is Triton's (a dead stub) or the model's; only "not healthy"
            # counts as dead there.
            return error.from_model or "not healthy" not in error.message
        except TimeoutError:
            # A dead stub is refused at once; a probe still waiting is queued behind real work.
            return True
        except Exception as error:
            logger.warning("health probe of %s failed: %s", model, error)
            return False
        return True

    async def _probe_paged_llm(self, model: str) -> bool:
        """Healthy only on the model's own empty final: its error (the engine is down or being
        restarted), Triton's (a dead stub) or no answer at all mean not."""
        request = GenerationRequest(model, "", {}, False, False, "paged_llm-health-probe")
        parameters = {ERROR_OUTPUT_PARAMETER: True, HEALTH_PROBE_PARAMETER: True}

        async def answer() -> str | None:
            async with aclosing(self._grpc.responses(request, None, parameters)) as responses:
                async for outputs_of, is_final in responses:
                    if ERROR_OUTPUT in outputs_of:
                        return outputs_of[ERROR_OUTPUT][0].partition("\t")[2]
                    if is_final:
                        return None
            return "tritonserver closed the stream before the final response"

        try:
            problem = await asyncio.wait_for(answer(), PROBE_TIMEOUT_S)
        except (StreamRefused, TritonUnreachable) as error:
            problem = str(error)
        except Exception as error:  # a timeout (asyncio's own class on Python 3.10), or a bug
            # The stub answers from its state at once: no answer means it is stuck, or the
            # server is (a dead stub is refused at once).
            problem = f"no answer within {PROBE_TIMEOUT_S:.0f} s ({type(error).__name__})"
        now = time.monotonic()
        if problem is None:
            self._last_answer_at[model] = now
            return True
        self._last_failure_at[model] = now
        logger.warning("health probe of %s: %s", model, problem)
        return False

    async def lora_admin(self, model: str, command: dict[str, str]) -> list[str]:
        """Asks `model` (our llm model) to load, unload or list LoRA adapters (triton_model/
        lora_admin.py); the adapters it serves now, or BackendError with its refusal."""
        request = GenerationRequest(model, "", {}, False, False, f"paged_llm-lora-{command['action']}")
        parameters = {ERROR_OUTPUT_PARAMETER: True, LORA_ADMIN_PARAMETER: json.dumps(command)}
        async with aclosing(self._grpc.responses(request, None, parameters)) as responses:
            async for outputs_of, is_final in responses:
                if ERROR_OUTPUT in outputs_of:
                    raise error_from_output(outputs_of[ERROR_OUTPUT])
                if "text_output" in outputs_of:
                    return list(json.loads(outputs_of["text_output"][0])["lora_names"])
                if is_final:
                    break
        raise BackendError(500, "the model answered a LoRA request without its adapters")

    async def server_version(self) -> str:
        metadata = await self._client.get_server_metadata(as_json=True, client_timeout=2.0)
        return str(metadata.get("version", ""))

    async def model_parameters(self, model: str) -> dict[str, str]:
        config = await self._client.get_model_config(model, as_json=True, client_timeout=5.0)
        parameters = config.get("config", config).get("parameters", {})
        return {k: v.get("string_value", "") for k, v in parameters.items()}
