"""The engine at tensor_parallel_size=2 on CPU (rank 0 in this process, one spawned worker, gloo): greedy tokens as at
one rank under every way a step runs, no KV block left behind on any rank, a killed worker failing its requests
instead of hanging the engine, and the knob's validation."""

from __future__ import annotations

import multiprocessing.spawn
import os
import signal
import sys
import time

import pytest
from engine_helpers import OFFLOAD_CONFIGS, collect, fixed_perf_model, mixed_requests, never_tokens, offload_engine

from neo_backend import EngineConfig, LLMEngine
from neo_backend.errors import ConfigError, EngineDeadError
from neo_backend.streaming import StreamingEngine

FAILURE_DEADLINE_S = 30.0


@pytest.fixture(scope="module")
def workload():
    return mixed_requests(8, seed=5)


@pytest.fixture(scope="module")
def reference_tokens(tiny_model_dirs, workload):
    return never_tokens(tiny_model_dirs["llama3"], *workload)


@pytest.mark.parametrize("name", list(OFFLOAD_CONFIGS))
def test_two_ranks_give_one_rank_s_greedy_tokens(tiny_model_dirs, workload, reference_tokens, name, monkeypatch):
    prompts, max_tokens = workload
    engine = offload_engine(tiny_model_dirs["llama3"], 24, tensor_parallel_size=2, **OFFLOAD_CONFIGS[name])
    try:
        if name == "auto-small-gpu":
            fixed_perf_model(engine, monkeypatch)
        assert collect(engine, prompts, max_tokens, stagger=True) == reference_tokens
        stats = engine.stats_snapshot()
        assert stats["gpu_blocks_used"] == 0 and stats["cpu_blocks_used"] == 0, "KV blocks leaked"
        assert [(s.num_sequences, s.swaps_in_flight) for s in engine.runner.rank_states()] == [(0, [])]
        if name != "never":
            assert stats["cpu_decode_tokens"] > 0 and stats["swap_out_blocks"] > 0
        if name.startswith("always"):
            assert stats["modes"].get("pipelined" if name.endswith("pipelined") else "sequential", 0) > 0
    finally:
        engine.close()
    assert not multiprocessing.active_children()


def test_workers_start_from_a_program_that_embeds_python(tiny_model_dirs, workload, reference_tokens, monkeypatch):
    """As in Triton's python-backend stub: sys.executable (and so multiprocessing's spawn executable) is not this
    process's own program, and may not be a Python at all."""
    monkeypatch.setattr(sys, "executable", "/bin/false")
    monkeypatch.setattr(multiprocessing.spawn, "_python_exe", b"/bin/false")
    prompts, max_tokens = workload
    engine = offload_engine(tiny_model_dirs["llama3"], 64, offload_policy="never", tensor_parallel_size=2)
    try:
        assert collect(engine, prompts[:1], max_tokens[:1], stagger=False) == reference_tokens[:1]
    finally:
        engine.close()
    assert multiprocessing.spawn.get_executable() == b"/bin/false", "the spawn executable must be put back"


def test_a_killed_worker_fails_its_requests_and_leaves_no_process(tiny_model_dirs, workload):
    engine = offload_engine(tiny_model_dirs["llama3"], 512, offload_policy="never", tensor_parallel_size=2)
    worker = engine.runner.workers[0].process
    try:
        params = {"max_tokens": 400, "temperature": 0, "ignore_eos": True}
        ids = {engine.add_request(p[:40], params) for p in workload[0][:3]}
        engine.step()
        os.kill(worker.pid, signal.SIGKILL)
        errors, start = {}, time.monotonic()
        while engine.has_unfinished_requests():
            assert time.monotonic() - start < FAILURE_DEADLINE_S, "the engine hangs on a dead rank"
            errors.update({out.request_id: out.error for out in engine.step() if out.finished})
        assert set(errors) == ids
        assert all("tensor-parallel rank 1" in e and "SIGKILL" in e for e in errors.values()), errors
        assert not engine.healthy
        with pytest.raises(EngineDeadError, match="tensor-parallel rank 1"):
            engine.add_request([5, 6, 7], params)
    finally:
        engine.close()
    assert not worker.is_alive() and not multiprocessing.active_children()


def test_a_worker_dead_while_idle_makes_the_front_unready_and_shutdown_stops_it(tiny_model_dirs):
    config = EngineConfig(
        model=str(tiny_model_dirs["llama3"]), offload_policy="never", num_gpu_blocks=64, tensor_parallel_size=2
    )
    front = StreamingEngine(config)
    try:
        assert front.healthy
        worker = front.engine.runner.workers[0].process
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(FAILURE_DEADLINE_S)
        assert not front.healthy
        with pytest.raises(EngineDeadError, match="tensor-parallel rank 1 .* was killed by SIGKILL"):
            front.submit([5, 6, 7], {"max_tokens": 2})
    finally:
        front.shutdown()
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_bad_tensor_parallel_sizes_are_config_errors(value):
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        EngineConfig.from_strings({"tensor_parallel_size": value})


def test_a_size_that_does_not_divide_the_kv_heads_fails_before_any_process_starts(tiny_model_dirs):
    with pytest.raises(ConfigError, match="tensor_parallel_size=2 does not divide the number of KV heads"):
        LLMEngine(EngineConfig(model=str(tiny_model_dirs["qwen2"]), num_gpu_blocks=64, tensor_parallel_size=2))
    assert not multiprocessing.active_children()
