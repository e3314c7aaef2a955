"""The performance model on hand-computed numbers: the dense term interpolated between profiled token counts, the
host-attention plane fit, how the terms make the sequential and pipelined predictions, the online host correction,
and the profile cache, keyed by what the timings depend on."""

from __future__ import annotations

import json

import numpy as np
import pytest

from neo_backend import EngineConfig, LLMEngine
from neo_backend.core.perf_model import PerfModel, fit_plane, load_cached, save
from neo_backend.executor.model_runner import ModelRunner

MS = 1e-3


def _model(**terms) -> PerfModel:
    """Dense 10 ms up to 8 tokens, 12 ms at 64 and 30 ms at 256; device attention 1 us per context token;
    host attention 0.1 ms + 0.2 ms per request + 0.3 us per context token."""
    base = dict(
        dense_tokens=[8, 64, 256],
        dense_seconds=[10 * MS, 12 * MS, 30 * MS],
        gpu_attn_per_token=1e-6,
        cpu_attn_fixed=0.1 * MS,
        cpu_attn_per_request=0.2 * MS,
        cpu_attn_per_token=0.3e-6,
    )
    return PerfModel(**{**base, **terms})


# Predictions -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tokens,seconds",
    [
        (0, 0.0),  # nothing to run
        (1, 10 * MS),
        (8, 10 * MS),  # at and below the first profiled count: its time
        (36, 11 * MS),
        (64, 12 * MS),  # halfway between 8 and 64, and at 64
        (160, 21 * MS),
        (256, 30 * MS),  # halfway between 64 and 256, and at 256
        (448, 48 * MS),  # beyond: the last segment's slope, 18 ms per 192 tokens
    ],
)
def test_dense_time_is_piecewise_linear_through_the_profiled_points(tokens, seconds):
    assert _model().dense(tokens) == pytest.approx(seconds)


def test_one_profiled_point_is_a_flat_dense_time():
    model = _model(dense_tokens=[16], dense_seconds=[5 * MS])
    assert [model.dense(t) for t in (1, 16, 1000)] == pytest.approx([5 * MS] * 3)


def test_attention_terms_are_linear_in_their_work():
    model = _model()
    assert model.gpu_attention(5000) == pytest.approx(5 * MS)
    assert model.cpu_attention(0, 5000) == 0.0, "no host requests, no host work, not even the fixed cost"
    assert model.cpu_attention(10, 10_000) == pytest.approx((0.1 + 2.0 + 3.0) * MS)


def test_sequential_runs_the_two_attentions_side_by_side_and_counts_host_requests_as_dense_tokens():
    model = _model()
    # dense(24 + 40 = 64 tokens) + the longer of device attention of 2000 tokens (2 ms) and host attention of 40
    # requests, 20000 tokens (14.1 ms)
    assert model.sequential(24, 2000, 40, 20_000) == pytest.approx((12 + 0.1 + 8 + 6) * MS)
    # the device's attention of 20000 tokens (20 ms) outlasts one host request of 1000 tokens (0.6 ms)
    assert model.sequential(63, 20_000, 1, 1000) == pytest.approx((12 + 20) * MS)
    assert model.sequential(64, 20_000, 0, 0) == pytest.approx((12 + 20) * MS)


@pytest.mark.parametrize(
    "per_request,pipelined,sequential",
    [
        # host attention (2 and 6 ms) hides under the other sub-batch's dense work (15 and 17 ms)
        (1 * MS, (17 + 15) * MS, (23 + 8) * MS),
        # the first overlap waits for sub-batch 1's host attention (24 ms), the second hides sub-batch 0's (8 ms)
        (4 * MS, (24 + 15) * MS, (23 + 32) * MS),
    ],
)
def test_pipelined_overlaps_each_sub_batch_host_attention_with_the_other_dense_work(per_request, pipelined, sequential):
    """6 device decodes and 8 host ones, 2 in sub-batch 0 (with the device's) and 6 in sub-batch 1; dense work
    9 ms + 1 ms per token."""
    model = _model(
        dense_tokens=[1, 17],
        dense_seconds=[10 * MS, 26 * MS],
        gpu_attn_per_token=0.0,
        cpu_attn_fixed=0.0,
        cpu_attn_per_request=per_request,
        cpu_attn_per_token=0.0,
    )
    assert model.pipelined(6, 0, (2, 0), (6, 0)) == pytest.approx(pipelined)
    assert model.sequential(6, 0, 8, 0) == pytest.approx(sequential)


