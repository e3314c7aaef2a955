#!/usr/bin/env python3
"""What a swap costs: one request's KV blocks moved between the device pool and the host pool by the engine's
`BlockSwapper`, alone and beside the host's CPU attention (as in serving, where a swap-out lands while the
next iteration's CPU decodes run, and a swap-in follows them).

    python bench/swap.py --device cuda --model bench/configs/llama2-7b --context 1100 --busy-host

Per condition, medians over --reps of each swap's launch (the calling thread's time: the engine thread's cost
in serving) and its time to the device's end (copies landed): a swap-in copies the request's host block runs up
and scatters them into the device pool; a swap-out gathers its device blocks and copies them down into host
block runs. Each condition's first round trip is timed apart (`first`). `--busy-host` repeats them while another
thread runs the engine's CPU attention iterations (`HostAttention.run_iteration`: append + attention in every
layer, --busy-requests at the same context) in a loop, with the engine's default team size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import LLAMA3_8B  # noqa: E402

from neo_backend.config import ModelConfig  # noqa: E402
from neo_backend.cpu.handoff import Flags, IterationLane  # noqa: E402
from neo_backend.executor.host_attention import HostAttention  # noqa: E402
from neo_backend.executor.host_pool import HostKVCache  # noqa: E402
from neo_backend.executor.swapper import BlockSwapper  # noqa: E402
from neo_backend.layers.parallel import TensorParallel  # noqa: E402
from neo_backend.timing import sync  # noqa: E402

BLOCK_SIZE = 16
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class BusyHost:
    """CPU attention iterations in a loop on a thread of their own, over host blocks the swaps do not touch."""

    def __init__(self, attention: HostAttention, cfg: ModelConfig, batch: int, context: int) -> None:
        per_seq = -(-context // BLOCK_SIZE)
        tables = torch.arange(batch * per_seq, dtype=torch.int32).view(batch, per_seq)
        q = torch.randn(batch, cfg.num_heads, cfg.head_dim).to(attention.host.k_caches[0].dtype)
        k = torch.randn(batch, cfg.num_kv_heads, cfg.head_dim).to(q.dtype)
        self.ready, self.done = Flags(cfg.num_layers, 0.0), Flags(cfg.num_layers, 0.0)
        self.ready.values[:] = 1
        lens = torch.full((batch,), context, dtype=torch.int32)
        slots = tables[:, -1].long() * BLOCK_SIZE
        self.lane = IterationLane(q, k, k, torch.empty_like(q), tables, lens, slots, self.ready)
        self.attention = attention
        self.num_layers = cfg.num_layers
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> BusyHost:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        self.attention.enter_thread()
        while not self._stop.is_set():
            self.done.reset(self.num_layers)
            self.attention.run_iteration([self.lane], self.done, 60.0)


def time_swaps(swapper: BlockSwapper, device: torch.device, host_ids: list[list[int]], reps: int) -> dict:
    """Median seconds of each part over `reps` round trips, alternating between two sets of host blocks, after a
    first round trip timed apart (`first`)."""
    device_ids = list(range(len(host_ids[0])))
    parts: dict[str, list[float]] = {"swap_in_launch": [], "swap_in": [], "swap_out_launch": [], "swap_out": []}
    for rep in range(reps + 1):
        src, dst = host_ids[rep % 2], host_ids[(rep + 1) % 2]
        sync(device)
        start = time.perf_counter()
        swapper.swap_in(src, device_ids)
        launched_in = time.perf_counter()
        swapper.wait_swap_in()
        sync(device)
        swapped_in = time.perf_counter()
        swapper.swap_out("bench", device_ids, dst)
        launched_out = time.perf_counter()
        swapper.complete(wait=True)
        sync(device)
        swapped_out = time.perf_counter()
        ends = (launched_in, swapped_in, launched_out, swapped_out)
        starts = (start, start, swapped_in, swapped_in)
        for name, begin, end in zip(parts, starts, ends):
            parts[name].append(end - begin)
    times = {name: statistics.median(values[1:]) for name, values in parts.items()}
    times["first"] = {name: values[0] for name, values in parts.items()}
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=LLAMA3_8B, help="a directory with a Hugging Face config.json")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--context", type=int, default=1100, help="tokens of the swapped request")
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--busy-host", action="store_true", help="also time the swaps beside CPU attention")
    parser.add_argument("--busy-requests", type=int, default=1)
    parser.add_argument(
        "--scattered", action="store_true", help="no two host blocks of the request adjacent: a copy per block"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    cfg = ModelConfig.from_hf(json.loads((Path(args.model) / "config.json").read_text()))
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    per_seq = -(-args.context // BLOCK_SIZE)
    busy_blocks = args.busy_requests * per_seq if args.busy_host else 0
    host = HostKVCache(cfg, busy_blocks + 2 * per_seq, BLOCK_SIZE, dtype, pin=device.type == "cuda")
    shape = (per_seq, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
    device_k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
    device_v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
    attention = HostAttention(host, cfg.head_dim**-0.5, device, None, None, TensorParallel())
    swapper = BlockSwapper(device_k, device_v, host, device)
    if args.scattered:
        host_ids = [list(range(busy_blocks + i, busy_blocks + 2 * per_seq, 2)) for i in range(2)]
    else:
        host_ids = [list(range(busy_blocks + i * per_seq, busy_blocks + (i + 1) * per_seq)) for i in range(2)]
    request_bytes = 2 * cfg.num_layers * per_seq * device_k[0][0].numel() * dtype.itemsize

    results = {"args": {k: str(v) for k, v in vars(args).items()}, "request_bytes": request_bytes}
    print(
        f"one request: {args.context} tokens, {per_seq} blocks, {request_bytes / 1e6:.0f} MB of KV; "
        f"torch threads {torch.get_num_threads()}"
    )
    conditions = ["quiet"] + (["busy_host"] if args.busy_host else [])
    for condition in conditions:
        if condition == "busy_host":
            with BusyHost(attention, cfg, args.busy_requests, args.context):
                times = time_swaps(swapper, device, host_ids, args.reps)
            times["attention_team"] = attention.num_threads
        else:
            times = time_swaps(swapper, device, host_ids, args.reps)
        results[condition] = times
        for label, part in ((condition, times), ("first", times["first"])):
            print(
                f"{label:>9}: swap-in {1e3 * part['swap_in']:.1f} ms ({request_bytes / part['swap_in'] / 1e9:.1f} "
                f"GB/s; launch {1e3 * part['swap_in_launch']:.1f} ms), swap-out {1e3 * part['swap_out']:.1f} ms "
                f"({request_bytes / part['swap_out'] / 1e9:.1f} GB/s; launch {1e3 * part['swap_out_launch']:.1f} ms)"
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
