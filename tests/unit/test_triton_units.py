"""The Triton model's request parsing, responses and metrics, and the knob parsing they share, without a server."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from neo_backend.cli import _sampling_from_args, build_parser
from neo_backend.config import EngineConfig, parse_knob
from neo_backend.core.outputs import RequestMetrics, RequestOutput
from neo_backend.core.sampling_params import SamplingParams
from neo_backend.errors import ConfigError, EngineDeadError, InvalidRequestError, KernelError, QueueFullError
from neo_backend.triton.metrics import NeoMetrics
from neo_backend.triton.parameters import engine_config
from neo_backend.triton.request import RequestSpec
from neo_backend.triton.responses import ErrorCode, ResponseWriter, is_cancelled, rejection, send_quietly
from neo_backend.triton.server import (
    ServerAddress,
    ServerSetupError,
    TritonInstall,
    check_stub_environment,
    find_tritonserver,
    free_ports,
    is_ready,
    knob_overrides,
)
from neo_backend.triton.sigterm import SigtermWatcher


class FakeTensor:
    def __init__(self, name: str, values: list, dtype=np.object_) -> None:
        self._name, self._array = name, np.array(values, dtype=dtype)

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array


class FakeRequest:
    def __init__(self, prompt: object = b"Hello", parameters: dict | None = None, **inputs: FakeTensor) -> None:
        self._inputs = ([] if prompt is None else [FakeTensor("text_input", [prompt])]) + list(inputs.values())
        self._parameters = json.dumps(parameters or {})

    def inputs(self) -> list[FakeTensor]:
        return self._inputs

    def parameters(self) -> str:
        return self._parameters


def flag(name: str, value: bool) -> FakeTensor:
    return FakeTensor(name, [value], np.bool_)


def sampling_tensor(values: dict) -> FakeTensor:
    return FakeTensor("sampling_parameters", [json.dumps(values).encode()])


def output(text: str, token_ids: list[int], finished: bool = False, **fields) -> RequestOutput:
    values = dict(
        finish_reason="length" if finished else None,
        num_prompt_tokens=3,
        num_output_tokens=len(token_ids),
        cumulative_logprob=-1.5,
    )
    return RequestOutput("r", text, token_ids, finished, **{**values, **fields})


# Knob parsing ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, value",
    [(word, True) for word in ("1", "true", "yes", "on", " TRUE ", "Yes")]
    + [(word, False) for word in ("0", "false", "no", "off", "False", " OFF")],
)
def test_every_boolean_spelling_reads_the_same_from_every_source(text, value):
    assert EngineConfig.from_strings({"enforce_eager": text}).enforce_eager is value
    assert EngineConfig.from_env({"NEO_ENFORCE_EAGER": text}).enforce_eager is value
    assert engine_config({"enforce_eager": {"string_value": text}}).enforce_eager is value
    assert SamplingParams.parse_strings({"ignore_eos": text}) == {"ignore_eos": value}


def test_parse_knob_reads_types_and_unset_optionals():
    assert parse_knob("block_size", " 32 ", int, "flag") == 32
    assert parse_knob("gpu_memory_utilization", "0.5", float, "flag") == 0.5
    assert [parse_knob("num_gpu_blocks", text, int | None, "flag") for text in ("", "None", "null")] == [None] * 3
    with pytest.raises(ConfigError, match="flag block_size='' is not a valid int"):
        parse_knob("block_size", "", int, "flag")
    with pytest.raises(InvalidRequestError, match="sampling parameter ignore_eos='maybe' is not a valid bool"):
        parse_knob("ignore_eos", "maybe", bool, "sampling parameter", InvalidRequestError)


def test_sampling_strings_are_parsed_and_other_values_left_to_validation():
    values = {"temperature": "0.1", "max_tokens": " 12", "seed": "null", "stop": "x", "stop_token_ids": [5], "top_k": 3}
    assert SamplingParams.parse_strings(values) == {
        "temperature": 0.1,
        "max_tokens": 12,
        "seed": None,
        "stop": "x",
        "stop_token_ids": [5],
        "top_k": 3,
    }
    assert SamplingParams.parse_strings({"no_such_knob": "1"}) == {"no_such_knob": "1"}
    with pytest.raises(InvalidRequestError, match="sampling parameter temperature='hot' is not a valid float"):
        SamplingParams.parse_strings({"temperature": "hot"})


def test_cli_sampling_flags_use_the_knob_rules():
    args = build_parser().parse_args(
        [
            "generate",
            "--prompt",
            "hi",
            "--max-tokens",
            "7",
            "--temperature",
            "0",
            "--ignore-eos",
            "--stop",
            "a",
            "--stop",
            "b",
            "--stop-token-ids",
            "9",
        ]
    )
    assert _sampling_from_args(args) == SamplingParams(
        max_tokens=7, temperature=0.0, ignore_eos=True, stop=["a", "b"], stop_token_ids=[9]
    )
    args = build_parser().parse_args(["generate", "--prompt", "hi", "--max-tokens", "many"])
    with pytest.raises(InvalidRequestError, match="flag max_tokens='many' is not a valid int"):
        _sampling_from_args(args)


def test_cli_engine_flags_go_through_the_knob_rules():
    args = build_parser().parse_args(["generate", "--prompt", "hi", "--enforce-eager", "--num-gpu-blocks", "64"])
    assert EngineConfig.from_cli_args(args).changed_knobs() == {"num_gpu_blocks": 64, "enforce_eager": True}


def test_changed_knobs_lists_what_differs_from_the_base_in_declaration_order():
    base = EngineConfig(block_size=32)
    config = EngineConfig(block_size=32, offload_policy="never", model="m")
    assert EngineConfig().changed_knobs() == {}
    assert list(config.changed_knobs().items()) == [("model", "m"), ("block_size", 32), ("offload_policy", "never")]
    assert config.changed_knobs(base) == {"model": "m", "offload_policy": "never"}


def test_knob_overrides_spell_values_as_config_pbtxt_does():
    assert knob_overrides(environ={"NEO_ENFORCE_EAGER": "yes", "NEO_BLOCK_SIZE": "16"}) == {"enforce_eager": "true"}


def test_backend_parameters_are_no_knobs_but_unknown_ones_fail():
    parameters = {"EXECUTION_ENV_PATH": {"string_value": "/env.tar.gz"}, "block_size": {"string_value": "32"}}
    assert engine_config(parameters).changed_knobs() == {"block_size": 32}
    with pytest.raises(ConfigError, match="unknown config.pbtxt parameter 'bogus'"):
        engine_config({"bogus": {"string_value": "1"}})


# Requests --------------------------------------------------------------------------------------------------------


def test_a_bare_prompt_is_a_non_streamed_answer_with_the_prompt_prepended():
    spec = RequestSpec.parse(FakeRequest("Héllo".encode()))
    assert spec == RequestSpec("Héllo", {}, stream=False, exclude_input=False, returns=frozenset())


def test_flags_come_from_bool_inputs_or_request_parameters():
    request = FakeRequest(
        parameters={"stream": True, "return_finish_reason": True},
        logprobs=flag("return_logprobs", True),
        input_tokens=flag("return_num_input_tokens", False),
    )
    spec = RequestSpec.parse(request)
    assert spec.stream and spec.exclude_input and spec.returns == {"finish_reason", "logprobs"}
    with pytest.raises(InvalidRequestError, match="request parameter stream must be a boolean, got 'true'"):
        RequestSpec.parse(FakeRequest(parameters={"stream": "true"}))
    with pytest.raises(InvalidRequestError, match="stream must hold exactly one boolean, got 2"):
        RequestSpec.parse(FakeRequest(stream=FakeTensor("stream", [True, False], np.bool_)))


def test_streaming_must_exclude_the_prompt():
    request = FakeRequest(stream=flag("stream", True), exclude=flag("exclude_input_in_output", False))
    with pytest.raises(InvalidRequestError, match="stream=true requires exclude_input_in_output=true"):
        RequestSpec.parse(request)


def test_sampling_comes_from_parameters_unless_a_sampling_parameters_input_is_given():
    parameters = {
        "temperature": "0.5",
        "ignore_eos": "on",
        "triton_enable_empty_final_response": True,
        "priority": 1,
        "stream": False,
    }
    assert RequestSpec.parse(FakeRequest(parameters=parameters)).sampling == {"temperature": 0.5, "ignore_eos": True}
    request = FakeRequest(parameters=parameters, sampling=sampling_tensor({"max_tokens": "4"}))
    assert RequestSpec.parse(request).sampling == {"max_tokens": 4}


def test_scalar_inputs_take_precedence_over_sampling_parameters():
    request = FakeRequest(
        sampling=sampling_tensor({"max_tokens": 99, "top_p": 0.5}),
        max_tokens=FakeTensor("max_tokens", [7], np.int32),
        temperature=FakeTensor("temperature", [0.25], np.float32),
        stop=FakeTensor("stop_words", [b"\n", "é".encode()]),
    )
    assert RequestSpec.parse(request).sampling == {
        "max_tokens": 7,
        "top_p": 0.5,
        "temperature": 0.25,
        "stop": ["\n", "é"],
    }
    with pytest.raises(InvalidRequestError, match="max_tokens must hold exactly one value, got 2"):
        RequestSpec.parse(FakeRequest(max_tokens=FakeTensor("max_tokens", [1, 2], np.int32)))


@pytest.mark.parametrize(
    "request_, message",
    [
        (FakeRequest(None), "missing input text_input"),
        (FakeRequest(b"\xff"), "text_input is not valid UTF-8 (invalid start byte at byte 0)"),
        (
            FakeRequest(None, text=FakeTensor("text_input", [b"a", b"b"])),
            "text_input must hold exactly one string, got 2",
        ),
        (FakeRequest(sampling=FakeTensor("sampling_parameters", [b"{"])), "sampling_parameters is not valid JSON"),
        (FakeRequest(sampling=sampling_tensor([1])), "sampling_parameters must be a JSON object, got list"),
        (FakeRequest(sampling=FakeTensor("sampling_parameters", [b"[" * 100_000])), "nests too deeply"),
        (
            FakeRequest(sampling=sampling_tensor({"top_k": "three"})),
            "sampling parameter top_k='three' is not a valid int",
        ),
    ],
)
def test_malformed_requests_name_what_is_wrong(request_, message):
    with pytest.raises(InvalidRequestError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RequestSpec.parse(request_)


# Responses -------------------------------------------------------------------------------------------------------


def decode(token_ids: list[int]) -> str:
    return f"<{token_ids[0]}>"


def test_a_stream_sends_every_delta_with_the_outputs_asked_for():
    spec = RequestSpec("p", {}, True, True, frozenset({"finish_reason", "num_output_tokens", "cumulative_logprob"}))
    writer = ResponseWriter(spec, decode)
    first = writer.add(output("Hel", [1, 2]))
    assert list(first) == ["text_output", "finish_reason", "cumulative_logprob", "num_output_tokens"]
    assert first["text_output"].tolist() == [b"Hel"] and first["finish_reason"].tolist() == [b""]
    assert first["num_output_tokens"].dtype == np.uint32 and first["num_output_tokens"].tolist() == [2]
    assert first["cumulative_logprob"].dtype == np.float32
    last = writer.add(output("lo", [3], finished=True, num_output_tokens=3))
    assert last["text_output"].tolist() == [b"lo"] and last["finish_reason"].tolist() == [b"length"]
    assert last["num_output_tokens"].tolist() == [1]


def test_a_whole_answer_is_sent_once_with_the_prompt_and_all_logprobs():
    spec = RequestSpec("Say: ", {}, False, False, frozenset({"logprobs", "num_input_tokens", "num_output_tokens"}))
    writer = ResponseWriter(spec, decode)
    assert writer.add(output("a", [1], logprobs=[{1: -0.5, 4: -1.0}])) is None
    answer = writer.add(output("b", [2], finished=True, num_output_tokens=2, logprobs=[{2: -0.25}]))
    assert answer["text_output"].tolist() == [b"Say: ab"]
    assert answer["num_input_tokens"].tolist() == [3] and answer["num_output_tokens"].tolist() == [2]
    assert json.loads(answer["logprobs"][0]) == [
        {"1": {"logprob": -0.5, "decoded_token": "<1>"}, "4": {"logprob": -1.0, "decoded_token": "<4>"}},
        {"2": {"logprob": -0.25, "decoded_token": "<2>"}},
    ]


def test_logprobs_asked_for_but_not_produced_are_null():
    writer = ResponseWriter(RequestSpec("p", {}, True, True, frozenset({"logprobs"})), decode)
    assert writer.add(output("x", [1]))["logprobs"].tolist() == [b"null"]


@pytest.mark.parametrize(
    "error, reason, code",
    [
        (QueueFullError("full"), "queue_full", ErrorCode.UNAVAILABLE),
        (EngineDeadError("dead"), "engine_dead", ErrorCode.UNAVAILABLE),
        (InvalidRequestError("bad"), "invalid_request", ErrorCode.INVALID_ARG),
        (KernelError("broken"), "rejected", ErrorCode.INTERNAL),
    ],
)
def test_rejections_have_a_metric_reason_and_an_error_code(error, reason, code):
    assert rejection(error) == (reason, code)


class FakeSender:
    def __init__(self, fail: bool = False) -> None:
        self.fail, self.sent = fail, []

    def send(self, response: object, flags: int) -> None:
        if self.fail:
            raise RuntimeError("the client is gone")
        self.sent.append((response, flags))

    def is_cancelled(self) -> bool:
        if self.fail:
            raise RuntimeError("the server is stopping")
        return True


def test_a_sender_that_fails_is_reported_not_raised():
    sender = FakeSender()
    assert send_quietly(sender, "response", 1) and sender.sent == [("response", 1)]
    assert is_cancelled(sender)
    assert not send_quietly(FakeSender(fail=True), "response", 1)
    assert not is_cancelled(FakeSender(fail=True))


# Metrics ---------------------------------------------------------------------------------------------------------


class FakeMetric:
    def __init__(self, labels: dict, buckets: list | None) -> None:
        self.labels, self.buckets, self.observed, self.value = labels, buckets, [], 0

    def observe(self, value: float) -> None:
        self.observed.append(value)

    def increment(self, n: int) -> None:
        self.value += n

    def set(self, value: float) -> None:
        self.value = value


class FakeMetricFamily:
    """pb_utils.MetricFamily's interface; every metric it makes is kept by (name, labels)."""

    HISTOGRAM, COUNTER, GAUGE = "histogram", "counter", "gauge"
    metrics: dict[tuple[str, tuple], FakeMetric]

    def __init__(self, name: str, description: str, kind: str) -> None:
        self.name, self.description, self.kind = name, description, kind

    def Metric(self, labels: dict, buckets: list | None = None) -> FakeMetric:  # noqa: N802 (pb_utils' name)
        metric = FakeMetric(labels, buckets)
        self.metrics[(self.name, tuple(sorted(labels.items())))] = metric
        return metric


