"""CUDA paths (skipped without a GPU; run on the H200 machine): the fused paged decode kernel, logits against
the CPU engine, and greedy tokens unchanged by offloading with the real CPU kernel and the real pipeline."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from engine_helpers import collect, fixed_perf_model, mixed_requests

from neo_backend import EngineConfig, LLMEngine
from neo_backend.config import ModelConfig
from neo_backend.cpu.handoff import Flags
from neo_backend.executor import stream_flags
from neo_backend.executor.cuda_graphs import MixedGraphs
from neo_backend.executor.host_pool import HostKVCache
from neo_backend.executor.swapper import BlockSwapper
from neo_backend.layers import flashinfer_prefill, fused, paged_decode, skinny_gemm
from neo_backend.layers.activation import silu_and_mul_reference
from neo_backend.layers.attention import AttentionMetadata, PagedAttention, PrefillChunk, split_qkv
from neo_backend.layers.blas import Gemm
from neo_backend.layers.norm import add_rms_norm_reference
from neo_backend.layers.paged_decode import decode_attention, decode_attention_reference
from neo_backend.layers.rotary import RotaryEmbedding, rotate_reference
from neo_backend.staging import device_view, write_rows

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def cuda_engine(model_dir, **knobs) -> LLMEngine:
    """An engine on the GPU with 16-token blocks, GPU-only unless `knobs` say otherwise."""
    knobs = {"device": "cuda", "block_size": 16, "offload_policy": "never", **knobs}
    return LLMEngine(EngineConfig(model=str(model_dir), **knobs))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(32, 8, 128, 16), (9, 3, 64, 16), (8, 8, 64, 32)])
@pytest.mark.parametrize("max_len,spare_blocks", [(1500, 0), (200, 0), (700, 300)])
@pytest.mark.parametrize("batch", [37, 2])
def test_triton_decode_kernel_matches_reference(
    dtype, heads, kv_heads, head_dim, block_size, max_len, spare_blocks, batch
):
    """Contexts of one split and of several, and a table much wider than any context (as in CUDA graphs); a
    batch of 2 runs the short splits of a batch with few (sequence, KV head) pairs."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    num_blocks = 512
    lens = torch.randint(1, max_len, (batch,), device="cuda", generator=gen, dtype=torch.int32)
    width = int((lens.max() + block_size - 1) // block_size) + spare_blocks
    tables = torch.randint(0, num_blocks, (batch, width), device="cuda", generator=gen, dtype=torch.int32)
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, device="cuda", generator=gen).to(dtype)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, device="cuda", generator=gen).to(dtype)
    q = torch.randn(batch, heads, head_dim, device="cuda", generator=gen).to(dtype)
    ours = decode_attention(q, k, v, tables, lens, head_dim**-0.5).double()
    ref = decode_attention_reference(q.double(), k.double(), v.double(), tables, lens, head_dim**-0.5)
    assert torch.isfinite(ours).all()
    assert ((ours - ref).norm() / ref.norm()).item() < 1e-2


