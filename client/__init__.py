"""gRPC streaming client for the `neo` model on Triton (speaks the Triton vLLM backend's tensor names).

    from client import NeoClient
    with NeoClient("127.0.0.1:8001") as c:
        with c.stream("The capital of France is", {"max_tokens": 16, "temperature": 0}) as s:
            for delta in s:
                print(delta, end="", flush=True)
        print(s.result.finish_reason, s.result.num_output_tokens, s.result.stats_line())

`AsyncNeoClient` is the asyncio twin (`async for delta in c.stream(...)`).
"""

from .aio import AsyncNeoClient, AsyncStream
from .chat import DEFAULT_CHAT_TEMPLATE, render_chat
from .errors import ClientError, ModelNotFoundError, RequestTimeoutError, ServerError, ServerUnreachableError
from .protocol import DEFAULT_MODEL, Delta, GenerationResult, default_url
from .sync import NeoClient, Stream

__all__ = [
    "AsyncNeoClient",
    "AsyncStream",
    "ClientError",
    "DEFAULT_CHAT_TEMPLATE",
    "DEFAULT_MODEL",
    "Delta",
    "GenerationResult",
    "ModelNotFoundError",
    "NeoClient",
    "RequestTimeoutError",
    "ServerError",
    "ServerUnreachableError",
    "Stream",
    "default_url",
    "render_chat",
]
