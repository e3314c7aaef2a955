"""Scheduler decisions under a synthetic performance model: placement, swaps, sub-batches, modes, fail-safe."""

from __future__ import annotations

import pytest

from neo_backend import EngineConfig, SamplingParams
from neo_backend.core.block_manager import BlockManager
from neo_backend.core.perf_model import CORRECTION_SMOOTHING, PerfModel
from neo_backend.core.scheduler import CPU_BEHIND, HOST_SLOW, Scheduler
from neo_backend.core.scheduler_output import SchedulerOutput
from neo_backend.core.sequence import Placement, Sequence, SequenceStatus

BLOCK = 4


def perf(dense_fixed=10e-3, dense_per_token=1e-5, cpu_per_token=1e-6, cpu_per_request=1e-5, cpu_fixed=0.0) -> PerfModel:
    """Dense time on a line, fixed + per_token * tokens (two profiled points)."""
    points = [1, 4096]
    return PerfModel(
        dense_tokens=points,
        dense_seconds=[dense_fixed + dense_per_token * t for t in points],
        gpu_attn_per_token=1e-7,
        cpu_attn_fixed=cpu_fixed,
        cpu_attn_per_request=cpu_per_request,
        cpu_attn_per_token=cpu_per_token,
    )


def test_dense_time_interpolates_between_profiled_points():
    """Flat while the weights' read dominates, then rising with the FLOPs; beyond the last point the last
    segment goes on."""
    model = PerfModel(
        dense_tokens=[1, 64, 128],
        dense_seconds=[25e-3, 26e-3, 37e-3],
        gpu_attn_per_token=0.0,
        cpu_attn_fixed=0.0,
        cpu_attn_per_request=0.0,
        cpu_attn_per_token=0.0,
    )
    assert model.dense(0) == 0.0 and model.dense(1) == 25e-3
    assert model.dense(32) == pytest.approx(25e-3 + 1e-3 * 31 / 63)
    assert model.dense(96) == pytest.approx(31.5e-3)
    assert model.dense(256) == pytest.approx(59e-3)


def test_the_offload_correction_scales_predictions_and_is_taken_out_of_observations():
    """Iterations with CPU work measured at twice the profile's time: the correction follows that ratio, not the
    ratio to the already corrected prediction it is handed back."""
    model = perf()
    assert model.corrected(1.0, with_cpu_work=True) == 1.0
    model.observe_iteration(model.corrected(1.0, with_cpu_work=True), 2.0, with_cpu_work=True)
    first = 1.0 + CORRECTION_SMOOTHING * (2.0 - 1.0)
    assert model.offload_slowdown == pytest.approx(first) and model.corrected(1.0, True) == pytest.approx(first)
    model.observe_iteration(model.corrected(1.0, with_cpu_work=True), 2.0, with_cpu_work=True)
    assert model.offload_slowdown == pytest.approx(first + CORRECTION_SMOOTHING * (2.0 - first))
    assert model.corrected(1.0, with_cpu_work=False) == 1.0


def make_scheduler(
    policy: str,
    gpu_blocks: int,
    cpu_blocks: int = 256,
    model: PerfModel | None = None,
    max_num_batched_tokens: int = 64,
    **knobs,
) -> Scheduler:
    config = EngineConfig(
        offload_policy=policy, block_size=BLOCK, max_num_batched_tokens=max_num_batched_tokens, **knobs
    )
    return Scheduler(
        config, policy, BlockManager(gpu_blocks, BLOCK, "gpu"), BlockManager(cpu_blocks, BLOCK, "cpu"), model or perf()
    )


def request(i: int, prompt_len: int = 6) -> Sequence:
    return Sequence(f"r{i}", None, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=1000))


def advance(out: SchedulerOutput) -> None:
    """What the model does: compute the scheduled tokens; a sequence with all of them computed samples one."""
    for seq, n in out.scheduled():
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == len(seq.token_ids):
            seq.token_ids.append(7)


def run_step(sched: Scheduler) -> SchedulerOutput:
    """What the engine does around the model, with a runner whose swap-outs land before the next step (as on a
    CPU device): plan, advance, offload, report the offloads landed."""
    out = sched.schedule()
    advance(out)
    sched.swaps_landed([swap.request_id for swap in sched.offload(out.offload_after_step)])
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
            assert sched.swap_out_blocks == 0 and set(sched.preemptions) == {"device_full_no_host"}


def test_a_prompt_chunked_by_the_token_budget_is_admitted_only_with_room_for_all_of_it():
    """Prompts of 60% of the device's blocks, prefilled in chunks of 16 tokens: the second waits until the first
    is done instead of taking its first chunk's blocks and being preempted (or preempting) once the pool fills,
    its chunks recomputed."""
    sched = make_scheduler("never", gpu_blocks=20, max_num_batched_tokens=16)
    first, second = request(0, prompt_len=48), request(1, prompt_len=48)
    sched.add(first)
    sched.add(second)
    for _ in range(6):
        run_step(sched)
        assert second.status == SequenceStatus.WAITING and not second.block_table
    assert first.num_output_tokens == 4 and sched.num_preemptions == 0
    sched.remove(first)
    chunks = [run_step(sched).prefills for _ in range(3)]
    assert chunks == [[(second, 16)]] * 3 and second.is_decode and sched.num_preemptions == 0


