"""Response bodies and stream chunks of the two APIs, built from generation pieces.

Logprobs arrive per token in the vLLM backend's format ({token id: {"logprob", "decoded_token"}}, the sampled
token first, then the most likely ones); each API gets them in its own shape.
"""

from __future__ import annotations

import abc
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from client import GenerationResult

from .generation import Generation, Piece

TokenLogprobs = dict[str, dict[str, Any]]


@dataclass
class ChoiceState:
    """What one choice has produced so far."""

    parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    text_offset: int = 0  # completions' logprobs.text_offset of the next token
    started: bool = False  # a chat stream has sent this choice's role
    result: GenerationResult | None = None


class ResponseBuilder(abc.ABC):
    """Base of the two APIs' builders: ids, usage, the bookkeeping of choices."""

    object = ""
    chunk_object = ""
    id_prefix = ""

    def __init__(self, model: str, generations: list[Generation], top_logprobs: int | None) -> None:
        self.id = self.id_prefix + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model
        self.generations = generations
        self.top_logprobs = top_logprobs  # None: no logprobs asked for
        self.choices = [ChoiceState() for _ in generations]

    def add(self, piece: Piece) -> ChoiceState:
        choice = self.choices[piece.index]
        choice.parts.append(piece.text)
        choice.logprobs.extend(piece.logprobs or [])
        if piece.result is not None:
            choice.result = piece.result
        return choice

    def usage(self) -> dict[str, int]:
        """Token counts as the model reported them; a prompt shared by n choices counts once."""
        done = [(g, c.result) for g, c in zip(self.generations, self.choices) if c.result is not None]
        prompt = sum({g.prompt_index: r.num_input_tokens or 0 for g, r in done}.values())
        completion_tokens = sum(r.num_output_tokens for _, r in done)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens,
        }

    def response(self) -> dict[str, Any]:
        choices = [
            self.choice(i, "".join(c.parts), self._logprobs(c, c.logprobs), _finish(c))
            for i, c in enumerate(self.choices)
        ]
        return self._envelope(self.object, choices) | {"usage": self.usage()}

    def chunk(self, piece: Piece) -> dict[str, Any] | None:
        """The stream chunk for a piece, or None for a piece that adds nothing."""
        choice = self.add(piece)
        if not (piece.text or piece.logprobs or piece.result):
            return None
        logprobs = self._logprobs(choice, piece.logprobs or [])
        return self._envelope(self.chunk_object, [self.chunk_choice(choice, piece, logprobs)])

    def usage_chunk(self) -> dict[str, Any]:
        return self._envelope(self.chunk_object, []) | {"usage": self.usage()}

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def _logprobs(self, choice: ChoiceState, entries: list[TokenLogprobs]) -> dict[str, Any] | None:
        return None if self.top_logprobs is None else self.logprobs(choice, entries)

    @abc.abstractmethod
    def choice(
        self, index: int, text: str, logprobs: dict[str, Any] | None, finish_reason: str | None
    ) -> dict[str, Any]: ...

    @abc.abstractmethod
    def chunk_choice(self, choice: ChoiceState, piece: Piece, logprobs: dict[str, Any] | None) -> dict[str, Any]: ...

    @abc.abstractmethod
    def logprobs(self, choice: ChoiceState, entries: list[TokenLogprobs]) -> dict[str, Any]: ...


class CompletionBuilder(ResponseBuilder):
    object = chunk_object = "text_completion"
    id_prefix = "cmpl-"

    def choice(
        self, index: int, text: str, logprobs: dict[str, Any] | None, finish_reason: str | None
    ) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def chunk_choice(self, choice: ChoiceState, piece: Piece, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        return self.choice(piece.index, piece.text, logprobs, _finish(choice) if piece.result else None)

    def logprobs(self, choice: ChoiceState, entries: list[TokenLogprobs]) -> dict[str, Any]:
        tokens, token_logprobs, top, offsets = [], [], [], []
        for entry in entries:
            sampled = _sampled(entry)
            tokens.append(sampled["decoded_token"])
            token_logprobs.append(sampled["logprob"])
            top.append({e["decoded_token"]: e["logprob"] for e in _most_likely(entry, self.top_logprobs or 0)})
            offsets.append(choice.text_offset)
            choice.text_offset += len(sampled["decoded_token"])
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


class ChatBuilder(ResponseBuilder):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def choice(
        self, index: int, text: str, logprobs: dict[str, Any] | None, finish_reason: str | None
    ) -> dict[str, Any]:
        return {
            "index": index,
            "message": {"role": "assistant", "content": text},
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }

    def chunk_choice(self, choice: ChoiceState, piece: Piece, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        delta: dict[str, str] = {} if piece.result and not piece.text else {"content": piece.text}
        if not choice.started:
            choice.started = True
            delta = {"role": "assistant", "content": piece.text}
        return {
            "index": piece.index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": _finish(choice) if piece.result else None,
        }

    def logprobs(self, choice: ChoiceState, entries: list[TokenLogprobs]) -> dict[str, Any]:
        return {
            "content": [
                {
                    **_token(_sampled(entry)),
                    "top_logprobs": [_token(e) for e in _most_likely(entry, self.top_logprobs or 0)],
                }
                for entry in entries
            ]
        }


def _finish(choice: ChoiceState) -> str | None:
    return choice.result.finish_reason if choice.result else None


def _sampled(entry: TokenLogprobs) -> dict[str, Any]:
    return next(iter(entry.values()))


def _most_likely(entry: TokenLogprobs, n: int) -> list[dict[str, Any]]:
    return sorted(entry.values(), key=lambda e: e["logprob"], reverse=True)[:n]


def _token(e: dict[str, Any]) -> dict[str, Any]:
    return {"token": e["decoded_token"], "logprob": e["logprob"], "bytes": list(e["decoded_token"].encode("utf-8"))}
