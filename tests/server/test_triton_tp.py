"""The `neo` model at tensor_parallel_size=2 behind a real tritonserver (the python-backend stub spawns the worker
rank), on the tiny GQA llama: greedy streams over gRPC as one rank in process gives them, then a worker killed
mid-stream fails that stream naming the rank, refuses new requests, and the server's stop leaves no process."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from server_utils import descendant_pids, is_gone
from test_triton import GREEDY, Stream, request_inputs, run_stream

from loadtest.server import RunningServer, triton_server
from neo_backend import EngineConfig, LLMEngine

PROMPTS = ["Paris is the capital of", "def add(a, b):"]
LONG = {"temperature": 0, "max_tokens": 480, "ignore_eos": True}  # far longer than the kill takes to land
FAILURE_DEADLINE_S = 30.0


@pytest.fixture(scope="module")
def knobs(tiny_model_dirs) -> dict[str, object]:
    return {
        "model": str(tiny_model_dirs["llama3"]),
        "tensor_parallel_size": 2,
        "num_gpu_blocks": 96,
        "max_model_len": 512,
        "cpu_kv_cache_gb": 0.01,
        "offload_policy": "never",
        "max_num_seqs": 8,
    }


@pytest.fixture(scope="module")
def server_and_reference(knobs) -> tuple[RunningServer, dict[str, str]]:
    """The server, plus each prompt's greedy text from an in-process engine at one rank (built while the server
    starts)."""
    with triton_server(knobs, wait=False) as server:
        engine = LLMEngine(EngineConfig(**{**knobs, "tensor_parallel_size": 1}))
        reference = {p: out.text for p, out in zip(PROMPTS, engine.generate(PROMPTS, GREEDY))}
        engine.close()
        server.wait_ready()
        yield server, reference


def worker_pids(server: RunningServer) -> list[int]:
    """The spawned tensor-parallel ranks among the server's processes."""
    return [pid for pid in descendant_pids(server) if "spawn_main" in _cmdline(pid)]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read()
    except OSError:
        return ""


def test_two_ranks_stream_one_rank_s_greedy_text(server_and_reference):
    server, reference = server_and_reference
    assert len(worker_pids(server)) == 1, server.log_tail()
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(lambda p: run_stream(server, request_inputs(p, GREEDY)), PROMPTS))
    assert [r.error for r in results] == [None] * len(PROMPTS)
    assert [r.text for r in results] == [reference[p] for p in PROMPTS]


def test_a_killed_rank_fails_its_stream_refuses_requests_and_stop_leaves_no_process(server_and_reference):
    """The bundled Triton 2.51 does not ask the model whether it is ready (see model.py `is_ready`): there a dead
    engine shows as every new request refused with UNAVAILABLE."""
    server, _ = server_and_reference
    [worker] = worker_pids(server)
    processes = descendant_pids(server)
    stream = Stream(server).send(request_inputs(PROMPTS[0], LONG))
    try:
        for _ in range(3):
            stream.next()
        assert stream.result.error is None and not stream.done
        os.kill(worker, signal.SIGKILL)
        killed = time.monotonic()
        result = stream.collect(timeout=FAILURE_DEADLINE_S)
    finally:
        stream.close()
    assert time.monotonic() - killed < FAILURE_DEADLINE_S
    assert "tensor-parallel rank 1" in str(result.error) and "SIGKILL" in str(result.error), result.error
    refused = run_stream(server, request_inputs(PROMPTS[1], GREEDY))
    assert "engine is not running: tensor-parallel rank 1" in str(refused.error), refused.error
    assert server.stop() == 0, server.log_tail()
    deadline = time.monotonic() + FAILURE_DEADLINE_S
    while (left := [pid for pid in processes if not is_gone(pid)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes left after the stop: {[(pid, _cmdline(pid)) for pid in left]}"