def _causal_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """[T, H, D] attention of every row to the rows up to it, K/V heads repeated for their query groups."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    rows = q.shape[0]
    future = torch.ones(rows, rows, dtype=torch.bool, device=q.device).triu(1)
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(future, float("-inf")).softmax(dim=-1), v)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 128), (8, 8, 64)])
def test_prefill_chunks_attend_like_the_reference(dtype, heads, kv_heads, head_dim):
    """Prompts that start in the step (two runs of them, one call each in fp16/bf16) around two chunks that
    continue cached prompts (a call each), every row against exact causal attention over its whole sequence."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    block_size, scale = 16, head_dim**-0.5
    # (tokens cached before, tokens in the step)
    chunks_of = [(0, 37), (0, 1000), (50, 30), (1100, 257), (0, 1), (0, 129)]
    attn = PagedAttention(0, heads, kv_heads, head_dim)
    num_blocks = sum((c + n + block_size - 1) // block_size for c, n in chunks_of)
    attn.k_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim, device="cuda", dtype=dtype)
    attn.v_cache = torch.zeros_like(attn.k_cache)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.empty(sum(n for _, n in chunks_of), width, device="cuda", dtype=dtype)
    q, k, v = split_qkv(qkv, heads, kv_heads, head_dim)
    chunks, slots, expected, first_block, row = [], [], [], 0, 0
    for context, n in chunks_of:
        total = context + n
        seq_q = torch.randn(total, heads, head_dim, device="cuda", generator=gen).to(dtype)
        seq_k, seq_v = torch.randn(2, total, kv_heads, head_dim, device="cuda", generator=gen).to(dtype)
        table = torch.arange(first_block, first_block + (total + block_size - 1) // block_size, device="cuda")
        seq_slots = first_block * block_size + torch.arange(total, device="cuda")
        attn._store(seq_k[:context], seq_v[:context], seq_slots[:context])
        q[row : row + n], k[row : row + n], v[row : row + n] = seq_q[context:], seq_k[context:], seq_v[context:]
        chunks.append(PrefillChunk(row, n, context, table.to(torch.int32)))
        slots.append(seq_slots[context:])
        expected.append(_causal_reference(seq_q.double(), seq_k.double(), seq_v.double(), scale)[context:])
        first_block, row = first_block + len(table), row + n
    slot_mapping = torch.cat(slots)
    attn._store(k, v, slot_mapping)
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        prefills=chunks,
        num_prefill_tokens=row,
        decode_block_tables=torch.zeros(0, 1, dtype=torch.int32, device="cuda"),
        decode_context_lens=torch.zeros(0, dtype=torch.int32, device="cuda"),
    )
    assert [run.lengths for run in meta.prefill_runs] == [[37, 1000], [30], [257], [1, 129]]
    out = attn(q, k, v, meta).double()
    for chunk, ref in zip(chunks, expected):
        ours = out[chunk.token_start : chunk.token_start + chunk.num_tokens]
        assert torch.isfinite(ours).all()
        assert ((ours - ref).norm() / ref.norm()).item() < 1e-2


