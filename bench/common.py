"""Helpers shared by the benchmarks: the dummy 8B shape, device ceilings, sequences placed by hand."""

from __future__ import annotations

import argparse
import logging
import random
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from neo_backend import EngineConfig, LLMEngine, SamplingParams
from neo_backend.core.sequence import Placement, Sequence
from neo_backend.timing import median_seconds

LLAMA3_8B = str(Path(__file__).parent / "configs" / "llama3-8b")
DECODE_POINTS = ((64, 1024), (8, 1024), (256, 512))  # (batch, context) of the decode step against its floor


def llama3_8b_args(doc: str, log_level: int = logging.INFO) -> argparse.Namespace:
    """A bench's command line: `--json` and the engine's flags, the model the Llama-3-8B shape with dummy weights
    unless `--model` names another; the log set up at `log_level`."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="also write the results here")
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args()
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args.model, args.load_format = args.model or LLAMA3_8B, args.load_format or "dummy"
    return args


def device_copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a large device-to-device copy, counting bytes read plus written."""
    src = torch.randn(1 << 29, device=device, dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / median_seconds(lambda: dst.copy_(src), 10, device=device, warmup=1)


def matmul_flops(device: torch.device) -> float:
    """FLOP/s of a bf16 matmul of two 8192 x 8192 matrices."""
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    return 2 * n**3 / median_seconds(lambda: a @ b, 10, device=device, warmup=1)


def placed_sequence(name: str, length: int, blocks: list[int], placement: Placement, vocab: int) -> Sequence:
    """A decode-ready sequence of `length` tokens whose KV (all but the last token) sits in `blocks`."""
    rng = random.Random(name)
    seq = Sequence(name, None, [rng.randrange(vocab) for _ in range(length)], SamplingParams(temperature=0))
    seq.num_computed_tokens = length - 1
    seq.block_table = list(blocks)
    seq.placement = placement
    return seq


def take_blocks(pool_size: int, count: int, rng: random.Random) -> list[int]:
    return rng.sample(range(pool_size), count)


def timed_iterations(engine: LLMEngine) -> Iterator[tuple[float, dict, list]]:
    """Run the engine until no request is left; for each iteration read back, the seconds of the `step()` calls
    since the one before, its record (`last_iteration`) and that call's outputs. With overlapped steps a call
    reads back the step the call before launched, and waits for the device to finish it."""
    previous, seconds = engine.counters.last_iteration, 0.0
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = engine.step()
        seconds += time.perf_counter() - start
        last = engine.counters.last_iteration
        if last is not previous:
            yield seconds, last, outputs
            previous, seconds = last, 0.0


def full_batch_decode_steps(engine: LLMEngine, batch: int, context: int, measured: int = 8) -> list[float]:
    """Seconds of the decode-only `engine.step()`s that carry all `batch` requests, their contexts near `context`
    (requests prefilled early decode in the mixed steps that prefill the rest, so they get that many more tokens).
    The call that finishes the requests is left out: with overlapped steps it only reads the last step back."""
    rng = random.Random(context)
    vocab = min(engine.model_config.vocab_size, len(engine.tokenizer))
    max_tokens = batch * context // engine.config.max_num_batched_tokens + 2 + measured
    for _ in range(batch):
        prompt = [rng.randrange(vocab) for _ in range(context - max_tokens // 2)]
        engine.add_request(prompt, {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    times = [
        seconds
        for seconds, last, _ in timed_iterations(engine)
        if not last["prefill_tokens"] and last["gpu_decodes"] == batch and engine.has_unfinished_requests()
    ]
    return times[1:] if len(times) > 1 else times


def decode_floor_seconds(engine: LLMEngine, batch: int, context: int, bandwidth: float) -> float:
    """A decode step's floor: the weights and the batch's KV read once at `bandwidth` bytes/s (under tensor
    parallelism, rank 0's shard)."""
    weights = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    kv_per_token = engine.runner.block_bytes // engine.config.block_size
    return (weights + batch * context * kv_per_token) / bandwidth


def prefill_step_seconds(engine: LLMEngine, num_seqs: int, tokens: int, seed: int) -> float:
    """Seconds of the step that prefills `num_seqs` prompts of `tokens` and samples their first tokens (a process's
    first such step also grows the allocator's pool)."""
    rng = random.Random(seed)
    vocab = min(engine.model_config.vocab_size, len(engine.tokenizer))
    for _ in range(num_seqs):
        engine.add_request([rng.randrange(vocab) for _ in range(tokens)], {"max_tokens": 1, "ignore_eos": True})
    torch.cuda.synchronize()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start
