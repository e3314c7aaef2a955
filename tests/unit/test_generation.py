"""Greedy generation, continuous batching, preemption, sampling, stop strings and streaming text."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch
from engine_helpers import collect, mixed_requests

from neo_backend import EngineConfig, LLMEngine

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


def test_greedy_matches_transformers_generate(smollm_engine, hf_smollm):
    n = 24
    for prompt in PROMPTS:
        ids = smollm_engine.tokenizer.encode(prompt)
        ours = smollm_engine.generate([ids], {"max_tokens": n, "min_tokens": n, "temperature": 0})[0]
        with torch.no_grad():
            ref = hf_smollm.generate(
                torch.tensor([ids]),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                eos_token_id=list(smollm_engine.tokenizer.eos_token_ids),
                pad_token_id=0,
            )
        assert ours.token_ids == ref[0, len(ids) :].tolist(), prompt


@pytest.mark.parametrize("num_blocks", [256, 12])
def test_staggered_batch_equals_each_alone(tiny_model_dirs, num_blocks):
    prompts, max_tokens = mixed_requests(16, seed=3)
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_model_dirs["llama3"]),
            num_gpu_blocks=num_blocks,
            block_size=8,
            max_num_batched_tokens=64,
            offload_policy="never",
        )
    )
    together = collect(engine, prompts, max_tokens, stagger=True)
    if num_blocks == 12:
        assert engine.scheduler.num_preemptions > 0
    assert engine.gpu_blocks.num_free_blocks == num_blocks
    alone = [collect(engine, [p], [m], stagger=False)[0] for p, m in zip(prompts, max_tokens)]
    assert together == alone
    assert all(len(t) == m for t, m in zip(together, max_tokens))


def test_smollm_batch_with_preemption_equals_alone():
    engine = LLMEngine(EngineConfig(num_gpu_blocks=8, max_num_batched_tokens=64, offload_policy="never"))
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS * 2]
    max_tokens = [20, 12, 28, 9, 16, 24]
    together = collect(engine, prompts, max_tokens, stagger=True)
    assert engine.scheduler.num_preemptions > 0
    alone = [collect(engine, [p], [m], stagger=False)[0] for p, m in zip(prompts, max_tokens)]
    assert together == alone
    assert engine.gpu_blocks.num_free_blocks == 8


def _run_to_end(engine: LLMEngine, requests: list[tuple[str, dict]]) -> dict[str, list]:
    """Each request's outputs, merged: text, tokens, finish reason, output count, logprobs; added two per step."""
    merged: dict[str, list] = {}
    pending, steps = list(requests), 0
    while pending or engine.has_unfinished_requests():
        for prompt, params in pending[:2]:
            merged[engine.add_request(prompt, params, request_id=f"r{len(merged)}")] = ["", [], None, 0, []]
        del pending[:2]
        for out in engine.step():
            entry = merged[out.request_id]
            entry[0] += out.text
            entry[1] += out.token_ids
            entry[2:4] = out.finish_reason, out.num_output_tokens
            entry[4] += out.logprobs or []
        steps += 1
        assert steps < 2000, "engine made no progress"
    return merged


def test_overlapped_steps_change_no_output():
    """Steps launched before the step in flight is read back (its tokens fed to them on the device) give the
    same outputs as steps run one at a time: greedy, seeded sampling, stop strings, EOS, logprobs, min_tokens,
    a penalty (whose steps run one at a time), and recompute preemptions in a small pool; no block leaks."""
    params = [
        {"max_tokens": 24, "temperature": 0},
        {"max_tokens": 30, "temperature": 0.9, "top_p": 0.9, "seed": 7},
        {"max_tokens": 20, "temperature": 0, "stop": [" the"]},
        {"max_tokens": 40, "temperature": 0, "min_tokens": 10, "logprobs": 2},
        {"max_tokens": 12, "temperature": 0, "repetition_penalty": 1.3},
        {"max_tokens": 1, "temperature": 0},
    ]
    requests = [(prompt, p) for prompt in PROMPTS for p in params]
    results, engines = [], []
    for overlap in ("off", "on"):
        engine = LLMEngine(
            EngineConfig(num_gpu_blocks=10, max_num_batched_tokens=64, offload_policy="never", overlap_steps=overlap)
        )
        results.append(_run_to_end(engine, requests))
        engines.append(engine)
        assert engine.gpu_blocks.num_used_blocks == 0
    sequential, overlapped = engines
    assert overlapped.counters.overlapped_steps > 0 and sequential.counters.overlapped_steps == 0
    assert overlapped.scheduler.num_preemptions > 0
    assert {entry[2] for entry in results[1].values()} == {"stop", "length"}
    for request_id, (text, tokens, reason, count, logprobs) in results[0].items():
        assert results[1][request_id][:4] == [text, tokens, reason, count], request_id
        theirs = results[1][request_id][4]
        # the batches differ in make-up (blocks are freed a step later), so logprobs differ in float noise
        assert [entry.keys() for entry in theirs] == [entry.keys() for entry in logprobs]
        assert all(e[t] == pytest.approx(o[t], abs=1e-3) for e, o in zip(theirs, logprobs) for t in e)


