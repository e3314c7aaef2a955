"""Owns the model and the KV pools; carries out a scheduled batch's swaps, turns it into tensors, runs it, samples."""

from __future__ import annotations

import contextlib
import logging
import time
from array import array
from dataclasses import dataclass

import torch

from ..config import EngineConfig, ModelConfig
from ..core.perf_model import PerfModel
from ..core.scheduler_output import SchedulerOutput, SwapOut
from ..core.sequence import PENDING_TOKEN, Sequence
from ..cpu.abi import SUPPORTED_HEAD_DIMS
from ..errors import ConfigError
from ..layers.attention import AttentionMetadata, PrefillChunk, prefill_metadata
from ..layers.parallel import TensorParallel
from ..layers.sampler import PendingSample, Sampler, greedy
from ..models.loader import ModelSource, load_model
from ..staging import tensor_on, to_device
from . import stream_flags
from .cuda_graphs import MIXED_MAX_ROWS, DecodeGraphs, DecodeInputs, LaneGraphs, MixedGraphs, bucket_for, width_buckets
from .gemm_libraries import GemmLibraries
from .gpu_partition import sm_partition
from .host_attention import HostAttention, HostDecodeBatch
from .host_pool import HostKVCache, host_available_bytes
from .pipeline import PipelinedExecutor, SubBatch
from .profiler import profile
from .segments import HandOffBuffers
from .swapper import BlockSwapper

log = logging.getLogger("neo_backend")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CPU_DEVICE_KV_BUDGET_BYTES = 1 << 30


