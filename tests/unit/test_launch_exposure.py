"""The launcher refuses explicit model control on a reachable address unless the repository API is
restricted with a key on both protocols (loading a model runs its Python)."""

from __future__ import annotations

import pytest

from paged_llm.launcher.launch import exposure_error, main

EXPLICIT = ["--model-control-mode=explicit"]
HTTP_KEY = "--http-restricted-api=model-repository,shared-memory:admin-key=s3cret"
GRPC_KEY = "--grpc-restricted-protocol=model-repository:admin-key=s3cret"


@pytest.mark.parametrize("address", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_is_always_allowed(address):
    assert exposure_error(address, EXPLICIT) is None


@pytest.mark.parametrize("address", ["0.0.0.0", "10.0.0.5", "::", "myhost.example"])
def test_explicit_control_on_a_reachable_address_needs_both_restrictions(address):
    for extra in (
        EXPLICIT,
        [*EXPLICIT, HTTP_KEY],
        [*EXPLICIT, GRPC_KEY],
        ["--model-control-mode", "explicit"],
    ):
        error = exposure_error(address, extra)
        assert error is not None and address in error
    assert "--grpc-restricted-protocol" in exposure_error(address, [*EXPLICIT, HTTP_KEY])
    assert "--http-restricted-api" in exposure_error(address, [*EXPLICIT, GRPC_KEY])
    assert exposure_error(address, [*EXPLICIT, HTTP_KEY, GRPC_KEY]) is None
    assert exposure_error(address, ["--model-control-mode", "explicit", HTTP_KEY, GRPC_KEY]) is None


def test_restrictions_must_cover_the_repository_api_with_a_key():
    other_api = ["--http-restricted-api=shared-memory:admin-key=x", GRPC_KEY]
    no_value = ["--http-restricted-api=model-repository:admin-key=", GRPC_KEY]
    for extra in (other_api, no_value):
        assert exposure_error("0.0.0.0", [*EXPLICIT, *extra]) is not None


def test_without_explicit_model_control_any_address_is_allowed():
    assert exposure_error("0.0.0.0", []) is None
    assert exposure_error("0.0.0.0", ["--model-control-mode=none"]) is None


def test_serve_refuses_before_starting_anything(capsys):
    ports = ["--http-port", "1", "--grpc-port", "2", "--metrics-port", "3"]
    code = main(["serve", "--address", "0.0.0.0", *ports, "--", "--model-control-mode=explicit"])
    assert code == 2
    assert "refusing to serve with --model-control-mode=explicit on 0.0.0.0" in capsys.readouterr().err


# Every way tritonserver 2.51's getopt_long reads MODE_EXPLICIT (launcher/triton_args.py).
EXPLICIT_SPELLINGS = [
    ["--model-control-mode=explicit"],
    ["--model-control-mode=EXPLICIT"],
    ["--model-control-mode=Explicit"],
    ["--model-control-mode", "EXPLICIT"],
    ["--model-control=explicit"],
    ["--model-contr=explicit"],
    ["--model-cont", "explicit"],
    ["--model-control-mode=none", "--model-control=explicit"],
    ["--model-control-mode=explicit", "--log-verbose=1"],
]


@pytest.mark.parametrize("spelling", EXPLICIT_SPELLINGS, ids=" ".join)
def test_every_spelling_of_explicit_model_control_is_refused_on_a_reachable_address(spelling):
    error = exposure_error("0.0.0.0", spelling)
    assert error is not None and "explicit" in error
    assert exposure_error("127.0.0.1", spelling) is None


@pytest.mark.parametrize(
    "restrictions",
    [
        [HTTP_KEY, GRPC_KEY],
        ["--http-restricted=model-repository:admin-key=k", "--grpc-restricted=model-repository:k=v"],
        ["--http-restricted-api", "model-repository:k=v", "--grpc-restricted-pro", "model-repository:k=v"],
        ["--http-restricted-api=inference:a=b", "--http-restricted-api=model-repository:k=v", GRPC_KEY],
        ["--allow-http=false", GRPC_KEY],
        ["--allow-grpc", "OFF", HTTP_KEY],
    ],
    ids=" ".join,
)
def test_explicit_control_with_the_repository_api_restricted_in_any_spelling_is_allowed(restrictions):
    for spelling in EXPLICIT_SPELLINGS:
        assert exposure_error("0.0.0.0", [*spelling, *restrictions]) is None


def test_the_last_model_control_mode_wins():
    assert exposure_error("0.0.0.0", ["--model-control-mode=explicit", "--model-control-mode=none"]) is None
    assert exposure_error("0.0.0.0", ["--model-control-mode=explicit", "--model-control=POLL"]) is None


@pytest.mark.parametrize(
    "extra",
    [
        ["--model=explicit"],  # a prefix of model-store, model-repository, model-control-mode, ...
        ["--http=x"],
        ["--no-such-option=1"],
        ["--model-control-mode"],  # no value
        ["--help=1"],
        ["-m", "explicit"],
        ["explicit"],
        ["--", "--model-control-mode=explicit"],
        ["--model-control-mode=sometimes"],
        ["--http-restricted-api=model-repository", GRPC_KEY],  # no key
        ["--http-restricted-api=Model-Repository:k=v"],  # API names are exact
        ["--http-restricted-api=model-repository:k=v", "--http-restricted-api=model-repository:j=w"],
    ],
    ids=" ".join,
)
def test_arguments_tritonserver_would_refuse_are_refused(extra):
    for address in ("0.0.0.0", "127.0.0.1"):
        error = exposure_error(address, extra)
        assert error is not None and error.startswith("refusing to start tritonserver")


@pytest.mark.parametrize(
    "extra",
    [
        ["--http-port=1"],
        ["--http-addr", "0.0.0.0"],
        ["--metrics-address=0.0.0.0"],
        ["--grpc-p", "9"],
        ["--allow-sagemaker=true"],
        ["--allow-vertex=ON"],
    ],
    ids=" ".join,
)
def test_options_that_would_move_an_endpoint_off_the_guard_are_refused(extra):
    assert exposure_error("127.0.0.1", extra) is not None


def test_a_value_may_start_with_dashes():
    # `--log-file --model-control-mode=explicit`: the second argument is the log file's name.
    assert exposure_error("0.0.0.0", ["--log-file", "--model-control-mode=explicit"]) is None


def test_the_vertex_ai_environment_switch_is_not_passed_on(monkeypatch):
    from paged_llm.launcher.launch import server_env

    assert "AIP_MODE" not in server_env({"AIP_MODE": "PREDICTION", "PATH": "/bin"})
