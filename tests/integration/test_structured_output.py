"""Structured output in the engine on the tiny model (CPU): only the grammar can make a random-weight
model's output valid, so every check here is the grammar's doing.

The property test draws JSON schemas from the supported subset (objects, arrays with bounds, enums,
integer ranges, booleans, strings with patterns or length bounds, nesting, anyOf) and runs each
greedy and sampled with n = 3, all at once: every output that ends with `stop` parses and
validates, and nearly all end within max_tokens. The same runs under preemption (a small KV pool),
chunked prefill, n-gram speculation, asynchronous scheduling (the launched-ahead step samples
after the grammars took the previous token) and in a session turn.
"""

from __future__ import annotations

import json
import re
import threading
import time
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from paged_llm.config import StructuredOutputConfig
from paged_llm.core.sessions import SessionTurn
from paged_llm.engine.llm_engine import LLMEngine
from paged_llm.errors import InvalidRequestError
from paged_llm.sampling.token_bitmask import masked_argmax
from paged_llm.sampling_params import SamplingParams
from paged_llm.structured_output import grammar as grammar_module
from tests.integration.conftest import run_to_completion

pytestmark = pytest.mark.timeout(900)

MAX_TOKENS = 300  # every drawn schema's longest output fits (bounded strings, arrays and depth)
_ENUM_CHARS = st.sampled_from(list('abc xyz"\\é中/'))


def _leaf() -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(
        st.just({"type": "boolean"}),
        st.builds(
            lambda low, span: {"type": "integer", "minimum": low, "maximum": low + span},
            st.integers(-1000, 1000),
            st.integers(0, 5000),
        ),
        st.lists(st.text(_ENUM_CHARS, min_size=1, max_size=5), min_size=1, max_size=4, unique=True).map(
            lambda values: {"enum": values}
        ),
        st.builds(
            lambda low, span: {"type": "string", "minLength": low, "maxLength": low + span},
            st.integers(0, 3),
            st.integers(0, 5),
        ),
        st.sampled_from(["^[a-z]{1,6}$", "^[0-9]{3}-[0-9]{2}$", "^(yes|no)$", "^[A-Z][a-z]{0,4}$"]).map(
            lambda pattern: {"type": "string", "pattern": pattern}
        ),
    )


def _object(children: list[dict[str, Any]], required: list[bool]) -> dict[str, Any]:
    names = [f"p{index}" for index in range(len(children))]
    return {
        "type": "object",
        "properties": dict(zip(names, children, strict=True)),
        "required": [name for name, needed in zip(names, required) if needed],
    }


