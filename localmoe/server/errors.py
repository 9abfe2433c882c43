"""The server's errors as the OpenAI API shapes them: `ApiError` (an HTTP status and one line) and its JSON body,
`{"error": {"message", "type", "param", "code"}}`.

Statuses: 400 a malformed request (not JSON, a field missing, of the wrong type or out of range, a prompt longer
than the context), 401 a wrong or missing API key, 404 an unknown model or route, 405 a wrong method, 413 a body
over the size limit, 422 a well-formed request asking for what localmoe does not do (n > 1, logprobs, images, tools
on a template without them), 503 a full queue (with Retry-After), 500 a failure inside the engine.

Imports nothing from localmoe.
"""

from __future__ import annotations

TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    503: "server_overloaded",
    500: "server_error",
}


class ApiError(Exception):
    """A request the server answers with an error: `status`, a one-line `message` that says what to change, and
    OpenAI's optional `param` (the offending field) and `code`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, " ".join(message.split()), param, code
        self.headers: dict[str, str] = {}

    def body(self) -> dict:
        return error_body(self.status, self.message, param=self.param, code=self.code)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict:
    return {
        "error": {"message": message, "type": TYPES.get(status, "invalid_request_error"), "param": param, "code": code}
    }


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """400: the request is malformed."""
    return ApiError(400, message, param=param, code=code)


def unsupported(message: str, param: str | None = None) -> ApiError:
    """422: well-formed, but not something localmoe does."""
    return ApiError(422, message, param=param, code="unsupported")