@pytest.fixture
def metrics() -> tuple[NeoMetrics, dict]:
    FakeMetricFamily.metrics = {}
    return NeoMetrics({"model": "neo", "version": "1"}, FakeMetricFamily), FakeMetricFamily.metrics


def metric(made: dict, name: str, **labels: str) -> FakeMetric:
    return made[(name, tuple(sorted({"model": "neo", "version": "1", **labels}.items())))]


def test_latencies_reach_the_histograms_only_when_flushed(metrics):
    neo, made = metrics
    neo.record(
        RequestMetrics(
            arrival_time=10.0, first_scheduled_time=10.5, first_token_time=11.0, finish_time=14.0, num_output_tokens=4
        )
    )
    neo.record(RequestMetrics(10.0, None, None, None, 0))
    assert metric(made, "neo_e2e_request_latency_seconds").observed == []
    neo.flush()
    assert metric(made, "neo_e2e_request_latency_seconds").observed == [4.0]
    assert metric(made, "neo_request_queue_time_seconds").observed == [0.5]
    assert metric(made, "neo_time_to_first_token_seconds").observed == [1.0]
    assert metric(made, "neo_time_per_output_token_seconds").observed == [1.0]
    assert metric(made, "neo_time_per_output_token_seconds").buckets[0] == 0.005


