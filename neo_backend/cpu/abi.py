"""The numbers of the library's C ABI (kernels/abi.h), mirrored for ctypes; tests/unit/test_cpu_abi.py checks every
one against the header."""

from __future__ import annotations

from enum import IntEnum

import torch

ABI_VERSION = 5


class DType(IntEnum):
    F32 = 0
    F16 = 1
    BF16 = 2


DTYPE_CODES = {torch.float32: DType.F32, torch.float16: DType.F16, torch.bfloat16: DType.BF16}


class Isa(IntEnum):
    """SIMD paths: scalar, AVX2+FMA+F16C, AVX-512."""

    SCALAR = 0
    AVX2 = 1
    AVX512 = 2


class Status(IntEnum):
    """What `neo_paged_attention` returns (and `neo_decode_iteration`, besides an `IterationStatus`)."""

    OK = 0
    UNSUPPORTED = 1
    NO_MEMORY = 2
    BAD_ARGUMENT = 3


class WaitStatus(IntEnum):
    """What `neo_wait_flag` returns."""

    SET = 0
    FAILED = 1
    TIMED_OUT = 2


class IterationStatus(IntEnum):
    """What `neo_decode_iteration` returns when a hand-off, not a kernel, stopped it."""

    HAND_OFF_TIMED_OUT = 12
    ABANDONED = 20


# A hand-off flag holding this (any negative value) means the side that should set it gave up.
FLAG_FAILED = -1


class StepField(IntEnum):
    """The int64 fields of one step of `neo_decode_iteration`'s table, in order."""

    READY = 0
    DONE = 1
    Q = 2
    K_NEW = 3
    V_NEW = 4
    OUT = 5
    K_CACHE = 6
    V_CACHE = 7
    SLOTS = 8
    TABLES = 9
    LENS = 10
    BATCH = 11
    MAX_BLOCKS = 12
    Q_ROW_STRIDE = 13
    KV_ROW_STRIDE = 14


# The head sizes kernels/attention_impl.h instantiates its kernel for.
SUPPORTED_HEAD_DIMS = (64, 128, 256)
