"""Scheduler decisions under a synthetic performance model: placement, swaps, sub-batches, modes, fail-safe."""
from __future__ import annotations

import pytest
import torch

from neo_backend import EngineConfig, ModelConfig, SamplingParams
from neo_backend.block_manager import BlockManager
from neo_backend.host_kv import BlockSwapper, HostKVCache
from neo_backend.perf_model import PerfModel
from neo_backend.scheduler import CPU_BEHIND, HOST_SLOW, Scheduler
from neo_backend.scheduler_output import SchedulerOutput
from neo_backend.sequence import Placement, Sequence

BLOCK = 4
TINY = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=16, num_layers=1, num_heads=1, num_kv_heads=1,
                   head_dim=4)


def perf(dense_fixed=10e-3, dense_per_token=1e-5, cpu_per_token=1e-6, cpu_per_request=1e-5) -> PerfModel:
    """Dense time on a line, fixed + per_token * tokens (two profiled points)."""
    points = [1, 4096]
    return PerfModel(dense_tokens=points, dense_seconds=[dense_fixed + dense_per_token * t for t in points],
                     gpu_attn_per_token=1e-7, cpu_attn_fixed=0.0, cpu_attn_per_request=cpu_per_request,
                     cpu_attn_per_token=cpu_per_token)


def test_dense_time_interpolates_between_profiled_points():
    """Flat while the weights' read dominates, then rising with the FLOPs; beyond the last point the last
    segment goes on."""
    model = PerfModel(dense_tokens=[1, 64, 128], dense_seconds=[25e-3, 26e-3, 37e-3], gpu_attn_per_token=0.0,
                      cpu_attn_fixed=0.0, cpu_attn_per_request=0.0, cpu_attn_per_token=0.0)
    assert model.dense(0) == 0.0 and model.dense(1) == 25e-3
    assert model.dense(32) == pytest.approx(25e-3 + 1e-3 * 31 / 63)
    assert model.dense(96) == pytest.approx(31.5e-3)
    assert model.dense(256) == pytest.approx(59e-3)


def make_scheduler(policy: str, gpu_blocks: int, cpu_blocks: int = 256, model: PerfModel | None = None,
                   **knobs) -> Scheduler:
    config = EngineConfig(offload_policy=policy, block_size=BLOCK, max_num_batched_tokens=64, **knobs)
    shape = (gpu_blocks, BLOCK, 1, 4)
    host = HostKVCache(TINY, cpu_blocks, BLOCK, torch.float32)
    swapper = BlockSwapper([torch.zeros(shape)], [torch.zeros(shape)], host, torch.device("cpu"))
    return Scheduler(config, policy, BlockManager(gpu_blocks, BLOCK, "gpu"), BlockManager(cpu_blocks, BLOCK, "cpu"),
                     swapper, model or perf())


def request(i: int, prompt_len: int = 6) -> Sequence:
    return Sequence(f"r{i}", None, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=1000))


def run_step(sched: Scheduler):
    """What the engine does around the model: advance computed tokens, sample one token, offload."""
    out = sched.schedule()
    for seq, n in out.scheduled():
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == len(seq.token_ids):
            seq.token_ids.append(7)
    sched.offload(out.offload_after_step)
    return out


def test_always_places_every_request_on_the_cpu_after_prefill():
    sched = make_scheduler("always", gpu_blocks=32)
    for i in range(3):
        sched.add(request(i))
    first = run_step(sched)
    assert len(first.prefills) == 3 and first.offload_after_step
    assert all(s.placement == Placement.CPU for s in sched.cpu_running) and len(sched.cpu_running) == 3
    second = run_step(sched)
    assert len(second.cpu_decodes) == 3 and not second.gpu_decodes
    assert sched.gpu_blocks.num_used_blocks == 0, "device blocks return once the swap-out completes"


def test_auto_keeps_requests_on_gpu_while_memory_is_plentiful():
    sched = make_scheduler("auto", gpu_blocks=256)
    for i in range(4):
        sched.add(request(i))
    for _ in range(5):
        out = run_step(sched)
    assert not sched.cpu_running and out.mode == "gpu_only" and len(out.gpu_decodes) == 4
    assert sched.swap_out_blocks == 0


def test_gpu_shortage_swaps_out_under_auto_and_preempts_under_never():
    for policy, expect_swap in (("auto", True), ("never", False)):
        sched = make_scheduler(policy, gpu_blocks=8)
        for i in range(4):
            sched.add(request(i, prompt_len=7))
        for _ in range(12):
            run_step(sched)
        if expect_swap:
            assert sched.swap_out_blocks > 0 and sched.cpu_running and sched.num_preemptions == 0
        else:
            assert sched.swap_out_blocks == 0 and sched.num_preemptions > 0


