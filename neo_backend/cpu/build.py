"""Compiles the C++ attention library in `kernels/` with the system compiler, once per build key.

The key hashes everything that decides the binary: the sources, the compiler's identity, the flags and the
CPU's feature flags (the library dispatches ISAs at run time, but a cached build still never moves to a
different CPU). Builds land in `$NEO_KERNEL_CACHE/<key>/` (default `~/.cache/neo-triton/kernels/<key>/`),
written to a temporary name and renamed, so concurrent processes never see a half-written library.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile

from ..errors import KernelError

KERNEL_DIR = pathlib.Path(__file__).resolve().parents[2] / "kernels"
MAIN_SOURCE = "cpu_attention.cpp"
LIB_NAME = "libneo_cpu_attention.so"
# No -march=native: the AVX2/AVX-512 code sits in per-ISA target regions, chosen at run time.
# No -ffast-math: the kernel relies on IEEE infinities for its running max.
FLAGS = (
    "-O3",
    "-std=c++17",
    "-fPIC",
    "-shared",
    "-fopenmp",
    "-fno-math-errno",
    "-fvisibility=hidden",
    "-Wall",
    "-Wextra",
)


def compiler() -> str:
    """The C++ compiler: `$CXX`, else g++."""
    return os.environ.get("CXX", "g++")


def cache_root() -> pathlib.Path:
    env = os.environ.get("NEO_KERNEL_CACHE")
    return pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "neo-triton" / "kernels"


def _sources(kernel_dir: pathlib.Path) -> list[pathlib.Path]:
    if not (kernel_dir / MAIN_SOURCE).is_file():
        raise KernelError(
            f"kernel source {kernel_dir / MAIN_SOURCE} is missing; run from a full checkout "
            "of neo-triton (the kernels/ folder ships next to neo_backend/)"
        )
    return sorted(p for p in kernel_dir.iterdir() if p.suffix in (".cpp", ".h"))


def _compiler_identity(cxx: str) -> str:
    if shutil.which(cxx) is None:
        raise KernelError(f"C++ compiler {cxx!r} not found; install g++ (>= 12) or point $CXX at one")
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True, timeout=60)
        machine = subprocess.run([cxx, "-dumpmachine"], capture_output=True, text=True, check=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelError(f"could not run the C++ compiler {cxx!r}: {e}") from e
    return out.stdout + machine.stdout


def cpu_flags() -> str:
    """The CPU feature flags from /proc/cpuinfo (empty where that file does not exist)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return ""


def build_key(kernel_dir: pathlib.Path = KERNEL_DIR) -> str:
    cxx = compiler()
    h = hashlib.sha256()
    for src in _sources(kernel_dir):
        h.update(src.name.encode() + b"\0" + src.read_bytes() + b"\0")
    for part in (_compiler_identity(cxx), " ".join(FLAGS), cpu_flags()):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:24]


def build(force: bool = False, kernel_dir: pathlib.Path = KERNEL_DIR) -> pathlib.Path:
    """Compiles the library if this key has no build yet (or `force`), and returns the .so path. `kernel_dir`:
    another copy of `kernels/` (bench/kernel_ab.py builds past revisions)."""
    out_dir = cache_root() / build_key(kernel_dir)
    lib = out_dir / LIB_NAME
    if lib.is_file() and not force:
        return lib
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=out_dir)
        os.close(fd)
    except OSError as e:
        raise KernelError(
            f"cannot write the kernel cache {out_dir}: {e}; set NEO_KERNEL_CACHE to a writable folder"
        ) from e
    cmd = [compiler(), *FLAGS, "-o", tmp, str(kernel_dir / MAIN_SOURCE)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise KernelError(f"compiling the CPU attention library failed ({' '.join(cmd)}):\n{proc.stderr[-4000:]}")
        os.replace(tmp, lib)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelError(f"compiling the CPU attention library failed ({' '.join(cmd)}): {e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib
