"""What a request asks the grammar to hold its output to, from whichever field the client used, as
the llm model's `sampling_parameters.structured_outputs` (vLLM's keys, structured_output_params.py):

  response_format {"type": "json_object"}                    -> {"json_object": true}
  response_format {"type": "json_schema", "json_schema": {"schema": S, ...}}  -> {"json": S}
  structured_outputs {...} (vLLM's extra body)               -> as given
  guided_json / guided_regex / guided_choice / guided_grammar (vLLM's older extra body)
                                                             -> {"json" | "regex" | "choice" | "grammar": ...}

One constraint per request: two are a 400 naming both. Each is checked here as the llm model checks
it (the same code), so the 400 names the field the client sent (`response_format.json_schema.schema
/properties/tags/uniqueItems`); what only compiling finds (a regex that does not parse) comes back
from the engine naming `structured_outputs...`, and `Constraint.client_error` renames it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from paged_llm.errors import InvalidRequestError
from paged_llm.openai.errors import OpenAIError, bad_request
from paged_llm.structured_output_params import FIELD, KINDS, check_json_schema, parse_structured_outputs

# vLLM's older extra-body fields, each one constraint kind.
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


@dataclass(frozen=True)
class Constraint:
    field: str  # where the client put it, as errors name it
    spec: dict[str, Any]  # the structured_outputs value
    kind: str  # the spec's one kind (structured_output_params.KINDS)

    @property
    def value(self) -> Any:
        return self.spec[self.kind]

    @property
    def compact(self) -> bool:
        """JSON without free whitespace (the engine's default) unless the client asked for it."""
        return self.spec.get("disable_any_whitespace") is not False

    def client_field(self, field: str) -> str:
        """An engine's or the checks' field (`structured_outputs.json/properties/a`) as the client
        named it (`response_format.json_schema.schema/properties/a`)."""
        if not field.startswith(FIELD):
            return field
        rest = field[len(FIELD) :]
        for kind in (self.kind, "structural_tag"):  # (a constraint sent inside a structural tag)
            if rest.startswith(f".{kind}"):
                rest = rest[len(kind) + 1 :]
                break
        return self.field + (rest if rest.startswith("/") else "")

    def client_error(self, error: OpenAIError) -> OpenAIError:
        """`error` (a 400 the engine sent about structured_outputs), renamed to the client's field."""
        if error.status_code != 400 or not (error.param or "").startswith(FIELD):
            return error
        param = error.param or ""
        field = self.client_field(param)
        message = error.message
        if message.startswith(f"{param}:"):
            message = field + message[len(param) :]
        error.param, error.message, error.args = field, message, (message,)
        return error


def checked(field: str, spec: dict[str, Any]) -> Constraint | None:
    """The constraint `spec` (a structured_outputs value) checked as the llm model checks it, its
    errors naming `field`; None when it asks for none."""
    try:
        params = parse_structured_outputs(spec, None)
        if params is not None and params.kind == "json":
            # The stub leaves the schema's checks to the engine (they can take seconds of pure
            # Python for a big schema): here the error names the client's own field at once.
            check_json_schema(json.loads(params.spec), f"{FIELD}.json")
    except InvalidRequestError as error:
        kinds = [kind for kind in KINDS if isinstance(spec, dict) and spec.get(kind) is not None]
        draft = Constraint(field, {}, kinds[0] if len(kinds) == 1 else "")
        where = draft.client_field(error.field) if field != FIELD else error.field
        reason = str(error)[len(error.field) + 2 :]
        raise bad_request(f"{where}: {reason}", where) from None
    if params is None:
        return None
    return Constraint(field if field != FIELD else f"{FIELD}.{params.kind}", spec, params.kind)


def request_constraint(body: Any) -> Constraint | None:
    """The one constraint of a completions or chat body (protocol.py), checked; a 400 for two."""
    found: list[Constraint] = []
    response_format = body.response_format
    if response_format is not None and response_format.type == "json_object":
        found.append(Constraint("response_format", {"json_object": True}, "json_object"))
    elif response_format is not None and response_format.type == "json_schema":
        if response_format.json_schema is None:
            raise bad_request(
                "Missing required parameter: 'response_format.json_schema'", "response_format.json_schema"
            )
        schema = response_format.json_schema.schema_
        if schema is None:  # (OpenAI's schema is optional: any JSON value)
            schema = {}
        found.append(_required(checked("response_format.json_schema.schema", {"json": schema})))
    if body.structured_outputs is not None:
        constraint = checked(FIELD, body.structured_outputs)
        if constraint is not None:
            found.append(constraint)
    for name, kind in GUIDED_FIELDS.items():
        value = getattr(body, name)
        if value is not None:
            found.append(_required(checked(name, {kind: value})))
    if body.guided_whitespace_pattern:
        raise bad_request(
            "guided_whitespace_pattern is not supported; structured_outputs.disable_any_whitespace "
            "chooses between compact JSON (the default) and any whitespace",
            "guided_whitespace_pattern",
        )
    if len(found) > 1:
        raise two_constraints(found[0].field, found[1].field)
    return found[0] if found else None


def two_constraints(first: str, second: str) -> OpenAIError:
    """The 400 of a request with two output constraints (fields as the client named them)."""
    first, second = first.split(".")[0], second.split(".")[0]
    return bad_request(f"one output constraint per request: {first} and {second} were both given", second)


def _required(constraint: Constraint | None) -> Constraint:
    assert constraint is not None  # (a json / regex / choice / grammar value always constrains)
    return constraint