def test_an_iteration_splits_its_cpu_decodes_in_order():
    model, ctx = _model(), [1000, 2000, 3000]
    assert model.iteration(4, 500, ctx, None) == model.sequential(4, 500, 3, 6000)
    assert model.iteration(4, 500, ctx, 1) == model.pipelined(4, 500, (1, 1000), (2, 5000))
    assert model.iteration(4, 500, ctx, 2) == model.pipelined(4, 500, (2, 3000), (1, 3000))


# The host-attention fit --------------------------------------------------------------------------------------------

PROFILE_SHAPES = [(1, 256), (4, 1024), (8, 1024), (16, 512), (32, 1024)]  # (requests, context), as profiler.py
TRUE_PLANE = (0.1 * MS, 0.2 * MS, 0.3e-6)  # fixed, per request, per context token


def _plane(coefficients, requests: int, tokens: int) -> float:
    fixed, per_request, per_token = coefficients
    return fixed + per_request * requests + per_token * tokens


def _timings(coefficients, noise: float = 0.0) -> tuple[list[tuple[int, int]], list[float]]:
    """Host attention times of the profiler's shapes on `coefficients`, with relative noise of `noise` (seeded)."""
    rng = np.random.default_rng(0)
    rows = [(batch, batch * context) for batch, context in PROFILE_SHAPES]
    return rows, [_plane(coefficients, *row) * (1 + noise * rng.standard_normal()) for row in rows]


def test_fit_plane_recovers_the_coefficients_of_exact_timings():
    assert fit_plane(*_timings(TRUE_PLANE)) == pytest.approx(TRUE_PLANE)


def test_fit_plane_on_noisy_timings_predicts_the_largest_shape_closely():
    fitted = fit_plane(*_timings(TRUE_PLANE, noise=0.02))
    assert _plane(fitted, 32, 32_768) == pytest.approx(_plane(TRUE_PLANE, 32, 32_768), rel=0.05)


def test_fit_plane_predicts_the_smallest_shape_when_the_largest_ran_faster():
    """The host's read rate is bimodal between runs, and within one: the largest shape running 20% fast must not
    lift the intercept over the small batches' real time."""
    rows, times = _timings(TRUE_PLANE)
    times[-1] *= 0.8
    fitted = fit_plane(rows, times)
    assert _plane(fitted, *rows[0]) == pytest.approx(times[0], rel=0.15)
    assert _plane(fitted, *rows[-1]) == pytest.approx(times[-1], rel=0.15)


def test_fit_plane_clamps_a_negative_coefficient_to_zero():
    fixed, per_request, per_token = fit_plane(*_timings((-0.5 * MS, *TRUE_PLANE[1:])))
    assert fixed == 0.0
    assert (per_request, per_token) == pytest.approx(TRUE_PLANE[1:])


# Online correction -------------------------------------------------------------------------------------------------


def test_host_correction_moves_each_observation_toward_the_measured_time():
    """Host attention measured at twice the profile: one observation alone is no evidence, every one after it
    brings the prediction closer, and it settles on the measured time."""
    model = _model()
    raw = model.cpu_attention(8, 8192)
    errors = []
    for _ in range(30):
        model.observe_cpu(model.cpu_attention(8, 8192), 2 * raw)
        errors.append(abs(model.cpu_attention(8, 8192) - 2 * raw))
    assert errors[0] == pytest.approx(raw)
    assert all(later < earlier for earlier, later in zip(errors[1:], errors[2:]))
    assert model.cpu_attention(8, 8192) == pytest.approx(2 * raw, rel=1e-3)
    assert model.cpu_attention(16, 4096) == pytest.approx(2 * _model().cpu_attention(16, 4096), rel=1e-3)


def test_one_slow_host_iteration_among_normal_ones_moves_nothing():
    """A page fault or a cold cache makes one iteration slow; the fail-safe must not read it as a busy host."""
    model = _model()
    for i in range(40):
        predicted = model.cpu_attention(4, 4096)
        model.observe_cpu(predicted, predicted / model.cpu_correction * (5.0 if i % 10 == 3 else 1.0))
    assert model.cpu_correction == 1.0


