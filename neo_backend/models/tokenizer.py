"""Tokenizer wrapper and incremental detokenization with stop strings."""

from __future__ import annotations

from typing import Any

from ..errors import InvalidRequestError


class Tokenizer:
    """A Hugging Face fast tokenizer plus the model's end-of-sequence ids."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: tuple[int, ...]) -> None:
        self.hf = hf_tokenizer
        self.eos_token_ids = eos_token_ids
        # The Rust tokenizer decodes as `hf.decode` does without its clean-up pass, at a third of the cost:
        # the detokenizer calls it twice per generated token.
        self._backend = getattr(hf_tokenizer, "backend_tokenizer", None)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text)

    def decode(self, token_ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(token_ids, skip_special_tokens=True)
        return self.hf.decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        if not getattr(self.hf, "chat_template", None):
            raise InvalidRequestError("this model's tokenizer has no chat template; send a plain prompt")
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def __len__(self) -> int:
        return len(self.hf)


class IncrementalDetokenizer:
    """Turns a growing list of output tokens into text deltas that are safe to stream.

    A delta never ends inside a multi-byte UTF-8 character split across tokens, and text that could still
    become a stop string is held back until it cannot; a matched stop string is cut from the output.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.token_ids = list(prompt_token_ids)
        self.prefix_offset = max(len(prompt_token_ids) - 6, 0)
        self.read_offset = len(prompt_token_ids)
        self.text = ""
        self.num_sent_chars = 0
        self.stopped = False

    def add_token(self, token_id: int, check_stop: bool) -> None:
        if self.stopped:
            return
        self.token_ids.append(token_id)
        prefix = self.tokenizer.decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.token_ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return
        old_len = len(self.text)
        self.text += full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        if check_stop:
            self._check_stop(old_len)

    def _check_stop(self, old_len: int) -> None:
        for stop in self.stop:
            at = self.text.find(stop, max(0, old_len - len(stop) + 1))
            if at != -1:
                self.text = self.text[:at]
                self.stopped = True
                return

    def take_delta(self, final: bool) -> str:
        end = len(self.text) if final or self.stopped else len(self.text) - self._held_back()
        end = max(end, self.num_sent_chars)
        delta = self.text[self.num_sent_chars : end]
        self.num_sent_chars = end
        return delta

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
