"""OutputProcessor: what reaches clients when several core steps are applied in one pass."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from paged_llm.engine.core_types import CoreError, EngineCoreOutputs, FinishedRequest, FinishedSequence
from paged_llm.engine.output_processor import OutputProcessor
from paged_llm.engine.stats import EngineStats
from paged_llm.models.tiny_model import ensure_tiny_model
from paged_llm.sampling_params import SamplingParams


@pytest.mark.parametrize("in_session", [False, True])
def test_a_request_a_stop_string_completed_stays_completed_when_the_core_then_reports_an_error(in_session):
    """Step N's token completes a stop string here (the core does not know yet); step N+1, applied in
    the same pass, carries the core's error for the request (its deadline, a fault). The request
    completed: its one final says stop, not the error, and the core is told where it stopped; but a
    session's turn, which the core then did not add to the history, ends with the error."""
    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())
    processor = OutputProcessor(tokenizer, EngineStats())
    params = SamplingParams(max_tokens=8, stop=["zz"])
    core_id = processor.add_request("r", [10, 11, 12], params, 0.0, in_session=in_session)
    token_ids = tokenizer("a zz", add_special_tokens=False)["input_ids"]
    step = EngineCoreOutputs(
        request_ids=[core_id] * len(token_ids), seq_indices=[0] * len(token_ids), new_token_ids=token_ids
    )
    touched, aborts = processor.process(step)
    assert [(a.seq_index, a.reason, a.num_output_tokens) for a in aborts] == [
        (0, "stop string", len(token_ids))
    ]
    error_step = EngineCoreOutputs(
        finished_requests=[FinishedRequest(core_id, CoreError("aborted", "timed out"))]
    )
    more, _ = processor.process(error_step)
    [final] = processor.collect(touched | more)
    assert final.finished and final.sequences[0].text == "a "
    if in_session:  # the core ended the turn with its error: the history did not take it, say so
        assert "timed out" in str(final.error)
    else:
        assert final.error is None and final.sequences[0].finish_reason == "stop"
    assert not processor.has_unfinished_requests()


@pytest.mark.parametrize(
    "ending",
    [
        CoreError("invalid_arg", "LoRA adapter 'made-up' is not loaded", field="lora_name"),  # refused
        CoreError("invalid_arg", "session 's' already has a turn in flight", field="session_id"),
        None,  # a session's close-only request: finished at once, nothing generated
    ],
)
def test_a_request_is_counted_by_adapter_only_once_it_generated_with_it(ending):
    """A name the client chose reaches the stub unchecked when adapters load while serving (the core
    checks it, or not at all for a close-only request): only a request that generated tokens, which
    needs the adapter loaded, counts under its name (a metric label per name)."""
    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())
    stats = EngineStats()
    processor = OutputProcessor(tokenizer, stats)
    refused = processor.add_request("r", [10, 11], SamplingParams(max_tokens=4, lora_name="made-up"), 0.0)
    served = processor.add_request("s", [10, 11], SamplingParams(max_tokens=1, lora_name="tuned"), 0.0)
    step = EngineCoreOutputs(request_ids=[served], seq_indices=[0], new_token_ids=[42])
    step.finished_sequences.append(FinishedSequence(served, 0, "length"))
    if ending is None:
        step.finished_sequences.append(FinishedSequence(refused, 0, "stop"))
    else:
        step.finished_requests.append(FinishedRequest(refused, ending))
    touched, _ = processor.process(step)
    processor.collect(touched)
    assert stats.snapshot().num_requests_by_lora == {"tuned": 1}
