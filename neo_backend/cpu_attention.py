"""Python binding of the CPU paged decode-attention library (`kernels/`, built by `kernel_build`).

Tensors are validated here, before any C code runs, so bad input raises `KernelInputError` and never
reaches the library. Calls go through ctypes, which releases the GIL for the whole foreign call: the
engine can run GPU work from another Python thread while the kernel runs.

dtypes: the KV cache is fp16, bf16 or fp32. `q` is either the cache's dtype or fp32, and the output has
q's dtype (all arithmetic is fp32; pass fp32 q to get unrounded fp32 output from a 16-bit cache).

Run `python -m neo_backend build-kernel` to compile the library ahead of first use.
"""
from __future__ import annotations

import contextlib
import ctypes
import math
import os
import pathlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from .cpu import build as kernel_build
from .errors import KernelError, KernelInputError

SUPPORTED_HEAD_DIMS = (64, 128, 256)
ISAS = ("scalar", "avx2", "avx512")  # index = the library's ISA code
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_ABI_VERSION = 2
_STATUS = {1: "unsupported dtype or head_dim", 2: "out of memory", 3: "invalid argument"}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_num_threads = len(os.sched_getaffinity(0))


def build(force: bool = False) -> pathlib.Path:
    """Compiles the library if needed (cached per source, compiler, flags and CPU) and returns its path."""
    return kernel_build.build(force)


