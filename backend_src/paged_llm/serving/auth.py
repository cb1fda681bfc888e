"""API keys on Triton's own endpoints: tritonserver forwards the `authorization` header of an
inference request as a request parameter (--http-header-forward-pattern /
--grpc-header-forward-pattern, set by `paged-llm serve --api-key`), and the llm model checks it
against the SHA-256 digests in its `api_key_sha256` parameter (the keys themselves never sit in
config.pbtxt). Triton's health, metadata and metrics endpoints stay open; inference needs a key."""

from __future__ import annotations

import hashlib
import hmac

from paged_llm.errors import InvalidRequestError

AUTHORIZATION_PARAMETER = "authorization"


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class ApiKeyCheck:
    def __init__(self, digests_csv: str) -> None:
        self._digests = [bytes.fromhex(d.strip()) for d in digests_csv.split(",") if d.strip()]

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def check(self, authorization: str | None) -> None:
        """InvalidRequestError unless `authorization` is `Bearer KEY` with a known KEY (every digest
        is compared, each in constant time)."""
        if not self._digests:
            return
        scheme, _, token = (authorization or "").partition(" ")
        digest = hashlib.sha256(token.strip().encode()).digest()
        matched = False
        for known in self._digests:
            matched |= hmac.compare_digest(digest, known)
        if scheme.lower() != "bearer" or not matched:
            raise InvalidRequestError(
                AUTHORIZATION_PARAMETER,
                "missing or wrong API key: send the header 'authorization: Bearer KEY'",
            )
