"""Typed client errors. Each message names the server address and says what to try next."""

from __future__ import annotations


class ClientError(Exception):
    """Base class of every error the client raises on purpose."""

    exit_code = 1


class ServerUnreachableError(ClientError):
    """Nothing answers gRPC at the address, or the server is not live."""

    exit_code = 3


class ModelNotFoundError(ClientError):
    """The server is up but does not serve the model, or the model is not ready."""

    exit_code = 4


class RequestTimeoutError(ClientError):
    """The request did not complete within its timeout; it was cancelled on the server."""

    exit_code = 5


class ServerError(ClientError):
    """The server answered the request with an error (bad parameters, overload, engine failure)."""

    exit_code = 1

    def __init__(self, message: str, server_message: str = "") -> None:
        super().__init__(message)
        self.server_message = server_message  # the server's own words, for callers that relay them
