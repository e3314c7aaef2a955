"""Engine throughput on an offline trace, and (on CUDA) the decode step and prefill against the roofline.

    python bench/engine.py                                   # embedded SmolLM2, a smoke figure on CPU
    python bench/engine.py --device cuda --roofline          # Llama-3-8B-shaped dummy weights, bf16

The trace: all requests arrive at once with random prompt token ids; each generates exactly --output-len
tokens (ignore_eos). Prefill tokens/s counts steps that carry prefill work, decode tokens/s decode-only steps.
With --roofline: the decode step carrying every request of a batch (batch 64 at context 1024, 8 at 1024, 256
at 512) over its floor (weight bytes + KV bytes read) / measured device copy bandwidth, and the prefill of
8 x 1000 tokens (the median of five such steps, after an untimed one) as a fraction of the measured bf16 matmul
rate in model FLOPs.
Under --tensor-parallel-size N both are rank 0's: its shard of the weights and KV heads on its own GPU.
The ceilings are measured on the engine's own stream, so with --gpu-sm-count N they are the partition's; a
decode step faster than the floor at that bandwidth means work escaped the partition, and the script exits
with status 1.

    python bench/engine.py --device cuda --roofline --gpu-sm-count 8   # an A10G-class partition of the H200
    python bench/engine.py --roofline --model bench/configs/llama3-70b --load-format dummy --tensor-parallel-size 2
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import (  # noqa: E402
    DECODE_POINTS,
    LLAMA3_8B,
    decode_floor_seconds,
    device_copy_bandwidth,
    full_batch_decode_steps,
    matmul_flops,
    timed_iterations,
)

from neo_backend import EngineConfig, LLMEngine  # noqa: E402


def run_trace(engine: LLMEngine, num_requests: int, prompt_len: int, output_len: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    vocab = min(engine.model_config.vocab_size, len(engine.tokenizer))
    for _ in range(num_requests):
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        engine.add_request(prompt, {"max_tokens": output_len, "temperature": 0, "ignore_eos": True})
    prefill_time = decode_time = 0.0
    prefill_tokens = decode_tokens = 0
    decode_steps: list[float] = []
    start = time.perf_counter()
    for dt, last, outputs in timed_iterations(engine):
        if last["prefill_tokens"]:
            prefill_time += dt
            prefill_tokens += last["prefill_tokens"]
        else:
            decode_time += dt
            decode_tokens += len(outputs)
            decode_steps.append(dt)
    total = time.perf_counter() - start
    return {
        "requests": num_requests,
        "prompt_len": prompt_len,
        "output_len": output_len,
        "prefill_tokens_per_s": prefill_tokens / prefill_time if prefill_time else None,
        "decode_tokens_per_s": decode_tokens / decode_time if decode_time else None,
        "output_tokens_per_s": num_requests * output_len / total,
        "decode_step_median_ms": 1e3 * statistics.median(decode_steps) if decode_steps else None,
        "prefill_time_s": prefill_time,
        "total_s": total,
    }


def roofline(engine: LLMEngine) -> dict:
    device = engine.runner.device
    cfg = engine.model_config
    with engine.runner.device_scope():
        copy_bw = device_copy_bandwidth(device)
        peak = matmul_flops(device)

    points = []
    for batch, context in DECODE_POINTS:
        step_s = statistics.median(full_batch_decode_steps(engine, batch, context))
        floor_s = decode_floor_seconds(engine, batch, context, copy_bw)
        points.append(
            {
                "batch": batch,
                "context": context,
                "step_ms": step_s * 1e3,
                "floor_ms": floor_s * 1e3,
                "step_over_floor": step_s / floor_s,
                "tokens_per_s": batch / step_s,
            }
        )

    run_trace(engine, 8, 1000, 1, seed=3)  # a process's first step of 8000 tokens grows the allocator's pool
    prefill_s = statistics.median(run_trace(engine, 8, 1000, 1, seed=seed)["prefill_time_s"] for seed in range(5))
    linear_params = sum(p.numel() for n, p in engine.runner.model.named_parameters() if n.endswith("proj.weight"))
    tokens = 8 * 1000
    num_heads = engine.runner.model.layers[0].num_heads  # this rank's, as the weights are its shard
    attention_flops = 8 * cfg.num_layers * 2 * 2 * num_heads * cfg.head_dim * 1000 * 1000 / 2
    prefill_flops = 2 * linear_params * tokens + attention_flops  # the LM head scores only the 8 last tokens
    return {
        "copy_bandwidth_GBps": copy_bw / 1e9,
        "matmul_TFLOPs": peak / 1e12,
        "decode_step_ms": points[0]["step_ms"],
        "decode_floor_ms": points[0]["floor_ms"],
        "decode_step_over_floor": points[0]["step_over_floor"],
        "decode_tokens_per_s": points[0]["tokens_per_s"],
        "decode_points": points,
        "prefill_s": prefill_s,
        "prefill_fraction_of_matmul_peak": prefill_flops / prefill_s / peak,
    }


def profile(engine: LLMEngine, num_requests: int, prompt_len: int, output_len: int) -> None:
    """Print the kernels that take the device's time over a short trace (prefill and decode steps)."""
    from torch.profiler import ProfilerActivity

    run_trace(engine, 2, 16, 2)
    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_trace(engine, num_requests, prompt_len, output_len, seed=3)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--roofline", action="store_true", help="decode/prefill against the device's ceilings")
    parser.add_argument("--profile", action="store_true", help="print the top device kernels of the trace")
    parser.add_argument("--json", type=Path, help="also write the results here")
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.roofline and args.model is None:
        args.model, args.load_format = LLAMA3_8B, "dummy"
        args.max_num_batched_tokens = args.max_num_batched_tokens or 8192
        args.max_num_seqs = max(args.max_num_seqs or 0, max(batch for batch, _ in DECODE_POINTS))
        args.offload_policy = args.offload_policy or "never"
    config = EngineConfig.from_cli_args(args)
    engine = LLMEngine(config)
    result = {
        "device": str(engine.runner.device),
        "dtype": str(engine.runner.dtype),
        "model": config.model or "default (SmolLM2-135M-Instruct)",
    }
    if engine.runner.device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(engine.runner.device)
    if args.profile:
        profile(engine, args.num_requests, args.prompt_len, args.output_len)
    if args.roofline:
        result.update(roofline(engine))
        result["gpu_sm_count"] = config.gpu_sm_count or torch.cuda.get_device_properties(0).multi_processor_count
    else:
        result.update(run_trace(engine, args.num_requests, args.prompt_len, args.output_len))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    for key, value in result.items():
        if key == "decode_points":
            for p in value:
                print(
                    f"decode batch {p['batch']:3d} context {p['context']:4d}  {p['step_ms']:.2f} ms, floor "
                    f"{p['floor_ms']:.2f} ms: {p['step_over_floor']:.3f}x"
                )
            continue
        print(f"{key:32s} {value:.4g}" if isinstance(value, float) else f"{key:32s} {value}")
    if args.roofline and min(p["step_over_floor"] for p in result["decode_points"]) < 1.0:
        print(
            f"FAIL: the decode step ran faster than its floor at the measured {result['copy_bandwidth_GBps']:.0f} "
            f"GB/s: work escaped the engine's stream (and its SM partition)"
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
