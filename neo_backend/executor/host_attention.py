"""Decode attention of the CPU-requests over the host KV pool: what the model runner, the pipeline and the
profiler call to run attention on the host."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..cpu import library
from ..cpu.affinity import attention_cpus, pin_current_thread
from ..cpu.handoff import Flags, IterationLane
from ..cpu.ops import Kernels
from ..layers.parallel import TensorParallel
from .host_pool import HostKVCache


@dataclass
class HostDecodeBatch:
    """The CPU-requests of one (sub-)batch: where their new k/v go and what they attend to."""

    block_tables: torch.Tensor  # int32 [B, max_blocks]
    context_lens: torch.Tensor  # int32 [B]
    slots: torch.Tensor  # int64 [B]

    @property
    def size(self) -> int:
        return self.context_lens.numel()

    @property
    def context_tokens(self) -> int:
        return int(self.context_lens.sum())


def attention_threads(requested: int | None, cpus: set[int], engine_cpu: int | None, device: torch.device) -> int:
    """The OpenMP team's size: `requested`, else one thread per CPU in `cpus` (the attention's CPUs)."""
    if requested:
        return requested
    if engine_cpu is None and device.type == "cuda":
        # one core stays with the thread that launches the device work: OpenMP's static schedule waits
        # for its slowest thread, and a team on every core shares one with that thread
        return max(1, len(cpus) - 1)
    return len(cpus)


class HostAttention:
    """Decode attention of CPU-requests: q/k/v of the new token go down, the kernel appends k/v to the host
    pool and attends (GIL released), the output goes back up. Times every call for the fail-safe."""

    def __init__(
        self,
        host: HostKVCache,
        scale: float,
        device: torch.device,
        num_threads: int | None,
        engine_cpu: int | None,
        tp: TensorParallel,
    ) -> None:
        """`num_threads`: the kernels' team (None: see `attention_threads`); `engine_cpu`: the CPU the
        kernels stay off; `tp`: whose share of the CPUs they run on (pinned there when there are several ranks)."""
        self.host = host
        self.scale = scale
        self.device = device
        self.engine_cpu = engine_cpu
        self.cpus = attention_cpus(engine_cpu, tp.rank, tp.size)
        self.pinned = engine_cpu is not None or tp.size > 1
        self.kernels = Kernels(library.default(), attention_threads(num_threads, self.cpus, engine_cpu, device))
        self.seconds = 0.0

    @property
    def num_threads(self) -> int:
        return self.kernels.num_threads

    def enter_thread(self) -> None:
        """Run first by a thread that will call the kernels: with `engine_cpu` set, it and the OpenMP team it
        starts (whose threads inherit its CPUs) stay off the engine's CPU; with several ranks, on its rank's share.
        A one-token call starts that team now rather than inside the first iteration, whose timing the fail-safe
        reads."""
        if self.pinned:
            pin_current_thread(self.cpus, "CPU attention")
        k_cache, v_cache = self.host.k_caches[0], self.host.v_caches[0]
        q = torch.zeros(1, *k_cache.shape[2:], dtype=k_cache.dtype)
        one = torch.ones(1, 1, dtype=torch.int32)
        self.kernels.paged_decode_attention(q, k_cache, v_cache, one - 1, one[0], self.scale)

    def run(
        self, layer: int, batch: HostDecodeBatch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor
    ) -> None:
        """q [B, Hq, D], k/v [B, Hkv, D] on the host (already copied down) -> attention output into `out`."""
        start = time.perf_counter()
        self.kernels.append_kv(k, v, self.host.k_caches[layer], self.host.v_caches[layer], batch.slots)
        self.kernels.paged_decode_attention(
            q,
            self.host.k_caches[layer],
            self.host.v_caches[layer],
            batch.block_tables,
            batch.context_lens,
            self.scale,
            out=out,
        )
        self.seconds += time.perf_counter() - start

    def run_iteration(self, lanes: list[IterationLane], done: Flags, timeout_s: float) -> None:
        """Every layer of a pipelined iteration, each step once its lane's ready flag is set (see
        `Kernels.decode_iteration`)."""
        seconds = self.kernels.decode_iteration(
            self.host.k_caches, self.host.v_caches, lanes, done, self.scale, timeout_s
        )
        self.seconds += float(seconds.sum())
