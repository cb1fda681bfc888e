"""triton_model/auth.py: the llm model's API-key check against a salted scrypt verifier from its
environment (never from config.pbtxt, which Triton serves to anyone)."""

from __future__ import annotations

import hashlib

import pytest

from paged_llm.config import ConfigError, EngineConfig
from paged_llm.errors import InvalidRequestError
from paged_llm.triton_model.auth import API_KEY_VERIFIER_ENV, ApiKeyCheck, make_verifier

WRONG = "authorization: missing or wrong API key"


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_right_keys_pass_and_wrong_or_missing_ones_get_the_per_request_error():
    check = ApiKeyCheck(make_verifier(["one", "two"]))
    assert check.enabled
    for header in ("Bearer one", "bearer two", "BEARER  one "):
        check.check(header)
    for header in (None, "", "Bearer", "Bearer three", "one", "Basic one", "Bearer one2"):
        with pytest.raises(InvalidRequestError, match=WRONG):
            check.check(header)


def test_no_verifier_means_no_key_needed():
    check = ApiKeyCheck.from_environment({})
    assert not check.enabled
    check.check(None)
    assert not ApiKeyCheck("").enabled


def test_the_verifier_comes_from_the_environment_with_a_fresh_salt_at_each_launch():
    first, second = make_verifier(["key"]), make_verifier(["key"])
    assert first != second and first.split("$")[4] != second.split("$")[4]
    assert first.split("$")[:4] == ["scrypt", "16384", "8", "1"]
    for verifier in (first, second):  # either launch's verifier knows the key
        ApiKeyCheck.from_environment({API_KEY_VERIFIER_ENV: verifier}).check("Bearer key")
    # neither the key nor its plain SHA-256 (a dictionary lookup away from a weak key) is in it
    assert "key" not in first.split("$", 1)[1] and hashlib.sha256(b"key").hexdigest() not in first


def test_a_verified_key_is_remembered_and_unknown_keys_are_hashed_at_a_bounded_rate():
    clock = _Clock()
    check = ApiKeyCheck(make_verifier(["good", "other"]), clock=clock)
    check.check("Bearer good")  # the one slow check of this key
    for _ in range(3):  # the rest of the burst, spent on made-up keys
        with pytest.raises(InvalidRequestError, match=WRONG):
            check.check("Bearer made-up")
    with pytest.raises(InvalidRequestError, match="authorization: too many requests with keys not checked"):
        check.check("Bearer other")  # a right key not seen yet waits for the bucket to refill
    for _ in range(100):
        check.check("Bearer good")  # remembered: no slow check, however many requests
    clock.now += 1.0
    check.check("Bearer other")
    with pytest.raises(InvalidRequestError, match=WRONG):
        check.check("Bearer made-up")


def test_a_malformed_verifier_is_refused_without_echoing_it():
    secretish = "scrypt$16384$8$1$zz$" + "ab" * 32
    for bad in ("sha256$abc", secretish, "scrypt$1000$8$1$00$" + "ab" * 32, "scrypt$16384$8$1$00$abcd"):
        with pytest.raises(ValueError, match=API_KEY_VERIFIER_ENV) as raised:
            ApiKeyCheck(bad)
        assert "ab" * 8 not in str(raised.value)


def test_config_pbtxt_takes_no_key_digest():
    with pytest.raises(ConfigError, match=r"'api_key_sha256' in config\.pbtxt is not read"):
        EngineConfig.from_parameters({"api_key_sha256": hashlib.sha256(b"key").hexdigest()})
    assert not any("key" in name for name in vars(EngineConfig().serving))
