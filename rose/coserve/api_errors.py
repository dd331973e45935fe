"""The HTTP API's errors: every one is answered with an OpenAI-style body,
`{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from fastapi.responses import JSONResponse

RETRY_AFTER_S = 1


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.code, self.headers = code, headers

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status, headers=self.headers)


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


def busy(status: int, message: str, code: str) -> APIError:
    """A 429 (too many waiting) or a 503 (overloaded) that tells the client when to retry."""
    kind = "rate_limit_error" if status == 429 else "server_error"
    return APIError(status, message, kind=kind, code=code, headers={"Retry-After": str(RETRY_AFTER_S)})
