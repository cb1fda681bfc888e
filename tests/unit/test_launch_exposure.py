"""The launcher refuses explicit model control on a reachable address unless the repository API is
restricted with a key on both protocols (loading a model runs its Python)."""

from __future__ import annotations

import pytest

from paged_llm.tools.launch import exposure_error, main

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
