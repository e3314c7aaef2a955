"""An OpenAI request as Triton generations: one per prompt and choice, all streamed concurrently over gRPC.

Every generation is its own gRPC stream on the client's one channel; closing a `pieces` iterator early (the
HTTP client went away, an error, a cancelled task) cancels every stream it still has open, so the engine
aborts those requests and frees their KV blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from client import AsyncNeoClient, ClientError, GenerationResult
from neo_backend.core.sampling_params import SamplingParams
from neo_backend.errors import InvalidRequestError

from .errors import APIError, from_client_error
from .schema import GenerationRequest

# Request fields both APIs share that are engine sampling parameters of the same name.
_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "ignore_eos",
    "min_tokens",
    "top_k",
    "repetition_penalty",
)


@dataclass(frozen=True)
class Generation:
    index: int  # the choice index in the response
    prompt_index: int  # which prompt it continues
    prompt: str
    sampling: dict[str, Any]


@dataclass(frozen=True)
class Piece:
    """Part of one choice: new text and its tokens' logprobs; the choice's last piece carries its result."""

    index: int
    text: str
    logprobs: list[dict[str, dict[str, Any]]] | None = None
    result: GenerationResult | None = None


def sampling_parameters(request: GenerationRequest, max_tokens: int | None, logprobs: int | None) -> dict[str, Any]:
    """The engine's sampling parameters for a request, checked here by the engine's own rules."""
    values = {name: getattr(request, name) for name in _SAMPLING_FIELDS}
    values.update(max_tokens=max_tokens, logprobs=logprobs)
    values = {name: value for name, value in values.items() if value is not None}
    try:
        SamplingParams.from_dict(values)
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), param=next((n for n in values if str(exc).startswith(n)), None)) from None
    return values


def plan(prompts: list[str], n: int, sampling: dict[str, Any]) -> list[Generation]:
    """n choices per prompt, prompt by prompt; a seeded request gives choice i the seed + i, so its choices differ
    from each other and repeat from run to run."""
    generations = []
    for prompt_index, prompt in enumerate(prompts):
        for i in range(n):
            choice = dict(sampling)
            if "seed" in choice:
                choice["seed"] += i
            generations.append(Generation(len(generations), prompt_index, prompt, choice))
    return generations


async def pieces(client: AsyncNeoClient, generations: list[Generation], timeout: float) -> AsyncIterator[Piece]:
    """The pieces of every generation as they arrive; a generation's error ends the whole iteration."""
    if len(generations) == 1:
        async for piece in _one(client, generations[0], timeout):
            yield piece
        return
    queue: asyncio.Queue[Piece | BaseException | None] = asyncio.Queue()

    async def forward(generation: Generation) -> None:
        try:
            async for piece in _one(client, generation, timeout):
                queue.put_nowait(piece)
            queue.put_nowait(None)
        except Exception as exc:
            queue.put_nowait(exc)

    tasks = [asyncio.create_task(forward(g)) for g in generations]
    try:
        for _ in range(len(tasks)):
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
    finally:
        for task in tasks:
            task.cancel()


async def _one(client: AsyncNeoClient, generation: Generation, timeout: float) -> AsyncIterator[Piece]:
    try:
        async with client.stream(generation.prompt, generation.sampling, timeout=timeout) as stream:
            async for delta in stream.deltas():
                yield Piece(generation.index, delta.text, delta.logprobs)
    except ClientError as exc:
        raise from_client_error(exc) from None
    yield Piece(generation.index, "", None, stream.result)