def test_host_observations_without_a_positive_time_are_ignored():
    model = _model()
    for predicted, measured in ((0.0, 1.0), (1.0, 0.0), (-1.0, 1.0)):
        model.observe_cpu(predicted, measured)
    assert model.cpu_correction == 1.0


def test_reset_observations_returns_to_the_profile():
    model = _model(cpu_correction=2.5, gpu_only_ratio=1.3, offload_ratio=3.0)
    model.reset_observations()
    assert model == _model()


# The profile cache -------------------------------------------------------------------------------------------------


def test_a_saved_profile_loads_back_without_its_observations(tmp_path):
    path = tmp_path / "profiles" / "key.json"
    save(_model(cpu_correction=1.7, gpu_only_ratio=1.2, offload_ratio=2.0), path)
    assert load_cached(path) == _model()


@pytest.mark.parametrize(
    "content",
    [None, "{not json", json.dumps({"dense_tokens": [1]}), json.dumps({**vars(_model()), "from_a_newer_version": 1})],
)
def test_a_missing_damaged_or_foreign_profile_is_a_cache_miss(tmp_path, content):
    path = tmp_path / "key.json"
    if content is not None:
        path.write_text(content)
    assert load_cached(path) is None


def test_profiles_are_cached_by_what_the_timings_depend_on(tiny_model_dirs, tmp_path, monkeypatch):
    """The same model and knobs load the saved profile; a knob the timings do not depend on (cpu_latency_slack) shares
    it; one they do depend on (block_size) is profiled and saved beside it."""
    profiled = []

    def fake_profile(runner) -> PerfModel:
        profiled.append(runner.block_size)
        return _model(dense_tokens=[1], dense_seconds=[runner.block_size * MS])

    monkeypatch.setattr(ModelRunner, "profile", fake_profile)

    def engine(**knobs) -> LLMEngine:
        knobs = {"block_size": 8, "max_num_seqs": 16, **knobs}
        return LLMEngine(
            EngineConfig(
                model=str(tiny_model_dirs["llama3"]),
                num_gpu_blocks=24,
                cpu_kv_cache_gb=0.01,
                offload_policy="always",
                pipeline="off",
                cache_dir=str(tmp_path),
                **knobs,
            )
        )

    first = engine()
    assert profiled == [8] and first.perf_model == _model(dense_tokens=[1], dense_seconds=[8 * MS])
    [saved] = (tmp_path / "profiles").glob("*.json")
    assert load_cached(saved) == first.perf_model
    assert engine().perf_model == first.perf_model and engine(cpu_latency_slack=3.0).perf_model == first.perf_model
    assert profiled == [8], "the same timings are not profiled twice"
    assert engine(block_size=16).perf_model.dense_seconds == [16 * MS]
    assert profiled == [8, 16] and len(list((tmp_path / "profiles").glob("*.json"))) == 2


def test_dense_profile_times_decode_rows_up_to_max_num_seqs_and_prefills_beyond(tiny_model_dirs, tmp_path, monkeypatch):
    """An iteration of more tokens than `max_num_seqs` holds a prompt's prefill, so that is what the dense profile
    times there: decode rows are a different pass (on a small GPU ~1.4x slower for the same tokens)."""
    from neo_backend.models.llama import LlamaForCausalLM

    passes = []
    forward = LlamaForCausalLM.forward

    def recorded(self, input_ids, positions, meta):
        passes.append((input_ids.numel(), meta.num_prefill_tokens, meta.num_decodes))
        return forward(self, input_ids, positions, meta)

    monkeypatch.setattr(LlamaForCausalLM, "forward", recorded)
    LLMEngine(
        EngineConfig(
            model=str(tiny_model_dirs["llama3"]),
            num_gpu_blocks=24,
            block_size=8,
            max_num_seqs=16,
            max_num_batched_tokens=64,
            cpu_kv_cache_gb=0.01,
            offload_policy="auto",
            cache_dir=str(tmp_path),
        )
    )
    shapes = {tokens: (prefill, decodes) for tokens, prefill, decodes in passes}
    assert sorted(shapes) == [1, 8, 16, 32, 64]
    assert all(shapes[t] == (0, t) for t in (1, 8, 16)), shapes
    assert all(shapes[t] == (t, 0) for t in (32, 64)), shapes