def load_library(path: pathlib.Path) -> ctypes.CDLL:
    """Loads a build of the library, checks its ABI and declares its functions."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise KernelError(f"cannot load {path}: {e}; rebuild with "
                          "`python -m neo_backend build-kernel --force`") from e
    if lib.neo_abi_version() != _ABI_VERSION:
        raise KernelError(f"{path} has ABI {lib.neo_abi_version()}, this binding needs {_ABI_VERSION}; "
                          "rebuild with `python -m neo_backend build-kernel --force`")
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.neo_paged_attention.argtypes = [p, i, p, p, i, p, p, p, i, i, i, i, i, i, ctypes.c_float, i, i]
    lib.neo_paged_attention.restype = i
    lib.neo_append_kv.argtypes = [p, p, p, p, p, i, ctypes.c_size_t]
    lib.neo_append_kv.restype = i
    lib.neo_stream_read.argtypes = [p, ctypes.c_size_t, i]
    lib.neo_stream_read.restype = ctypes.c_double
    lib.neo_set_isa.argtypes = [i]
    lib.neo_wait_flag.argtypes = [p, ctypes.c_int64, ctypes.c_double, ctypes.c_double]
    lib.neo_wait_flag.restype = i
    lib.neo_decode_iteration.argtypes = [p, i, i, i, i, i, i, i, ctypes.c_float, i, ctypes.c_double,
                                         ctypes.c_double, p]
    lib.neo_decode_iteration.restype = i
    return lib


def _library() -> ctypes.CDLL:
    global _lib
    with _lock:
        if _lib is None:
            _lib = load_library(build())
        return _lib


@contextlib.contextmanager
def using_library(lib: ctypes.CDLL) -> Iterator[None]:
    """This module's calls go to `lib` (another build, from `load_library`) inside the block, to compare builds
    call by call (bench/kernel_ab.py). Not for use while other threads call the kernels."""
    global _lib
    previous = _library()
    with _lock:
        _lib = lib
    try:
        yield
    finally:
        with _lock:
            _lib = previous


def set_num_threads(n: int) -> None:
    """Sets the default OpenMP thread count of the kernels (initially: the cores this process may use)."""
    global _num_threads
    _num_threads = _thread_count(n)


def get_num_threads() -> int:
    return _num_threads


def _thread_count(n: int | None) -> int:
    if n is None:
        return _num_threads
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise KernelInputError(f"num_threads must be a positive int, got {n!r}")
    return n


def active_isa() -> str:
    """The SIMD path in use: 'avx512', 'avx2' or 'scalar'."""
    return ISAS[_library().neo_isa()]


def best_isa() -> str:
    """The widest SIMD path this CPU supports."""
    return ISAS[_library().neo_max_isa()]


def set_isa(name: str | None) -> None:
    """Forces a narrower SIMD path (tests cover every path this way); None restores the best one."""
    lib = _library()
    target = lib.neo_max_isa() if name is None else (ISAS.index(name) if name in ISAS else -1)
    if target < 0:
        raise KernelInputError(f"unknown ISA {name!r}; choose one of {ISAS}")
    if lib.neo_set_isa(target) != 0:
        raise KernelInputError(f"ISA {name!r} is not supported by this CPU (best: {best_isa()})")


def _check(name: str, t: object, ndim: int, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise KernelInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise KernelInputError(f"{name} is on {t.device}; the CPU kernel needs host tensors")
    if t.dim() != ndim:
        raise KernelInputError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise KernelInputError(f"{name} has dtype {t.dtype}; expected one of {[str(d) for d in dtypes]}")
    if not t.is_contiguous():
        raise KernelInputError(f"{name} must be contiguous (call .contiguous()); got strides {t.stride()}")
    return t


def _check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape:
        raise KernelInputError(f"{name} has shape {tuple(t.shape)}, expected {shape}")


def _check_caches(k_cache: object, v_cache: object) -> tuple[int, int, int, int]:
    kv_dtypes = tuple(_DTYPE_CODES)
    _check("k_cache", k_cache, 4, kv_dtypes)
    _check("v_cache", v_cache, 4, kv_dtypes)
    if v_cache.dtype != k_cache.dtype:
        raise KernelInputError(f"v_cache dtype {v_cache.dtype} differs from k_cache dtype {k_cache.dtype}")
    _check_shape("v_cache", v_cache, tuple(k_cache.shape))
    num_blocks, block_size, hkv, d = k_cache.shape
    if block_size < 1 or hkv < 1:
        raise KernelInputError(f"k_cache shape {tuple(k_cache.shape)} has an empty block or head dimension")
    return num_blocks, block_size, hkv, d


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None, num_threads: int | None = None,
                           split_long: bool = True) -> torch.Tensor:
    """Decode attention of one query token per sequence over a paged KV cache.

    q [B, Hq, D] (cache dtype or fp32); k_cache/v_cache [num_blocks, block_size, Hkv, D];
    block_tables int32 [B, max_blocks]; context_lens int32 [B], each >= 1 and counting the current token,
    whose k/v must already be in the cache (see `append_kv`). Hq must be a multiple of Hkv (GQA).
    Returns `out` [B, Hq, D] in q's dtype (allocated when None). `split_long` lets long sequences be
    split across threads and merged exactly (log-sum-exp); results then differ from the unsplit ones
    only by fp32 rounding.
    """
    if out is None:
        out = torch.empty_like(q) if isinstance(q, torch.Tensor) else None
    shape = _check_attention(q, k_cache, v_cache, block_tables, context_lens, scale, out)
    threads = _thread_count(num_threads)
    if shape.batch == 0:
        return out
    status = _library().neo_paged_attention(
        q.data_ptr(), _DTYPE_CODES[q.dtype], k_cache.data_ptr(), v_cache.data_ptr(), _DTYPE_CODES[k_cache.dtype],
        block_tables.data_ptr(), context_lens.data_ptr(), out.data_ptr(), shape.batch, shape.q_heads, shape.kv_heads,
        shape.head_dim, shape.block_size, shape.max_blocks, float(scale), threads, int(bool(split_long)))
    if status != 0:
        raise KernelError(f"paged_decode_attention failed in the library: {_STATUS.get(status, status)}")
    return out


@dataclass(frozen=True)
class _AttentionShape:
    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    max_blocks: int


def _check_attention(q: object, k_cache: object, v_cache: object, block_tables: object, context_lens: object,
                     scale: object, out: object) -> _AttentionShape:
    num_blocks, block_size, hkv, d = _check_caches(k_cache, v_cache)
    if d not in SUPPORTED_HEAD_DIMS:
        raise KernelInputError(f"head_dim {d} is not supported; supported: {SUPPORTED_HEAD_DIMS}")
    _check("q", q, 3, (k_cache.dtype, torch.float32))
    b, hq, _ = q.shape
    _check_shape("q", q, (b, hq, d))
    if hq == 0 or hq % hkv:
        raise KernelInputError(f"query heads ({hq}) must be a positive multiple of KV heads ({hkv})")
    _check("block_tables", block_tables, 2, (torch.int32,))
    max_blocks = block_tables.shape[1]
    _check_shape("block_tables", block_tables, (b, max_blocks))
    _check("context_lens", context_lens, 1, (torch.int32,))
    _check_shape("context_lens", context_lens, (b,))
    _check("out", out, 3, (q.dtype,))
    _check_shape("out", out, tuple(q.shape))
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise KernelInputError(f"scale must be a finite float, got {scale!r}")
    if b:
        _check_block_tables(block_tables, context_lens, block_size, num_blocks)
    return _AttentionShape(b, hq, hkv, d, block_size, max_blocks)


def _check_block_tables(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                        num_blocks: int) -> None:
    """Context lengths fit the table, and every entry the kernel will read names an existing block."""
    # numpy: a few microseconds per operation where torch dispatch costs tens, on every decode step.
    ctx, tables = context_lens.numpy(), block_tables.numpy()
    lo, hi = int(ctx.min()), int(ctx.max())
    if lo < 1:
        raise KernelInputError(f"context_lens must be >= 1 (they include the current token); got {lo}")
    if hi > tables.shape[1] * block_size:
        raise KernelInputError(f"context length {hi} exceeds the block table's capacity "
                               f"({tables.shape[1]} blocks x {block_size} tokens)")
    used = np.arange(tables.shape[1]) < ((ctx + (block_size - 1)) // block_size)[:, None]
    bad = used & ((tables < 0) | (tables >= num_blocks))
    if bad.any():
        raise KernelInputError(f"block_tables holds block id {int(tables[bad][0])} within a context, outside "
                               f"the cache's [0, {num_blocks})")


def append_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
    """Writes each sequence's new token k/v [B, Hkv, D] at slot = block_id * block_size + offset."""
    _check_append(k, v, k_cache, v_cache, slot_mapping)
    if k.shape[0]:
        _library().neo_append_kv(k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                 slot_mapping.data_ptr(), k.shape[0], k.shape[1] * k.shape[2] * k.element_size())


