"""Start-up profiling that fits the performance model, cached on disk by model, device and knobs."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict

import torch

from ..core.perf_model import PerfModel, fit_plane, load_cached, save
from ..cpu import library
from ..cpu.handoff import Flags, IterationLane
from ..layers.attention import AttentionMetadata, prefill_metadata
from ..layers.paged_decode import decode_attention
from ..timing import median_seconds
from .pipeline import spin_seconds

log = logging.getLogger("neo_backend")

CPU_DEVICE_MAX_PROFILE_TOKENS = 256  # the torch-on-CPU "device" of tests is slow
DENSE_PROFILE_TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 1024)  # and the iteration's token budget
PROFILE_TIMEOUT_S = 60.0  # every flag is set up front: a call that takes this long has failed


def load_or_profile(runner) -> PerfModel:
    cfg = runner.model_cfg
    device_name = torch.cuda.get_device_name(runner.device) if runner.device.type == "cuda" else "cpu"
    key_fields = {
        "model": asdict(cfg),
        "dtype": str(runner.dtype),
        "device": device_name,
        "threads": runner.host_attention.num_threads,
        "block_size": runner.block_size,
        "max_tokens": runner.config.max_num_batched_tokens,
        "max_decode_rows": runner.config.max_num_seqs,
        "isa": library.active_isa(runner.host_attention.kernels.lib),
        "cuda_graphs": runner.decode_graphs is not None,
        "gpu_sm_count": runner.config.gpu_sm_count,
        "tensor_parallel_size": runner.tp.size,
        "version": 9,
    }
    key = hashlib.sha256(json.dumps(key_fields, sort_keys=True, default=str).encode()).hexdigest()[:16]
    path = runner.config.cache_path / "profiles" / f"{key}.json"
    cached = load_cached(path)
    if cached is not None:
        log.info("performance model loaded from %s", path)
        return cached
    model = runner.profile()
    save(model, path)
    log.info("performance model saved to %s: %s", path, model)
    return model


@torch.inference_mode()
def profile(runner) -> PerfModel:
    cfg, bs = runner.model_cfg, runner.block_size
    max_tokens = min(runner.config.max_num_batched_tokens, runner.num_gpu_blocks * bs)
    if runner.device.type != "cuda":
        max_tokens = min(max_tokens, CPU_DEVICE_MAX_PROFILE_TOKENS)
    token_counts = sorted({t for t in DENSE_PROFILE_TOKENS if t < max_tokens} | {max_tokens})
    dense_times = []
    for i, tokens in enumerate(token_counts):
        log.info("profiling dense layers (%d/%d): %d tokens", i + 1, len(token_counts), tokens)
        measured = median_seconds(lambda: _dense_forward(runner, tokens), 3, device=runner.device, warmup=1)
        dense_times.append(max(measured, dense_times[-1] if dense_times else 0.0))  # more tokens never cost less

    log.info("profiling device decode attention")
    gpu_per_token = _gpu_attention_per_token(runner) * cfg.num_layers
    log.info("profiling host decode attention (%d threads)", runner.host_attention.num_threads)
    cpu_fixed, cpu_per_req, cpu_per_tok = _cpu_attention_fit(runner)
    return PerfModel(token_counts, dense_times, gpu_per_token, cpu_fixed, cpu_per_req, cpu_per_tok)


def _dense_forward(runner, tokens: int) -> None:
    """One forward of `tokens` tokens shaped as the iterations of that size are: decode rows (through the decode
    graphs where those run) up to `max_num_seqs`, beyond it a prompt's prefill, which only such iterations can
    hold. On a small GPU the two differ by more than their attention: at 8 SMs of the H200 1024 decode rows ran
    ~1.4x slower than a 1000-token prefill."""
    device = runner.device
    ids = torch.zeros(tokens, dtype=torch.long, device=device)
    if tokens > runner.config.max_num_seqs:
        meta = prefill_metadata(tokens, runner.block_size, device)
        hidden = runner.forward_prefilling(ids, torch.arange(tokens, device=device), meta)
        runner.model.compute_logits(hidden[-1:])
        return
    table = (torch.arange(tokens, device=device, dtype=torch.int32) // runner.block_size).view(tokens, 1)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(tokens, device=device),
        prefills=[],
        num_prefill_tokens=0,
        decode_block_tables=table,
        decode_context_lens=torch.ones(tokens, dtype=torch.int32, device=device),
    )
    graphs = runner.decode_graphs
    if graphs is not None and graphs.can_run(tokens):  # what decode steps of this size run through
        hidden = graphs.run(ids, ids, meta)
    else:
        hidden = runner.model(ids, ids, meta)
    runner.model.compute_logits(hidden)


def _random_tables(batch: int, context: int, block_size: int, num_blocks: int, device) -> torch.Tensor:
    per_seq = (context + block_size - 1) // block_size
    return torch.randint(0, num_blocks, (batch, per_seq), dtype=torch.int32, device=device)


def _gpu_attention_per_token(runner) -> float:
    cfg, bs, device = runner.rank_cfg, runner.block_size, runner.device
    k, v = runner.k_caches[0], runner.v_caches[0]
    points = []
    for batch, context in ((8, 256), (32, 1024)):
        q = torch.randn(batch, cfg.num_heads, cfg.head_dim, dtype=runner.dtype, device=device)
        tables = _random_tables(batch, context, bs, runner.num_gpu_blocks, device)
        lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        t = median_seconds(lambda: decode_attention(q, k, v, tables, lens, cfg.head_dim**-0.5), device=device, warmup=1)
        points.append((batch * context, t))
    (small_tokens, small_t), (large_tokens, large_t) = points
    slope = (large_t - small_t) / (large_tokens - small_tokens)
    return slope if slope > 0 else large_t / large_tokens


def _cpu_attention_fit(runner) -> tuple[float, float, float]:
    """Host attention of one iteration, fitted by requests and context tokens: append + attention in every layer in
    the one library call the pipeline makes (`HostAttention.run_iteration`), every layer's inputs ready. Each
    layer reads its own cache, so the reads come from DRAM as in serving; timing one layer over and over would
    measure the last-level cache (300 MiB on the H200's host). The team waits between layers as in serving
    (`spin_seconds`): sleeping there cost each layer a wake-up, ~2.5 ms an iteration on the H200's host, where one
    1100-token request of Llama-2-7B takes ~9 ms."""
    cfg, bs = runner.rank_cfg, runner.block_size
    host_cache, host = runner.host_cache, runner.host_attention
    dtype = host_cache.k_caches[0].dtype
    ready, done = Flags(cfg.num_layers, 0.0), Flags(cfg.num_layers, spin_seconds(runner.device))
    ready.values[:] = 1
    rows, times = [], []
    for batch, context in ((1, 256), (4, 1024), (8, 1024), (16, 512), (32, 1024)):
        context = max(bs, min(context, host_cache.num_blocks * bs // batch))  # a small pool: shorter contexts
        q = torch.randn(batch, cfg.num_heads, cfg.head_dim).to(dtype)
        k = torch.randn(batch, cfg.num_kv_heads, cfg.head_dim).to(dtype)
        tables = _random_tables(batch, context, bs, host_cache.num_blocks, "cpu")
        lens = torch.full((batch,), context, dtype=torch.int32)
        lane = IterationLane(q, k, k, torch.empty_like(q), tables, lens, tables[:, -1].long() * bs, ready)

        def iteration() -> None:
            done.reset(cfg.num_layers)
            host.run_iteration([lane], done, PROFILE_TIMEOUT_S)

        rows.append((batch, batch * context))
        times.append(median_seconds(iteration, 3, warmup=1))
        log.info(
            "host decode attention: %d requests x %d tokens, %.2f ms an iteration", batch, context, 1e3 * times[-1]
        )
    return fit_plane(rows, times)
