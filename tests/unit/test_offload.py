"""NEO offload end to end on CPU: greedy tokens do not depend on where requests live or how a step runs."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
from engine_helpers import (
    OFFLOAD_CONFIGS,
    collect,
    fixed_perf_model,
    mixed_requests,
    never_tokens,
    offload_engine,
    outputs_of,
)

from neo_backend import EngineConfig, LLMEngine
from neo_backend.core.block_manager import BlockManager
from neo_backend.cpu.ops import Kernels
from neo_backend.executor.host_pool import HUGE_PAGE_BYTES, huge_page_tensor
from neo_backend.executor.swapper import block_runs
from neo_backend.streaming import StreamingEngine


@pytest.fixture(scope="module")
def workload():
    return mixed_requests(20, seed=11)


@pytest.fixture(scope="module")
def reference_tokens(tiny_model_dirs, workload):
    return never_tokens(tiny_model_dirs["llama3"], *workload)


@pytest.mark.parametrize("name", list(OFFLOAD_CONFIGS))
def test_greedy_tokens_identical_across_policies(tiny_model_dirs, workload, reference_tokens, name, monkeypatch):
    prompts, max_tokens = workload
    engine = offload_engine(tiny_model_dirs["llama3"], 24, **OFFLOAD_CONFIGS[name])
    if name == "auto-small-gpu":
        fixed_perf_model(engine, monkeypatch)
    tokens = collect(engine, prompts, max_tokens, stagger=True)
    assert tokens == reference_tokens
    stats = engine.stats_snapshot()
    assert stats["gpu_blocks_used"] == 0 and stats["cpu_blocks_used"] == 0, "KV blocks leaked"
    if name.startswith("always"):
        assert stats["cpu_decode_tokens"] > 0 and stats["swap_out_blocks"] > 0
        assert stats["modes"].get("pipelined" if name.endswith("pipelined") else "sequential", 0) > 0
    if name == "auto-small-gpu":
        assert stats["swap_out_blocks"] > 0, "a 24-block GPU pool must push requests to the host pool"
        assert stats["cpu_decode_tokens"] > 0


def test_smollm_greedy_unchanged_by_offload(smollm_engine):
    prompts = [
        smollm_engine.tokenizer.encode(p)
        for p in ["The capital of France is", "List three colors:", "def add(a, b):", "Water boils at"]
    ]
    max_tokens = [12, 10, 14, 8]
    expected = [collect(smollm_engine, [p], [m], stagger=False)[0] for p, m in zip(prompts, max_tokens)]
    engine = LLMEngine(
        EngineConfig(
            offload_policy="always", pipeline="on", num_gpu_blocks=64, cpu_kv_cache_gb=0.05, max_num_batched_tokens=128
        )
    )
    assert collect(engine, prompts, max_tokens, stagger=True) == expected
    assert engine.stats_snapshot()["modes"].get("pipelined", 0) > 0
    assert engine.cpu_blocks.num_free_blocks == engine.cpu_blocks.num_blocks


def test_host_pool_larger_than_memory_is_a_clear_error(tiny_model_dirs):
    from neo_backend import ConfigError

    with pytest.raises(ConfigError, match="cpu_kv_cache_gb"):
        offload_engine(tiny_model_dirs["llama3"], 24, offload_policy="auto", cpu_kv_cache_gb=1e6)


def test_auto_backs_off_when_cpu_attention_is_slowed(tiny_model_dirs, workload, reference_tokens, monkeypatch):
    """Injected slowness (a busy host): iterations with CPU work run far slower than predicted, so `auto`
    stops moving requests to the CPU while it is behind; outputs are unchanged and nothing leaks."""
    import time as _time

    prompts, max_tokens = workload
    engine = offload_engine(tiny_model_dirs["llama3"], 24, offload_policy="auto")
    fixed_perf_model(engine, monkeypatch, remeasured=True)
    real_iteration = Kernels.decode_iteration

    def slow_iteration(*args, **kwargs):
        # twice what an iteration without CPU work measures (the fixed model predicts 10 ms for any): a busy test
        # machine's slow iterations cannot hide it
        delay = max(0.02, 2 * 0.01 * engine.perf_model.gpu_only_ratio)
        _time.sleep(delay)
        seconds = real_iteration(*args, **kwargs)
        return seconds + delay / len(seconds)

    monkeypatch.setattr(Kernels, "decode_iteration", slow_iteration)
    sched = engine.scheduler
    tokens = {}
    order = []
    behind_steps = 0
    for step in range(5000):
        if 2 * len(order) <= step and len(order) < len(prompts):
            i = len(order)
            order.append(
                engine.add_request(prompts[i], {"max_tokens": max_tokens[i], "temperature": 0, "ignore_eos": True})
            )
            tokens[order[-1]] = []
        if len(order) == len(prompts) and not engine.has_unfinished_requests():
            break
        behind, swapped = sched.cpu_behind, sched.swap_out_blocks
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
        if behind:
            behind_steps += 1
            assert sched.swap_out_blocks == swapped, "no request goes to the CPU while it is behind"
    assert behind_steps > 0, "the slowed CPU must be noticed"
    assert [tokens[r] for r in order] == reference_tokens
    stats = engine.stats_snapshot()
    assert stats["gpu_blocks_used"] == 0 and stats["cpu_blocks_used"] == 0


class _CopyEvent:
    """Stands in for the swap stream's CUDA event: the copy lands when the test says so, or once the compute
    stream is made to wait for it."""

    def __init__(self) -> None:
        self.landed = False

    def query(self) -> bool:
        return self.landed

    def wait(self, stream=None) -> None:
        self.landed = True


def test_block_runs_and_the_pools_hand_out_runs_that_grow_in_place():
    """A swap copies one run of consecutive host blocks at a time: the pool hands a request's blocks out as a
    run, leaves room after it, and a growing request takes the block after its last while it is free."""
    assert block_runs([4, 5, 6, 9, 2, 3]) == [(0, 4, 3), (3, 9, 1), (4, 2, 2)]
    assert block_runs([]) == []
    pool = BlockManager(16, 4, "cpu")
    first, second = pool.allocate(3), pool.allocate(3)
    assert first == [0, 1, 2] and second == [6, 7, 8], "a new run starts past room for the last to double"
    assert pool.allocate(2, after=first[-1]) == [3, 4], "growth in place"
    assert pool.allocate(1, after=second[-1]) == [9]
    pool.release(first[1:])
    assert pool.allocate(6) == [10, 11, 12, 13, 14, 15]
    assert pool.allocate(3) == [1, 2, 5], "no free run that long: the lowest free blocks"
    assert pool.num_free_blocks == 0 and pool.num_used_blocks == 16


def test_the_runner_reports_the_swap_outs_that_landed_and_only_those_decode(tiny_model_dirs, monkeypatch):
    """Freshly prefilled requests move to the host pool while the device computes: the runner starts their copies
    after the step, and a request decodes on the CPU once the runner has reported its copy landed. Finishing a
    request whose copy is still in flight lands it before its blocks are freed."""
    engine = offload_engine(tiny_model_dirs["llama3"], 64, offload_policy="always", pipeline="off")
    events: list[_CopyEvent] = []
    monkeypatch.setattr(engine.runner.swapper, "_record", lambda: events.append(_CopyEvent()) or events[-1])
    params = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    first, second = (engine.add_request([3, 4, 5, 6, 7], params, request_id) for request_id in ("r0", "r1"))
    assert {out.request_id for out in engine.step()} == {first, second}
    assert len(events) == 2 and len(engine.scheduler.cpu_running) == 2
    used = engine.gpu_blocks.num_used_blocks
    assert engine.step() == [] and engine.gpu_blocks.num_used_blocks == used, "nothing landed: nothing decodes"
    events[0].landed = True
    assert [out.request_id for out in engine.step()] == [first] and engine.gpu_blocks.num_used_blocks < used
    engine.abort(second)
    assert events[1].landed and not engine.runner.swapper.in_transit(second)
    assert engine.gpu_blocks.num_used_blocks == 0


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_engine_cpu_pins_the_loop_and_keeps_cpu_attention_off_it(tiny_model_dirs, workload, reference_tokens):
    allowed = os.sched_getaffinity(0)
    engine_cpu = max(allowed)
    front = StreamingEngine(
        engine=offload_engine(
            tiny_model_dirs["llama3"], 24, offload_policy="always", pipeline="on", engine_cpu=engine_cpu
        )
    )
    try:
        prompts, max_tokens = workload
        streams = [
            front.submit(p, {"max_tokens": m, "temperature": 0, "ignore_eos": True})
            for p, m in zip(prompts, max_tokens)
        ]
        tokens = [[t for out in outputs_of(stream) for t in out.token_ids] for stream in streams]
        threads = {t.name: t.native_id for t in threading.enumerate()}
        assert os.sched_getaffinity(threads["neo-engine-loop"]) == {engine_cpu}
        worker = next(tid for name, tid in threads.items() if name.startswith("neo-cpu-attention"))
        assert os.sched_getaffinity(worker) == allowed - {engine_cpu}
        assert tokens == reference_tokens
        assert front.stats()["cpu_decode_tokens"] > 0
    finally:
        front.shutdown()


def test_an_engine_cpu_this_process_may_not_use_is_a_clear_error(tiny_model_dirs):
    from neo_backend import ConfigError

    with pytest.raises(ConfigError, match="engine_cpu=100000 is not among the CPUs"):
        offload_engine(tiny_model_dirs["llama3"], 24, offload_policy="always", engine_cpu=100000)


def test_a_host_pool_smaller_than_the_profile_shapes_still_profiles(tiny_model_dirs, tmp_path):
    block_bytes = offload_engine(tiny_model_dirs["llama3"], 24, offload_policy="never").runner.block_bytes
    engine = offload_engine(
        tiny_model_dirs["llama3"],
        24,
        offload_policy="auto",
        cpu_kv_cache_gb=3 * block_bytes / 2**30,
        cache_dir=str(tmp_path),
    )
    assert engine.runner.num_cpu_blocks == 3
    assert engine.perf_model.cpu_attention(4, 4 * 8) > 0


def test_the_host_pool_asks_for_huge_pages():
    """Whether Linux grants the huge pages depends on its free memory; that the pool asks for them does not."""
    if not Path("/proc/self/smaps").exists():
        pytest.skip("no /proc/self/smaps on this system")
    pool = huge_page_tensor((32, 2**20 + 1), torch.float16)
    assert pool.data_ptr() % HUGE_PAGE_BYTES == 0 and pool.is_contiguous()
    for address in (pool.data_ptr(), pool[-1, -1].data_ptr()):
        assert "hg" in _vm_flags(address), "the whole pool should be advised MADV_HUGEPAGE"


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding `address`, from /proc/self/smaps."""
    found = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(x, 16) for x in head.split("-"))
            found = low <= address < high
        elif found and head == "VmFlags:":
            return line.split()[1:]
    return []
