"""Errors in OpenAI's JSON shape (`{"error": {"message", "type", "param", "code"}}`) with their HTTP status."""

from __future__ import annotations

from client import ClientError, ModelNotFoundError, RequestTimeoutError, ServerError, ServerUnreachableError

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout",
}

# A decoupled model's error reaches a gRPC stream as its message only, without the model's status code, so the
# engine's wording tells a refused request from a failed one. Anything not recognised is a server error.
_MODEL_ERROR_STATUS = (  # (marker, status, the request field at fault)
    ("server is at capacity", 429, None),  # admission control: the waiting queue is full
    ("engine is not running", 503, None),
    ("server is shutting down", 503, None),
    ("prompt ", 400, "prompt"),  # empty, over max_prompt_bytes, or no room under max_model_len
    ("the server's limit", 400, None),  # max_tokens_cap, max_stop_strings, max_logprobs, ...
    ("must be", 400, None),  # a sampling value out of range
    ("unknown sampling parameter", 400, None),
)


class APIError(Exception):
    """An error answered to the client as it is; `param` names the request field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, dict[str, str | None]]:
        return {
            "error": {
                "message": self.message,
                "type": ERROR_TYPES.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }


def from_client_error(exc: ClientError) -> APIError:
    """The answer for an error the Triton client raised."""
    if isinstance(exc, ServerError):
        message = exc.server_message or str(exc)
        status, param = next(((s, p) for marker, s, p in _MODEL_ERROR_STATUS if marker in message), (500, None))
        return APIError(status, message, param=param)
    if isinstance(exc, (ServerUnreachableError, ModelNotFoundError)):
        return APIError(503, f"the model is not available: {exc}")
    if isinstance(exc, RequestTimeoutError):
        return APIError(504, str(exc))
    return APIError(500, str(exc))