def _check_append(k: object, v: object, k_cache: object, v_cache: object, slot_mapping: object) -> None:
    num_blocks, block_size, hkv, d = _check_caches(k_cache, v_cache)
    _check("k", k, 3, (k_cache.dtype,))
    b = k.shape[0]
    _check_shape("k", k, (b, hkv, d))
    _check("v", v, 3, (k_cache.dtype,))
    _check_shape("v", v, (b, hkv, d))
    _check("slot_mapping", slot_mapping, 1, (torch.int64,))
    _check_shape("slot_mapping", slot_mapping, (b,))
    if b == 0:
        return
    slots = slot_mapping.numpy()
    lo, hi = int(slots.min()), int(slots.max())
    if lo < 0 or hi >= num_blocks * block_size:
        raise KernelInputError(f"slot_mapping holds slot {lo if lo < 0 else hi}, outside the cache's "
                               f"[0, {num_blocks * block_size})")


# How long a hand-off waiter spins before it polls: through any wait of an iteration. Only for waiters with a
# core of their own (on CUDA the attention team leaves one to the launching thread); others use 0.
HAND_OFF_SPIN_S = 0.1


class Flags:
    """Counters in host memory that one side sets and another waits on, spinning in C with the GIL released.

    The pipeline's hand-offs: the device sets a sub-batch's "ready" flag for a layer with a copy queued behind
    its q/k/v copies (hence pinned memory), the CPU-attention loop sets "done" flags, the launching thread
    waits on them. A spinning waiter sees a store at once, where a condition variable's wake-up costs tens of
    microseconds per layer. Waiters spin for `spin_s`, then poll every 20 us (spin only where the waiter has a
    core of its own). A negative value means the setter gave up; `wait` reports it instead of waiting on.
    """

    FAILED = -1

    def __init__(self, size: int, spin_s: float, pin: bool = False) -> None:
        self.spin_s, self.pin = spin_s, pin
        self._lib = _library()
        self._allocate(size)

    def _allocate(self, size: int) -> None:
        self.tensor = torch.zeros(size, dtype=torch.int64, pin_memory=self.pin)
        self.values = self.tensor.numpy()
        self.size = size

    def reset(self, size: int) -> None:
        if self.values.size < size:
            self._allocate(size)
        else:
            self.values[:size] = 0
        self.size = size

    def set(self, index: int) -> None:
        self.values[index] = 1

    def set_in_order(self, index: int, one: torch.Tensor) -> None:
        """Sets flag `index` after the work queued before it: on CUDA by copying `one` (int64 [1] holding 1, on
        the device) on the current stream, so it lands behind the copies it announces; elsewhere at once."""
        if one.device.type == "cuda":
            self.tensor[index:index + 1].copy_(one, non_blocking=True)
        else:
            self.set(index)

    def fail_from(self, index: int) -> None:
        self.values[index:] = self.FAILED

    def fail_pending(self) -> None:
        """Marks every flag of the current round not yet set as failed."""
        pending = self.values[:self.size]
        pending[pending == 0] = self.FAILED

    def address(self, index: int = 0) -> int:
        return self.values.ctypes.data + 8 * index

    def wait(self, index: int, timeout_s: float) -> bool:
        """True once flag `index` is set; False if it was marked failed. Raises KernelError on timeout."""
        if not 0 <= index < self.values.size:
            raise KernelInputError(f"flag index {index} outside [0, {self.values.size})")
        status = self._lib.neo_wait_flag(self.address(index), 1, self.spin_s, float(timeout_s))
        if status == 2:
            raise KernelError(f"CPU attention hand-off timed out after {timeout_s:.0f} s")
        return status == 0