def test_overlapped_steps_abort_and_fail_mid_flight(smollm_engine):
    engine = LLMEngine(EngineConfig(num_gpu_blocks=64, offload_policy="never", overlap_steps="on"))
    keep = engine.add_request("The capital of France is", {"max_tokens": 16, "temperature": 0, "ignore_eos": True})
    dropped = engine.add_request("Once upon a time", {"max_tokens": 16, "temperature": 0, "ignore_eos": True})
    failed = engine.add_request("def fibonacci(n):", {"max_tokens": 16, "temperature": 0, "ignore_eos": True})
    tokens: dict[str, list[int]] = {keep: [], dropped: [], failed: []}
    for _ in range(4):
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
    aborted = engine.abort(dropped)
    errored = engine.fail(failed, "told to fail")
    assert aborted.num_output_tokens == len(tokens[dropped]) and errored.num_output_tokens == len(tokens[failed])
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == keep
            tokens[keep] += out.token_ids
    alone = smollm_engine.generate(
        ["The capital of France is"], {"max_tokens": 16, "temperature": 0, "ignore_eos": True}
    )
    assert tokens[keep] == alone[0].token_ids
    assert engine.gpu_blocks.num_used_blocks == 0


def test_seeded_sampling_reproduces(smollm_engine):
    params = {"max_tokens": 16, "temperature": 0.9, "top_p": 0.95, "top_k": 50, "seed": 1234}
    first = smollm_engine.generate(["Tell me a story about"], params)[0]
    batched = smollm_engine.generate(["Some other prompt", "Tell me a story about"], params)[1]
    other = smollm_engine.generate(["Tell me a story about"], {**params, "seed": 99})[0]
    assert first.token_ids == batched.token_ids
    assert first.token_ids != other.token_ids


def test_stop_string_cuts_exactly(smollm_engine):
    free = smollm_engine.generate(["The capital of France is"], {"max_tokens": 12, "temperature": 0})[0]
    assert "." in free.text
    stop = free.text[free.text.index(".") - 2 : free.text.index(".") + 1]
    cut = smollm_engine.generate(["The capital of France is"], {"max_tokens": 12, "temperature": 0, "stop": [stop]})[0]
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.index(stop)]


def test_streamed_deltas_never_split_utf8_or_leak_stop(smollm_engine):
    prompt = "Translate to Chinese and Japanese with emoji: I love my cat 🐱. 我爱我的猫"
    rid = smollm_engine.add_request(prompt, {"max_tokens": 40, "temperature": 0.8, "seed": 5, "stop": ["猫猫猫"]})
    deltas, tokens = [], []
    while smollm_engine.has_unfinished_requests():
        for out in smollm_engine.step():
            assert out.request_id == rid
            deltas.append(out.text)
            tokens += out.token_ids
    assert all("\ufffd" not in d for d in deltas[:-1])
    full = smollm_engine.tokenizer.decode(tokens)
    assert "".join(deltas) == full.split("猫猫猫")[0]
    assert any(ord(c) > 127 for c in "".join(deltas)), "prompt should elicit non-ASCII text"


def test_tokenizer_decode_equals_transformers_decode(smollm_engine):
    """The detokenizer's fast path (the Rust tokenizer) must decode exactly as transformers does."""
    tok = smollm_engine.tokenizer
    rng = random.Random(0)
    specials = list(tok.hf.all_special_ids)
    for _ in range(300):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(0, 12))] + rng.sample(specials, 1)
        rng.shuffle(ids)
        assert tok.decode(ids) == tok.hf.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_finish_reasons_and_logprobs(smollm_engine):
    out = smollm_engine.generate(["Hello"], {"max_tokens": 3, "temperature": 0, "logprobs": 2})[0]
    assert out.finish_reason == "length" and out.num_output_tokens == 3
    assert len(out.logprobs) == 3
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and len(entry) <= 3
        assert entry[token] == max(entry.values())  # greedy picks the most likely token
    assert out.cumulative_logprob == pytest.approx(sum(e[t] for t, e in zip(out.token_ids, out.logprobs)), abs=1e-4)
    rid = smollm_engine.add_request("Hello", {"max_tokens": 50})
    aborted = smollm_engine.abort(rid)
    assert aborted.finished and aborted.finish_reason == "abort"
    assert not smollm_engine.has_unfinished_requests()


def test_cli_generate_prints_paris():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "neo_backend",
            "generate",
            "--prompt",
            "The capital of France is",
            "--max-tokens",
            "8",
            "--temperature",
            "0",
            "--num-gpu-blocks",
            "64",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