def _extend(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(
        st.lists(children, min_size=1, max_size=4).flatmap(
            lambda kids: st.lists(st.booleans(), min_size=len(kids), max_size=len(kids)).map(
                lambda required: _object(kids, required)
            )
        ),
        st.builds(
            lambda item, low, span: {"type": "array", "items": item, "minItems": low, "maxItems": low + span},
            children,
            st.integers(0, 2),
            st.integers(0, 2),
        ),
        st.lists(children, min_size=2, max_size=3).map(lambda branches: {"anyOf": branches}),
    )


SCHEMAS = st.recursive(_leaf(), _extend, max_leaves=6)
SCHEMA_BATCHES = st.lists(SCHEMAS, min_size=6, max_size=6)
PROPERTY_SETTINGS = settings(
    max_examples=2,
    deadline=None,
    derandomize=True,  # the same schemas every run: a failure is a bug, never luck
    phases=[Phase.explicit, Phase.generate],  # no shrinking: each example runs an engine for seconds
    suppress_health_check=list(HealthCheck),
)


def _params(schema: dict[str, Any], sampled: bool, seed: int) -> SamplingParams:
    fields: dict[str, Any] = {"max_tokens": MAX_TOKENS, "structured_outputs": {"json": schema}}
    fields.update({"temperature": 1.0, "n": 3, "seed": seed} if sampled else {"temperature": 0.0})
    return SamplingParams.from_mapping(fields)


def check_schema_batch(
    engine: LLMEngine,
    schemas: list[dict[str, Any]],
    prompts: list[list[int]],
    extra: list[tuple[list[int], SamplingParams]] = (),  # type: ignore[assignment]
) -> None:
    """Each schema greedy and sampled (n = 3) in one batch (with `extra` unconstrained requests):
    every stopped output validates, and at most one in 20 runs out of max_tokens."""
    requests = [
        (prompts[index % len(prompts)], _params(schema, sampled, seed=index))
        for index, schema in enumerate(schemas)
        for sampled in (False, True)
    ]
    requests += list(extra)
    results = run_to_completion(engine, [p for p, _ in requests], [params for _, params in requests])
    outcomes = []
    for (_, params), completions in zip(requests, results):
        if params.structured_outputs is None:
            continue
        schema = json.loads(params.structured_outputs.spec)
        for completion in completions:
            outcomes.append(completion.finish_reason)
            if completion.finish_reason == "stop":
                jsonschema.validate(json.loads(completion.text), schema)
    assert set(outcomes) <= {"stop", "length"}, outcomes
    assert outcomes.count("stop") >= 0.95 * len(outcomes), outcomes


@pytest.fixture(scope="module")
def module_engines(tiny_model_dir):
    from tests.integration.conftest import make_engine

    made: dict[str, LLMEngine] = {}

    def get(name: str, **overrides: Any) -> LLMEngine:
        if name not in made:
            made[name] = make_engine(tiny_model_dir, **overrides)
        return made[name]

    yield get
    for engine in made.values():
        engine.shutdown()


@pytest.fixture
def async_engine(module_engines) -> LLMEngine:
    return module_engines("async", async_scheduling="on")


@pytest.fixture
def sync_engine(module_engines) -> LLMEngine:
    return module_engines("sync", async_scheduling="off")


@given(schemas=SCHEMA_BATCHES)
@PROPERTY_SETTINGS
def test_json_schema_outputs_validate_with_asynchronous_scheduling(async_engine, prompts, schemas):
    check_schema_batch(async_engine, schemas, prompts)
    assert async_engine.core.num_steps_launched_ahead > 0
    # the masks' fills reach the stub's figures (paged_llm_grammar_mask_* on /metrics)
    figures = async_engine.stats.snapshot().structured_output
    assert figures.num_mask_fills > 0 and figures.mask_fill_seconds > 0.0


@given(schemas=SCHEMA_BATCHES)
@PROPERTY_SETTINGS
def test_json_schema_outputs_validate_under_preemption_and_chunked_prefill(module_engines, prompts, schemas):
    # 32 blocks of 16 tokens for 18 constrained sequences and four unconstrained ones of ~150
    # tokens each: the scheduler must preempt; a 32-token step budget prefills prompts in chunks.
    engine = module_engines("tight", num_blocks=32, max_num_batched_tokens=32)
    before = engine.scheduler_stats().num_preemptions_total
    usable = sorted((p for p in prompts if 8 < len(p) <= 100), key=len)
    assert len(usable[-1]) > 32
    hogs = [
        (prompt, SamplingParams(max_tokens=100, ignore_eos=True, temperature=0)) for prompt in usable[-4:]
    ]
    check_schema_batch(engine, schemas, usable, hogs)
    assert engine.scheduler_stats().num_preemptions_total > before


@given(schemas=SCHEMA_BATCHES)
@PROPERTY_SETTINGS
def test_json_schema_outputs_validate_with_ngram_speculation(module_engines, prompts, schemas):
    from paged_llm.config import SpeculativeConfig

    engine = module_engines("ngram", speculative=SpeculativeConfig(num_speculative_tokens=3))
    before = engine.scheduler_stats().spec_num_drafts
    repetitive = prompts[4]  # a prompt that repeats itself: n-gram proposals for the unconstrained row
    extra = [(repetitive, SamplingParams(temperature=0.0, max_tokens=64))]
    check_schema_batch(engine, schemas, prompts, extra)
    assert engine.scheduler_stats().spec_num_drafts > before


@given(schemas=st.lists(SCHEMAS, min_size=3, max_size=3))
@PROPERTY_SETTINGS
def test_json_schema_outputs_validate_in_session_turns(module_engines, prompts, schemas):
    from paged_llm.config import SessionConfig

    engine = module_engines("sessions", sessions=SessionConfig(max_sessions=4))
    outcomes = []
    for index, schema in enumerate(schemas):  # one session, a schema per turn, the history growing
        turn = SessionTurn("drawn", start=index == 0, end=index == len(schemas) - 1)
        completion = _run_turn(engine, f"drawn{index}", prompts[index], _params(schema, False, index), turn)
        outcomes.append(completion.finish_reason)
        if completion.finish_reason == "stop":
            jsonschema.validate(json.loads(completion.text), schema)
    assert outcomes.count("stop") >= len(outcomes) - 1, outcomes
    engine.check_integrity()


def test_a_session_turn_is_constrained_and_the_next_turn_is_free(module_engines, prompts):
    from paged_llm.config import SessionConfig

    engine = module_engines("sessions", sessions=SessionConfig(max_sessions=4))
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
    params = SamplingParams.from_mapping(
        {"max_tokens": 40, "temperature": 0, "structured_outputs": {"json": schema}}
    )
    first = _run_turn(engine, "t0", prompts[1], params, SessionTurn("s", start=True))
    assert json.loads(first.text) in ({"answer": "yes"}, {"answer": "no"})
    follow = _run_turn(
        engine, "t1", prompts[0], SamplingParams(max_tokens=12, temperature=0), SessionTurn("s")
    )
    assert follow.finish_reason == "length"  # the grammar ended with its turn: free text, to max_tokens
    regex = SamplingParams.from_mapping({"max_tokens": 20, "structured_outputs": {"regex": "[0-9]{4}"}})
    third = _run_turn(engine, "t2", prompts[2], regex, SessionTurn("s", end=True))
    assert re.fullmatch("[0-9]{4}", third.text) and third.finish_reason == "stop"


def _run_turn(
    engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams, turn: SessionTurn
):
    from tests.integration.conftest import Completion

    engine.add_request(request_id, prompt, params, session=turn)
    completion = Completion()
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert output.error is None, output.error
            for delta in output.sequences:
                completion.text += delta.text
                completion.token_ids.extend(delta.token_ids)
                completion.finish_reason = delta.finish_reason or completion.finish_reason
    return completion


@pytest.mark.parametrize("engine_name", ["sync", "async"])
def test_regex_and_choice_outputs_match_exactly(module_engines, prompts, engine_name):
    engine = module_engines(engine_name, async_scheduling="on" if engine_name == "async" else "off")
    choices = ["yes", "no", 'a "quoted" answer', "中文", "tab\there"]
    requests = [
        ({"regex": r"[a-z]{2,5}-[0-9]{1,3}"}, 0.0),
        ({"regex": r"(red|green|blue)( (red|green|blue)){0,2}"}, 1.0),
        ({"choice": choices}, 0.0),
        ({"choice": choices}, 1.0),
        ({"grammar": 'root ::= "(" digits ")"\ndigits ::= [0-9] | [0-9] [0-9] | [0-9] [0-9] [0-9]'}, 1.0),
    ]
    params = [
        SamplingParams.from_mapping(
            {
                "max_tokens": 64,
                "temperature": temperature,
                "seed": 7,
                "n": 3,
                "structured_outputs": constraint,
            }
        )
        for constraint, temperature in requests
    ]
    results = run_to_completion(engine, prompts[:5], params)
    patterns = [
        r"[a-z]{2,5}-[0-9]{1,3}",
        r"(red|green|blue)( (red|green|blue)){0,2}",
        None,
        None,
        r"\([0-9]{1,3}\)",
    ]
    for pattern, completions in zip(patterns, results):
        for completion in completions:
            assert completion.finish_reason == "stop", completion
            if pattern is None:
                assert completion.text in choices
            else:
                assert re.fullmatch(pattern, completion.text), completion.text


def test_launched_ahead_steps_leave_their_tokens_to_the_fill_thread_and_give_the_same_tokens(
    module_engines, prompts, monkeypatch
):
    """With asynchronous scheduling the grammars take a step's tokens on the bitmask's fill thread,
    just before it fills the next step's mask (the stop rules tell an ended grammar by its EOS):
    greedy and seeded sampled outputs equal the synchronous engine's token for token, ends included
    (grammars that end by themselves, and one cut by max_tokens)."""
    from paged_llm.structured_output.grammar import SequenceGrammar

    original = SequenceGrammar.accept_tokens
    threads: list[str] = []

    def recording(grammars, token_ids):
        threads.append(threading.current_thread().name)
        return original(grammars, token_ids)

    monkeypatch.setattr(SequenceGrammar, "accept_tokens", staticmethod(recording))
    constraints = [
        ({"regex": r"[a-z]{2,5}-[0-9]{1,3}"}, 0.0, 64),
        ({"regex": r"(red|green|blue)( (red|green|blue)){0,4}"}, 1.0, 64),
        ({"choice": ["yes", "no", "maybe not"]}, 1.0, 64),
        ({"regex": "[a-z]{40}"}, 0.0, 6),
    ]
    params = [
        SamplingParams.from_mapping(
            {
                "max_tokens": max_tokens,
                "temperature": temperature,
                "seed": 11,
                "n": 3,
                "ignore_eos": True,  # a grammar's end ends it all the same
                "structured_outputs": c,
            }
        )
        for c, temperature, max_tokens in constraints
    ]
    outputs = {}
    for name, mode in (("sync", "off"), ("async", "on")):
        threads.clear()
        engine = module_engines(name, async_scheduling=mode)
        results = run_to_completion(engine, prompts[:4], params)
        outputs[name] = [[(c.token_ids, c.finish_reason) for c in completions] for completions in results]
        on_fill_thread = sum(thread.startswith("grammar-bitmask") for thread in threads)
        if name == "sync":
            assert on_fill_thread == 0, threads
        else:
            assert on_fill_thread > 0 and engine.core.num_steps_launched_ahead > 0, threads
    assert outputs["async"] == outputs["sync"]
    reasons = [[reason for _, reason in completions] for completions in outputs["async"]]
    assert reasons == [["stop"] * 3] * 3 + [["length"] * 3]


def test_a_grammar_cut_by_max_tokens_ends_with_length(sync_engine, prompts):
    params = SamplingParams.from_mapping(
        {"max_tokens": 5, "temperature": 0, "structured_outputs": {"regex": "[a-z]{40}"}}
    )
    [[completion]] = run_to_completion(sync_engine, prompts[:1], params)
    assert completion.finish_reason == "length" and len(completion.token_ids) == 5
    assert re.fullmatch("[a-z]+", completion.text)
    stats = sync_engine.core.structured.take_stats()
    assert stats is not None and stats.num_length_in_grammar >= 1


@pytest.mark.parametrize("engine_name", ["sync", "async"])
def test_unconstrained_requests_give_their_own_tokens_next_to_constrained_ones(
    module_engines, prompts, engine_name
):
    engine = module_engines(engine_name, async_scheduling="on" if engine_name == "async" else "off")
    free = [
        SamplingParams(max_tokens=24, temperature=0.0),
        SamplingParams(max_tokens=24, temperature=0.9, seed=11, n=2),
        SamplingParams(max_tokens=24, temperature=0.7, top_p=0.8, seed=5, logprobs=2),
    ]
    alone = run_to_completion(engine, prompts[:3], free)
    constrained = SamplingParams.from_mapping(
        {"max_tokens": 24, "temperature": 0.8, "seed": 3, "n": 2, "structured_outputs": {"json_object": True}}
    )
    mixed = run_to_completion(engine, prompts[:3] + prompts[5:8], free + [constrained] * 3)
    assert [[c.token_ids for c in r] for r in mixed[:3]] == [[c.token_ids for c in r] for r in alone]


@pytest.mark.parametrize("engine_name", ["sync", "async"])
def test_greedy_rows_under_a_grammar_take_the_samplers_tokens_without_its_metadata(
    module_engines, prompts, engine_name, monkeypatch
):
    """A step whose rows are all greedy with nothing but a grammar takes the masked argmax
    (runner's masked_argmax, no sampling metadata); with logprobs the same rows go through the
    sampler. The tokens are the same."""
    from paged_llm.runner import model_runner

    engine = module_engines(engine_name, async_scheduling="on" if engine_name == "async" else "off")
    calls = []
    monkeypatch.setattr(model_runner, "masked_argmax", lambda *args: calls.append(1) or masked_argmax(*args))
    constraint = {
        "json": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
    }

    def params(**extra: Any) -> SamplingParams:
        return SamplingParams.from_mapping(
            {"max_tokens": 40, "temperature": 0, "structured_outputs": constraint, **extra}
        )

    fast = run_to_completion(engine, prompts[:3], [params()] * 3)
    assert calls, "the masked-argmax path was not taken"
    calls.clear()
    through_sampler = run_to_completion(engine, prompts[:3], [params(logprobs=0)] * 3)
    assert not calls
    assert [[c.token_ids for c in r] for r in fast] == [[c.token_ids for c in r] for r in through_sampler]
    assert all(c.token_ids and c.finish_reason in ("stop", "length") for r in fast for c in r)


def test_min_tokens_and_stop_strings_with_a_grammar(sync_engine, prompts):
    # min_tokens past the grammar's end: the grammar's EOS is kept (nothing else may follow).
    ended = SamplingParams.from_mapping(
        {"max_tokens": 30, "min_tokens": 20, "temperature": 0, "structured_outputs": {"choice": ["ok"]}}
    )
    # A stop string inside the constrained text ends it there, as for free text.
    stopped = SamplingParams.from_mapping(
        {
            "max_tokens": 30,
            "temperature": 0,
            "stop": ["-"],
            "structured_outputs": {"regex": "[a-c]{3}-[0-9]{3}"},
        }
    )
    [[first], [second]] = run_to_completion(sync_engine, prompts[:2], [ended, stopped])
    assert (first.text, first.finish_reason) == ("ok", "stop")
    assert second.finish_reason == "stop" and re.fullmatch("[a-c]{3}", second.text)


def test_bad_constraints_fail_their_request_only(sync_engine, prompts):
    bad = SamplingParams.from_mapping({"max_tokens": 8, "structured_outputs": {"regex": "(?=a)b"}})
    good = SamplingParams.from_mapping(
        {"max_tokens": 8, "temperature": 0, "structured_outputs": {"regex": "[xy]{3}"}}
    )
    sync_engine.add_request("bad", prompts[0], bad)
    sync_engine.add_request("good", prompts[1], good)
    errors, texts = {}, {"good": ""}
    while sync_engine.has_unfinished_requests():
        for output in sync_engine.step():
            if output.error is not None:
                errors[output.request_id] = output.error
            for delta in output.sequences:
                texts[output.request_id] = texts.get(output.request_id, "") + delta.text
    assert list(errors) == ["bad"]
    assert (
        isinstance(errors["bad"], InvalidRequestError) and errors["bad"].field == "structured_outputs.regex"
    )
    assert "Lookahead" in str(errors["bad"])
    assert re.fullmatch("[xy]{3}", texts["good"])
    sync_engine.check_integrity()


def test_a_compile_over_the_time_cap_fails_its_request_and_the_others_run(module_engines, prompts):
    engine = module_engines("capped", structured_output=StructuredOutputConfig(grammar_compile_timeout_s=0.5))
    properties = {
        f"p{i}": {
            "type": "object",
            "properties": {f"q{j}": {"type": "string", "pattern": "[a-z]{1,8}"} for j in range(20)},
        }
        for i in range(300)
    }
    huge = SamplingParams.from_mapping(
        {"max_tokens": 8, "structured_outputs": {"json": {"type": "object", "properties": properties}}}
    )
    small = SamplingParams.from_mapping(
        {"max_tokens": 8, "temperature": 0, "structured_outputs": {"choice": ["a", "b"]}}
    )
    free = SamplingParams(max_tokens=8, temperature=0)
    engine.add_request("huge", prompts[0], huge)
    engine.add_request("free", prompts[1], free)
    errors, finished = _errors_and_finished(engine)
    assert "grammar_compile_timeout_s" in str(errors["huge"]) and set(errors) == {"huge"}
    assert finished == {"huge", "free"}
    # The killed worker is replaced: the next constrained request compiles.
    [[completion]] = run_to_completion(engine, prompts[2:3], small)
    assert completion.text in ("a", "b")


def test_requests_waiting_for_one_grammar_share_its_compile_and_an_abort_while_waiting_is_clean(
    module_engines, prompts
):
    engine = module_engines("sync", async_scheduling="off")
    schema = {
        "type": "object",
        "properties": {"k": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["k"],
    }
    params = SamplingParams.from_mapping(
        {"max_tokens": 20, "temperature": 0, "structured_outputs": {"json": schema}}
    )
    core = engine.core
    before = core.structured.take_stats()
    compiles_before = before.num_compiles if before else 0
    for index in range(3):
        engine.add_request(f"w{index}", prompts[index], params)
    engine.abort_request("w1")
    texts: dict[str, str] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            for delta in output.sequences:
                texts[output.request_id] = texts.get(output.request_id, "") + delta.text
    assert json.loads(texts["w0"])["k"] in range(100) and json.loads(texts["w2"])["k"] in range(100)
    assert core.structured.take_stats().num_compiles == compiles_before + 1
    engine.check_integrity()
    assert engine.scheduler_stats().kv_usage == 0.0


def test_a_small_constraint_over_the_cap_is_left_on_its_thread_and_compiles_go_to_workers_meanwhile(
    module_engines, prompts
):
    # 12 bytes, seconds to compile: the in-process route's cap fails the request, the thread runs on.
    engine = module_engines("capped", structured_output=StructuredOutputConfig(grammar_compile_timeout_s=0.5))
    compiler = engine.core.structured.compiler
    slow = SamplingParams.from_mapping({"max_tokens": 8, "structured_outputs": {"regex": "[^x]{0,2000}"}})
    [[failed]] = _outcomes(engine, prompts[0], slow)
    assert "grammar_compile_timeout_s" in str(failed)
    if compiler._num_abandoned:  # still compiling: this one must not wait behind it
        small = SamplingParams.from_mapping(
            {"max_tokens": 8, "temperature": 0, "structured_outputs": {"choice": ["left", "right"]}}
        )
        [[completion]] = run_to_completion(engine, prompts[1:2], small)
        assert completion.text in ("left", "right")
        assert compiler._threads, "the compile went to a worker process"
    deadline = time.monotonic() + 120
    while compiler._num_abandoned and time.monotonic() < deadline:
        time.sleep(0.1)
    assert compiler._num_abandoned == 0


def _errors_and_finished(engine: LLMEngine) -> tuple[dict[str, Any], set[str]]:
    """Steps until every request ended: each failed request's error, and the ids that finished."""
    errors, finished = {}, set()
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.error is not None:
                errors[output.request_id] = output.error
            if output.finished:
                finished.add(output.request_id)
    return errors, finished


def _outcomes(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[list[Any]]:
    engine.add_request("one", prompt, params)
    errors = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.error is not None:
                errors.append(output.error)
    return [errors]


@pytest.mark.parametrize("num_constrained", [2, 4])
def test_a_bitmask_fill_that_raises_fails_its_steps_requests_and_the_engine_goes_on(
    async_engine, prompts, monkeypatch, num_constrained
):
    """The launched-ahead step's bitmask fills on the fill thread (a row or two: at once, on the
    core's thread): an error there reaches the core when the next launch samples that step (or at
    once), fails the requests in it (an error, never a hang), returns their blocks, and the engine
    keeps serving."""
    from paged_llm.structured_output.grammar import StepBitmask

    original = StepBitmask._take_and_fill
    calls = {"n": 0}

    def failing_once(self, host, rows, grammar_tokens):
        calls["n"] += 1
        if calls["n"] == 3:
            calls["thread"] = threading.current_thread().name
            raise RuntimeError("injected fill failure")
        return original(self, host, rows, grammar_tokens)

    monkeypatch.setattr(StepBitmask, "_take_and_fill", failing_once)
    params = SamplingParams.from_mapping(
        {"max_tokens": 12, "temperature": 0, "structured_outputs": {"regex": "[a-z]{40}"}}
    )
    constrained = {f"g{index}" for index in range(num_constrained)}
    for index in range(num_constrained):
        async_engine.add_request(f"g{index}", prompts[index], params)
    async_engine.add_request("free", prompts[num_constrained], SamplingParams(max_tokens=12, temperature=0))
    errors, finished = _errors_and_finished(async_engine)
    assert calls["n"] >= 3
    on_fill_thread = calls["thread"].startswith("grammar-bitmask")
    assert on_fill_thread == (num_constrained > grammar_module.MAX_INLINE_FILL_ROWS), calls["thread"]
    assert finished == constrained | {"free"}
    assert constrained <= set(errors) <= constrained | {"free"}
    assert all("injected fill failure" in str(error) for error in errors.values())
    monkeypatch.setattr(StepBitmask, "_take_and_fill", original)
    async_engine.check_integrity()
    assert async_engine.scheduler_stats().kv_usage == 0.0
    [[after]] = run_to_completion(async_engine, prompts[5:6], params)
    assert re.fullmatch("[a-z]+", after.text)
    assert after.finish_reason == "length" or (after.finish_reason == "stop" and len(after.text) == 40)
