"""FlashInfer's attention kernels against the engine's, one process, the same inputs (CUDA; needs the `flashinfer`
extra: `pip install '.[flashinfer]'`).

- decode: our paged decode kernel (`paged_decode`) against FlashInfer's batch decode, on CUDA cores and on tensor
  cores, over one pool (random blocks), the decode graphs' table widths, a third of the rows 37 tokens shorter and a
  seventh 5 tokens long; 4 layers' caches in one CUDA graph, µs a layer.
- prefill: torch's flash attention variable-length call (the engine's without FlashInfer) against FlashInfer's
  ragged prefill (its own choice of backend: FlashAttention-3 on Hopper), causal over packed prompts; one call in
  a CUDA graph, µs a layer.
- engine: the engine's step that prefills 8 x 1000-token prompts (Llama-3-8B shape, dummy weights, unless
  --model names another), FlashInfer's prefill and torch's call alternating step by step in one process, the
  median of each.

Llama-3-8B's attention shape (32 query heads, 8 K/V heads, head size 128), bf16.

    python3 bench/flashinfer_ab.py --tokenizer DIR [--json bench/results/<gpu>_flashinfer_ab.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import flashinfer  # noqa: E402
import torch  # noqa: E402
from common import llama3_8b_args, prefill_step_seconds  # noqa: E402

from neo_backend import EngineConfig, LLMEngine  # noqa: E402
from neo_backend.executor.cuda_graphs import capture  # noqa: E402
from neo_backend.layers import flashinfer_prefill, paged_decode  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
SCALE = HEAD_DIM**-0.5
DECODE_POINTS = [(64, 1024), (64, 1030), (8, 1024), (256, 512), (16, 3000), (1, 1024)]  # (batch, context)
PREFILL_PROMPTS = [[1000] * 8, [1000], [3000] * 2, [100] * 64, [7000] * 3]
LAYERS, POOL_BLOCKS = 4, 16384
ENGINE_STEPS = 6  # each way


def graph_us(fn, reps: int) -> float:
    """Median µs of one replay of `fn` captured in a CUDA graph (as the engine captures), timed by CUDA events."""
    graph, _ = capture(fn, None)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def decode_point(caches, workspace, batch: int, context: int, tensor_cores: bool) -> dict:
    dev = workspace.device
    lens = torch.full((batch,), context, dtype=torch.int32)
    lens[::3] = max(1, context - 37)
    lens[1::7] = 5
    pages = (lens + BLOCK_SIZE - 1) // BLOCK_SIZE
    width = max(32, 1 << int(pages.max() - 1).bit_length())  # the decode graphs' table width
    blocks = torch.randperm(POOL_BLOCKS, dtype=torch.int32)[: batch * width].view(batch, width)
    tables, lens_on_device = blocks.to(dev), lens.to(dev)
    indptr = torch.zeros(batch + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(pages, 0)
    indices = torch.cat([blocks[i, : pages[i]] for i in range(batch)]).to(dev)
    q = torch.randn(batch, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    ref = paged_decode.decode_attention_reference(q, *caches[0], tables, lens_on_device, SCALE).float()
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace,
        "NHD",
        use_cuda_graph=True,
        use_tensor_cores=tensor_cores,
        paged_kv_indptr_buffer=torch.empty(batch + 1, dtype=torch.int32, device=dev),
        paged_kv_indices_buffer=torch.empty(indices.numel(), dtype=torch.int32, device=dev),
        paged_kv_last_page_len_buffer=torch.empty(batch, dtype=torch.int32, device=dev),
    )
    wrapper.plan(
        indptr.to(dev),
        indices,
        ((lens - 1) % BLOCK_SIZE + 1).to(dev),
        HEADS,
        KV_HEADS,
        HEAD_DIM,
        BLOCK_SIZE,
        pos_encoding_mode="NONE",
        q_data_type=torch.bfloat16,
        kv_data_type=torch.bfloat16,
        sm_scale=SCALE,
    )
    theirs = torch.empty_like(q)
    wrapper.run(q, caches[0], out=theirs)
    ours = paged_decode.decode_attention(q, *caches[0], tables, lens_on_device, SCALE)
    out = torch.empty_like(q)
    theirs_us = graph_us(lambda: [wrapper.run(q, kv, out=out) for kv in caches], 30) / LAYERS
    ours_us = graph_us(
        lambda: [paged_decode.decode_attention(q, k, v, tables, lens_on_device, SCALE, out=out) for k, v in caches], 30
    )
    ours_us /= LAYERS
    return {
        "batch": batch,
        "context": context,
        "table_blocks": width,
        "flashinfer": "tensor cores" if tensor_cores else "CUDA cores",
        "ours_us": ours_us,
        "flashinfer_us": theirs_us,
        "flashinfer_over_ours": theirs_us / ours_us,
        "ours_max_error": (ours.float() - ref).abs().max().item(),
        "flashinfer_max_error": (theirs.float() - ref).abs().max().item(),
    }


def prefill_point(workspace: torch.Tensor, lengths: list[int]) -> dict:
    device, total = workspace.device, sum(lengths)
    cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=device)
    cu_seqlens[1:] = torch.cumsum(torch.tensor(lengths, device=device), 0)
    q = torch.randn(total, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    k, v = torch.randn(2, total, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    longest = max(lengths)

    def torch_flash() -> torch.Tensor:
        args = (q, k, v, cu_seqlens, cu_seqlens, longest, longest, 0.0, True, False)
        return torch.ops.aten._flash_attention_forward(*args, scale=SCALE)[0]

    wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
        workspace,
        "NHD",
        use_cuda_graph=True,
        qo_indptr_buf=torch.empty_like(cu_seqlens),
        kv_indptr_buf=torch.empty_like(cu_seqlens),
    )
    wrapper.plan(
        cu_seqlens,
        cu_seqlens,
        HEADS,
        KV_HEADS,
        HEAD_DIM,
        causal=True,
        sm_scale=SCALE,
        q_data_type=torch.bfloat16,
        kv_data_type=torch.bfloat16,
    )
    theirs = wrapper.run(q, k, v)
    torch_us = graph_us(torch_flash, 20)
    flashinfer_us = graph_us(lambda: wrapper.run(q, k, v), 20)
    return {
        "prompts": len(lengths),
        "tokens": lengths[0],
        "torch_flash_us": torch_us,
        "flashinfer_us": flashinfer_us,
        "flashinfer_over_torch": flashinfer_us / torch_us,
        "max_difference": (theirs.float() - torch_flash().float()).abs().max().item(),
    }


def engine_prefill(args: argparse.Namespace) -> dict:
    """Median seconds of the engine's 8 x 1000-token prefill step through FlashInfer and through torch's call,
    alternating (the torch steps find no FlashInfer: `for_shape` answers None)."""
    args.offload_policy, args.max_num_batched_tokens = "never", 8192
    engine = LLMEngine(EngineConfig.from_cli_args(args))
    with_flashinfer = flashinfer_prefill.for_shape
    seconds: dict[str, list[float]] = {"flashinfer": [], "torch": []}
    with engine.runner.device_scope(), torch.inference_mode():
        prefill_step_seconds(engine, 8, 1000, seed=0)
        for step in range(2 * ENGINE_STEPS):
            way = "torch" if step % 2 else "flashinfer"
            flashinfer_prefill.for_shape = with_flashinfer if way == "flashinfer" else lambda q, k: None
            seconds[way].append(prefill_step_seconds(engine, 8, 1000, seed=step + 1))
    flashinfer_prefill.for_shape = with_flashinfer
    flashinfer_ms, torch_ms = (statistics.median(seconds[way]) * 1e3 for way in ("flashinfer", "torch"))
    return {"flashinfer_ms": flashinfer_ms, "torch_ms": torch_ms, "flashinfer_over_torch": flashinfer_ms / torch_ms}


def main() -> None:
    args = llama3_8b_args(__doc__)
    torch.manual_seed(0)
    device = torch.device("cuda")
    result = {
        "gpu": torch.cuda.get_device_name(device),
        "flashinfer": flashinfer.__version__,
        "decode": [],
        "prefill": [],
    }
    print(f"{result['gpu']}, FlashInfer {flashinfer.__version__}", flush=True)
    caches = [
        tuple(
            torch.randn(POOL_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16) for _ in "kv"
        )
        for _ in range(LAYERS)
    ]
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=device)
    for tensor_cores in (False, True):
        for batch, context in DECODE_POINTS:
            point = decode_point(caches, workspace, batch, context, tensor_cores)
            result["decode"].append(point)
            print(
                f"decode {point['flashinfer']:12s} batch {batch:3d} context {context} "
                f"({point['table_blocks']} blocks): "
                f"ours {point['ours_us']:.1f} µs, FlashInfer {point['flashinfer_us']:.1f} µs, "
                f"FlashInfer/ours {point['flashinfer_over_ours']:.3f}",
                flush=True,
            )
    del caches
    for lengths in PREFILL_PROMPTS:
        point = prefill_point(workspace, lengths)
        result["prefill"].append(point)
        print(
            f"prefill {len(lengths)} x {lengths[0]}: torch flash {point['torch_flash_us']:.1f} µs, "
            f"FlashInfer {point['flashinfer_us']:.1f} µs, FlashInfer/torch {point['flashinfer_over_torch']:.3f}",
            flush=True,
        )
    del workspace
    result["engine_prefill_8x1000"] = point = engine_prefill(args)
    print(
        f"engine prefill step 8 x 1000: torch flash {point['torch_ms']:.1f} ms, "
        f"FlashInfer {point['flashinfer_ms']:.1f} ms, FlashInfer/torch {point['flashinfer_over_torch']:.3f}",
        flush=True,
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
