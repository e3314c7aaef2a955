"""The sampler's knobs against independent references: transformers' logits processors (temperature, top-k, top-p,
repetition penalty, min_tokens) and the OpenAI definition of presence and frequency penalties, on the processed
logits, on the distribution that seeded draws follow, and end to end (stop_token_ids too) against
`transformers.generate` on the same weights."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from neo_backend import EngineConfig, LLMEngine, SamplingParams
from neo_backend.core.sequence import Sequence
from neo_backend.layers.sampler import Sampler

VOCAB = 16
EOS = (2,)
PROMPT = [1, 5, 5, 9, 3]  # 5 and 9 in the prompt only: repetition penalty, no presence/frequency penalty
OUTPUT = [7, 3, 7, 7, 12]  # 7 three times, 3 and 12 once
DRAWS = 10_000
TOLERANCE = 5 * (0.25 / DRAWS) ** 0.5  # five standard deviations of a frequency estimated from DRAWS draws


def _logits(rows: int = 1, seed: int = 0) -> torch.Tensor:
    return 2.0 * torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed))


def _seq(params: dict, prompt: list[int] = PROMPT, output: list[int] = OUTPUT) -> Sequence:
    seq = Sequence("r", None, list(prompt), SamplingParams(**params))
    seq.token_ids += output
    return seq


class OpenAIPenalties(LogitsProcessor):
    """mu[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty, c[j] counting token j among the tokens
    generated so far (OpenAI's definition; prompt tokens do not count)."""

    def __init__(self, presence: float, frequency: float, prompt_len: int) -> None:
        self.presence, self.frequency, self.prompt_len = presence, frequency, prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        for row, ids in enumerate(input_ids[:, self.prompt_len :].tolist()):
            for token, count in Counter(ids).items():
                scores[row, token] -= count * self.frequency + self.presence
        return scores


def _penalised(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """One row as the references process it before sampling: repetition penalty over prompt and output, presence
    and frequency penalties, then min_tokens' ban of the stop token ids and, unless ignore_eos, EOS (vLLM's
    rule: with ignore_eos, EOS is no stop)."""
    p, ids, scores = seq.params, torch.tensor([seq.token_ids]), logits.unsqueeze(0)
    if p.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, scores)
    scores = OpenAIPenalties(p.presence_penalty, p.frequency_penalty, seq.num_prompt_tokens)(ids, scores)
    banned = ([] if p.ignore_eos else list(EOS)) + p.stop_token_ids
    scores = MinNewTokensLengthLogitsProcessor(seq.num_prompt_tokens, p.min_tokens, banned)(ids, scores)
    return scores[0]


def _truncated(scores: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """top-k then top-p, as transformers applies them; k of 0 and p of 1 leave the row alone."""
    scores = scores.unsqueeze(0)
    if params.top_k:
        scores = TopKLogitsWarper(params.top_k)(None, scores)
    if params.top_p < 1.0:
        scores = TopPLogitsWarper(params.top_p)(None, scores)
    return scores[0]


def _reference_distribution(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    scores = _penalised(logits, seq)
    if seq.params.greedy:
        return torch.nn.functional.one_hot(scores.argmax(), VOCAB).float()
    scores = TemperatureLogitsWarper(seq.params.temperature)(None, scores.unsqueeze(0))[0]
    return _truncated(scores, seq.params).softmax(dim=-1)


# The logits each stage hands on ------------------------------------------------------------------------------------

PENALTY_CASES = [
    {"repetition_penalty": 1.4},
    {"repetition_penalty": 0.7},
    {"presence_penalty": 0.8},
    {"frequency_penalty": -0.6},
    {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.4},
    {},
]


def test_penalties_match_transformers_and_the_openai_definition():
    """One batch, one penalty mix per row (and a row without any): rows do not share their penalties or histories."""
    logits = _logits(len(PENALTY_CASES))
    seqs = [_seq(params, output=OUTPUT[: 2 + i % 4]) for i, params in enumerate(PENALTY_CASES)]
    ours = Sampler(EOS, seed=0)._apply_penalties(logits, seqs)
    for row, seq in enumerate(seqs):
        torch.testing.assert_close(ours[row], _penalised(logits[row], seq), msg=f"row {row}: {PENALTY_CASES[row]}")


def test_min_tokens_bans_eos_and_stop_token_ids_until_reached():
    """As transformers' MinNewTokensLengthLogitsProcessor with the stop token ids among the end tokens; a stop token
    id beyond the vocabulary is no error."""
    params = {"max_tokens": 20, "stop_token_ids": [4, 11, VOCAB + 3]}
    seqs = [_seq({**params, "min_tokens": n}) for n in (len(OUTPUT) + 1, len(OUTPUT), 0)]
    seqs.append(_seq({**params, "min_tokens": len(OUTPUT) + 1, "ignore_eos": True}))
    logits = _logits(len(seqs))
    ours = Sampler(EOS, seed=0)._apply_min_tokens(logits, seqs)
    for row, seq in enumerate(seqs):
        torch.testing.assert_close(ours[row], _penalised(logits[row], seq))
    assert ours[0, [2, 4, 11]].tolist() == [float("-inf")] * 3
    assert torch.equal(ours[1:3], logits[1:3]), "a request with min_tokens output tokens is left alone"
    assert ours[3, 2] == logits[3, 2] and ours[3, [4, 11]].tolist() == [float("-inf")] * 2, "ignore_eos: EOS allowed"


TRUNCATION_CASES = [(0, 1.0), (3, 1.0), (VOCAB + 5, 1.0), (0, 0.6), (0, 0.01), (6, 0.8), (1, 0.9)]


def test_top_k_and_top_p_match_transformers_warpers():
    """Per row of one batch: no truncation, top-k alone (also beyond the vocabulary), top-p alone (also one that
    keeps only the most likely token) and both."""
    logits = _logits(len(TRUNCATION_CASES), seed=1)
    seqs = [_seq({"top_k": k, "top_p": p}) for k, p in TRUNCATION_CASES]
    ours = Sampler._filter(logits, seqs)
    for row, seq in enumerate(seqs):
        torch.testing.assert_close(ours[row], _truncated(logits[row], seq.params), msg=str(TRUNCATION_CASES[row]))


def test_top_k_keeps_every_token_tied_with_the_kth():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0, 2.0]])
    kept = torch.isfinite(Sampler._filter(logits, [_seq({"top_k": 2})]))
    assert kept.tolist() == [[True, False, True, True, False, True]]


# What the draws follow ---------------------------------------------------------------------------------------------

DISTRIBUTION_CASES = {
    "temperature": {"temperature": 0.6},
    "hot top-k": {"temperature": 1.5, "top_k": 5},
    "top-p": {"temperature": 0.9, "top_p": 0.75},
    "penalties before truncation": {
        "temperature": 0.8,
        "top_k": 8,
        "top_p": 0.9,
        "repetition_penalty": 1.3,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.3,
    },
    "min_tokens": {"min_tokens": 8, "max_tokens": 16, "stop_token_ids": [7], "top_k": 6},
}


@pytest.mark.parametrize("case,seeded", [(case, False) for case in DISTRIBUTION_CASES] + [("top-p", True)])
def test_draws_follow_the_reference_distribution(case, seeded):
    """DRAWS rows of one request's logits: the sampled tokens lie in the reference's support, each at its
    probability; with a seed per request, each row draws from its own generator."""
    logits = _logits(seed=2)
    logits[0, EOS[0]] = logits.max() + 1.0  # the most likely token, unless min_tokens bans it
    seqs = [_seq({**DISTRIBUTION_CASES[case], "seed": i if seeded else None}) for i in range(DRAWS)]
    tokens = torch.tensor(Sampler(EOS, seed=0)(logits.expand(DRAWS, VOCAB), seqs).token_ids)
    expected = _reference_distribution(logits[0], seqs[0])
    observed = torch.bincount(tokens, minlength=VOCAB) / DRAWS
    assert (expected[observed > 0] > 0).all(), f"drawn outside the support: {observed}"
    assert (observed - expected).abs().max() < TOLERANCE, f"observed {observed}\nexpected {expected}"


def test_greedy_rows_take_the_penalised_argmax_and_report_raw_logprobs():
    """Greedy rows beside a sampled one: each takes the argmax after its penalties and min_tokens, and the logprobs
    it reports are those of the model's raw distribution."""
    cases = [
        {"temperature": 0, "logprobs": 3},
        {"temperature": 0, "presence_penalty": 2.0, "logprobs": 2},
        {"temperature": 1.0, "top_k": 4},
        {"temperature": 0, "min_tokens": 9, "max_tokens": 9},
    ]
    seqs = [_seq(params) for params in cases]
    logits = _logits(len(cases), seed=3)
    lead = OUTPUT[-1]
    logits[:, lead] = logits.max() + 1.0  # the raw argmax of every row, and a token the output holds
    logits[3, EOS[0]] = logits.max() + 1.0  # ... but in the last row EOS leads, which min_tokens bans
    result = Sampler(EOS, seed=0)(logits, seqs)
    assert [result.token_ids[i] for i in (0, 1, 3)] == [lead, int(_penalised(logits[1], seqs[1]).argmax()), lead]
    assert result.token_ids[1] != lead, "a presence penalty of 2 outweighs a lead of 1"
    raw = logits.log_softmax(dim=-1)
    for row, seq in enumerate(seqs):
        token, n = result.token_ids[row], seq.params.logprobs
        assert result.logprobs[row] == pytest.approx(float(raw[row, token]), abs=1e-6)
        if n:
            values, ids = raw[row].topk(n)
            assert result.top_logprobs[row] == pytest.approx(dict(zip(ids.tolist(), values.tolist())), abs=1e-6)
        else:
            assert result.top_logprobs[row] is None


def test_plain_greedy_batches_sample_as_the_general_path_does():
    """A batch of plain greedy rows takes the one-pass greedy path; its tokens, logprobs and non-finite rows are
    those the general path gives the same rows beside a sampled one."""
    logits = _logits(4, seed=7)
    logits[1, 3] = float("nan")
    logits[2, [4, 9]] = logits[2].max() + 1.0  # a tie: the first index wins
    plain = [_seq({"temperature": 0}) for _ in range(4)]
    fast = Sampler(EOS, seed=0)(logits, plain)
    mixed = Sampler(EOS, seed=0)(torch.cat([logits, _logits(1)]), plain + [_seq({"temperature": 1.0})])
    assert fast.non_finite_rows == mixed.non_finite_rows == {1}
    good = [0, 2, 3]
    assert [fast.token_ids[i] for i in good] == [mixed.token_ids[i] for i in good]
    assert fast.token_ids[2] == 4
    assert [fast.logprobs[i] for i in good] == pytest.approx([mixed.logprobs[i] for i in good], abs=1e-6)
    assert fast.top_logprobs == [None] * 4


# End to end against transformers.generate --------------------------------------------------------------------------

STEPS = 24


@pytest.fixture(scope="module")
def tiny_engine(tiny_model_dirs) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model=str(tiny_model_dirs["llama3"]), num_gpu_blocks=64, block_size=8, offload_policy="never")
    )


