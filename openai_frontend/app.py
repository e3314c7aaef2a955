"""The FastAPI application: /v1/completions, /v1/chat/completions, /v1/models and /health over one Triton model."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from .config import GatewayConfig
from .errors import APIError
from .generation import pieces, plan, sampling_parameters
from .responses import ChatBuilder, CompletionBuilder, ResponseBuilder
from .schema import ChatCompletionRequest, CompletionRequest, GenerationRequest
from .served_model import ServedModel

log = logging.getLogger("openai_frontend")

HEALTH_TIMEOUT_S = 2.0
DISCONNECT_POLL_S = 0.1  # how soon a non-streamed request notices that its client went away


class EventStream(StreamingResponse):
    """Server-Sent Events. The body's iterator is closed however the response ends, so a client that went away
    cancels its generations at once instead of whenever the iterator is garbage-collected."""

    media_type = "text/event-stream"

    async def stream_response(self, send: Any) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


def create_app(config: GatewayConfig) -> FastAPI:
    served = ServedModel(config.triton_url, config.model, timeout=HEALTH_TIMEOUT_S)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        served.connect()
        loading = asyncio.create_task(served.load())
        loading.add_done_callback(_log_failure)
        try:
            yield
        finally:
            loading.cancel()
            await served.close()

    app = FastAPI(title="neo-triton OpenAI-compatible API", lifespan=lifespan, docs_url=None, redoc_url=None)
    _install_error_handlers(app)

    def authorize(request: Request) -> None:
        if config.api_key is None:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), config.api_key.encode()):
            raise APIError(
                401, "missing or wrong API key: send the header `Authorization: Bearer <key>`", code="invalid_api_key"
            )

    def check_model(name: str) -> None:
        if name != config.model:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {config.model!r}",
                param="model",
                code="model_not_found",
            )

    @app.get("/health")
    async def health() -> JSONResponse:
        if await served.is_ready():
            return JSONResponse({"status": "ok"})
        raise APIError(503, f"model {config.model!r} is not ready")

    card = {"id": config.model, "object": "model", "created": int(time.time()), "owned_by": "neo-triton"}

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model}", dependencies=[Depends(authorize)])
    async def model(model: str) -> dict[str, Any]:
        check_model(model)
        return card

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(request: CompletionRequest, http: Request) -> Any:
        check_model(request.model)
        served.require_loaded()
        prompts = [request.prompt] if isinstance(request.prompt, str) else request.prompt
        sampling = sampling_parameters(request, request.max_tokens, request.logprobs)
        generations = plan(prompts, request.n, sampling)
        return await _answer(
            http,
            request,
            CompletionBuilder(config.model, generations, request.logprobs),
            pieces(served.client, generations, config.request_timeout_s),
        )

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(request: ChatCompletionRequest, http: Request) -> Any:
        check_model(request.model)
        engine_config, _ = served.require_loaded()
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        prompt = served.render_chat([{"role": m.role, "content": m.text()} for m in request.messages])
        # Without a limit a chat reply may run to the end of the context (max_model_len stops it).
        max_tokens = next(
            (v for v in (request.max_completion_tokens, request.max_tokens) if v is not None),
            engine_config.max_tokens_cap,
        )
        top_logprobs = (request.top_logprobs or 0) if request.logprobs else None
        sampling = sampling_parameters(request, max_tokens, top_logprobs)
        generations = plan([prompt], request.n, sampling)
        return await _answer(
            http,
            request,
            ChatBuilder(config.model, generations, top_logprobs),
            pieces(served.client, generations, config.request_timeout_s),
        )

    return app


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("loading the model's tokenizer failed; the gateway stays not ready", exc_info=task.exception())


async def _answer(
    http: Request, request: GenerationRequest, builder: ResponseBuilder, stream: AsyncIterator[Any]
) -> Any:
    """The whole response, or an event stream. A stream's first piece is awaited before the response starts, so
    a request the model refuses gets its error status rather than a 200 stream holding an error."""
    if not request.stream:
        collecting = asyncio.ensure_future(_collect(builder, stream))
        watching = asyncio.ensure_future(_until_disconnected(http))
        await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
        watching.cancel()
        if not collecting.done():  # the client went away: free the engine's blocks now, not at the answer's end
            collecting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await collecting
            raise APIError(499, "the client closed the connection")
        return collecting.result()
    try:
        first = await stream.__anext__()
    except BaseException:
        await stream.aclose()  # type: ignore[attr-defined]
        raise
    return EventStream(_events(builder, first, stream, request.include_usage))


async def _collect(builder: ResponseBuilder, stream: AsyncIterator[Any]) -> dict[str, Any]:
    try:
        async for piece in stream:
            builder.add(piece)
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    return builder.response()


async def _until_disconnected(http: Request) -> None:
    while not await http.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)


async def _events(
    builder: ResponseBuilder, first: Any, stream: AsyncIterator[Any], include_usage: bool
) -> AsyncIterator[bytes]:
    try:
        piece = first
        while True:
            if (chunk := builder.chunk(piece)) is not None:
                yield _event(chunk)
            try:
                piece = await stream.__anext__()
            except StopAsyncIteration:
                break
        if include_usage:
            yield _event(builder.usage_chunk())
    except APIError as exc:  # the response has started: the error goes into the stream
        yield _event(exc.body())
    except Exception:
        log.exception("stream failed")
        yield _event(APIError(500, "internal error while streaming; see the gateway log").body())
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    yield b"data: [DONE]\n\n"


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def _install_error_handlers(app: FastAPI) -> None:
    def answer(error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return answer(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        return answer(_validation_error(exc))

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return answer(APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        log.exception("request failed")
        return answer(APIError(500, f"internal error ({type(exc).__name__}); see the gateway log"))


def _validation_error(exc: RequestValidationError) -> APIError:
    """The first problem FastAPI found in the body, named by its field."""
    error = exc.errors()[0]
    location = [str(part) for part in error["loc"] if part != "body"]
    field = ".".join(location) or None
    if error["type"] == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {error.get('ctx', {}).get('error', error['msg'])}")
    if error["type"] == "extra_forbidden":
        return APIError(400, f"unknown parameter {field!r}: this server does not support it", param=field)
    if error["type"] == "missing":
        return APIError(400, f"missing required parameter {field!r}", param=field)
    return APIError(400, f"invalid value for {field!r}: {error['msg']}", param=field)