def test_engine_counters_advance_by_their_deltas_and_gauges_follow_the_snapshot(metrics):
    neo, made = metrics
    neo.refresh({"prompt_tokens": 10, "swap_in_blocks": 2, "requests_waiting": 3, "cpu_blocks_total": 64})
    neo.refresh({"prompt_tokens": 25, "swap_in_blocks": 2, "requests_waiting": 1, "cpu_blocks_total": 64})
    assert metric(made, "neo_prompt_tokens_total").value == 25
    assert metric(made, "neo_swapped_blocks_total", direction="in").value == 2
    assert metric(made, "neo_swapped_blocks_total", direction="out").value == 0
    assert metric(made, "neo_requests", state="waiting").value == 1
    assert metric(made, "neo_kv_blocks_total", pool="cpu").value == 64


def test_failures_are_counted_by_reason_from_rejections_and_the_engine(metrics):
    neo, made = metrics
    neo.count_failure("queue_full")
    neo.count_failure("queue_full")
    neo.flush()
    neo.refresh({"failures": {"error": 1}})
    neo.refresh({"failures": {"error": 3}})
    assert metric(made, "neo_request_failures_total", reason="queue_full").value == 2
    assert metric(made, "neo_request_failures_total", reason="error").value == 3


def test_sigterm_watcher_calls_back_on_its_thread_and_ends_when_stopped():
    previous = signal.getsignal(signal.SIGTERM)
    called = threading.Event()
    on_threads = []

    def on_sigterm() -> None:
        on_threads.append(threading.current_thread().name)
        called.set()

    watcher = SigtermWatcher(on_sigterm)
    try:
        assert watcher.start()
        os.kill(os.getpid(), signal.SIGTERM)
        assert called.wait(10), "SIGTERM was not passed on"
        assert on_threads == ["neo-sigterm"]
    finally:
        watcher.stop()
        signal.signal(signal.SIGTERM, previous)
    watcher.thread.join(10)
    assert not watcher.thread.is_alive()


