"""Owns the model and the device KV pool; turns a scheduled batch into tensors, runs it, samples."""
from __future__ import annotations

import logging
import os

import torch

from .config import EngineConfig, ModelConfig
from .layers.attention import AttentionMetadata, PrefillChunk
from .layers.sampler import SampleResult, Sampler
from .loader import ModelSource, load_model
from .scheduler import SchedulerOutput
from .sequence import Sequence

log = logging.getLogger("neo_backend")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CPU_DEVICE_KV_BUDGET_BYTES = 1 << 30


def resolve_device(config: EngineConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if config.device == "cuda" and not torch.cuda.is_available():
        from .errors import ConfigError
        raise ConfigError("device=cuda but no CUDA device is visible; use device=cpu or auto")
    return torch.device(config.device)


def resolve_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[config.dtype]


class ModelRunner:
    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, source: ModelSource, max_model_len: int,
                 eos_token_ids: tuple[int, ...]) -> None:
        self.config = config
        self.model_cfg = model_cfg
        self.device = resolve_device(config)
        self.dtype = resolve_dtype(config, self.device)
        self.block_size = config.block_size
        self.model = load_model(source, model_cfg, max_model_len, self.dtype, self.device)
        self.sampler = Sampler(eos_token_ids, config.default_seed)
        self.num_gpu_blocks = config.num_gpu_blocks or self._profile_num_blocks()
        self.k_caches, self.v_caches = self._allocate_kv(self.num_gpu_blocks)
        log.info("device KV pool: %d blocks x %d tokens (%.2f GiB, %s on %s)", self.num_gpu_blocks,
                 self.block_size, self.num_gpu_blocks * self.block_bytes / 2 ** 30, self.dtype, self.device)

    @property
    def block_bytes(self) -> int:
        cfg = self.model_cfg
        return 2 * cfg.num_layers * self.block_size * cfg.num_kv_heads * cfg.head_dim * self.dtype.itemsize

    def _allocate_kv(self, num_blocks: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        cfg = self.model_cfg
        shape = (num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        k_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(cfg.num_layers)]
        v_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(cfg.num_layers)]
        for layer, k, v in zip(self.model.layers, k_caches, v_caches):
            layer.attn.k_cache, layer.attn.v_cache = k, v
        return k_caches, v_caches

    def _profile_num_blocks(self) -> int:
        """KV blocks that fit the memory budget after weights and the peak activation of a full batch."""
        if self.device.type != "cuda":
            available = _host_available_bytes()
            budget = min(CPU_DEVICE_KV_BUDGET_BYTES, available // 4)
            return max(1, budget // self.block_bytes)
        log.info("profiling device memory with a %d-token batch", self.config.max_num_batched_tokens)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        num_tokens = self.config.max_num_batched_tokens
        probe_blocks = (num_tokens + self.block_size - 1) // self.block_size
        self._allocate_kv(probe_blocks)
        with torch.inference_mode():
            ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
            table = torch.arange(probe_blocks, dtype=torch.int32, device=self.device)
            meta = AttentionMetadata(
                slot_mapping=torch.arange(num_tokens, device=self.device),
                prefills=[PrefillChunk(0, num_tokens, 0, table)], num_prefill_tokens=num_tokens,
                decode_block_tables=torch.zeros(0, 1, dtype=torch.int32, device=self.device),
                decode_context_lens=torch.zeros(0, dtype=torch.int32, device=self.device))
            hidden = self.model(ids, torch.arange(num_tokens, device=self.device), meta)
            self.model.compute_logits(hidden[-min(num_tokens, self.config.max_num_seqs):])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        self._allocate_kv(0)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        non_torch = total - free - torch.cuda.memory_reserved()
        budget = int(total * self.config.gpu_memory_utilization) - peak - non_torch
        if budget < self.block_bytes:
            from .errors import ConfigError
            raise ConfigError(f"no device memory left for the KV cache (weights + activations peak "
                              f"{peak / 2**30:.1f} GiB of {total / 2**30:.1f} GiB); raise gpu_memory_utilization "
                              f"or lower max_num_batched_tokens")
        log.info("memory profile: peak %.2f GiB, other %.2f GiB, KV budget %.2f GiB", peak / 2 ** 30,
                 non_torch / 2 ** 30, budget / 2 ** 30)
        return budget // self.block_bytes

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput, meta_hook=None) -> tuple[list[Sequence], SampleResult | None]:
        """Run one step; returns the sequences that sampled a token, and their samples."""
        input_ids, positions, meta, sample_rows, sample_seqs = self.prepare(batch)
        if meta_hook is not None:
            meta_hook(meta)
        hidden = self.model(input_ids, positions, meta)
        if not sample_seqs:
            return [], None
        logits = self.model.compute_logits(hidden[sample_rows])
        return sample_seqs, self.sampler(logits, sample_seqs)

    def prepare(self, batch: SchedulerOutput):
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        chunks: list[PrefillChunk] = []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        for seq, n in batch.prefills:
            start = seq.num_computed_tokens
            chunks.append(PrefillChunk(len(ids), n, start, self._tensor(seq.block_table, torch.int32)))
            ids.extend(seq.token_ids[start:start + n])
            pos.extend(range(start, start + n))
            slots.extend(seq.block_table[p // bs] * bs + p % bs for p in range(start, start + n))
            if start + n == len(seq.token_ids):
                sample_rows.append(len(ids) - 1)
                sample_seqs.append(seq)
        num_prefill = len(ids)
        for seq in batch.gpu_decodes:
            p = len(seq.token_ids) - 1
            ids.append(seq.token_ids[-1])
            pos.append(p)
            slots.append(seq.block_table[p // bs] * bs + p % bs)
        for seq in batch.cpu_decodes:
            ids.append(seq.token_ids[-1])
            pos.append(len(seq.token_ids) - 1)
        decodes = batch.gpu_decodes + batch.cpu_decodes
        sample_rows.extend(range(num_prefill, num_prefill + len(decodes)))
        sample_seqs.extend(decodes)
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots, torch.long), prefills=chunks, num_prefill_tokens=num_prefill,
            decode_block_tables=self._block_tables(batch.gpu_decodes),
            decode_context_lens=self._tensor([len(s.token_ids) for s in batch.gpu_decodes], torch.int32),
            num_host_decodes=len(batch.cpu_decodes))
        return (self._tensor(ids, torch.long), self._tensor(pos, torch.long), meta,
                self._tensor(sample_rows, torch.long), sample_seqs)

    def _block_tables(self, seqs: list[Sequence]) -> torch.Tensor:
        width = max((len(s.block_table) for s in seqs), default=1)
        rows = [s.block_table + [0] * (width - len(s.block_table)) for s in seqs]
        return self._tensor(rows, torch.int32).view(len(seqs), width)

    def _tensor(self, values, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)


def _host_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
