"""Loading the CPU attention library that `build` compiled, and checking that it speaks this binding's ABI.

Calls go through ctypes, which releases the GIL for the whole foreign call: the engine can run GPU work from
another Python thread while the kernel runs.
"""

from __future__ import annotations

import ctypes
import pathlib
import threading

from ..errors import KernelError
from . import build
from .abi import ABI_VERSION, Isa

_lock = threading.Lock()
_default: ctypes.CDLL | None = None


def load(path: pathlib.Path) -> ctypes.CDLL:
    """Loads a build of the library, checks its ABI and declares its functions."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise KernelError(f"cannot load {path}: {e}; rebuild with `python -m neo_backend build-kernel --force`") from e
    if lib.neo_abi_version() != ABI_VERSION:
        raise KernelError(
            f"{path} has ABI {lib.neo_abi_version()}, this binding needs {ABI_VERSION}; "
            "rebuild with `python -m neo_backend build-kernel --force`"
        )
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
    lib.neo_decode_iteration.argtypes = [p, i, i, i, i, i, i, i, ctypes.c_float, i, ctypes.c_double, ctypes.c_double, p]
    lib.neo_decode_iteration.restype = i
    return lib


def default() -> ctypes.CDLL:
    """This process's library: built for these sources if needed (cached), loaded once."""
    global _default
    with _lock:
        if _default is None:
            _default = load(build.build())
        return _default


def active_isa(lib: ctypes.CDLL) -> str:
    """The SIMD path in use: 'avx512', 'avx2' or 'scalar'."""
    return Isa(lib.neo_isa()).name.lower()


def best_isa(lib: ctypes.CDLL) -> str:
    """The widest SIMD path this CPU supports."""
    return Isa(lib.neo_max_isa()).name.lower()