def test_close_deletes_every_metric_before_its_family():
    deleted = []

    class Tracked:
        def __init__(self, what: str) -> None:
            self.what = what

        def __del__(self) -> None:
            deleted.append(self.what)

        def increment(self, n: int) -> None:
            pass

    class Family(Tracked):
        HISTOGRAM, COUNTER, GAUGE = "histogram", "counter", "gauge"

        def __init__(self, name: str, description: str, kind: str) -> None:
            super().__init__("family")

        def Metric(self, labels: dict, buckets: list | None = None) -> Tracked:  # noqa: N802 (pb_utils' name)
            return Tracked("metric")

    neo = NeoMetrics({"model": "neo", "version": "1"}, Family)
    neo.count_failure("invalid_request")
    neo.flush()
    made = deleted.copy()
    neo.close()
    assert made == [] and deleted, "close deleted nothing"
    assert set(deleted) == {"metric", "family"} and deleted.index("family") > max(
        i for i, what in enumerate(deleted) if what == "metric"
    ), deleted


def test_the_stub_environment_of_this_venv_passes():
    check_stub_environment(find_tritonserver())


def test_an_interpreter_without_neo_backend_is_refused_before_the_server_starts(tmp_path, monkeypatch):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    monkeypatch.setattr(sys, "executable", str(venv / "bin" / "python"))
    with pytest.raises(ServerSetupError, match="neo_backend is not installed for .*make install"):
        check_stub_environment(TritonInstall(Path("/opt/tritonserver/bin/tritonserver")))


class _Answers200(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_ready_waits_for_the_metrics_page_which_tritonserver_starts_after_http():
    """Triton reports ready on HTTP a moment before its metrics service listens; a caller told "ready" scrapes
    the metrics page at once, so readiness must include it."""
    with contextlib.ExitStack() as stack:
        http, metrics = (stack.enter_context(ThreadingHTTPServer(("127.0.0.1", 0), _Answers200)) for _ in range(2))
        for served in (http, metrics):
            threading.Thread(target=served.serve_forever, daemon=True).start()
            stack.callback(served.shutdown)
        http_port, metrics_port = http.server_address[1], metrics.server_address[1]
        (unused_port,) = free_ports(1)
        assert is_ready(ServerAddress("127.0.0.1", http_port, unused_port, metrics_port), timeout=5)
        assert not is_ready(ServerAddress("127.0.0.1", http_port, metrics_port, unused_port), timeout=5)
