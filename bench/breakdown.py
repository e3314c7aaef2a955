"""Where a decode step's and a prefill's time goes: each kernel of the model against its own floor, the whole
model's CUDA graph, and the host's share of `engine.step()`.

    python bench/breakdown.py --tokenizer DIR --json bench/results/h200_breakdown.json

Llama-3-8B shape, dummy bf16 weights, `offload_policy` never. Every kernel is timed on the engine's own stream,
replayed `REPS` times inside one CUDA graph (no launch gaps) on the engine's KV pool; a decode GEMM's replays go
through as many layers' weights, as a step's do (one layer's, replayed, would be read from the L2); its floor is
its bytes over the measured copy bandwidth (decode) or its FLOPs over the measured bf16 matmul rate (prefill). Per
decode point: the kernels of one layer times the layer count plus the LM head and the sampler ("kernels sum"), the
whole model's decode graph replayed alone, and the median `engine.step()`; the step minus the graph, the LM head
and the sampler (`host_gap_ms`) is the step's input copies and small kernels and any time the GPU waits for the
host (scheduling, batch building, launch, output processing). The prefill: 8 x 1000 tokens, its GEMMs (two calls a
graph: their outputs are large), its attention (the layer's own call over the 8 prompts, launched as a step
launches it) and the rest, against the step's time.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import (  # noqa: E402
    DECODE_POINTS,
    decode_floor_seconds,
    device_copy_bandwidth,
    full_batch_decode_steps,
    llama3_8b_args,
    matmul_flops,
    placed_sequence,
    prefill_step_seconds,
)

from neo_backend import EngineConfig, LLMEngine  # noqa: E402
from neo_backend.core.sequence import Placement  # noqa: E402
from neo_backend.executor.cuda_graphs import capture  # noqa: E402
from neo_backend.layers import paged_decode  # noqa: E402
from neo_backend.layers.activation import silu_and_mul  # noqa: E402
from neo_backend.layers.attention import prefill_metadata  # noqa: E402
from neo_backend.timing import median_seconds  # noqa: E402

REPS = 20
PREFILL_REPS = 2  # a prefill GEMM runs ~0.1-1 ms, and 20 of gate/up's 8000-row outputs take 9 GB


def graph_seconds(calls: list[Callable[[], object]], device: torch.device) -> float:
    """Seconds per call of `calls`, captured one after another in one CUDA graph as the engine captures its own
    (each call's output stays allocated in the graph's pool: few calls for large outputs)."""
    graph, _ = capture(lambda: [call() for call in calls], None)
    return median_seconds(graph.replay, 5, device=device, warmup=1) / len(calls)


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def decode_kernels(engine: LLMEngine, batch: int, context: int, bandwidth: float) -> list[dict]:
    """One layer's decode kernels at `batch` x `context` (times the layer count), the LM head and the sampler."""
    runner, cfg = engine.runner, engine.model_config
    layer, model, device, dtype = runner.model.layers[0], runner.model, runner.device, runner.dtype
    layers = model.layers[:REPS]
    hidden = torch.randn(batch, cfg.hidden_size, device=device, dtype=dtype)
    residual = torch.randn_like(hidden)
    qkv = layer.qkv_proj(hidden)
    q, k, v = qkv.split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
    q = q.reshape(batch, layer.num_heads, layer.head_dim).contiguous()
    k = k.reshape(batch, layer.num_kv_heads, layer.head_dim).contiguous()
    v = v.reshape(batch, layer.num_kv_heads, layer.head_dim).contiguous()
    positions = torch.full((batch,), context - 1, device=device, dtype=torch.long)
    gate_up = layer.gate_up_proj(hidden)
    ffn = silu_and_mul(gate_up)
    blocks_per_seq = context // runner.block_size
    rng = random.Random(batch)
    table = [rng.sample(range(runner.num_gpu_blocks), blocks_per_seq) for _ in range(batch)]
    tables = torch.tensor(table, dtype=torch.int32, device=device)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    slots = tables[:, -1].long() * runner.block_size
    k_cache, v_cache = layer.attn.k_cache, layer.attn.v_cache
    used = tables.flatten().long()
    k_cache[used], v_cache[used] = torch.randn_like(k_cache[used]), torch.randn_like(v_cache[used])
    kv_bytes = 2 * batch * context * layer.num_kv_heads * layer.head_dim * dtype.itemsize
    attn_out = torch.empty_like(q)
    logits_weight = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    n = cfg.num_layers
    rows = [
        ("add + RMSNorm (x2)", 2 * n, [lambda: layer.input_layernorm(hidden, residual)], 4 * nbytes(hidden)),
        ("qkv GEMM", n, [partial(ly.qkv_proj, hidden) for ly in layers], nbytes(layer.qkv_proj.weight, hidden, qkv)),
        (
            "RoPE + k/v store",
            n,
            [lambda: layer.attn.store_rotated(layer.rotary, positions, q, k, v, slots)],
            2 * nbytes(q, k) + 2 * nbytes(k, v),
        ),
        (
            "decode attention",
            n,
            [lambda: paged_decode.decode_attention(q, k_cache, v_cache, tables, lens, layer.attn.scale, attn_out)],
            kv_bytes + 2 * nbytes(q),
        ),
        ("o GEMM", n, [partial(ly.o_proj, q.flatten(1)) for ly in layers], nbytes(layer.o_proj.weight, q, hidden)),
        (
            "gate/up GEMM",
            n,
            [partial(ly.gate_up_proj, hidden) for ly in layers],
            nbytes(layer.gate_up_proj.weight, hidden, gate_up),
        ),
        ("SiLU * up", n, [lambda: silu_and_mul(gate_up)], nbytes(gate_up, ffn)),
        ("down GEMM", n, [partial(ly.down_proj, ffn) for ly in layers], nbytes(layer.down_proj.weight, ffn, hidden)),
        (
            "LM head",
            1,
            [lambda: model.compute_logits(hidden)],
            nbytes(logits_weight) + batch * cfg.vocab_size * 6,
        ),
    ]
    out = []
    with runner.gemms.applied(batch):
        for name, per_step, calls, moved in rows:
            seconds = graph_seconds(calls * (REPS // len(calls)), device)
            out.append(_row(name, per_step, seconds, moved / bandwidth))
    return out


def sampler_seconds(engine: LLMEngine, batch: int) -> float:
    """Wall seconds of greedy sampling of `batch` rows (device kernels, the read-back and the host lists)."""
    runner, cfg = engine.runner, engine.model_config
    logits = torch.randn(batch, cfg.vocab_size, device=runner.device, dtype=runner.dtype)
    seqs = [placed_sequence(f"s{i}", 8, [0], Placement.GPU, cfg.vocab_size) for i in range(batch)]
    return median_seconds(lambda: runner.sampler(logits, seqs), 20, device=runner.device, warmup=2)


def _row(name: str, per_step: int, seconds: float, floor_seconds: float) -> dict:
    return {
        "kernel": name,
        "per_step": per_step,
        "us_each": seconds * 1e6,
        "floor_us_each": floor_seconds * 1e6,
        "over_floor": seconds / floor_seconds,
        "ms_per_step": per_step * seconds * 1e3,
    }


def decode_point(engine: LLMEngine, batch: int, context: int, bandwidth: float) -> dict:
    """The kernels, the decode graph alone and the median engine step of `batch` requests at `context`."""
    kernels = decode_kernels(engine, batch, context, bandwidth)
    sampler_s = sampler_seconds(engine, batch)
    steps = full_batch_decode_steps(engine, batch, context)
    graph_s = decode_graph_seconds(engine, batch, context)
    floor_s = decode_floor_seconds(engine, batch, context, bandwidth)
    kernels_ms = sum(r["ms_per_step"] for r in kernels)
    step_ms = statistics.median(steps) * 1e3
    return {
        "batch": batch,
        "context": context,
        "kernels": kernels,
        "kernels_sum_ms": kernels_ms,
        "sampler_ms": sampler_s * 1e3,
        "decode_graph_ms": graph_s * 1e3,
        "step_ms": step_ms,
        "floor_ms": floor_s * 1e3,
        "step_over_floor": step_ms / (floor_s * 1e3),
        "graph_over_floor": graph_s / floor_s,
        "host_gap_ms": step_ms - graph_s * 1e3 - kernels[-1]["ms_per_step"] - sampler_s * 1e3,
    }


def decode_graph_seconds(engine: LLMEngine, batch: int, context: int) -> float:
    """The whole model's captured decode graph for `batch` rows, replayed alone with its inputs at `context`."""
    graphs = engine.runner.decode_graphs
    blocks = context // engine.config.block_size
    key = graphs.key(batch, blocks)
    bs, inputs = key[0], graphs.inputs
    inputs.tables[:bs, :blocks] = torch.arange(bs * blocks, device=inputs.tables.device).view(bs, blocks)
    inputs.lens[:bs] = context
    return median_seconds(graphs.graphs[key].replay, 10, device=engine.runner.device, warmup=2)


def prefill(engine: LLMEngine, peak: float, num_seqs: int = 8, tokens: int = 1000) -> dict:
    """8 x 1000 prompt tokens: the step, and its GEMMs and attention at that shape against the matmul rate."""
    runner, cfg = engine.runner, engine.model_config
    layer, device, dtype = runner.model.layers[0], runner.device, runner.dtype
    m = num_seqs * tokens
    hidden = torch.randn(m, cfg.hidden_size, device=device, dtype=dtype)
    ffn = torch.randn(m, layer.down_proj.in_features, device=device, dtype=dtype)
    q = torch.randn(m, layer.num_heads, layer.head_dim, device=device, dtype=dtype)
    kv = torch.randn(m, layer.num_kv_heads, layer.head_dim, device=device, dtype=dtype)
    n = cfg.num_layers
    gemms = [
        ("qkv GEMM", layer.qkv_proj, hidden),
        ("o GEMM", layer.o_proj, hidden),
        ("gate/up GEMM", layer.gate_up_proj, hidden),
        ("down GEMM", layer.down_proj, ffn),
    ]
    rows = []
    for name, linear, x in gemms:
        seconds = graph_seconds([partial(linear, x)] * PREFILL_REPS, device)
        rows.append(_row(name, n, seconds, _gemm_flops(linear, m) / peak))
    attention_flops = num_seqs * 2 * 2 * layer.num_heads * layer.head_dim * tokens * tokens / 2
    meta = prefill_metadata(tokens, engine.config.block_size, device, num_prompts=num_seqs)
    out = torch.empty_like(q)
    seconds = median_seconds(lambda: layer.attn(q, kv, kv, meta, out=out), 5, device=device, warmup=1)
    rows.append(_row(f"attention ({num_seqs} prompts, one call)", n, seconds, attention_flops / peak))
    step_s = min(prefill_step_seconds(engine, num_seqs, tokens, seed) for seed in range(2))
    model_flops = sum(r["floor_us_each"] * r["per_step"] for r in rows) * 1e-6 * peak
    return {
        "tokens": m,
        "kernels": rows,
        "kernels_sum_ms": sum(r["ms_per_step"] for r in rows),
        "step_ms": step_s * 1e3,
        "fraction_of_matmul_peak": model_flops / step_s / peak,
    }


def _gemm_flops(linear: torch.nn.Linear, m: int) -> float:
    return 2 * m * linear.in_features * linear.out_features


def print_table(title: str, rows: list[dict]) -> None:
    print(
        f"\n{title}\n{'kernel':32s} {'per step':>8s} {'us each':>9s} {'floor us':>9s} {'x floor':>8s} {'ms/step':>8s}"
    )
    for r in rows:
        print(
            f"{r['kernel']:32s} {r['per_step']:8d} {r['us_each']:9.1f} {r['floor_us_each']:9.1f} "
            f"{r['over_floor']:8.2f} {r['ms_per_step']:8.3f}"
        )


def main() -> int:
    args = llama3_8b_args(__doc__)
    args.offload_policy, args.max_num_seqs = "never", max(args.max_num_seqs or 0, 256)
    args.max_num_batched_tokens = args.max_num_batched_tokens or 8192
    engine = LLMEngine(EngineConfig.from_cli_args(args))
    device = engine.runner.device
    if device.type != "cuda":
        print("bench/breakdown.py needs a CUDA device")
        return 2
    with engine.runner.device_scope(), torch.inference_mode():
        bandwidth, peak = device_copy_bandwidth(device), matmul_flops(device)
        result = {"gpu": torch.cuda.get_device_name(device), "copy_bandwidth_GBps": bandwidth / 1e9}
        result["matmul_TFLOPs"] = peak / 1e12
        result["decode"] = [decode_point(engine, b, c, bandwidth) for b, c in DECODE_POINTS]
        result["prefill"] = prefill(engine, peak)
    for point in result["decode"]:
        print_table(f"decode, batch {point['batch']}, context {point['context']}", point["kernels"])
        print(
            f"kernels sum {point['kernels_sum_ms']:.2f} ms, decode graph {point['decode_graph_ms']:.2f} ms, sampler "
            f"{point['sampler_ms']:.2f} ms, engine.step {point['step_ms']:.2f} ms, floor {point['floor_ms']:.2f} ms "
            f"(step {point['step_over_floor']:.3f}x, graph {point['graph_over_floor']:.3f}x), host gap "
            f"{point['host_gap_ms']:.2f} ms"
        )
    p = result["prefill"]
    print_table(f"prefill, {p['tokens']} tokens", p["kernels"])
    print(
        f"kernels sum {p['kernels_sum_ms']:.1f} ms, step {p['step_ms']:.1f} ms, "
        f"{p['fraction_of_matmul_peak']:.3f} of the matmul rate"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
