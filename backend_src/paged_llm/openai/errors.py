"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from typing import Any

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    503: "service_unavailable_error",
}
RETRY_AFTER_S = 1  # what a 503 tells the client to wait


class OpenAIError(Exception):
    """An error answered to the client with `status_code` (the message names the field)."""

    def __init__(
        self, status_code: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(RETRY_AFTER_S)} if self.status_code == 503 else {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(
                    self.status_code, "server_error" if self.status_code >= 500 else "invalid_request_error"
                ),
                "param": self.param,
                "code": self.code,
            }
        }


INTERNAL_ERROR = OpenAIError(500, "internal server error (the server log says why)")


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param)