def test_auto_recomputes_instead_of_swapping_out_when_the_cpu_could_not_keep_up():
    """A host that would take far longer than the device's decodes gets no request: it would starve there."""
    slow_cpu = perf(dense_fixed=1e-3, dense_per_token=1e-6, cpu_per_request=50e-3)
    sched = make_scheduler("auto", gpu_blocks=8, model=slow_cpu)
    for i in range(4):
        sched.add(request(i, prompt_len=7))
    for _ in range(12):
        run_step(sched)
    assert sched.swap_out_blocks == 0 and not sched.cpu_running
    assert set(sched.preemptions) == {"device_full_host_would_not_pay"}


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


def test_the_plan_carries_the_swaps_and_the_step_gets_the_device_blocks_they_free():
    """The scheduler moves no data: a swap-out it needs room from, and a swap-in once room returns, are in its
    output for the runner, with the blocks each side owns; the swapped-out blocks serve this very step."""
    sched = make_scheduler("auto", gpu_blocks=12)
    for i in range(4):
        sched.add(request(i, prompt_len=7))
    swap_outs = []
    for _ in range(8):
        before = sched.swap_out_blocks
        out = run_step(sched)
        if out.swap_out:
            swap_outs.append((out, sched.swap_out_blocks - before))
    assert swap_outs, "a 12-block device pool must swap requests out"
    out, blocks = swap_outs[0]
    assert sum(len(swap.host_blocks) for swap in out.swap_out) == blocks and not out.swap_in
    by_id = {seq.request_id: seq for seq in sched.cpu_running}
    for swap in out.swap_out:
        assert len(swap.device_blocks) == len(swap.host_blocks)
        assert by_id[swap.request_id].block_table[: len(swap.host_blocks)] == swap.host_blocks
    assert not any(map(sched.is_swapping_out, sched.cpu_running)), "swapped out for room: landed at once"
    for seq in list(sched.running):
        sched.remove(seq)
    out = run_step(sched)
    assert out.swap_in and not out.swap_out
    for swap in out.swap_in:
        seq = next(s for s in sched.running if s.block_table[: len(swap.device_blocks)] == swap.device_blocks)
        assert seq.placement == Placement.GPU and len(swap.host_blocks) == len(swap.device_blocks)
    assert sched.swap_in_blocks == sum(len(swap.device_blocks) for swap in out.swap_in)


def test_a_swap_out_in_flight_holds_its_request_until_the_runner_reports_it_landed():
    """A freshly prefilled request moves to the host pool while the device computes: until the runner reports
    its copy landed, the request does not decode and its device blocks stay taken."""
    sched = make_scheduler("always", gpu_blocks=32)
    for i in range(2):
        sched.add(request(i))
    first = sched.schedule()
    advance(first)
    swaps = sched.offload(first.offload_after_step)
    assert [swap.request_id for swap in swaps] == ["r0", "r1"] and len(sched.cpu_running) == 2
    assert all(sched.is_swapping_out(seq) for seq in sched.cpu_running)
    used = sched.gpu_blocks.num_used_blocks
    second = sched.schedule()
    assert second.is_empty and sched.gpu_blocks.num_used_blocks == used, "nothing landed: nothing moves"
    sched.swaps_landed(["r0"])
    third = sched.schedule()
    assert [s.request_id for s in third.cpu_decodes] == ["r0"]
    assert sched.gpu_blocks.num_used_blocks == used - len(swaps[0].device_blocks)
    assert sched.is_swapping_out(sched.cpu_running[1])
    sched.swaps_landed(["r1"])
    assert sched.gpu_blocks.num_used_blocks == 0


def test_preempting_a_request_in_flight_lands_the_copies_before_its_host_blocks_are_freed():
    """A CPU-request preempted for host room while its swap-out still copies: the plan has the runner land every
    copy in flight first, so none writes into host blocks given to another request."""
    sched = make_scheduler("always", gpu_blocks=32, cpu_blocks=6)
    sched.add(request(0, prompt_len=8))
    run_step(sched)
    sched.add(request(1, prompt_len=7))
    out = sched.schedule()
    advance(out)
    assert [swap.request_id for swap in sched.offload(out.offload_after_step)] == ["r1"]
    in_flight = sched.cpu_running[1]
    for _ in range(20):  # r0 grows in the host pool until it needs r1's blocks
        out = sched.schedule()
        advance(out)
        if out.preempted:
            break
    assert out.preempted == [in_flight] and out.land_swap_outs and sched.preemptions == {"host_full": 1}
    assert not sched.is_swapping_out(in_flight) and sched.gpu_blocks.num_used_blocks == 0


