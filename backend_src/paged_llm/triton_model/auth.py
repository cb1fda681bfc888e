"""API keys on Triton's own endpoints: tritonserver forwards the `authorization` header of an
inference request as a request parameter (--http-header-forward-pattern /
--grpc-header-forward-pattern, set by `paged-llm serve --api-key`), and the llm model checks it.

No key and no digest of one sits in config.pbtxt: Triton serves that file to anyone
(GET /v2/models/llm/config). `paged-llm serve` puts a verifier in tritonserver's environment
(API_KEY_VERIFIER_ENV; /proc/<pid>/environ is readable by the server's user alone): one scrypt
digest per key, all with one random salt drawn at each launch. A presented key is checked against
it once (a slow hash, ~50 ms); a key that matched is remembered as an HMAC under a per-process
random secret, so later requests cost one HMAC and constant-time comparisons. At most one entry per
configured key is remembered. Slow checks of keys not seen yet are rate-limited, so that requests
with made-up keys cannot keep the model's execute thread busy hashing.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from paged_llm.errors import InvalidRequestError

AUTHORIZATION_PARAMETER = "authorization"
API_KEY_VERIFIER_ENV = "PAGED_LLM_API_KEY_VERIFIER"

_SCHEME = "scrypt"
# scrypt cost: 16 MiB and ~50 ms per check on a server core (the stub's memory and one request's wait)
SCRYPT_N, SCRYPT_R, SCRYPT_P = 1 << 14, 8, 1
_SALT_BYTES = 16
_DIGEST_BYTES = 32
_SLOW_CHECKS_PER_S = 2.0  # refill of the bucket below
_SLOW_CHECK_BURST = 4

_WRONG_KEY = "missing or wrong API key: send the header 'authorization: Bearer KEY'"
_TOO_MANY = "too many requests with keys not checked yet: retry in a second"


def _scrypt(key: str, salt: bytes, n: int, r: int, p: int) -> bytes:
    return hashlib.scrypt(key.encode(), salt=salt, n=n, r=r, p=p, maxmem=256 * r * n, dklen=_DIGEST_BYTES)


def make_verifier(keys: Sequence[str], salt: bytes | None = None) -> str:
    """`scrypt$N$r$p$SALT$DIGEST,DIGEST...` (hex) for `keys`, with a fresh random salt unless
    given one (tests)."""
    salt = os.urandom(_SALT_BYTES) if salt is None else salt
    digests = ",".join(_scrypt(k, salt, SCRYPT_N, SCRYPT_R, SCRYPT_P).hex() for k in keys)
    return f"{_SCHEME}${SCRYPT_N}${SCRYPT_R}${SCRYPT_P}${salt.hex()}${digests}"


class ApiKeyCheck:
    """Checks forwarded `Bearer KEY` headers against a verifier from make_verifier ("": no keys)."""

    def __init__(self, verifier: str, clock: Callable[[], float] = time.monotonic) -> None:
        self._digests: list[bytes] = []
        if verifier.strip():
            n, r, p, self._salt, self._digests = _parse(verifier.strip())
            self._cost = (n, r, p)
        self._secret = os.urandom(32)
        self._verified: list[bytes] = []  # HMACs of keys that matched: at most len(self._digests)
        self._lock = threading.Lock()
        self._clock = clock
        self._tokens = float(_SLOW_CHECK_BURST)
        self._refilled_at = clock()

    @staticmethod
    def from_environment(environ: Mapping[str, str] | None = None) -> ApiKeyCheck:
        environ = os.environ if environ is None else environ
        return ApiKeyCheck(environ.get(API_KEY_VERIFIER_ENV, ""))

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def check(self, authorization: str | None) -> None:
        """InvalidRequestError unless `authorization` is `Bearer KEY` with a known KEY."""
        if not self._digests:
            return
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise InvalidRequestError(AUTHORIZATION_PARAMETER, _WRONG_KEY)
        mac = hmac.digest(self._secret, token.encode(), "sha256")
        if _any_equal(mac, self._verified):
            return
        with self._lock:
            if _any_equal(mac, self._verified):  # verified meanwhile by another thread
                return
            if not self._take_slow_check():
                raise InvalidRequestError(AUTHORIZATION_PARAMETER, _TOO_MANY)
            if not _any_equal(_scrypt(token, self._salt, *self._cost), self._digests):
                raise InvalidRequestError(AUTHORIZATION_PARAMETER, _WRONG_KEY)
            if len(self._verified) < len(self._digests):
                self._verified = [*self._verified, mac]

    def _take_slow_check(self) -> bool:
        now = self._clock()
        self._tokens = min(_SLOW_CHECK_BURST, self._tokens + (now - self._refilled_at) * _SLOW_CHECKS_PER_S)
        self._refilled_at = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True


def _any_equal(value: bytes, candidates: Sequence[bytes]) -> bool:
    """Whether `value` is one of `candidates`, every one compared in constant time."""
    matched = False
    for candidate in candidates:
        matched |= hmac.compare_digest(value, candidate)
    return matched


def _parse(verifier: str) -> tuple[int, int, int, bytes, list[bytes]]:
    """ValueError naming what is wrong (never the verifier's text: it is a secret's digest)."""
    parts = verifier.split("$")
    if len(parts) != 6 or parts[0] != _SCHEME:
        raise ValueError(f"${API_KEY_VERIFIER_ENV}: expected scrypt$N$r$p$SALT$DIGEST[,DIGEST...]")
    try:
        n, r, p = (int(x) for x in parts[1:4])
        salt = bytes.fromhex(parts[4])
        digests = [bytes.fromhex(d) for d in parts[5].split(",")]
    except ValueError:
        raise ValueError(f"${API_KEY_VERIFIER_ENV}: N, r, p must be integers, SALT and DIGEST hex") from None
    if n < 2 or n & (n - 1) or not 1 <= r <= 64 or not 1 <= p <= 16 or 128 * r * n > 1 << 30 or not salt:
        raise ValueError(f"${API_KEY_VERIFIER_ENV}: scrypt cost out of range (N a power of 2, r, p small)")
    if any(len(d) != _DIGEST_BYTES for d in digests):
        raise ValueError(f"${API_KEY_VERIFIER_ENV}: every DIGEST must be {_DIGEST_BYTES} bytes")
    return n, r, p, salt, digests