def test_auto_recomputes_instead_of_swapping_out_when_the_cpu_could_not_keep_up():
    """A host that would take far longer than the device's decodes gets no request: it would starve there."""
    slow_cpu = perf(dense_fixed=1e-3, dense_per_token=1e-6, cpu_per_request=50e-3)
    sched = make_scheduler("auto", gpu_blocks=8, model=slow_cpu)
    for i in range(4):
        sched.add(request(i, prompt_len=7))
    for _ in range(12):
        run_step(sched)
    assert sched.swap_out_blocks == 0 and not sched.cpu_running and sched.num_preemptions > 0


def test_auto_offloads_only_where_the_host_adds_tokens_per_second():
    """NEO's objective: a CPU decode of 0.5 ms fits the latency bound beside device decodes of 1 ms of dense work,
    but slows the 5-10 of them by more than its own token adds, so the request is recomputed instead."""
    for cpu_per_request, offloads in ((0.05e-3, True), (0.5e-3, False)):
        model = perf(dense_fixed=1e-3, dense_per_token=0.0, cpu_per_token=0.0, cpu_per_request=cpu_per_request)
        sched = make_scheduler("auto", gpu_blocks=12, model=model, cpu_latency_slack=2.0)
        for i in range(10):
            sched.add(request(i, prompt_len=3))
        for _ in range(6):
            run_step(sched)
        assert (sched.swap_out_blocks > 0) == offloads, cpu_per_request
        assert sched.num_preemptions > 0 or offloads


def test_swap_in_when_room_returns_and_never_both_ways_in_one_iteration():
    sched = make_scheduler("auto", gpu_blocks=12)
    seqs = [request(i, prompt_len=7) for i in range(4)]
    for s in seqs:
        sched.add(s)
    for _ in range(8):
        run_step(sched)
    assert sched.cpu_running
    for s in list(sched.running):  # the GPU requests finish: room returns
        sched.remove(s)
    out_before = sched.swap_out_blocks
    run_step(sched)
    assert sched.swap_in_blocks > 0 and sched.running
    assert sched.swap_out_blocks == out_before, "no request swapped both ways in one iteration"


def test_pipelined_split_balances_cpu_attention_against_dense_work():
    model = perf(dense_fixed=5e-3, dense_per_token=1e-5, cpu_per_token=2e-6, cpu_per_request=0.0)
    sched = make_scheduler("always", gpu_blocks=64, model=model, pipeline="auto")
    ready = [request(i, prompt_len=1000) for i in range(8)]
    out = SchedulerOutput()
    sched._plan_cpu_decodes(out, ready)
    assert out.pipelined and 0 < out.split < 8
    ctx = [len(s.token_ids) for s in ready]
    seq_time = model.sequential(0, 0, 8, sum(ctx))
    assert out.predicted_time < seq_time
    # the chosen split is the best of all splits
    best = min(model.pipelined(0, 0, (k, sum(ctx[:k])), (8 - k, sum(ctx[k:]))) for k in range(9))
    assert out.predicted_time == pytest.approx(best)


def test_sequential_when_cpu_attention_is_cheap():
    model = perf(dense_fixed=20e-3, cpu_per_token=1e-9, cpu_per_request=1e-7)
    sched = make_scheduler("always", gpu_blocks=64, model=model)
    out = SchedulerOutput()
    sched._plan_cpu_decodes(out, [request(i, 50) for i in range(8)])
    assert not out.pipelined and len(out.cpu_decodes) == 8


def _prefill_heavy_output() -> SchedulerOutput:
    """An iteration whose GPU part is one 1000-token prefill."""
    return SchedulerOutput(prefills=[(request(100, 1000), 1000)])


def test_auto_admits_cpu_work_that_hides_under_the_gpu_and_never_starves():
    model = perf(dense_fixed=2e-3, dense_per_token=2e-5, cpu_per_token=1e-6, cpu_per_request=1e-5)
    sched = make_scheduler("auto", gpu_blocks=512, model=model)
    cpu_ready = [request(i, 2000) for i in range(16)]
    out = _prefill_heavy_output()
    sched._plan_cpu_decodes(out, list(cpu_ready))
    gpu_alone = model.sequential(1000, 1000, 0, 0)
    assert 0 < len(out.cpu_decodes) < 16 and out.pipelined
    assert out.predicted_time <= gpu_alone * sched.config.cpu_latency_slack
    seen = set()
    for _ in range(8):
        out = _prefill_heavy_output()
        sched._plan_cpu_decodes(out, list(cpu_ready))
        seen |= {s.request_id for s in out.cpu_decodes}
    assert seen == {s.request_id for s in cpu_ready}, "every CPU-request runs within a few iterations"


