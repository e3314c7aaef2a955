"""LLMEngine: requests in, scheduling + model steps, text deltas out; on CUDA each step is launched before the
one before it is read back (`overlap_steps`)."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .config import OFFLOAD_POLICIES, EngineConfig
from .core.block_manager import BlockManager
from .core.outputs import RequestMetrics, RequestOutput
from .core.sampling_params import SamplingParams
from .core.scheduler import Scheduler
from .core.scheduler_output import SchedulerOutput
from .core.sequence import PENDING_TOKEN, Sequence, SequenceStatus
from .errors import ConfigError, EngineDeadError, InvalidRequestError, KernelError
from .executor.model_runner import LaunchedStep, ModelRunner
from .executor.profiler import load_or_profile
from .executor.tp_workers import TensorParallelRunner
from .layers.sampler import SampleResult
from .models.loader import load_tokenizer, read_model_config, resolve_source
from .models.tokenizer import IncrementalDetokenizer

log = logging.getLogger("neo_backend")


@dataclass
class EngineCounters:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    gpu_decode_tokens: int = 0
    cpu_decode_tokens: int = 0
    overlapped_steps: int = 0  # launched before the step before them was read back
    modes: dict[str, int] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    last_iteration: dict[str, Any] = field(default_factory=dict)

    def fail(self, reason: str) -> None:
        self.failures[reason] = self.failures.get(reason, 0) + 1


@dataclass
class InFlightStep:
    """A step handed to the device whose samples are not read back yet: each sampling sequence holds a
    `PENDING_TOKEN` at `positions[row]` of its token ids until then."""

    batch: SchedulerOutput
    launched: LaunchedStep
    positions: list[int]
    started: float  # time.monotonic() at launch
    schedule_seconds: float  # from scheduling to launch, `swap_seconds` included
    swap_seconds: float  # landing swap-outs and carrying out this step's swaps, on the engine thread
    overlapped: bool  # launched before the step before it was read back: measured when read back


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        source = resolve_source(self.config)
        model_cfg = read_model_config(source)
        self.model_config = model_cfg
        self.tokenizer = load_tokenizer(source, self.config, model_cfg)
        max_len = self.config.max_model_len or model_cfg.max_position_embeddings
        runner_class = TensorParallelRunner if self.config.tensor_parallel_size > 1 else ModelRunner
        self.runner = runner_class(self.config, model_cfg, source, max_len, self.tokenizer.eos_token_ids)
        self.dead_reason: str | None = None
        try:
            self._init_scheduling(max_len)
        except BaseException:
            self.runner.close()
            raise
        self.counters = EngineCounters()
        self._seqs: dict[str, Sequence] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        mode = self.config.overlap_steps
        self.overlap_steps = mode == "on" or (
            mode == "auto" and self.config.tensor_parallel_size == 1 and self.runner.runs_async
        )
        self._in_flight: InFlightStep | None = None
        log.info(
            "engine ready: max_model_len %d, max_num_seqs %d, max_num_batched_tokens %d, tensor_parallel_size %d, "
            "overlapped steps %s",
            self.max_model_len,
            self.config.max_num_seqs,
            self.config.max_num_batched_tokens,
            self.config.tensor_parallel_size,
            "on" if self.overlap_steps else "off",
        )

    def _init_scheduling(self, max_len: int) -> None:
        """Block managers as large as the runner's pools, the performance model, the scheduler."""
        pool_tokens = self.runner.num_gpu_blocks * self.config.block_size
        if max_len > pool_tokens:
            log.warning("max_model_len %d exceeds the KV pool (%d tokens); capping it", max_len, pool_tokens)
            max_len = pool_tokens
        self.max_model_len = max_len
        self.gpu_blocks = BlockManager(self.runner.num_gpu_blocks, self.config.block_size, "gpu")
        self.cpu_blocks = BlockManager(self.runner.num_cpu_blocks, self.config.block_size, "cpu")
        self.perf_model = None
        if self.runner.offload_policy != "never":
            with self.runner.device_scope():
                self.perf_model = load_or_profile(self.runner)
        self.scheduler = Scheduler(
            self.config, self.runner.offload_policy, self.gpu_blocks, self.cpu_blocks, self.perf_model
        )
        log.info(
            "offload policy %s, pipeline %s, host KV %d blocks, CPU attention threads %d",
            self.scheduler.policy,
            self.config.pipeline,
            self.cpu_blocks.num_blocks,
            self.runner.host_attention.num_threads if self.runner.host_attention else 0,
        )

    @property
    def failure(self) -> str | None:
        """Why no request can make progress any more (a tensor-parallel rank died), or None."""
        return self.dead_reason or self.runner.lost_rank

    @property
    def healthy(self) -> bool:
        return self.failure is None

    def close(self) -> None:
        """Stop the runner: its CPU-attention thread and, at tensor_parallel_size > 1, the worker ranks."""
        self.runner.close()

    # Requests ---------------------------------------------------------------------------------------------

    def make_sequence(
        self,
        prompt: str | list[int],
        params: SamplingParams | Mapping[str, Any] | None = None,
        request_id: str | None = None,
    ) -> Sequence:
        """Validate and tokenize a request without touching engine state (safe from any thread)."""
        self._check_alive()
        params = self._check_params(params)
        text, token_ids = self._tokenize(prompt)
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len} "
                f"(prompt plus at least one output token must fit)"
            )
        return Sequence(request_id or uuid.uuid4().hex, text, token_ids, params)

    def add_sequence(self, seq: Sequence) -> None:
        self._check_alive()
        if seq.request_id in self._seqs:
            raise InvalidRequestError(f"request id {seq.request_id!r} is already in use")
        self._seqs[seq.request_id] = seq
        self._detokenizers[seq.request_id] = IncrementalDetokenizer(
            self.tokenizer, seq.prompt_token_ids, seq.params.stop
        )
        self.scheduler.add(seq)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | Mapping[str, Any] | None = None,
        request_id: str | None = None,
    ) -> str:
        seq = self.make_sequence(prompt, params, request_id)
        self.add_sequence(seq)
        return seq.request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        return self._finish(seq, "abort")

    def fail(self, request_id: str, message: str, reason: str = "error") -> RequestOutput | None:
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        seq.error = message
        self.counters.fail(reason)
        return self._finish(seq, "error")

    def set_offload_policy(self, policy: str) -> None:
        """Serve under another offload policy from now on, so a benchmark compares policies on one engine (same
        weights, graphs and profile). Only while idle; `auto` and `always` need the host pool, which an engine
        built under `never` does not have. The performance model's online corrections start over."""
        if policy not in OFFLOAD_POLICIES:
            raise ConfigError(f"offload_policy={policy!r} is not one of {', '.join(OFFLOAD_POLICIES)}")
        if self.has_unfinished_requests():
            raise ConfigError("the offload policy can change only while no request is in flight")
        if policy != "never" and self.runner.offload_policy == "never":
            raise ConfigError(
                f"offload_policy={policy} needs the host KV pool, and this engine has none: it serves never "
                f"(built under offload_policy={self.config.offload_policy}; the log's start-up lines say why)"
            )
        self.scheduler.policy = policy
        if self.perf_model is not None:
            self.perf_model.reset_observations()

    def has_unfinished_requests(self) -> bool:
        return bool(self._seqs)

    def stats_snapshot(self) -> dict[str, Any]:
        """Counters and gauges for logs, `--stats` and the Triton metrics."""
        sched = self.scheduler
        return {
            "prompt_tokens": self.counters.prompt_tokens,
            "generation_tokens": self.counters.generation_tokens,
            "preemptions": sched.num_preemptions,
            "preemptions_by_cause": dict(sched.preemptions),
            "failures": dict(self.counters.failures),
            "requests_waiting": len(sched.waiting),
            "requests_gpu_decode": len(sched.running),
            "requests_cpu_decode": len(sched.cpu_running),
            "gpu_blocks_used": self.gpu_blocks.num_used_blocks,
            "gpu_blocks_total": self.gpu_blocks.num_blocks,
            "cpu_blocks_used": self.cpu_blocks.num_used_blocks,
            "cpu_blocks_total": self.cpu_blocks.num_blocks,
            "swap_out_blocks": sched.swap_out_blocks,
            "swap_in_blocks": sched.swap_in_blocks,
            "gpu_decode_tokens": self.counters.gpu_decode_tokens,
            "overlapped_steps": self.counters.overlapped_steps,
            "cpu_decode_tokens": self.counters.cpu_decode_tokens,
            "modes": dict(self.counters.modes),
            "cpu_correction": round(self.perf_model.cpu_correction, 3) if self.perf_model else None,
            "offload_slowdown": round(self.perf_model.offload_slowdown, 3) if self.perf_model else None,
            "last_iteration": self.counters.last_iteration,
        }

    # Stepping ---------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        with self.runner.device_scope():
            try:
                return self._step()
            except EngineDeadError as exc:
                return self._stop_for_good(str(exc))

    def _stop_for_good(self, reason: str) -> list[RequestOutput]:
        """A tensor-parallel rank is gone: every request in flight fails with `reason`, and new ones are refused."""
        log.error("%s; failing %d requests", reason, len(self._seqs))
        self.dead_reason = reason
        self.runner.close()
        return [self.fail(request_id, reason, "engine_dead") for request_id in list(self._seqs)]

    def _check_alive(self) -> None:
        failure = self.failure
        if failure is not None:
            raise EngineDeadError(f"engine is not running: {failure}")

    def _step(self) -> list[RequestOutput]:
        """Schedule and launch a step. An overlapped step is launched before the step in flight is read back, and
        that one's outputs are made while the device runs it; other steps run one at a time, as do all of them
        while requests use the host (its scheduling then wants every token read back)."""
        outputs = self._read_back() if self.scheduler.host_in_use else []
        scheduling = time.monotonic()
        self.scheduler.swaps_landed(self.runner.land_swap_outs(wait=False))
        swap_seconds = time.monotonic() - scheduling
        batch = self.scheduler.schedule()
        overlapped = self._can_overlap(batch)
        if not overlapped:
            outputs += self._read_back()
            batch.drop_finished()
        swapping = time.monotonic()
        self.runner.swap(batch)
        swap_seconds += time.monotonic() - swapping
        if batch.is_empty:
            return outputs + self._read_back()
        start = time.monotonic()
        for seq, _ in batch.scheduled():
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = start
        host = self.runner.host_attention
        host_seconds_before = host.seconds if host else 0.0
        previous = self._in_flight.launched.sample if self._in_flight else None
        try:
            launched = self.runner.execute(batch, previous)
        except KernelError as exc:
            self._fail_over_to_gpu(exc)
            return outputs + self._read_back()
        except EngineDeadError:
            raise
        except Exception as exc:  # an iteration that breaks fails the requests it carried, not the server
            log.exception("iteration failed; failing its %d requests", len(batch.scheduled()))
            outputs += self._read_back()
            return outputs + self._fail_all([seq for seq, _ in batch.scheduled()], exc)
        for seq, n in batch.scheduled():
            seq.num_computed_tokens += n
        self.runner.start_swap_outs(self.scheduler.offload(batch.offload_after_step))
        positions = self._add_pending_tokens(launched.seqs)
        step = InFlightStep(batch, launched, positions, start, start - scheduling, swap_seconds, overlapped)
        if overlapped:
            outputs += self._read_back()  # the step before, while the device runs this one
            self._in_flight = step
            return outputs
        if launched.sample is not None:
            launched.sample.result()
        host_seconds = (host.seconds if host else 0.0) - host_seconds_before
        self._record_iteration(step, time.monotonic() - start, host_seconds)
        self._in_flight = step
        return outputs + self._read_back()

    def _can_overlap(self, batch: SchedulerOutput) -> bool:
        """Whether `batch` may be launched before the step in flight is read back: GPU work alone, no swap, and no
        penalty (it reads the request's tokens on the host)."""
        if not self.overlap_steps or batch.cpu_decodes or batch.swap_in or batch.swap_out or batch.land_swap_outs:
            return False
        seqs = batch.gpu_decodes + [seq for seq, _ in batch.prefills]
        return not any(seq.params.has_penalties for seq in seqs)

    def _add_pending_tokens(self, seqs: list[Sequence]) -> list[int]:
        """Each sampling sequence's next token stands as `PENDING_TOKEN` until read back; returns where."""
        positions = []
        for seq in seqs:
            seq.token_ids.append(PENDING_TOKEN)
            positions.append(len(seq.token_ids) - 1)
            seq.finishing = self._at_length_limit(seq, seq.num_output_tokens)
        return positions

    def _read_back(self) -> list[RequestOutput]:
        """The step in flight's samples into its sequences, and their outputs (none for requests that finished
        meanwhile: their token was computed in vain)."""
        step, self._in_flight = self._in_flight, None
        if step is None:
            return []
        launched = step.launched
        try:
            result = launched.sample.result() if launched.sample is not None else None
            if step.overlapped:
                measured = launched.device_seconds() or time.monotonic() - step.started
                self._record_iteration(step, measured, 0.0)
        except Exception as exc:  # the device failed the step: its requests fail, not the server
            log.exception("reading back an iteration failed; failing its %d requests", len(launched.seqs))
            return self._fail_all(launched.seqs, exc)
        if result is None:
            return []
        now = time.monotonic()
        return [
            self._process_sample(seq, index, result, row, now)
            for row, (seq, index) in enumerate(zip(launched.seqs, step.positions))
            if not seq.finished
        ]

    def _fail_all(self, seqs: list[Sequence], exc: Exception) -> list[RequestOutput]:
        """Fail the requests of a step that broke (those not finished already)."""
        message = f"internal error while running this request: {type(exc).__name__}: {exc}"
        failed = [self.fail(seq.request_id, message) for seq in seqs if not seq.finished]
        return [out for out in failed if out is not None]

    def _process_sample(self, seq: Sequence, index: int, result: SampleResult, row: int, now: float) -> RequestOutput:
        """Put one sampled token at `index` of the sequence's tokens; a failure here (non-finite logits,
        detokenization) fails this request only."""
        if row in result.non_finite_rows:
            return self.fail(seq.request_id, "the model produced non-finite logits for this request", "nan")
        try:
            entry = None
            if seq.params.logprobs is not None:
                entry = {result.token_ids[row]: result.logprobs[row], **(result.top_logprobs[row] or {})}
            return self._append_token(seq, index, result.token_ids[row], result.logprobs[row], entry, now)
        except Exception as exc:
            log.exception("request %s failed while processing its output", seq.request_id)
            return self.fail(seq.request_id, f"output processing failed: {type(exc).__name__}: {exc}")

    def _fail_over_to_gpu(self, exc: KernelError) -> None:
        """The CPU kernel failed: turn offloading off and recompute the CPU-requests on the GPU."""
        log.error(
            "CPU attention failed (%s); offloading is off, %d CPU-requests move to the GPU",
            exc,
            len(self.scheduler.cpu_running),
        )
        self.counters.fail("cpu_kernel")
        self._land_swap_outs()
        self.scheduler.disable_offload()

    def _land_swap_outs(self) -> None:
        """Land every swap-out in flight (the compute stream waits for its copies), before host blocks it writes
        into are freed; also from `abort`, outside a step."""
        with self.runner.device_scope():
            self.scheduler.swaps_landed(self.runner.land_swap_outs(wait=True))

    def generate(
        self, prompts: Iterable[str | list[int]], params: SamplingParams | Mapping[str, Any] | None = None
    ) -> list[RequestOutput]:
        """Run prompts to completion; returns one merged output (whole text and tokens) per prompt, in order."""
        ids = [self.add_request(p, params) for p in prompts]
        merged = {i: RequestOutput(i, "", [], False, None, 0, 0, 0.0) for i in ids}
        while self.has_unfinished_requests():
            for out in self.step():
                _merge(merged[out.request_id], out)
        return [merged[i] for i in ids]

    # Internals --------------------------------------------------------------------------------------------

    def _record_iteration(self, step: InFlightStep, measured: float, host_seconds: float) -> None:
        batch, c = step.batch, self.counters
        c.prompt_tokens += batch.num_prefill_tokens
        c.gpu_decode_tokens += len(batch.gpu_decodes)
        c.cpu_decode_tokens += len(batch.cpu_decodes)
        c.modes[batch.mode] = c.modes.get(batch.mode, 0) + 1
        c.overlapped_steps += step.overlapped
        if self.perf_model is not None:
            self.perf_model.observe_iteration(batch.predicted_time, measured, bool(batch.cpu_decodes))
            if batch.cpu_decodes:
                self.perf_model.observe_cpu(batch.predicted_cpu_time, host_seconds)
        c.last_iteration = {
            "mode": batch.mode,
            "prefill_tokens": batch.num_prefill_tokens,
            "gpu_decodes": len(batch.gpu_decodes),
            "cpu_decodes": len(batch.cpu_decodes),
            "split": batch.split if batch.pipelined else None,
            "predicted_s": round(batch.predicted_time, 6),
            "measured_s": round(measured, 6),
            "predicted_cpu_s": round(batch.predicted_cpu_time, 6),
            "measured_cpu_s": round(host_seconds, 6),
            "schedule_s": round(step.schedule_seconds, 6),
            "swap_s": round(step.swap_seconds, 6),
        }

    def _append_token(
        self, seq: Sequence, index: int, token: int, logprob: float, logprob_entry, now: float
    ) -> RequestOutput:
        seq.token_ids[index] = token
        seq.cumulative_logprob += logprob
        seq.first_token_time = seq.first_token_time or now
        self.counters.generation_tokens += 1
        num_output_tokens = index + 1 - seq.num_prompt_tokens
        detok = self._detokenizers[seq.request_id]
        detok.add_token(token, check_stop=num_output_tokens >= seq.params.min_tokens)
        reason = self._finish_reason(seq, token, num_output_tokens, detok)
        if reason:
            del seq.token_ids[index + 1 :]
            out = self._finish(seq, reason)
            out.token_ids = [token]
        else:
            out = self._output(seq, detok.take_delta(final=False), [token], num_output_tokens)
        out.logprobs = None if logprob_entry is None else [logprob_entry]
        return out

    def _finish_reason(
        self, seq: Sequence, token: int, num_output_tokens: int, detok: IncrementalDetokenizer
    ) -> str | None:
        p = seq.params
        if (not p.ignore_eos and token in self.tokenizer.eos_token_ids) or token in p.stop_token_ids or detok.stopped:
            return "stop"
        return "length" if self._at_length_limit(seq, num_output_tokens) else None

    def _at_length_limit(self, seq: Sequence, num_output_tokens: int) -> bool:
        return (
            num_output_tokens >= seq.params.max_tokens
            or seq.num_prompt_tokens + num_output_tokens >= self.max_model_len
        )

    def _finish(self, seq: Sequence, reason: str) -> RequestOutput:
        """Take the request out; tokens of it still on their way from the device are dropped."""
        while seq.token_ids[-1] == PENDING_TOKEN:
            seq.token_ids.pop()
        if self.scheduler.is_swapping_out(seq):
            self._land_swap_outs()
        self.scheduler.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = time.monotonic()
        detok = self._detokenizers.pop(seq.request_id)
        del self._seqs[seq.request_id]
        out = self._output(seq, detok.take_delta(final=True) if reason != "error" else "", [], seq.num_output_tokens)
        out.metrics = RequestMetrics(
            seq.arrival_time, seq.first_scheduled_time, seq.first_token_time, seq.finish_time, seq.num_output_tokens
        )
        return out

    def _output(self, seq: Sequence, text: str, token_ids: list[int], num_output_tokens: int) -> RequestOutput:
        return RequestOutput(
            seq.request_id,
            text,
            token_ids,
            seq.finished,
            seq.finish_reason,
            seq.num_prompt_tokens,
            num_output_tokens,
            seq.cumulative_logprob,
            error=seq.error,
        )

    def _check_params(self, params: SamplingParams | Mapping[str, Any] | None) -> SamplingParams:
        if params is None:
            params = SamplingParams()
        elif isinstance(params, Mapping):
            params = SamplingParams.from_dict(params)
        elif not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling parameters must be a mapping, got {type(params).__name__}")
        cfg = self.config
        limits = [
            (
                params.max_tokens <= cfg.max_tokens_cap,
                f"max_tokens {params.max_tokens} exceeds the server's limit {cfg.max_tokens_cap}",
            ),
            (
                len(params.stop) <= cfg.max_stop_strings,
                f"{len(params.stop)} stop strings exceed the server's limit {cfg.max_stop_strings}",
            ),
            (
                all(len(s) <= cfg.max_stop_string_len for s in params.stop),
                f"a stop string is longer than the server's limit {cfg.max_stop_string_len}",
            ),
            (
                (params.logprobs or 0) <= cfg.max_logprobs,
                f"logprobs {params.logprobs} exceeds the server's limit {cfg.max_logprobs}",
            ),
        ]
        for ok, message in limits:
            if not ok:
                raise InvalidRequestError(message)
        return params

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            if len(prompt.encode("utf-8", "surrogatepass")) > self.config.max_prompt_bytes:
                raise InvalidRequestError(f"prompt exceeds the server's limit of {self.config.max_prompt_bytes} bytes")
            token_ids = self.tokenizer.encode(prompt)
            if not token_ids:
                raise InvalidRequestError("prompt encodes to no tokens")
            return prompt, token_ids
        if (
            isinstance(prompt, (list, tuple))
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            vocab = self.model_config.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
            return None, list(prompt)
        raise InvalidRequestError("prompt must be a non-empty string or a non-empty list of token ids")


def _merge(into: RequestOutput, out: RequestOutput) -> None:
    into.text += out.text
    into.token_ids += out.token_ids
    into.finished, into.finish_reason, into.error = out.finished, out.finish_reason, out.error
    into.num_prompt_tokens, into.num_output_tokens = out.num_prompt_tokens, out.num_output_tokens
    into.cumulative_logprob = out.cumulative_logprob
    if out.logprobs:
        into.logprobs = (into.logprobs or []) + out.logprobs
    into.metrics = out.metrics or into.metrics