def resolve_device(config: EngineConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA device is visible; use device=cpu or auto")
    return torch.device(config.device)


def resolve_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[config.dtype]


class ModelRunner:
    """One rank's model shard and KV pools (`tp`; the default: the whole model). Only rank 0 samples."""

    lost_rank: str | None = None  # why a rank of the group is gone (see TensorParallelRunner); one rank loses none

    def __init__(
        self,
        config: EngineConfig,
        model_cfg: ModelConfig,
        source: ModelSource,
        max_model_len: int,
        eos_token_ids: tuple[int, ...],
        tp: TensorParallel | None = None,
    ) -> None:
        self.config = config
        self.model_cfg = model_cfg
        self.tp = tp or TensorParallel()
        self.rank_cfg = self.tp.rank_config(model_cfg)
        self.device = resolve_device(config)
        self.dtype = resolve_dtype(config, self.device)
        self.block_size = config.block_size
        self.partition = sm_partition(config.gpu_sm_count, self.device) if config.gpu_sm_count else None
        self.compute_stream = self.partition.stream() if self.partition else None
        with self.device_scope():
            self.model = load_model(source, model_cfg, max_model_len, self.dtype, self.device, self.tp)
            self.sampler = Sampler(eos_token_ids, config.default_seed)
            self.num_gpu_blocks = self.tp.min(config.num_gpu_blocks or self._profile_num_blocks(), self.device)
            # one block beyond the pool: the scratch block that padded CUDA-graph rows write to
            self.k_caches, self.v_caches = self._allocate_kv(self.num_gpu_blocks + 1)
            log.info(
                "device KV pool: %d blocks x %d tokens (%.2f GiB, %s on %s)",
                self.num_gpu_blocks,
                self.block_size,
                self.num_gpu_blocks * self.block_bytes / 2**30,
                self.dtype,
                self.device,
            )
            self.decode_graphs: DecodeGraphs | None = None
            self.mixed_graphs: MixedGraphs | None = None
            self.gemms: GemmLibraries | None = None
            self.max_blocks_per_seq = (max_model_len + self.block_size - 1) // self.block_size
            self.table_widths = width_buckets(self.max_blocks_per_seq, self.block_size)
            if self.device.type == "cuda" and not config.enforce_eager:
                self.gemms = GemmLibraries(self.model)
                self.decode_graphs = DecodeGraphs(self.model, self._decode_inputs(), self.table_widths, self.gemms)
                max_rows = min(MIXED_MAX_ROWS, config.max_num_batched_tokens)
                scratch_slot = self.num_gpu_blocks * self.block_size
                self.mixed_graphs = MixedGraphs(self.model, self.device, max_rows, scratch_slot, self.gemms)
            self._warm_up()
            self._init_offload(config, model_cfg)

    @torch.inference_mode()
    def _warm_up(self, tokens: int = 16) -> None:
        """A short prefill and its greedy sample: what builds or compiles on first use (FlashInfer's prefill
        kernels, the greedy sampler's Triton kernels) does so at start-up, not on the first request."""
        ids = torch.zeros(tokens, dtype=torch.long, device=self.device)
        meta = prefill_metadata(tokens, self.block_size, self.device)
        hidden = self.forward_prefilling(ids, torch.arange(tokens, device=self.device), meta)
        greedy(self.model.compute_logits(hidden[-1:]))

    def device_scope(self) -> contextlib.AbstractContextManager:
        """Where every GPU operation of the engine runs: a stream of the SM partition, or the current one."""
        return torch.cuda.stream(self.compute_stream) if self.compute_stream else contextlib.nullcontext()

    def _decode_inputs(self) -> DecodeInputs:
        return DecodeInputs(
            self.device,
            self.config.max_num_seqs,
            self.max_blocks_per_seq,
            scratch_block=self.num_gpu_blocks,
            block_size=self.block_size,
        )

    def _init_offload(self, config: EngineConfig, model_cfg: ModelConfig) -> None:
        """The host side of NEO: host KV pool, swapper, CPU attention and the pipelined executor. Without it
        the engine serves `offload_policy` never, whatever was asked (`offload_policy` holds what it serves)."""
        self.offload_policy = "never"
        self.host_cache: HostKVCache | None = None
        self.swapper: BlockSwapper | None = None
        self._swaps_in_flight: list[str] = []  # request ids, in the order their swap-outs started
        self.host_attention: HostAttention | None = None
        self.pipeline: PipelinedExecutor | None = None
        if config.offload_policy == "never":
            return
        if model_cfg.head_dim not in SUPPORTED_HEAD_DIMS:
            log.warning(
                "head_dim %d has no CPU attention kernel (supported: %s); offloading is off",
                model_cfg.head_dim,
                SUPPORTED_HEAD_DIMS,
            )
            return
        if self.device.type == "cuda" and not stream_flags.available(self.device):
            log.warning(
                "this CUDA driver cannot set or wait on host flags from a stream (cuStreamWriteValue64, "
                "cuStreamWaitValue64), which the CPU attention's hand-offs need; offloading is off"
            )
            return
        if config.offload_policy == "auto" and self.device.type == "cpu" and config.num_gpu_blocks is None:
            log.info("offload_policy auto on a CPU device with no num_gpu_blocks limit: nothing to offload")
            return
        num_cpu_blocks = int(config.cpu_kv_cache_gb * 2**30 / self.tp.size) // self.block_bytes
        if num_cpu_blocks == 0:
            log.info("cpu_kv_cache_gb=%s holds no KV block: offloading is off", config.cpu_kv_cache_gb)
            return
        pin = self.device.type == "cuda"
        self.host_cache = HostKVCache(self.rank_cfg, num_cpu_blocks, self.block_size, self.dtype, pin)
        self.host_attention = HostAttention(
            self.host_cache,
            model_cfg.head_dim**-0.5,
            self.device,
            config.cpu_attention_threads,
            config.engine_cpu,
            self.tp,
        )
        self.swapper = BlockSwapper(
            self.k_caches,
            self.v_caches,
            self.host_cache,
            self.device,
            self.partition.stream() if self.partition else None,
        )
        self.swapper.warm_up(self.num_gpu_blocks)
        hand_offs = [HandOffBuffers(self.model, config.max_num_seqs, self.device) for _ in range(2)]
        if self.device.type == "cuda":
            log.info(
                "pipeline hand-offs: %d rows a lane in pinned host memory, which the device reads and writes in "
                "place; its stream sets and waits on each layer's flags",
                config.max_num_seqs,
            )
        self.pipeline = PipelinedExecutor(self.host_attention, hand_offs, self._capture_lane_graphs(hand_offs))
        self.offload_policy = config.offload_policy

    def _capture_lane_graphs(self, hand_offs: list[HandOffBuffers]) -> list[LaneGraphs] | None:
        """Segment graphs for the pipeline's two lanes; lane 0 may carry no host rows, lane 1 always does."""
        if self.decode_graphs is None:
            return None
        start = time.monotonic()
        lanes = [
            LaneGraphs(self.model, self._decode_inputs(), (False, True), self.gemms, hand_offs[0]),
            LaneGraphs(self.model, self._decode_inputs(), (True,), self.gemms, hand_offs[1]),
        ]
        log.info(
            "captured %d pipeline segment graphs in %.1fs", sum(len(g.graphs) for g in lanes), time.monotonic() - start
        )
        return lanes

    @property
    def num_cpu_blocks(self) -> int:
        return self.host_cache.num_blocks if self.host_cache else 0

    @property
    def block_bytes(self) -> int:
        cfg = self.rank_cfg
        return 2 * cfg.num_layers * self.block_size * cfg.num_kv_heads * cfg.head_dim * self.dtype.itemsize

    def _allocate_kv(self, num_blocks: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        cfg = self.rank_cfg
        shape = (num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        k_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(cfg.num_layers)]
        v_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(cfg.num_layers)]
        for layer, k, v in zip(self.model.layers, k_caches, v_caches):
            layer.attn.k_cache, layer.attn.v_cache = k, v
        return k_caches, v_caches

    def _profile_num_blocks(self) -> int:
        """KV blocks that fit the memory budget after weights and the peak activation of a full batch."""
        if self.device.type != "cuda":
            available = host_available_bytes()
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
            meta = prefill_metadata(num_tokens, self.block_size, self.device)
            hidden = self.model(ids, torch.arange(num_tokens, device=self.device), meta)
            self.model.compute_logits(hidden[-min(num_tokens, self.config.max_num_seqs) :]).float()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        self._allocate_kv(0)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        non_torch = total - free - torch.cuda.memory_reserved()
        budget = int(total * self.config.gpu_memory_utilization) - peak - non_torch
        if budget < self.block_bytes:
            raise ConfigError(
                f"no device memory left for the KV cache (weights + activations peak "
                f"{peak / 2**30:.1f} GiB of {total / 2**30:.1f} GiB); raise gpu_memory_utilization "
                f"or lower max_num_batched_tokens"
            )
        log.info(
            "memory profile: peak %.2f GiB, other %.2f GiB, KV budget %.2f GiB",
            peak / 2**30,
            non_torch / 2**30,
            budget / 2**30,
        )
        return budget // self.block_bytes

    # Swaps: the scheduler decides them, the runner carries them out and reports which swap-outs landed.

    def swap(self, batch: SchedulerOutput) -> None:
        """The batch's swaps, before its step and in the order the scheduler decided them: swap-ins (copied up on
        the swap stream, which the step waits for), the landing of swap-outs in flight where a preempted request's
        host blocks were freed, then swap-outs whose device blocks the step reuses, each landed at once (the step
        waits for their copies on the device)."""
        for swap in batch.swap_in:
            self.swapper.swap_in(swap.host_blocks, swap.device_blocks)
        if batch.land_swap_outs:
            self.land_swap_outs(wait=True)
        for swap in batch.swap_out:
            self.start_swap_outs([swap])
            self.land_swap_outs(wait=True)

    def start_swap_outs(self, swaps: list[SwapOut]) -> None:
        """Start copies to the host pool that land while later steps compute (`land_swap_outs`)."""
        for swap in swaps:
            self.swapper.swap_out(swap.request_id, swap.device_blocks, swap.host_blocks)
            self._swaps_in_flight.append(swap.request_id)

    @property
    def swaps_in_flight(self) -> list[str]:
        return list(self._swaps_in_flight)

    def land_swap_outs(self, wait: bool, only: list[str] | None = None) -> list[str]:
        """Land the swap-outs in flight: all (`wait`), or those whose copies have finished, or those of the
        requests in `only`; the compute stream waits for the unfinished ones' copies (`BlockSwapper.complete`).
        Returns their request ids, in the order they started."""
        if not self._swaps_in_flight:
            return []
        self.swapper.complete(wait, only)
        landed = [r for r in self._swaps_in_flight if not self.swapper.in_transit(r)]
        self._swaps_in_flight = [r for r in self._swaps_in_flight if self.swapper.in_transit(r)]
        return landed

    @property
    def runs_async(self) -> bool:
        """Whether `execute` returns before the device has run the step (CUDA): the engine can then prepare the
        next step meanwhile (`EngineConfig.overlap_steps`)."""
        return self.device.type == "cuda"

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput, previous: PendingSample | None = None) -> LaunchedStep:
        """Launch one step, its sampling and the samples' copy to the host. Decode rows whose input token is still
        pending (`PENDING_TOKEN`) take it from `previous`, the step before, on the device."""
        events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if self.device.type == "cuda" else None
        if events:
            events[0].record()
        seqs, sample = self._launch(batch, previous)
        if events:
            events[1].record()
        return LaunchedStep(seqs, sample, events)

    def _launch(
        self, batch: SchedulerOutput, previous: PendingSample | None
    ) -> tuple[list[Sequence], PendingSample | None]:
        if self.swapper is not None:
            self.swapper.wait_swap_in()
        if batch.cpu_decodes:
            split = batch.split if batch.pipelined else len(batch.cpu_decodes)
            steps = [self.prepare(batch.prefills, batch.gpu_decodes, batch.cpu_decodes[:split], previous)]
            if split < len(batch.cpu_decodes):
                steps.append(self.prepare([], [], batch.cpu_decodes[split:], previous))
            hiddens = self.pipeline.run(self.model, [s.sub for s in steps])
            hidden = torch.cat([h[s.sample_rows] for h, s in zip(hiddens, steps)])
            sample_seqs = [seq for s in steps for seq in s.sample_seqs]
        else:
            step = self.prepare(batch.prefills, batch.gpu_decodes, [], previous)
            sub = step.sub
            if (
                self.decode_graphs is not None
                and not batch.prefills
                and self.decode_graphs.can_run(len(batch.gpu_decodes))
            ):
                hidden = self.decode_graphs.run(sub.input_ids, sub.positions, sub.meta)
            else:
                hidden = self.forward_prefilling(sub.input_ids, sub.positions, sub.meta)[step.sample_rows]
            sample_seqs = step.sample_seqs
        if not sample_seqs:
            return [], None
        logits = self.model.compute_logits(hidden)  # every rank's part of the vocabulary is gathered
        if self.tp.rank > 0:
            return sample_seqs, None
        return sample_seqs, self.sampler.launch(logits, sample_seqs)

    def forward_prefilling(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states of a GPU-only step that prefills: through the mixed-step graphs where it fits, else
        launched a kernel at a time."""
        if self.mixed_graphs is not None and self.mixed_graphs.fits(input_ids.numel()):
            return self.mixed_graphs.run(input_ids, positions, meta)
        return self.model(input_ids, positions, meta)

    def profile(self) -> PerfModel:
        """The performance model's measurements; at tensor_parallel_size > 1 every rank takes them at once (the
        dense forwards' collectives need every rank) and rank 0's are used."""
        return profile(self)

    def close(self) -> None:
        if self.pipeline is not None:
            self.pipeline.shutdown()

    def prepare(
        self,
        prefills: list[tuple[Sequence, int]],
        gpu_decodes: list[Sequence],
        cpu_decodes: list[Sequence],
        previous: PendingSample | None = None,
    ) -> PreparedStep:
        """Flatten one (sub-)batch into tensors: tokens laid out as [prefill chunks | GPU decodes | CPU decodes]."""
        bs = self.block_size
        ids: list[int] = []
        pos: list[torch.Tensor] = []  # host int64, a tensor per prefill chunk, then the decodes'
        slots: list[torch.Tensor] = []
        chunks: list[PrefillChunk] = []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        for seq, n in prefills:
            start = seq.num_computed_tokens
            table = torch.tensor(seq.block_table, dtype=torch.int32)
            chunks.append(PrefillChunk(len(ids), n, start, to_device(table, self.device)))
            ids.extend(seq.token_ids[start : start + n])
            pos.append(torch.arange(start, start + n))
            slots.append(table[pos[-1] // bs].long() * bs + pos[-1] % bs)
            if start + n == len(seq.token_ids):
                sample_rows.append(len(ids) - 1)
                sample_seqs.append(seq)
        num_prefill = len(ids)
        decodes = gpu_decodes + cpu_decodes
        pending: list[tuple[int, int]] = []  # (input row, row of `previous`) of tokens still on the device
        for seq in decodes:
            token = seq.token_ids[-1]
            if token == PENDING_TOKEN:
                pending.append((len(ids), previous.row_of[seq.request_id]))
                token = 0
            ids.append(token)
        pos.append(torch.tensor([len(seq.token_ids) - 1 for seq in decodes], dtype=torch.long))
        slots.append(torch.tensor([_slot(seq, len(seq.token_ids) - 1, bs) for seq in gpu_decodes], dtype=torch.long))
        sample_rows.extend(range(num_prefill, num_prefill + len(decodes)))
        sample_seqs.extend(decodes)
        meta = AttentionMetadata(
            slot_mapping=to_device(_joined(slots), self.device),
            prefills=chunks,
            num_prefill_tokens=num_prefill,
            decode_block_tables=self._block_tables(gpu_decodes, self.device, self.table_widths),
            decode_context_lens=self._tensor([len(s.token_ids) for s in gpu_decodes], torch.int32),
        )
        host_batch = None
        if cpu_decodes:
            host_batch = HostDecodeBatch(
                block_tables=self._block_tables(cpu_decodes, torch.device("cpu")),
                context_lens=torch.tensor([len(s.token_ids) for s in cpu_decodes], dtype=torch.int32),
                slots=torch.tensor([_slot(s, len(s.token_ids) - 1, bs) for s in cpu_decodes], dtype=torch.long),
            )
        input_ids = self._tensor(ids, torch.long)
        if pending:
            rows, sources = self._tensor(list(zip(*pending)), torch.long)
            input_ids.index_copy_(0, rows, previous.token_ids.index_select(0, sources))
        sub = SubBatch(input_ids, to_device(_joined(pos), self.device), meta, host_batch)
        return PreparedStep(sub, self._tensor(sample_rows, torch.long), sample_seqs)

    @staticmethod
    def _block_tables(seqs: list[Sequence], device: torch.device, widths: list[int] | None = None) -> torch.Tensor:
        """The sequences' block tables as rows padded with block 0, built in one int32 buffer (a nested list
        through `torch.tensor` costs ~3x more, on the critical path of every step). With `widths`, as wide as the
        narrowest that fits: the device's decode attention then launches in one of the shapes the decode graphs
        compiled at start-up, where an eager step meeting a new one would wait 0.2-0.5 s for Triton to compile it."""
        width = max((len(s.block_table) for s in seqs), default=1)
        if widths:
            width = bucket_for(widths, width)
        flat = array("i", bytes(4 * width * max(1, len(seqs))))
        for row, seq in enumerate(seqs):
            start = row * width
            flat[start : start + len(seq.block_table)] = array("i", seq.block_table)
        table = torch.frombuffer(flat, dtype=torch.int32)[: width * len(seqs)].view(len(seqs), width)
        return to_device(table, device)

    def _tensor(self, values, dtype: torch.dtype) -> torch.Tensor:
        return tensor_on(values, dtype, self.device)


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _slot(seq: Sequence, position: int, block_size: int) -> int:
    return seq.block_table[position // block_size] * block_size + position % block_size


@dataclass
class LaunchedStep:
    """A step handed to the device: the sequences that sample a token, in row order, and their samples (None on
    ranks > 0, which do not sample)."""

    seqs: list[Sequence]
    sample: PendingSample | None
    events: list[torch.cuda.Event] | None  # on CUDA: recorded before and after the step's work

    def device_seconds(self) -> float | None:
        """The step's time on the device, from its first kernel to its samples' copy; waits for it to end."""
        if self.events is None:
            return None
        started, ended = self.events
        ended.synchronize()
        return started.elapsed_time(ended) / 1e3


@dataclass
class PreparedStep:
    sub: SubBatch
    sample_rows: torch.Tensor
    sample_seqs: list[Sequence]
