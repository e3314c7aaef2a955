"""Per-request sampling over a batch of logits: penalties, min_tokens, temperature, top-k, top-p, seeds."""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from ..core.sequence import Sequence
from ..staging import tensor_on, to_device
from . import fused


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float]  # of each sampled token, under the model's raw distribution
    top_logprobs: list[dict[int, float] | None]  # the N most likely tokens, where a request asked for them
    non_finite_rows: set[int]  # rows whose logits held NaN or inf: their requests fail


class PendingSample:
    """A batch's samples on their way to host memory. `token_ids` stays on the device, where the next step can
    take its inputs from before the host has read them (`row_of`); `result` waits for the copies."""

    def __init__(self, seqs: list[Sequence], device_tensors: list[torch.Tensor], num_logprobs: list[int]) -> None:
        """`device_tensors`: per row, whether its logits were finite, the sampled token, its logprob, and where any
        row asked for logprobs, the top logprobs' values and token ids (`num_logprobs[row]` of them are the row's)."""
        self.token_ids = device_tensors[1]
        self.row_of = {seq.request_id: row for row, seq in enumerate(seqs)}
        self._num_logprobs = num_logprobs
        self._copied: torch.cuda.Event | None = None
        if self.token_ids.device.type == "cuda":
            self._host = [
                torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in device_tensors
            ]
            # A blocking event: `result` sleeps instead of spinning, leaving the core to the process's other threads
            # (response senders; the effect on token gaps is in bench/RESULTS.md).
            self._copied = torch.cuda.Event(blocking=True)
            self._copied.record()
        else:
            self._host = device_tensors
        self._result: SampleResult | None = None

    def result(self) -> SampleResult:
        if self._result is None:
            if self._copied is not None:
                self._copied.synchronize()
            finite, tokens, chosen, *top = self._host
            top_values, top_ids = top or (None, None)
            tops: list[dict[int, float] | None] = []
            for row, n in enumerate(self._num_logprobs):
                tops.append(dict(zip(top_ids[row, :n].tolist(), top_values[row, :n].tolist())) if n else None)
            non_finite = set((~finite).nonzero().flatten().tolist())
            self._result = SampleResult(tokens.tolist(), chosen.tolist(), tops, non_finite)
        return self._result


def greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: whether its logits are all finite, their argmax and its log-softmax (fp32)."""
    if fused.available(logits):
        return fused.greedy_sample(logits)
    logits = logits.float()
    tokens = logits.argmax(dim=-1)
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)
    return torch.isfinite(logits).all(dim=-1), tokens, logprobs


class Sampler:
    def __init__(self, eos_token_ids: tuple[int, ...], seed: int) -> None:
        self.eos_token_ids = eos_token_ids
        self.default_generator: torch.Generator | None = None
        self.seed = seed

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        return self.launch(logits, seqs).result()

    def launch(self, logits: torch.Tensor, seqs: list[Sequence]) -> PendingSample:
        """Queue the sampling of one token per row of `logits` (the model's dtype; sampled in fp32) and the copy of
        the samples to host memory; nothing waits."""
        num_logprobs = [s.params.logprobs or 0 for s in seqs]
        if not any(num_logprobs) and all(self._plain_greedy(s) for s in seqs):
            return PendingSample(seqs, list(greedy(logits)), num_logprobs)
        logits = logits.float()
        finite = torch.isfinite(logits).all(dim=-1)
        logits = logits.masked_fill(~finite.unsqueeze(1), 0.0)
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = self._apply_penalties(logits, seqs)
        logits = self._apply_min_tokens(logits, seqs)
        tokens = self._sample(logits, seqs)
        chosen = raw_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
        num_top = max(num_logprobs)
        top = list(raw_logprobs.topk(num_top)) if num_top else []
        return PendingSample(seqs, [finite, tokens, chosen, *top], num_logprobs)

    @staticmethod
    def _plain_greedy(seq: Sequence) -> bool:
        """Whether the row's token is the argmax of its raw logits (no penalty or min_tokens changes them)."""
        params = seq.params
        return params.greedy and not params.has_penalties and seq.num_output_tokens >= params.min_tokens

    def _apply_penalties(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Every penalised row at once, at the positions of its tokens only: a handful of kernels whatever the batch
        (a loop over rows launches a dozen a row)."""
        rows = [i for i, s in enumerate(seqs) if s.params.has_penalties]
        if not rows:
            return logits
        params = [seqs[i].params for i in rows]
        logits = logits.clone()
        flat = logits.view(-1)
        if any(p.repetition_penalty != 1.0 for p in params):
            at, row = _token_positions(rows, [seqs[i].token_ids for i in rows], logits)
            rep = tensor_on([p.repetition_penalty for p in params], logits.dtype, logits.device)[row]
            values = flat[at]
            flat[at] = torch.where(values > 0, values / rep, values * rep)  # a repeated token writes one value
        if any(p.presence_penalty or p.frequency_penalty for p in params):
            at, row = _token_positions(rows, [seqs[i].output_token_ids for i in rows], logits)
            presence = tensor_on([p.presence_penalty for p in params], logits.dtype, logits.device)[row]
            frequency = tensor_on([p.frequency_penalty for p in params], logits.dtype, logits.device)[row]
            flat[at] = flat[at] - presence  # once per token, however often it stands
            flat.index_put_((at,), -frequency, accumulate=True)  # once per occurrence
        return logits

    def _apply_min_tokens(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        rows = [i for i, s in enumerate(seqs) if s.num_output_tokens < s.params.min_tokens]
        if not rows:
            return logits
        logits = logits.clone()
        vocab = logits.shape[1]
        for i in rows:
            params = seqs[i].params
            # with ignore_eos, EOS is no stop to hold back
            stops = params.stop_token_ids if params.ignore_eos else (*self.eos_token_ids, *params.stop_token_ids)
            logits[i, tensor_on([t for t in stops if t < vocab], torch.long, logits.device)] = float("-inf")
        return logits

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        greedy = logits.argmax(dim=-1)
        if all(s.params.greedy for s in seqs):
            return greedy
        temps = tensor_on([s.params.temperature or 1.0 for s in seqs], torch.float32, logits.device)
        probs = self._filter(logits / temps.unsqueeze(1), seqs).softmax(dim=-1)
        noise = self._exponential_noise(probs, seqs)
        sampled = (probs / noise).argmax(dim=-1)
        is_greedy = tensor_on([s.params.greedy for s in seqs], torch.bool, logits.device)
        return torch.where(is_greedy, greedy, sampled)

    @staticmethod
    def _filter(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        top_ks = [s.params.top_k for s in seqs]
        top_ps = [s.params.top_p for s in seqs]
        if any(top_ks):
            vocab = logits.shape[1]
            k = tensor_on([min(k, vocab) if k else vocab for k in top_ks], torch.long, logits.device)
            kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1).unsqueeze(1))
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if any(p < 1.0 for p in top_ps):
            p = tensor_on(top_ps, torch.float32, logits.device).unsqueeze(1)
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            drop_sorted = (cumulative - sorted_logits.softmax(dim=-1)) >= p  # keep the token that crosses p
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        return logits

    def _exponential_noise(self, probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Exp(1) noise per row; `argmax(p / noise)` is a sample from p. Seeded requests draw from their own
        generator, so their samples depend only on their seed and step, not on batch neighbours."""
        if self.default_generator is None or self.default_generator.device != probs.device:
            self.default_generator = torch.Generator(device=probs.device).manual_seed(self.seed)
        noise = torch.empty_like(probs).exponential_(generator=self.default_generator)
        for row, seq in enumerate(seqs):
            if seq.params.seed is not None and not seq.params.greedy:
                if seq.generator is None:
                    seq.generator = torch.Generator(device=probs.device).manual_seed(seq.params.seed)
                noise[row].exponential_(generator=seq.generator)
        return noise


def _token_positions(
    rows: list[int], histories: list[list[int]], logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each token of each history stands in `logits` viewed flat (row `rows[i]` for `histories[i]`), and
    each one's i; all histories in one copy to the device."""
    device = logits.device
    flat_tokens = array("q")
    for history in histories:
        flat_tokens.extend(history)
    tokens = to_device(
        torch.frombuffer(flat_tokens, dtype=torch.long) if flat_tokens else torch.empty(0, dtype=torch.long), device
    )
    lengths = tensor_on([len(h) for h in histories], torch.long, device)
    which = torch.repeat_interleave(torch.arange(len(rows), device=device), lengths, output_size=tokens.numel())
    return tensor_on(rows, torch.long, device)[which] * logits.shape[1] + tokens, which
