"""What the gateway knows of the Triton model: whether it is ready, its knobs, and its tokenizer's chat template.

The knobs are read from the model's configuration as Triton loaded it (NEO_* overrides included), so the
gateway renders chats with the very tokenizer the engine loaded, however the server was started.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from client import AsyncNeoClient, ClientError
from neo_backend.config import EngineConfig
from neo_backend.errors import InvalidRequestError
from neo_backend.models.loader import load_tokenizer, read_model_config, resolve_source
from neo_backend.models.tokenizer import Tokenizer

from .errors import APIError

log = logging.getLogger("openai_frontend")

READY_POLL_S = 1.0


class ServedModel:
    """The Triton client and the model's knobs and tokenizer; `connect` inside the event loop that serves."""

    def __init__(self, url: str, model: str, timeout: float) -> None:
        self.url, self.model, self.timeout = url, model, timeout
        self._client: AsyncNeoClient | None = None
        self.config: EngineConfig | None = None
        self.tokenizer: Tokenizer | None = None

    def connect(self) -> None:
        """Open the gRPC channel; grpc.aio binds it to the running event loop."""
        self._client = AsyncNeoClient(self.url, self.model, self.timeout)

    @property
    def client(self) -> AsyncNeoClient:
        assert self._client is not None, "connect() first"
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()

    async def load(self) -> None:
        """Wait until Triton serves the model, then load its tokenizer (once; the gateway is ready after it)."""
        last_reason = ""
        while True:
            try:
                await self.client.check_ready()
                parameters = (await self.client.model_config()).get("parameters", {})
                break
            except ClientError as exc:
                if str(exc) != last_reason:  # once per state, not once per poll
                    log.info("waiting for the Triton model: %s", exc)
                    last_reason = str(exc)
                await asyncio.sleep(READY_POLL_S)
        self.config = engine_config(parameters)
        self.tokenizer = await asyncio.to_thread(_tokenizer, self.config)
        log.info(
            "serving model %s (chat template: %s)", self.model, "yes" if self.tokenizer.hf.chat_template else "none"
        )

    async def is_ready(self) -> bool:
        if self.tokenizer is None:
            return False
        try:
            await self.client.check_ready()
        except ClientError:
            return False
        return True

    def require_loaded(self) -> tuple[EngineConfig, Tokenizer]:
        if self.config is None or self.tokenizer is None:
            raise APIError(503, f"model {self.model!r} is not ready yet; retry when GET /health answers 200")
        return self.config, self.tokenizer

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        _, tokenizer = self.require_loaded()
        try:
            return tokenizer.apply_chat_template(messages)
        except InvalidRequestError as exc:  # the model has no chat template
            raise APIError(400, f"{exc} to /v1/completions", param="messages") from None
        except Exception as exc:  # a template may refuse a conversation (raise_exception), e.g. roles out of order
            raise APIError(
                400, f"the model's chat template cannot render these messages: {exc}", param="messages"
            ) from None


def engine_config(parameters: dict[str, Any]) -> EngineConfig:
    """The engine's knobs from the `parameters` of the model's config (backend parameters are no knobs)."""
    known = set(EngineConfig.field_names())
    return EngineConfig.from_strings(
        {k: v.get("string_value", "") for k, v in parameters.items() if k in known},
        source="the Triton model's parameter",
    )


def _tokenizer(config: EngineConfig) -> Tokenizer:
    source = resolve_source(config)
    return load_tokenizer(source, config, read_model_config(source))