def test_prefill_runs_flashinfer_on_hopper_where_installed():
    """With `flashinfer-python` installed on a Hopper GPU, prefill attention builds and runs FlashInfer's kernels
    (the test above checks what they compute); elsewhere it keeps torch's flash attention."""
    flashinfer = pytest.importorskip("flashinfer")
    q = torch.zeros(4, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.zeros(4, 8, 128, device="cuda", dtype=torch.bfloat16)
    hopper = torch.cuda.get_device_capability()[0] == 9
    prefill = flashinfer_prefill.for_shape(q, k)
    assert (prefill is not None) == hopper, f"FlashInfer {flashinfer.__version__} on a Hopper GPU: {hopper}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_layers_match_reference(dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x, res = (torch.randn(33, 4096, device="cuda", generator=gen).to(dtype) for _ in range(2))
    weight = torch.randn(4096, device="cuda", generator=gen).to(dtype)
    for residual in (None, res):
        for ours, ref in zip(
            fused.add_rms_norm(x, residual, weight, 1e-5), add_rms_norm_reference(x, residual, weight, 1e-5)
        ):
            torch.testing.assert_close(ours, ref)
    rotary = RotaryEmbedding(128, 4096, 500000.0, None).cuda()
    qkv = torch.randn(33, 48 * 128, device="cuda", generator=gen).to(dtype)
    q, k, v = (t.view(33, -1, 128) for t in qkv.split([32 * 128, 8 * 128, 8 * 128], dim=-1))
    positions = torch.randint(0, 4096, (33,), device="cuda", generator=gen)
    cos, sin = rotary.cos[positions].unsqueeze(1), rotary.sin[positions].unsqueeze(1)
    expected_q, expected_k = rotate_reference(q, cos, sin), rotate_reference(k, cos, sin)
    k_cache, v_cache = (torch.zeros(40, 16, 8, 128, device="cuda", dtype=dtype) for _ in range(2))
    slots = torch.randperm(40 * 16, device="cuda", generator=gen)[:30]  # rows 30-32 stay off the pool (host rows)
    fused.rotary_and_store_(positions, q, k, v, rotary.cos, rotary.sin, k_cache, v_cache, slots)
    torch.testing.assert_close(q, expected_q)
    torch.testing.assert_close(k, expected_k)
    flat_k, flat_v = k_cache.view(-1, 8, 128), v_cache.view(-1, 8, 128)
    assert torch.equal(flat_k[slots], k[:30]) and torch.equal(flat_v[slots], v[:30])
    untouched = torch.ones(40 * 16, dtype=torch.bool, device="cuda")
    untouched[slots] = False
    assert not flat_k[untouched].any() and not flat_v[untouched].any()
    gate_up = torch.randn(33, 2 * 14336, device="cuda", generator=gen).to(dtype)
    torch.testing.assert_close(fused.silu_and_mul(gate_up), silu_and_mul_reference(gate_up))


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_skinny_gemm_matches_cublas(rows):
    """Every tiling the GEMM libraries may time, with and without K splits, at the 8B shapes cuBLAS tiles worst;
    a bias is added after the kernel."""
    gen = torch.Generator(device="cuda").manual_seed(rows)
    for in_features, out_features in ((4096, 6144), (14336, 4096)):
        x = torch.randn(rows, in_features, device="cuda", generator=gen).to(torch.bfloat16)
        weight = (0.02 * torch.randn(out_features, in_features, device="cuda", generator=gen)).to(torch.bfloat16)
        expected = torch.nn.functional.linear(x.float(), weight.float())
        unsplit_and_split = [skinny_gemm.Tiling(64, 128, 1, 4), skinny_gemm.Tiling(64, 128, 8, 4)]
        tilings = skinny_gemm.tilings(rows, in_features, out_features, 132) + unsplit_and_split
        for tiling in tilings:
            ours = skinny_gemm.linear(x, weight, tiling)
            assert ours.dtype == torch.bfloat16 and ours.shape == (rows, out_features)
            torch.testing.assert_close(ours.float(), expected, rtol=2e-2, atol=2e-2)
        bias = torch.randn(out_features, device="cuda", generator=gen).to(torch.bfloat16)
        with_bias = Gemm("triton", tilings[0]).linear(x, weight, bias)
        torch.testing.assert_close(with_bias.float(), expected + bias.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,vocab", [(64, 128256), (3, 4097), (1, 100)])
def test_greedy_kernel_matches_argmax_and_log_softmax(dtype, rows, vocab):
    """Ties (bf16 has many: the first index wins, as in torch.argmax), a row's max in its last chunk, and rows
    holding NaN, +inf or -inf, which are flagged and nothing else."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    logits = (4 * torch.randn(rows, vocab, device="cuda", generator=gen)).to(dtype)
    logits[0, vocab - 1] = 30.0
    if rows > 2:
        logits[1, [5, vocab // 2]] = 40.0
        logits[2, 7], logits[2, vocab - 2] = float("nan"), float("-inf")
    if rows > 32:
        logits[32, 3], logits[33, vocab - 3] = float("inf"), float("-inf")
    finite, tokens, logprobs = fused.greedy_sample(logits)
    reference = logits.float()
    expected_finite = torch.isfinite(reference).all(dim=-1)
    assert torch.equal(finite, expected_finite)
    ok = expected_finite
    assert torch.equal(tokens[ok], reference[ok].argmax(dim=-1))
    expected = reference[ok].log_softmax(dim=-1).gather(1, tokens[ok].unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(logprobs[ok], expected, rtol=0, atol=1e-5)


def test_cuda_logits_match_cpu_engine(tiny_model_dirs):
    prompt = list(range(3, 60))
    params = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    outs = {}
    for device in ("cpu", "cuda"):
        engine = cuda_engine(tiny_model_dirs["llama3"], device=device, dtype="float32", num_gpu_blocks=64)
        outs[device] = engine.generate([prompt], params)[0]
    assert outs["cuda"].token_ids == outs["cpu"].token_ids
    assert outs["cuda"].cumulative_logprob == pytest.approx(outs["cpu"].cumulative_logprob, rel=1e-2, abs=1e-2)


@pytest.mark.parametrize(
    "policy,pipeline,sm_count",
    [
        ("never", "auto", None),
        ("always", "off", None),
        ("always", "on", None),
        ("auto", "auto", None),
        ("never", "auto", 8),
        ("always", "on", 8),
        ("auto", "auto", 8),
    ],
)
def test_cuda_greedy_unchanged_by_offload(tiny_model_dirs, policy, pipeline, sm_count, monkeypatch):
    """Against the whole GPU under `never`, its steps one at a time: the same tokens with overlapped steps (in a
    pool small enough to preempt), with offloading, and on an 8-SM partition."""
    prompts, max_tokens = mixed_requests(32, seed=21)
    base = cuda_engine(tiny_model_dirs["llama3"], dtype="float32", num_gpu_blocks=512, overlap_steps="off")
    expected = collect(base, prompts, max_tokens, stagger=True)
    engine = cuda_engine(
        tiny_model_dirs["llama3"],
        dtype="float32",
        num_gpu_blocks=24,
        gpu_sm_count=sm_count,
        offload_policy=policy,
        pipeline=pipeline,
        cpu_kv_cache_gb=0.05,
        max_num_batched_tokens=128,
        cpu_latency_slack=1000.0,
    )
    if policy == "auto":
        fixed_perf_model(engine, monkeypatch)
    assert collect(engine, prompts, max_tokens, stagger=True) == expected
    stats = engine.stats_snapshot()
    assert (stats["cpu_decode_tokens"] > 0) == (policy != "never")
    if policy == "never":
        assert stats["overlapped_steps"] > 0
    assert stats["gpu_blocks_used"] == 0 and stats["cpu_blocks_used"] == 0


def test_cuda_greedy_unchanged_by_mixed_step_graphs(tiny_model_dirs, monkeypatch):
    """Staggered requests, so that prompts prefill beside decodes, new and continued chunks: the same tokens with
    the steps that prefill replayed as captured pieces (`MixedGraphs`) as with every step launched eagerly."""
    prompts, max_tokens = mixed_requests(32, seed=23)

    def engine(**overrides) -> LLMEngine:
        return cuda_engine(
            tiny_model_dirs["llama3"], dtype="float32", num_gpu_blocks=512, max_num_batched_tokens=96, **overrides
        )

    expected = collect(engine(enforce_eager=True), prompts, max_tokens, stagger=True)
    graphed = engine()
    assert graphed.runner.mixed_graphs.buckets == [16, 32, 64, 96]
    rows_run = []
    run = MixedGraphs.run

    def counted(self, input_ids, positions, meta):
        rows_run.append(input_ids.numel())
        return run(self, input_ids, positions, meta)

    monkeypatch.setattr(MixedGraphs, "run", counted)
    assert collect(graphed, prompts, max_tokens, stagger=True) == expected
    assert len(rows_run) >= 10 and max(rows_run) > 16, rows_run


def _triton_kernels() -> dict:
    """The engine's Triton kernels by name."""
    from triton.runtime.jit import JITFunction

    return {
        f"{module.__name__}.{name}": fn
        for module in (paged_decode, fused, skinny_gemm)
        for name, fn in vars(module).items()
        if isinstance(fn, JITFunction)
    }


def _compiled_variants() -> dict[str, int]:
    """How many specializations of each of the engine's Triton kernels this process holds compiled."""
    return {name: sum(len(cache[0]) for cache in fn.device_caches.values()) for name, fn in _triton_kernels().items()}


def test_cuda_steps_after_start_up_compile_no_triton_kernel(tiny_model_dirs):
    """Triton compiles a kernel for each new specialization it meets (constexprs, and integer arguments divisible
    by 16 or not), on the engine's thread, 0.2-0.5 s each: whatever serving meets must be compiled at start-up.
    Staggered greedy requests of many lengths, prompts prefilled beside decodes of every batch size and table
    width they reach: no kernel compiles after the engine is built (this process's compiled kernels dropped
    first, so earlier tests' compiles do not count)."""
    for fn in _triton_kernels().values():
        fn.device_caches.clear()
    engine = cuda_engine(tiny_model_dirs["llama3"], dtype="bfloat16", num_gpu_blocks=512, max_num_batched_tokens=96)
    compiled = _compiled_variants()
    prompts, max_tokens = mixed_requests(32, seed=29)
    collect(engine, prompts, max_tokens, stagger=True)
    after = _compiled_variants()
    assert after == compiled, {name: (compiled[name], n) for name, n in after.items() if n != compiled[name]}


def _decode_graph_seconds(engine: LLMEngine, batch: int = 64, reps: int = 20) -> float:
    """Median time of one replay of the engine's captured decode graph, on the engine's stream."""
    graphs = engine.runner.decode_graphs
    with engine.runner.device_scope():
        graph = graphs.graphs[graphs.key(batch, 1)]
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(reps):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[reps // 2]


def test_sm_partition_confines_a_bandwidth_bound_step(tmp_path, tiny_model_dirs):
    """A decode step of 2.4 GB of bf16 weights reads them at the partition's bandwidth: 8 of the H200's 132 SMs
    copy at ~0.64 TB/s against ~4.2 TB/s, so the step runs at most ~1/4 of its full-GPU speed."""
    import json

    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 32000,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "head_dim": 128,
        "max_position_embeddings": 2048,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    times = {}
    for sm_count in (None, 8):
        engine = cuda_engine(
            tmp_path,
            load_format="dummy",
            tokenizer=str(tiny_model_dirs["llama3"]),
            num_gpu_blocks=256,
            max_num_seqs=64,
            gpu_sm_count=sm_count,
        )
        times[sm_count] = _decode_graph_seconds(engine)
        del engine
    assert times[8] >= 4 * times[None], times


def test_decode_graph_gemms_run_where_chosen_per_shape(tiny_model_dirs):
    """Each graph's row count (decode batches, mixed-step buckets) has a GEMM for every linear shape of the layers;
    inside `applied` the linears run on it and compute what cuBLAS computes, and outside it they are back on torch's
    preferred library."""
    engine = cuda_engine(tiny_model_dirs["llama3"], dtype="bfloat16", num_gpu_blocks=64, max_num_seqs=64)
    gemms, model = engine.runner.gemms, engine.runner.model
    assert set(gemms.chosen) == set(engine.runner.decode_graphs.buckets) | set(engine.runner.mixed_graphs.buckets)
    linears = [linear for shape in gemms.by_shape.values() for linear in shape]
    assert len(linears) == 4 * len(model.layers)
    x = torch.randn(64, model.layers[0].down_proj.in_features, device="cuda", dtype=torch.bfloat16)
    with gemms.applied(64):
        assert all(linear.gemm == gemms.chosen[64][linear.in_features, linear.out_features] for linear in linears)
        chosen = model.layers[0].down_proj(x)
    assert all(linear.gemm is None for linear in linears)
    torch.testing.assert_close(chosen, model.layers[0].down_proj(x), rtol=2e-2, atol=2e-2)


def _swap_pools(num_layers: int) -> tuple[list[torch.Tensor], list[torch.Tensor], BlockSwapper]:
    """Random device K/V pools of 64 blocks per layer, a pinned host pool of 64 and a swapper between them, warmed
    up as the engine's is (a process's first swap loads the copies' kernels)."""
    cfg = ModelConfig(
        vocab_size=64,
        hidden_size=1024,
        intermediate_size=64,
        num_layers=num_layers,
        num_heads=8,
        num_kv_heads=8,
        head_dim=128,
    )
    shape = (64, 16, cfg.num_kv_heads, cfg.head_dim)
    device_k = [torch.randn(shape, device="cuda", dtype=torch.float16) for _ in range(num_layers)]
    device_v = [torch.randn(shape, device="cuda", dtype=torch.float16) for _ in range(num_layers)]
    host = HostKVCache(cfg, 64, 16, torch.float16, pin=True)
    swapper = BlockSwapper(device_k, device_v, host, torch.device("cuda"))
    swapper.warm_up(0)
    return device_k, device_v, swapper


def test_swaps_copy_the_right_blocks_while_the_compute_stream_moves_on():
    """A swap's copies run on the copy stream, behind earlier swaps, one per run of host blocks; the compute
    stream meanwhile allocates and fills tensors of the swap's index size, which must not land in the swap's
    block ids."""
    device_k, device_v, swapper = _swap_pools(num_layers=4)
    out_blocks, in_blocks = list(range(1, 33)), list(range(33, 64))
    host_blocks = list(range(40, 56)) + [3] + list(range(20, 35))  # runs of 16, 1 and 15

    def busy_copy_stream():
        with torch.cuda.stream(swapper.stream):
            torch.cuda._sleep(100_000_000)  # earlier swaps still copying

    busy_copy_stream()
    swapper.swap_out("a", out_blocks, host_blocks)
    decoys = [torch.zeros(len(out_blocks), dtype=torch.long, device="cuda") for _ in range(8)]
    swapper.complete(wait=True)
    torch.cuda.synchronize()
    for layer in range(4):
        assert torch.equal(swapper.host.k_caches[layer][host_blocks], device_k[layer][out_blocks].cpu())
        assert torch.equal(swapper.host.v_caches[layer][host_blocks], device_v[layer][out_blocks].cpu())

    busy_copy_stream()
    swapper.swap_in(host_blocks[:31], in_blocks)
    decoys += [torch.zeros(len(in_blocks), dtype=torch.long, device="cuda") for _ in range(8)]
    swapper.wait_swap_in()
    torch.cuda.synchronize()
    for layer in range(4):
        assert torch.equal(device_k[layer][in_blocks], device_k[layer][out_blocks[:31]])
        assert torch.equal(device_v[layer][in_blocks], device_v[layer][out_blocks[:31]])


def test_a_swap_out_landed_at_once_holds_back_the_compute_stream_not_the_caller():
    """Where a step reuses a swap-out's device blocks, `complete` returns at once and the compute stream waits
    for the copies: a kernel it queues next that overwrites the blocks runs after they were copied down."""
    device_k, device_v, swapper = _swap_pools(num_layers=2)
    blocks = list(range(8, 24))
    expected = [device_k[layer][blocks].cpu() for layer in range(2)]
    with torch.cuda.stream(swapper.stream):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of earlier copies
    start = time.perf_counter()
    swapper.swap_out("a", blocks, blocks)
    assert swapper.complete(wait=True) == blocks
    returned = time.perf_counter() - start
    for k in device_k:
        k[blocks] = 0  # the step reusing the blocks
    torch.cuda.synchronize()
    assert returned < 0.05, f"the caller waited {returned:.3f}s for the copies"
    for layer in range(2):
        assert torch.equal(swapper.host.k_caches[layer][blocks], expected[layer])


_FRESH_PROCESS_SWAPS = """
import sys, time
import torch
sys.path[:0] = ["tests", "tests/cuda"]
from test_cuda import _swap_pools

device_k, device_v, swapper = _swap_pools(num_layers=2)
blocks = list(range(8, 45))  # past 16 ids: the gather's other kernel
expected = [k[8:45].cpu() for k in device_k]


def seconds_behind_queued_copies(swap) -> float:
    with torch.cuda.stream(swapper.stream):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of earlier copies
    start = time.perf_counter()
    swap()
    returned = time.perf_counter() - start
    torch.cuda.synchronize()
    return returned


returned = seconds_behind_queued_copies(lambda: (swapper.swap_out("a", blocks, blocks), swapper.complete(wait=True)))
if returned >= 0.05:
    sys.exit(f"the caller waited {returned:.3f}s for the copies")
if not all(torch.equal(swapper.host.k_caches[layer][8:45], expected[layer]) for layer in range(2)):
    sys.exit("the swap-out copied the wrong blocks")
returned = seconds_behind_queued_copies(
    lambda: (swapper.swap_in(blocks, [block + 19 for block in blocks]), swapper.wait_swap_in())
)
if returned >= 0.05:
    sys.exit(f"the swap-in's caller waited {returned:.3f}s for the copies")
if not all(torch.equal(k[27:64].cpu(), expected[layer]) for layer, k in enumerate(device_k)):
    sys.exit("the swap-in copied the wrong blocks")
"""


def test_a_swap_launch_in_a_fresh_process_does_not_wait_for_queued_copies():
    """In a fresh process whose only swaps so far were `warm_up`'s: a swap of more than 16 blocks runs the gather's
    large-index kernel, and loading a kernel on its first launch waits for the copies queued on the device."""
    child = subprocess.run(
        [sys.executable, "-c", _FRESH_PROCESS_SWAPS],
        cwd=Path(__file__).parents[2],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0, child.stderr


@pytest.mark.parametrize("final", [1, Flags.FAILED], ids=["set", "failed"])
def test_a_stream_waits_on_a_host_flag_until_it_is_set_or_failed(final):
    """The pipeline's device-side wait: work queued behind it runs only once the CPU side sets the flag, and a
    flag the CPU side marked failed releases it too, so a failed iteration never leaves the device waiting."""
    assert stream_flags.available(torch.device("cuda"))
    flag = torch.zeros(1, dtype=torch.int64, pin_memory=True)
    out = torch.zeros(1, device="cuda")
    stream, after = torch.cuda.Stream(), torch.cuda.Event()
    try:
        with torch.cuda.stream(stream):
            stream_flags.enqueue_wait(stream, flag.data_ptr())
            out.fill_(1.0)
            after.record()
        time.sleep(0.3)
        assert not after.query(), "the queued work ran before the flag was set"
        flag[0] = final
        deadline = time.monotonic() + 10.0
        while not after.query():
            assert time.monotonic() < deadline, "the flag did not release the wait"
            time.sleep(0.001)
        assert out.item() == 1.0
    finally:
        flag[0] = 1  # never leave the stream waiting


def test_kernels_hand_rows_over_in_host_memory_and_the_stream_flags_them():
    """The pipeline's hand-off without copies: a kernel writes rows into pinned host memory through its
    `device_view` (bit for bit, signed zeros too), the stream sets a host flag behind that write, and a kernel
    reads back what the host wrote there since."""
    rows = torch.randn(3, 4096, dtype=torch.bfloat16, device="cuda")
    rows[0, :8] = -0.0
    host = torch.zeros(3, 4096, dtype=torch.bfloat16, pin_memory=True)
    flag = torch.zeros(1, dtype=torch.int64, pin_memory=True)
    view = device_view(host, torch.device("cuda"))
    assert view.is_cuda and view.data_ptr() == host.data_ptr() and view.shape == host.shape
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)  # tens of ms of device time ahead of the write and the flag
        write_rows(view, rows)
        stream_flags.enqueue_set(stream, flag.data_ptr())
    deadline = time.monotonic() + 10.0
    while int(flag[0]) == 0:
        assert time.monotonic() < deadline, "the stream never set the flag"
        time.sleep(0.0005)
    assert torch.equal(host.view(torch.int16), rows.cpu().view(torch.int16))
    host.neg_()
    assert torch.equal((view * 1).cpu(), -rows.cpu())