def test_fail_safe_backs_off_when_the_cpu_is_slower_than_predicted():
    model = perf(dense_fixed=2e-3, dense_per_token=2e-5, cpu_per_token=1e-6, cpu_per_request=1e-5)
    sched = make_scheduler("auto", gpu_blocks=512, model=model)
    cpu_ready = [request(i, 2000) for i in range(16)]
    healthy = _prefill_heavy_output()
    sched._plan_cpu_decodes(healthy, list(cpu_ready))
    for _ in range(10):  # the CPU is hogged: attention takes 5x the prediction
        model.observe_cpu(predicted=1e-3 * model.cpu_correction, measured=5e-3)
    assert model.cpu_correction > CPU_BEHIND and sched.cpu_behind
    sched._skipped.clear()
    slowed = _prefill_heavy_output()
    sched._plan_cpu_decodes(slowed, list(cpu_ready))
    assert len(slowed.cpu_decodes) < len(healthy.cpu_decodes)
    assert slowed.predicted_time <= model.sequential(1000, 1000, 0, 0) * sched.config.cpu_latency_slack
    for _ in range(20):  # the hog is gone: the correction recovers
        model.observe_cpu(predicted=1e-3 * model.cpu_correction, measured=1e-3)
    assert model.cpu_correction == pytest.approx(1.0, rel=0.05) and not sched.cpu_behind


class _CopyEvent:
    """Stands in for the swap stream's CUDA event: the copy lands when the test says so."""

    def __init__(self) -> None:
        self.landed = False

    def query(self) -> bool:
        return self.landed

    def synchronize(self) -> None:
        self.landed = True


def test_a_swap_out_in_flight_holds_its_request_until_the_copy_lands(monkeypatch):
    """A freshly prefilled request moves to the host pool while the device computes: the scheduler does not
    wait for the copy, does not decode the request before it lands, and lands it before freeing its blocks."""
    sched = make_scheduler("always", gpu_blocks=32)
    events: list[_CopyEvent] = []
    monkeypatch.setattr(sched.swapper, "_record", lambda: events.append(_CopyEvent()) or events[-1])
    for i in range(2):
        sched.add(request(i))
    run_step(sched)
    assert len(events) == 2 and len(sched.cpu_running) == 2
    used = sched.gpu_blocks.num_used_blocks
    second = run_step(sched)
    assert not second.cpu_decodes and sched.gpu_blocks.num_used_blocks == used, "nothing landed: nothing moves"
    events[0].landed = True
    third = run_step(sched)
    assert [s.request_id for s in third.cpu_decodes] == ["r0"] and sched.gpu_blocks.num_used_blocks < used
    in_flight = sched.cpu_running[1]
    sched.remove(in_flight)  # finishing (or aborting) a request lands its copy before its blocks are reused
    assert events[1].landed and not sched.swapper.in_transit(in_flight.request_id)
    assert sched.gpu_blocks.num_used_blocks == 0


def test_a_busy_host_sends_cpu_requests_back_to_the_gpu_and_a_quiet_one_gets_them_again():
    model = perf()
    sched = make_scheduler("auto", gpu_blocks=16, model=model)
    for i in range(6):
        sched.add(request(i, prompt_len=7))
    for _ in range(12):
        run_step(sched)
    assert sched.cpu_running, "a full device pushes requests to the host"
    model.cpu_correction = (CPU_BEHIND + HOST_SLOW) / 2  # behind: no new offloads, the CPU-requests stay
    assert run_step(sched).cpu_decodes is not None and sched.cpu_running
    model.cpu_correction = 2 * HOST_SLOW  # measured host attention: far slower than profiled
    out = run_step(sched)
    assert not sched.cpu_running and not out.cpu_decodes and out.preempted
    assert sched.cpu_blocks.num_used_blocks == 0
    swapped = sched.swap_out_blocks
    for _ in range(3):
        assert not run_step(sched).cpu_decodes, "nothing goes back to a busy host"
    assert sched.swap_out_blocks == swapped
    model.cpu_correction = 1.0
    for _ in range(12):
        run_step(sched)
    assert sched.swap_out_blocks > swapped and sched.cpu_running, "offloading resumes once the host is quiet"
