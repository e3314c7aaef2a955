"""Request bodies of the OpenAI completions and chat completions APIs, as far as this server implements them.

Unknown fields are refused (a parameter silently ignored would change results without a word), and values are
not coerced ("5" is no integer). Range checks of sampling values are the engine's (`SamplingParams`), so both
APIs and the Triton model refuse the same values with the same words.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_CHOICES = 128  # OpenAI's own limit on `n`


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(StrictModel):
    include_usage: bool = False


class GenerationRequest(StrictModel):
    """Fields shared by both APIs; the last four are vLLM's extra sampling parameters."""

    model: str
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None  # accepted for compatibility; not used
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(GenerationRequest):
    prompt: str | list[str] = Field(min_length=1)
    logprobs: int | None = Field(None, ge=0)


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
