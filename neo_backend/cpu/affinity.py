"""Host CPUs for the engine's threads: with `engine_cpu` set, the loop thread (scheduling, launches, sampling)
runs on that CPU alone and CPU attention on the others; each tensor-parallel rank's CPU attention runs on its own
share of them. With other processes kept off that CPU (cpusets,
`docker --cpuset-cpus`), a busy host slows only the CPU attention, which `auto` then moves off the CPU; the
GPU path keeps its pace."""

from __future__ import annotations

import logging
import os

from ..errors import ConfigError

log = logging.getLogger("neo_backend")


def attention_cpus(engine_cpu: int | None, rank: int = 0, size: int = 1) -> set[int]:
    """The CPUs of tensor-parallel rank `rank` of `size`, where its attention team runs (and, on a CPU device, its
    forward): the CPUs of this process less `engine_cpu`, split into `size` contiguous shares, one per rank."""
    allowed = os.sched_getaffinity(0)
    if engine_cpu is not None and engine_cpu not in allowed:
        raise ConfigError(
            f"engine_cpu={engine_cpu} is not among the CPUs this process may use "
            f"({_ranges(allowed)}); pick one of them or leave engine_cpu unset"
        )
    if engine_cpu is not None and len(allowed) < 2:
        raise ConfigError(f"engine_cpu needs at least two CPUs, this process may use only {_ranges(allowed)}")
    cpus = sorted(allowed - {engine_cpu})
    if len(cpus) < size:
        raise ConfigError(
            f"tensor_parallel_size={size} needs a CPU per rank, and this process may use only {_ranges(set(cpus))}; "
            f"lower tensor_parallel_size or give the process more CPUs"
        )
    return set(cpus[rank * len(cpus) // size : (rank + 1) * len(cpus) // size])


def pin_current_thread(cpus: set[int], role: str) -> None:
    os.sched_setaffinity(0, cpus)
    log.info("%s thread pinned to CPUs %s", role, _ranges(cpus))


def _ranges(cpus: set[int]) -> str:
    spans: list[list[int]] = []
    for cpu in sorted(cpus):
        if spans and cpu == spans[-1][1] + 1:
            spans[-1][1] = cpu
        else:
            spans.append([cpu, cpu])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in spans)