@pytest.fixture(scope="module")
def tiny_hf(tiny_model_dirs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dirs["llama3"], dtype=torch.float32).eval()


E2E_PROMPT = torch.randint(3, 500, (21,), generator=torch.Generator().manual_seed(5)).tolist()


def _ours(engine: LLMEngine, params: dict) -> tuple[list[int], str]:
    out = engine.generate([E2E_PROMPT], {"temperature": 0, "max_tokens": STEPS, **params})[0]
    return out.token_ids, out.finish_reason


def _theirs(hf, **kwargs) -> list[int]:
    ids = torch.tensor([E2E_PROMPT])
    with torch.no_grad():
        out = hf.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=STEPS, pad_token_id=0, **kwargs
        )
    return out[0, len(E2E_PROMPT) :].tolist()


def test_penalised_greedy_generation_matches_transformers(tiny_engine, tiny_hf):
    """EOS banned throughout (min_tokens = max_tokens), so both run all STEPS; penalties this strong change the
    tiny model's greedy text."""
    whole = {"min_tokens": STEPS}
    plain, _ = _ours(tiny_engine, whole)
    repetition, _ = _ours(tiny_engine, {**whole, "repetition_penalty": 1.8})
    assert repetition == _theirs(tiny_hf, min_new_tokens=STEPS, repetition_penalty=1.8) != plain
    openai_penalties = OpenAIPenalties(1.0, 0.5, len(E2E_PROMPT))
    penalised, _ = _ours(tiny_engine, {**whole, "presence_penalty": 1.0, "frequency_penalty": 0.5})
    assert (
        penalised
        == _theirs(tiny_hf, min_new_tokens=STEPS, logits_processor=LogitsProcessorList([openai_penalties]))
        != plain
    )


def test_stop_token_ids_end_the_request_once_min_tokens_allow(tiny_engine, tiny_hf):
    """A token of the greedy text as the stop token: the request ends on its first occurrence with reason `stop`,
    the token included; with min_tokens past it, as transformers with that token among its end tokens."""
    free, _ = _ours(tiny_engine, {"ignore_eos": True})
    position = next(i for i in range(2, STEPS) if free[i] not in (*free[:i], *EOS))
    stop = free[position]
    assert _ours(tiny_engine, {"stop_token_ids": [stop], "ignore_eos": True}) == (free[: position + 1], "stop")
    late, reason = _ours(tiny_engine, {"stop_token_ids": [stop], "min_tokens": position + 2})
    assert late == _theirs(tiny_hf, min_new_tokens=position + 2, eos_token_id=[*EOS, stop])
    assert len(late) > position + 1
    assert reason == ("stop" if late[-1] in (*EOS, stop) else "length")
