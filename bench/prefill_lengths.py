"""What a prompt of a length the server has not seen before costs, by prefill attention backend.

    python bench/prefill_lengths.py --tokenizer DIR --json bench/results/h100_prefill_lengths.json

Llama-3-8B shape, dummy bf16 weights, `never`, on CUDA. Two parts:
- SDPA alone, on one layer's prefill shape (32 query and 8 KV heads of 128, causal, `enable_gqa`): each backend's
  first call at lengths it has not met, against its next calls. cuDNN's builds a graph per new shape.
- The engine: one request (prefill and one token) of a new prompt length against one of a length seen before,
  and the warm prefill of 8 x 1000 tokens, with the engine's prefill backends and with cuDNN allowed first.
"""

from __future__ import annotations

import argparse
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
from common import LLAMA3_8B  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from neo_backend import EngineConfig, LLMEngine  # noqa: E402
from neo_backend.layers import attention  # noqa: E402
from neo_backend.timing import median_seconds  # noqa: E402

NEW_LENGTHS = (1000, 1001, 777, 2049, 123, 3001)
CUDA = torch.device("cuda")
ENGINE_BACKENDS = list(attention._PREFILL_BACKENDS)
WITH_CUDNN = [SDPBackend.CUDNN_ATTENTION, *ENGINE_BACKENDS]


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


def engine_costs(engine: LLMEngine, backends: list[SDPBackend], first_length: int) -> dict:
    """Median wall ms of one request of a new length, of one of a seen length, and of a warm 8 x 1000 prefill."""
    attention._PREFILL_BACKENDS = backends
    rng = random.Random(first_length)

    def generate(lengths: list[int]) -> float:
        prompts = [[rng.randrange(1000, 30000) for _ in range(n)] for n in lengths]
        return wall_ms(lambda: engine.generate(prompts, {"max_tokens": 1, "temperature": 0, "ignore_eos": True}))

    generate([1000] * 8)
    return {
        "new_length_ms": statistics.median(generate([first_length + 7 * i]) for i in range(6)),
        "seen_length_ms": statistics.median(generate([1000]) for _ in range(3)),
        "prefill_8x1000_ms": statistics.median(generate([1000] * 8) for _ in range(4)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="also write the results here")
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/prefill_lengths.py needs a CUDA device")
        return 2
    logging.basicConfig(level=logging.WARNING)
    args.model, args.load_format = args.model or LLAMA3_8B, args.load_format or "dummy"
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
    result = {"gpu": torch.cuda.get_device_name(), "sdpa": sdpa, "engine": {}}
    for rep in range(2):
        for name, backends in (("engine", ENGINE_BACKENDS), ("cudnn_first", WITH_CUDNN)):
            costs = engine_costs(engine, backends, 1101 + 100 * (2 * rep + (name != "engine")))
            result["engine"].setdefault(name, []).append(costs)
            print(f"{name:11s} " + ", ".join(f"{k} {v:.1f}" for k, v in costs.items()), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