@dataclass
class IterationLane:
    """One sub-batch's CPU decodes in a pipelined iteration: the same host buffers serve every layer (each
    layer's q/k/v are copied in before its `ready` flag is set), and `ready` holds one flag per layer."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    slots: torch.Tensor
    ready: Flags


_STEP_FIELDS = ("ready", "done", "q", "k", "v", "out", "k_cache", "v_cache", "slots", "tables", "lens", "batch",
                "max_blocks")  # the order of the library's StepField
_ABANDONED = 20  # the library's kAbandoned: the launching side gave up, and raised its own error
_HAND_OFF_STATUS = {12: "a hand-off timed out", _ABANDONED: "abandoned by the launching thread"}


def decode_iteration(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], lanes: list[IterationLane],
                     done: Flags, scale: float, timeout_s: float, num_threads: int | None = None) -> np.ndarray:
    """The CPU side of a pipelined iteration in one library call (GIL released throughout): for each layer,
    for each lane, wait for its ready flag, append k/v to that layer's caches, attend into `out`, set the
    step's done flag (step = layer * len(lanes) + lane). Returns the seconds of each step. If the launching
    side marks a ready flag failed, the remaining steps are skipped and their done flags failed too.
    """
    num_layers = len(k_caches)
    if len(v_caches) != num_layers or not lanes:
        raise KernelInputError(f"need one v cache per k cache and at least one lane; got {num_layers} k, "
                               f"{len(v_caches)} v caches and {len(lanes)} lanes")
    for k_cache, v_cache in zip(k_caches, v_caches):
        if k_cache.shape != k_caches[0].shape or v_cache.shape != k_cache.shape or k_cache.dtype != k_caches[0].dtype \
                or v_cache.dtype != k_cache.dtype or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise KernelInputError("every layer's k/v caches must be contiguous with layer 0's shape and dtype")
    shapes = []
    for lane in lanes:
        shapes.append(_check_attention(lane.q, k_caches[0], v_caches[0], lane.block_tables, lane.context_lens,
                                       scale, lane.out))
        _check_append(lane.k, lane.v, k_caches[0], v_caches[0], lane.slots)
        if lane.ready.values.size < num_layers:
            raise KernelInputError(f"a lane has {lane.ready.values.size} ready flags for {num_layers} layers")
        if lane.q.dtype != lanes[0].q.dtype or shapes[-1].q_heads != shapes[0].q_heads:
            raise KernelInputError("every lane's q must have the same dtype and number of heads")
    num_steps = num_layers * len(lanes)
    if done.values.size < num_steps:
        raise KernelInputError(f"{done.values.size} done flags for {num_steps} steps")
    table = np.empty((num_layers, len(lanes), len(_STEP_FIELDS)), dtype=np.int64)
    layers = np.arange(num_layers)
    field = {name: i for i, name in enumerate(_STEP_FIELDS)}
    table[:, :, field["k_cache"]] = np.array([t.data_ptr() for t in k_caches])[:, None]
    table[:, :, field["v_cache"]] = np.array([t.data_ptr() for t in v_caches])[:, None]
    for i, (lane, shape) in enumerate(zip(lanes, shapes)):
        column = table[:, i]
        column[:, field["ready"]] = lane.ready.address() + 8 * layers
        column[:, field["done"]] = done.address() + 8 * (layers * len(lanes) + i)
        for name, tensor in (("q", lane.q), ("k", lane.k), ("v", lane.v), ("out", lane.out), ("slots", lane.slots),
                             ("tables", lane.block_tables), ("lens", lane.context_lens)):
            column[:, field[name]] = tensor.data_ptr()
        column[:, field["batch"]] = shape.batch
        column[:, field["max_blocks"]] = shape.max_blocks
    seconds = np.zeros(num_steps)
    first = shapes[0]
    status = _library().neo_decode_iteration(
        table.ctypes.data, num_steps, _DTYPE_CODES[lanes[0].q.dtype], _DTYPE_CODES[k_caches[0].dtype], first.q_heads,
        first.kv_heads, first.head_dim, first.block_size, float(scale), _thread_count(num_threads), done.spin_s,
        float(timeout_s), seconds.ctypes.data)
    if status not in (0, _ABANDONED):
        reason = _HAND_OFF_STATUS.get(status) or _STATUS.get(status, status)
        raise KernelError(f"decode_iteration failed in the library: {reason}")
    return seconds


def reference_paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                     block_tables: torch.Tensor, context_lens: torch.Tensor,
                                     scale: float) -> torch.Tensor:
    """Plain float64 torch version of `paged_decode_attention` (slow; for tests and the benchmark's check)."""
    b, hq, d = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(b, hq, d, dtype=torch.float64)
    for i in range(b):
        n = int(context_lens[i])
        blocks = block_tables[i, :(n + block_size - 1) // block_size].long()
        k = k_cache[blocks].reshape(-1, hkv, d)[:n].double()
        v = v_cache[blocks].reshape(-1, hkv, d)[:n].double()
        qi = q[i].double().view(hkv, hq // hkv, d)
        p = torch.softmax(torch.einsum("hgd,thd->hgt", qi, k) * scale, dim=-1)
        out[i] = torch.einsum("hgt,thd->hgd", p, v).reshape(hq, d)
    return out


def stream_read(buf: torch.Tensor, num_threads: int | None = None) -> float:
    """Sums a float32 buffer with the kernels' threads and SIMD path: the memory-bandwidth yardstick."""
    _check("buf", buf, 1, (torch.float32,))
    return _library().neo_stream_read(buf.data_ptr(), buf.numel(), _thread_count(num_threads))
