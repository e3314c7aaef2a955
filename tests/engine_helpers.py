"""Engine-level helpers shared by the generation, offload, fault and CUDA tests."""

from __future__ import annotations

import torch

from neo_backend import EngineConfig, LLMEngine

# Every way a step runs on CPU; `auto-small-gpu` wants a small device pool and `fixed_perf_model`.
OFFLOAD_CONFIGS = {
    "never": dict(offload_policy="never"),
    "always-sequential": dict(offload_policy="always", pipeline="off"),
    "always-pipelined": dict(offload_policy="always", pipeline="on"),
    "auto-small-gpu": dict(offload_policy="auto", pipeline="auto"),
}


def offload_engine(model_dir, num_gpu_blocks: int, **knobs) -> LLMEngine:
    """A tiny model's engine with 8-token blocks, 64-token iterations and a host pool of 0.01 GiB."""
    knobs = {"cpu_kv_cache_gb": 0.01, **knobs}
    return LLMEngine(
        EngineConfig(
            model=str(model_dir), num_gpu_blocks=num_gpu_blocks, block_size=8, max_num_batched_tokens=64, **knobs
        )
    )


def never_tokens(model_dir, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """Each prompt's greedy tokens alone on a GPU-only engine with a roomy pool: what every mode must reproduce."""
    engine = offload_engine(model_dir, 512, offload_policy="never")
    return [collect(engine, [p], [m], stagger=False)[0] for p, m in zip(prompts, max_tokens)]


def mixed_requests(num: int, seed: int) -> tuple[list[list[int]], list[int]]:
    gen = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(3, 500, (int(torch.randint(3, 90, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(num)
    ]
    max_tokens = [int(torch.randint(1, 24, (1,), generator=gen)) for _ in range(num)]
    return prompts, max_tokens


def outputs_of(stream, timeout_s: float = 60.0):
    """A `StreamingEngine` stream's outputs up to its last; a stream nobody ends raises TimeoutError."""
    while not stream.finished:
        yield stream.get(timeout=timeout_s)


def fixed_perf_model(engine, monkeypatch, remeasured: bool = False) -> None:
    """The start-up profile replaced, in place, by a fixed model under which `auto` swaps and places on every
    pressured step: every iteration predicted to take 10 ms whatever it holds, the host's attention free (and,
    unless `remeasured`, never re-measured). With a measured profile, whether a tiny model's CPU work pays is
    decided by a margin that the start-up timing sets (and on a GPU it never pays, or the fail-safe stops it after
    a timing-dependent number of iterations)."""
    fixed = {
        "dense_tokens": [1],
        "dense_seconds": [0.01],
        "gpu_attn_per_token": 0.0,
        "cpu_attn_fixed": 0.0,
        "cpu_attn_per_request": 0.0,
        "cpu_attn_per_token": 0.0,
    }
    for term, value in fixed.items():
        monkeypatch.setattr(engine.perf_model, term, value)
    if not remeasured:
        for observe in ("observe_cpu", "observe_iteration"):
            monkeypatch.setattr(engine.perf_model, observe, lambda *args: None)


def collect(engine: LLMEngine, prompts, max_tokens, stagger: bool) -> list[list[int]]:
    tokens: dict[str, list[int]] = {}
    order = []
    step = 0
    pending = list(range(len(prompts)))
    while pending or engine.has_unfinished_requests():
        while pending and (not stagger or step >= 2 * pending[0]):
            i = pending.pop(0)
            rid = engine.add_request(prompts[i], {"max_tokens": max_tokens[i], "temperature": 0, "ignore_eos": True})
            tokens[rid] = []
            order.append(rid)
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
        step += 1
        assert step < 5000, "engine made no progress"
    return [tokens[rid] for rid in order]
