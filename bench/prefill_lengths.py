"""What prefill attention costs by prompt length and batch shape.

    python bench/prefill_lengths.py --tokenizer DIR --json bench/results/h200_prefill_lengths.json

Llama-3-8B shape, dummy bf16 weights, `never`, on CUDA. Three parts:
- SDPA alone, on one layer's prefill shape (32 query and 8 KV heads of 128, causal, `enable_gqa`): each backend's
  first call at lengths it has not met, against its next calls. cuDNN's builds a graph per new shape.
- The engine: one request (prefill and one token) of a new prompt length against one of a length seen before,
  and the warm prefill of 8 x 1000 tokens.
- The engine's prefill of several batch shapes with flash attention's variable-length calls (`layers/attention.py`:
  the prompts that start in a step in one call, a chunk that continues a cached prompt in one of its own) against
  an SDPA call per chunk (flash for a new prompt, a masked call over K/V heads repeated for a continued one),
  alternating in one process. 3 x 7000 tokens exceed the step's 8192-token budget: two of its chunks continue.
"""

from __future__ import annotations

import json
import logging
import random
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from common import llama3_8b_args  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from neo_backend import EngineConfig, LLMEngine  # noqa: E402
from neo_backend.layers import attention  # noqa: E402
from neo_backend.timing import median_seconds  # noqa: E402

NEW_LENGTHS = (1000, 1001, 777, 2049, 123, 3001)
BATCH_SHAPES = {
    f"{n}x{length}": [length] * n for n, length in ((8, 1000), (32, 128), (64, 100), (2, 3000), (1, 1000), (3, 7000))
}
CUDA = torch.device("cuda")


def wall_ms(call: Callable[[], object], reps: int = 1) -> float:
    """Median ms of `reps` calls, each waiting for its device work; with one, the call's own time."""
    return median_seconds(call, reps, device=CUDA) * 1e3


def sdpa_first_calls(backend: SDPBackend, lengths: tuple[int, ...]) -> list[dict]:
    rows = []
    for length in lengths:
        q = torch.randn(1, 32, length, 128, device=CUDA, dtype=torch.bfloat16)
        k, v = torch.randn(2, 1, 8, length, 128, device=CUDA, dtype=torch.bfloat16)

        def call() -> None:
            with sdpa_kernel([backend]):
                F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        first = wall_ms(call)
        rows.append({"length": length, "first_ms": first, "next_ms": wall_ms(call, 3)})
    return rows


def prefill_ms(engine: LLMEngine, lengths: list[int], rng: random.Random) -> float:
    """Wall ms of prompts of these lengths (random tokens) prefilled and given one token each."""
    prompts = [[rng.randrange(1000, 30000) for _ in range(n)] for n in lengths]
    return wall_ms(lambda: engine.generate(prompts, {"max_tokens": 1, "temperature": 0, "ignore_eos": True}))


def engine_costs(engine: LLMEngine, first_length: int) -> dict:
    """Median wall ms of one request of a new length, of one of a seen length, and of a warm 8 x 1000 prefill."""
    rng = random.Random(first_length)
    prefill_ms(engine, [1000] * 8, rng)
    return {
        "new_length_ms": statistics.median(prefill_ms(engine, [first_length + 7 * i], rng) for i in range(6)),
        "seen_length_ms": statistics.median(prefill_ms(engine, [1000], rng) for _ in range(3)),
        "prefill_8x1000_ms": statistics.median(prefill_ms(engine, [1000] * 8, rng) for _ in range(4)),
    }


def varlen_against_per_chunk(engine: LLMEngine, rounds: int = 3) -> dict:
    """Median wall ms of each batch shape's prefill through variable-length flash calls and through an SDPA call
    per chunk, after a warm-up round of both."""
    rng = random.Random(0)
    flash = attention._flash_supported
    times = {name: {"varlen_ms": [], "per_chunk_ms": []} for name in BATCH_SHAPES}
    try:
        for round_ in range(rounds + 1):
            for mode in ("varlen_ms", "per_chunk_ms"):
                attention._flash_supported = flash if mode == "varlen_ms" else (lambda q: False)
                for name, lengths in BATCH_SHAPES.items():
                    ms = prefill_ms(engine, lengths, rng)
                    if round_:
                        times[name][mode].append(ms)
    finally:
        attention._flash_supported = flash
    return {name: {mode: statistics.median(ms) for mode, ms in modes.items()} for name, modes in times.items()}


def main() -> int:
    args = llama3_8b_args(__doc__, logging.WARNING)
    if not torch.cuda.is_available():
        print("bench/prefill_lengths.py needs a CUDA device")
        return 2
    args.offload_policy, args.max_num_batched_tokens = "never", args.max_num_batched_tokens or 8192
    sdpa = {
        "flash": sdpa_first_calls(SDPBackend.FLASH_ATTENTION, NEW_LENGTHS),
        "cudnn": sdpa_first_calls(SDPBackend.CUDNN_ATTENTION, NEW_LENGTHS),
    }
    for name, rows in sdpa.items():
        for row in rows:
            length, first, then = row["length"], row["first_ms"], row["next_ms"]
            print(f"sdpa {name:5s} length {length:5d}: first call {first:8.2f} ms, then {then:.3f}")
    engine = LLMEngine(EngineConfig.from_cli_args(args))
    result = {"gpu": torch.cuda.get_device_name(), "sdpa": sdpa, "engine": []}
    for rep in range(2):
        costs = engine_costs(engine, 1101 + 100 * rep)
        result["engine"].append(costs)
        print("engine " + ", ".join(f"{k} {v:.1f}" for k, v in costs.items()), flush=True)
    result["batch_shapes"] = varlen_against_per_chunk(engine)
    for name, row in result["batch_shapes"].items():
        one, each = row["varlen_ms"], row["per_chunk_ms"]
        print(
            f"prefill {name:7s}: varlen calls {one:7.1f} ms, an SDPA call per chunk {each:7.1f} ms ({each / one:.3f}x)"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
