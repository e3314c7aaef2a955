"""Engine logits against Hugging Face transformers on the same weights, fp32: prefill and 20 decode steps."""

from __future__ import annotations

import pytest
import torch

from neo_backend import EngineConfig, LLMEngine

DECODE_STEPS = 20
TOLERANCE = 1e-4


class LogitRecorder:
    """Wraps the engine's sampler to keep the logits it is handed (the model's output, untouched)."""

    def __init__(self, sampler):
        self.sampler = sampler
        self.logits: list[torch.Tensor] = []

    def launch(self, logits, seqs):
        self.logits.append(logits[0].clone())
        return self.sampler.launch(logits, seqs)


def engine_logits(engine: LLMEngine, prompt_ids: list[int]) -> tuple[list[int], torch.Tensor]:
    recorder = LogitRecorder(engine.runner.sampler)
    engine.runner.sampler = recorder
    try:
        out = engine.generate([prompt_ids], {"max_tokens": DECODE_STEPS + 1, "temperature": 0, "ignore_eos": True})[0]
    finally:
        engine.runner.sampler = recorder.sampler
    return out.token_ids, torch.stack(recorder.logits)


def hf_logits(model, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt_ids + output_ids[:-1]])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    return logits[len(prompt_ids) - 1 :]


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    for step in range(ref.shape[0]):
        err = (ours[step] - ref[step]).norm() / ref[step].norm()
        assert err <= TOLERANCE, f"step {step}: relative error {err:.2e}"


@pytest.mark.parametrize("variant", ["llama3", "qwen2"])
def test_tiny_random_models_match_transformers(tiny_model_dirs, variant):
    from transformers import AutoModelForCausalLM

    directory = tiny_model_dirs[variant]
    engine = LLMEngine(EngineConfig(model=str(directory), num_gpu_blocks=64, block_size=8))
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    prompt = torch.randint(3, 500, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    tokens, ours = engine_logits(engine, prompt)
    assert len(tokens) == DECODE_STEPS + 1
    assert_close(ours, hf_logits(hf, prompt, tokens))


def test_chunked_prefill_matches_transformers(tiny_model_dirs):
    from transformers import AutoModelForCausalLM

    directory = tiny_model_dirs["llama3"]
    engine = LLMEngine(EngineConfig(model=str(directory), num_gpu_blocks=64, block_size=8, max_num_batched_tokens=16))
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    prompt = torch.randint(3, 500, (75,), generator=torch.Generator().manual_seed(2)).tolist()
    tokens, ours = engine_logits(engine, prompt)
    assert_close(ours, hf_logits(hf, prompt, tokens))


def test_smollm2_matches_transformers(smollm_engine, hf_smollm):
    prompt = smollm_engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. Once upon a time")
    tokens, ours = engine_logits(smollm_engine, prompt)
    assert_close(ours, hf_logits(hf_smollm, prompt, tokens))
