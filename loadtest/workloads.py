"""Request-length workloads for the load test; every request uses `ignore_eos` so output lengths are exact.

Prompt lengths are approximate: a prompt of N tokens is N words drawn from `WORDS`, common English words that
are one token each (with their leading space) in SmolLM2's tokenizer and, being this common, in other
Llama-family BPE vocabularies too. The server reports the real count (`num_input_tokens`) and the summary uses
it; `tests/server/test_loadtest.py` checks the approximation against the default model's tokenizer.

Workloads (all drawn from `random.Random(seed)`, so a seed fixes every length):
- `fixed`: every request has `input_tokens` prompt tokens and `output_tokens` output tokens.
- `a10g`: the NEO paper's A10G setup: 1000 prompt tokens; output length uniform in [50, 400], then scaled by a
  uniform factor in [0.9, 1.1] (the paper's +-10%).
- `conversation`: each user holds multi-turn chats (ChatML turns). A chat lasts 1 + Geometric(p=0.4) turns
  (mean 2.5); a user turn has LogNormal(median 48, sigma 0.9) words clipped to [4, 512]; a reply has
  LogNormal(median 160, sigma 0.7) tokens clipped to [8, 1024]; the prompt carries the whole history (earlier
  turns and the server's replies), dropping the oldest turns beyond 3072 tokens.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Protocol

from client import ClientError

WORDS = tuple(
    """
the of and to in is it that for on with as was at by be this are from or have an they which one you were her
all she there would their we him been has when who will more no if out so said what up its about into than them
can only other new some could time these two may then do first any my now such like our over man me even most
made after also did many before must through back years where much your way well down should because each just
those people how too little state good very make world still own see men work long get here between both life
being under never day same another know while last might us great old year off come since against go came right
used take three
""".split()
)

WORKLOADS = ("fixed", "a10g", "conversation")


@dataclass(frozen=True)
class RequestSpec:
    prompt: str
    max_tokens: int
    prompt_tokens: int  # the intended prompt length (the server's count may differ slightly)

    def sampling(self) -> dict[str, object]:
        """vLLM sampling parameters: greedy, exactly `max_tokens` tokens."""
        return {"max_tokens": self.max_tokens, "ignore_eos": True, "temperature": 0.0}


class RequestSource(Protocol):
    """One simulated user's stream of requests."""

    def next_request(self) -> RequestSpec: ...

    def observe(self, spec: RequestSpec, reply: str | None) -> None:
        """Tell the source how a request ended (`None`: it failed); conversations build on replies."""


def words(rng: random.Random, n: int) -> str:
    """About `n` tokens of text."""
    return " ".join(rng.choice(WORDS) for _ in range(n))


class FixedSource:
    def __init__(self, rng: random.Random, input_tokens: int, output_tokens: int) -> None:
        self.rng, self.input_tokens, self.output_tokens = rng, input_tokens, output_tokens

    def next_request(self) -> RequestSpec:
        return RequestSpec(words(self.rng, self.input_tokens), self.output_tokens, self.input_tokens)

    def observe(self, spec: RequestSpec, reply: str | None) -> None:
        pass


class A10GSource(FixedSource):
    INPUT_TOKENS = 1000
    OUTPUT_RANGE = (50, 400)
    JITTER = 0.10

    def __init__(self, rng: random.Random) -> None:
        super().__init__(rng, self.INPUT_TOKENS, 0)

    def next_request(self) -> RequestSpec:
        base = self.rng.randint(*self.OUTPUT_RANGE)
        output = max(1, round(base * self.rng.uniform(1 - self.JITTER, 1 + self.JITTER)))
        return RequestSpec(words(self.rng, self.INPUT_TOKENS), output, self.INPUT_TOKENS)


class ConversationSource:
    END_CHAT_P = 0.4
    TURN_WORDS = (48, 0.9, 4, 512)  # median, sigma, min, max
    REPLY_TOKENS = (160, 0.7, 8, 1024)
    MAX_HISTORY_TOKENS = 3072
    TURN_OVERHEAD_TOKENS = 5  # <|im_start|>, role, newline, <|im_end|>, newline

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.history: list[tuple[str, int]] = []  # (ChatML turn text, its approximate token count)
        self.pending_user_turn: tuple[str, int] | None = None

    def _lognormal(self, median: float, sigma: float, low: int, high: int) -> int:
        return min(high, max(low, round(self.rng.lognormvariate(math.log(median), sigma))))

    def next_request(self) -> RequestSpec:
        n_words = self._lognormal(*self.TURN_WORDS)
        user_turn = (f"<|im_start|>user\n{words(self.rng, n_words)}<|im_end|>\n", n_words + self.TURN_OVERHEAD_TOKENS)
        self.pending_user_turn = user_turn
        turns = self.history + [user_turn]
        while len(turns) > 1 and sum(n for _, n in turns) > self.MAX_HISTORY_TOKENS:
            turns.pop(0)
        prompt = "".join(text for text, _ in turns) + "<|im_start|>assistant\n"
        return RequestSpec(prompt, self._lognormal(*self.REPLY_TOKENS), sum(n for _, n in turns) + 3)

    def observe(self, spec: RequestSpec, reply: str | None) -> None:
        if reply is None or self.pending_user_turn is None or self.rng.random() < self.END_CHAT_P:
            self.history = []  # the chat ends (or broke): the next request starts a new one
        else:
            assistant = (f"<|im_start|>assistant\n{reply}<|im_end|>\n", spec.max_tokens + self.TURN_OVERHEAD_TOKENS)
            self.history += [self.pending_user_turn, assistant]
        self.pending_user_turn = None


def make_source(workload: str, seed: int, input_tokens: int = 128, output_tokens: int = 64) -> RequestSource:
    """The request stream of one user; `input_tokens`/`output_tokens` apply to the `fixed` workload."""
    rng = random.Random(seed)
    if workload == "fixed":
        return FixedSource(rng, input_tokens, output_tokens)
    if workload == "a10g":
        return A10GSource(rng)
    if workload == "conversation":
        return ConversationSource(rng)
    raise ClientError(f"unknown workload {workload!r}; choose one of {', '.join(WORKLOADS)}")
