"""Fault isolation inside the engine: a fault fails the requests it touches, never the engine."""

from __future__ import annotations

import itertools
import threading
import time

from engine_helpers import collect, mixed_requests, outputs_of

from neo_backend import EngineConfig, KernelError, LLMEngine
from neo_backend.errors import EngineDeadError, QueueFullError
from neo_backend.streaming import StreamingEngine


def _tiny_engine(tiny_model_dirs, **knobs) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model=str(tiny_model_dirs["llama3"]), block_size=8, max_num_batched_tokens=64, **knobs)
    )


def _failing_on_call(real, n: int, error: Exception):
    """`real`, except that its `n`-th call raises `error`."""
    calls = itertools.count(1)

    def wrapper(*args, **kwargs):
        if next(calls) == n:
            raise error
        return real(*args, **kwargs)

    return wrapper


def _drain(engine: LLMEngine) -> dict[str, list]:
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def test_non_finite_logits_fail_only_that_request(tiny_model_dirs, monkeypatch):
    engine = _tiny_engine(tiny_model_dirs, num_gpu_blocks=128, offload_policy="never")
    good_alone = engine.generate([[5, 6, 7, 8]], {"max_tokens": 6, "temperature": 0})[0].token_ids
    bad = engine.add_request([9, 10, 11], {"max_tokens": 6, "temperature": 0})
    good = engine.add_request([5, 6, 7, 8], {"max_tokens": 6, "temperature": 0})
    real = engine.runner.model.compute_logits

    def poisoned(hidden):
        logits = real(hidden)
        if logits.shape[0] == 2:
            logits[0] = float("nan")
        return logits

    monkeypatch.setattr(engine.runner.model, "compute_logits", poisoned)
    finals = _drain(engine)
    assert finals[bad].finish_reason == "error" and "non-finite" in finals[bad].error
    assert finals[good].finish_reason == "length"
    assert engine.counters.failures == {"nan": 1}
    assert engine.gpu_blocks.num_free_blocks == engine.gpu_blocks.num_blocks
    monkeypatch.undo()
    assert engine.generate([[5, 6, 7, 8]], {"max_tokens": 6, "temperature": 0})[0].token_ids == good_alone


def test_a_broken_iteration_fails_its_requests_and_the_engine_goes_on(tiny_model_dirs, monkeypatch):
    engine = _tiny_engine(tiny_model_dirs, num_gpu_blocks=128, offload_policy="never")
    expected = engine.generate([[3, 4, 5]], {"max_tokens": 5, "temperature": 0})[0].token_ids
    rid = engine.add_request([3, 4, 5], {"max_tokens": 5, "temperature": 0})
    monkeypatch.setattr(engine.runner, "execute", lambda *_: (_ for _ in ()).throw(RuntimeError("device lost")))
    outs = engine.step()
    assert [o.request_id for o in outs] == [rid] and outs[0].finish_reason == "error"
    assert "device lost" in outs[0].error
    monkeypatch.undo()
    assert engine.gpu_blocks.num_free_blocks == engine.gpu_blocks.num_blocks
    assert engine.generate([[3, 4, 5]], {"max_tokens": 5, "temperature": 0})[0].token_ids == expected


def test_cpu_kernel_failure_fails_over_to_the_gpu(tiny_model_dirs, monkeypatch):
    prompts, max_tokens = mixed_requests(12, seed=5)
    reference = collect(
        _tiny_engine(tiny_model_dirs, num_gpu_blocks=512, offload_policy="never"), prompts, max_tokens, stagger=False
    )
    engine = _tiny_engine(tiny_model_dirs, num_gpu_blocks=512, offload_policy="always", cpu_kv_cache_gb=0.01)
    host = engine.runner.host_attention
    monkeypatch.setattr(
        host,
        "run_iteration",
        _failing_on_call(host.run_iteration, 6, KernelError("injected: the CPU attention library failed")),
    )
    assert collect(engine, prompts, max_tokens, stagger=False) == reference
    assert engine.counters.failures == {"cpu_kernel": 1} and engine.scheduler.policy == "never"
    stats = engine.stats_snapshot()
    assert stats["gpu_blocks_used"] == 0 and stats["cpu_blocks_used"] == 0
    assert stats["cpu_decode_tokens"] > 0, "requests decoded on the CPU before the failure"
    assert set(stats["preemptions_by_cause"]) == {"cpu_kernel_failed"}, "the CPU-requests were recomputed"


def test_a_failure_inside_a_pipelined_iteration_does_not_strand_the_cpu_worker(tiny_model_dirs, monkeypatch):
    """The launching thread fails mid-iteration while the CPU-attention worker waits for its next step: the
    error reaches the iteration's requests at once and the next pipelined iteration runs normally."""
    engine = _tiny_engine(
        tiny_model_dirs, num_gpu_blocks=128, offload_policy="always", pipeline="on", cpu_kv_cache_gb=0.01
    )
    prompts = [[3, 4, 5], [6, 7, 8, 9]]
    expected = [o.token_ids for o in engine.generate(prompts, {"max_tokens": 6, "temperature": 0})]
    layer = engine.runner.model.layers[1]
    monkeypatch.setattr(
        layer, "attention_inputs", _failing_on_call(layer.attention_inputs, 9, RuntimeError("device lost"))
    )
    ids = [engine.add_request(p, {"max_tokens": 6, "temperature": 0}) for p in prompts]
    start = time.monotonic()
    finals = _drain(engine)
    assert time.monotonic() - start < 30, "the failed iteration waited for the worker's hand-off timeout"
    engine.runner.pipeline.worker.submit(lambda: None).result(timeout=5)  # the worker is not stuck
    assert {finals[i].finish_reason for i in ids} == {"error"} and "device lost" in finals[ids[0]].error
    monkeypatch.undo()
    assert [o.token_ids for o in engine.generate(prompts, {"max_tokens": 6, "temperature": 0})] == expected
    assert engine.counters.modes.get("pipelined", 0) > 0
    assert engine.stats_snapshot()["cpu_blocks_used"] == 0


def test_every_stream_ends_when_the_engine_shuts_down_under_a_stream_of_submits(tiny_model_dirs, monkeypatch):
    """Clients keep submitting while the server shuts down: each gets a refusal or a stream that ends. A slow
    tokenizer widens the window between a submit's health check and its registration."""
    front = StreamingEngine(engine=_tiny_engine(tiny_model_dirs, offload_policy="never"))
    make_sequence = front.engine.make_sequence

    def slow_make_sequence(*args, **kwargs):
        time.sleep(0.05)
        return make_sequence(*args, **kwargs)

    monkeypatch.setattr(front.engine, "make_sequence", slow_make_sequence)
    streams, refused = [], []

    def submit_until_refused() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                streams.append(front.submit([5, 6, 7], {"max_tokens": 4, "temperature": 0}))
            except QueueFullError:
                time.sleep(0.01)
            except EngineDeadError as exc:
                refused.append(exc)
                return

    submitters = [threading.Thread(target=submit_until_refused) for _ in range(4)]
    for thread in submitters:
        thread.start()
    time.sleep(0.5)
    front.shutdown()
    for thread in submitters:
        thread.join(timeout=60)
    assert streams and len(refused) == len(submitters)
    for stream in streams:
        list(outputs_of(stream, timeout_s=10))