def test_a_busy_host_sends_cpu_requests_back_to_the_gpu_and_a_quiet_one_gets_them_again():
    model = perf()
    sched = make_scheduler("auto", gpu_blocks=16, model=model)
    for i in range(6):
        sched.add(request(i, prompt_len=7))
    for _ in range(12):
        run_step(sched)
    assert sched.cpu_running, "a full device pushes requests to the host"
    model.cpu_correction = (CPU_BEHIND + HOST_SLOW) / 2  # behind: no new offloads; the CPU-requests stay and decode
    on_host, swapped = list(sched.cpu_running), sched.swap_out_blocks
    out = run_step(sched)
    assert sched.swap_out_blocks == swapped and not out.preempted and sched.cpu_running == on_host
    assert {s.request_id for s in out.cpu_decodes} == {s.request_id for s in on_host}
    model.cpu_correction = 2 * HOST_SLOW  # measured host attention: far slower than profiled
    before = sched.preemptions.get("host_slow", 0)
    out = run_step(sched)
    assert not sched.cpu_running and not out.cpu_decodes and out.preempted
    assert sched.preemptions["host_slow"] - before == len(on_host)
    assert sched.cpu_blocks.num_used_blocks == 0
    swapped = sched.swap_out_blocks
    for _ in range(3):
        assert not run_step(sched).cpu_decodes, "nothing goes back to a busy host"
    assert sched.swap_out_blocks == swapped
    model.cpu_correction = 1.0
    for _ in range(12):
        run_step(sched)
    assert sched.swap_out_blocks > swapped and sched.cpu_running, "offloading resumes once the host is quiet"


def _decoding(i: int, prompt_len: int, pool, placement: Placement) -> Sequence:
    """A request past its prefill, its KV in `pool`."""
    seq = request(i, prompt_len)
    seq.num_computed_tokens = prompt_len - 1
    seq.status = SequenceStatus.RUNNING
    seq.placement = placement
    pool.grow(seq, prompt_len)
    return seq


def test_waiting_prompts_count_in_the_host_batch_an_offload_leads_to():
    """Host attention with a fixed cost per iteration: beside two device decodes a host batch of two costs more than
    its tokens add, one of seven pays. A running request moves to the host only when enough prompts wait for device
    memory to follow it there; otherwise it is recomputed."""
    model = perf(dense_fixed=10e-3, dense_per_token=0.0, cpu_per_token=0.0, cpu_per_request=1e-3, cpu_fixed=20e-3)
    for num_waiting, offloads in ((1, False), (6, True)):
        sched = make_scheduler("auto", gpu_blocks=4, model=model, cpu_latency_slack=4.0)
        sched.running = [_decoding(i, 8, sched.gpu_blocks, Placement.GPU) for i in range(2)]
        for i in range(num_waiting):
            sched.add(request(10 + i, prompt_len=8))
        sched.schedule()
        assert bool(sched.cpu_running) == offloads, num_waiting


def test_a_long_queue_does_not_stop_offloading():
    """Beside two device decodes the latency bound holds a host batch of three, not the seven that six waiting
    prompts would make: a request still moves to the host, judged with the followers the bound allows."""
    model = perf(dense_fixed=10e-3, dense_per_token=0.0, cpu_per_token=0.0, cpu_per_request=3e-3)
    sched = make_scheduler("auto", gpu_blocks=4, model=model, cpu_latency_slack=2.0)
    sched.running = [_decoding(i, 8, sched.gpu_blocks, Placement.GPU) for i in range(2)]
    for i in range(6):
        sched.add(request(10 + i, prompt_len=8))
    sched.schedule()
    assert len(sched.cpu_running) == 1
    assert model.sequential(2, 16, 7, 7 * 8) > model.sequential(2, 16, 0, 0) * 2.0


def test_cpu_requests_without_room_on_the_device_run_in_every_iteration():
    """Beside a device decode, each CPU decode would break the latency bound; with no room for them on the device
    they still all run (left out, they would only wait longer)."""
    model = perf(dense_fixed=10e-3, dense_per_token=0.0, cpu_per_token=0.0, cpu_per_request=10e-3)
    sched = make_scheduler("auto", gpu_blocks=3, model=model)
    sched.running = [_decoding(0, 8, sched.gpu_blocks, Placement.GPU)]
    sched.cpu_running = [_decoding(i, 8, sched.cpu_blocks, Placement.CPU) for i in range(1, 4)]
    for _ in range(3):
        out = run_step(sched)
        assert len(out.gpu_decodes) == 1 and len(out.cpu_decodes) == 3
    assert out.predicted_time > model.sequential(1, 8, 0, 0) * sched.config.cpu_latency_slack
