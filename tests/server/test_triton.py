"""The `neo` model served by a real tritonserver (the one bundled in nvidia-pytriton), driven through real gRPC
and HTTP clients: streaming, concurrency, the HTTP generate extension, cancellation, metrics, bad requests,
start-up failures and SIGTERM."""

from __future__ import annotations

import json
import queue
import shutil
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from server_utils import kv_blocks_used, requests_in_engine, wait_for_metrics
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from loadtest.metrics import metric_value, scrape_metrics
from loadtest.server import RunningServer, ServerStartError, triton_server
from neo_backend import ConfigError, EngineConfig, LLMEngine
from neo_backend.triton.server import (
    DEFAULT_MODEL_REPOSITORY,
    MODEL_NAME,
    ServerAddress,
    free_ports,
    knob_overrides,
    read_parameters,
)

# Small pools and a short max_model_len keep start-up quick and make "prompt too long" cheap to hit.
KNOBS = {"num_gpu_blocks": 256, "max_model_len": 256, "cpu_kv_cache_gb": 0.05, "max_num_seqs": 32}
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
MAX_TOKENS = 8
GREEDY = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
LONG = {"temperature": 0, "max_tokens": 200, "ignore_eos": True}  # far longer than any test waits for
TIMEOUT_S = 120.0


# Clients ---------------------------------------------------------------------------------------------------------


def tensor(name: str, values: list, dtype: Any) -> grpcclient.InferInput:
    array = np.array(values, dtype=dtype)
    infer_input = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
    infer_input.set_data_from_numpy(array)
    return infer_input


def request_inputs(
    prompt: str | bytes, sampling: dict | None = None, stream: bool = True, **flags: bool
) -> list[grpcclient.InferInput]:
    text = prompt.encode() if isinstance(prompt, str) else prompt
    inputs = [tensor("text_input", [text], np.object_), tensor("stream", [stream], np.bool_)]
    if sampling is not None:
        inputs.append(tensor("sampling_parameters", [json.dumps(sampling).encode()], np.object_))
    inputs += [tensor(name, [value], np.bool_) for name, value in flags.items()]
    return inputs


@dataclass
class StreamResult:
    responses: list[grpcclient.InferResult] = field(default_factory=list)
    error: InferenceServerException | None = None

    @property
    def text(self) -> str:
        return "".join(
            b.decode()
            for r in self.responses
            if r.as_numpy("text_output") is not None
            for b in r.as_numpy("text_output")
        )

    def output(self, name: str) -> list:
        return [r.as_numpy(name).tolist() for r in self.responses if r.as_numpy(name) is not None]


class Stream:
    """One gRPC ModelStreamInfer call carrying one request; every wait has a timeout."""

    def __init__(self, server: RunningServer, timeout: float = TIMEOUT_S) -> None:
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self._queue: queue.Queue = queue.Queue()
        self.client.start_stream(
            callback=lambda result, error: self._queue.put((result, error)), stream_timeout=timeout
        )
        self.result = StreamResult()
        self.done = False

    def send(self, inputs: list[grpcclient.InferInput]) -> Stream:
        self.client.async_stream_infer(MODEL_NAME, inputs, enable_empty_final_response=True)
        return self

    def next(self, timeout: float = TIMEOUT_S) -> None:
        """Take one response (or the error that ends the request)."""
        result, error = self._queue.get(timeout=timeout)
        if error is not None:
            self.result.error, self.done = error, True
            return
        self.result.responses.append(result)
        final = result.get_response().parameters.get("triton_final_response")
        self.done = bool(final and final.bool_param)

    def collect(self, timeout: float = TIMEOUT_S) -> StreamResult:
        deadline = time.monotonic() + timeout
        while not self.done:
            self.next(max(0.1, deadline - time.monotonic()))
        return self.result

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def run_stream(server: RunningServer, inputs: list[grpcclient.InferInput], timeout: float = TIMEOUT_S) -> StreamResult:
    stream = Stream(server, timeout)
    try:
        return stream.send(inputs).collect(timeout)
    finally:
        stream.close()


def http_post(server: RunningServer, path: str, body: dict) -> str:
    request = urllib.request.Request(
        f"http://{server.http_url}/v2/models/{MODEL_NAME}/{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
        return response.read().decode()


# Fixtures --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server_and_reference() -> tuple[RunningServer, dict[str, str]]:
    """The module's server, plus the greedy text of each prompt from an in-process engine with the same knobs
    (built while the server starts)."""
    with triton_server(KNOBS, wait=False) as server:
        engine = LLMEngine(EngineConfig(**KNOBS))
        reference = {p: out.text for p, out in zip(PROMPTS, engine.generate(PROMPTS, GREEDY))}
        del engine
        server.wait_ready()
        yield server, reference


@pytest.fixture
def server(server_and_reference) -> RunningServer:
    return server_and_reference[0]


@pytest.fixture
def reference(server_and_reference) -> dict[str, str]:
    return server_and_reference[1]


# Configuration ---------------------------------------------------------------------------------------------------


def test_config_pbtxt_declares_every_knob_with_its_default():
    parameters = read_parameters(DEFAULT_MODEL_REPOSITORY / MODEL_NAME / "config.pbtxt")
    assert sorted(parameters) == sorted(EngineConfig.field_names())
    assert EngineConfig.from_strings(parameters) == EngineConfig()


def test_environment_overrides_knobs_and_ports_validated_before_start():
    assert knob_overrides(
        environ={
            "NEO_NUM_GPU_BLOCKS": "256",
            "NEO_OFFLOAD_POLICY": "never",
            "NEO_HOST": "0.0.0.0",
            "NEO_GRPC_PORT": "9001",
        }
    ) == {"num_gpu_blocks": "256", "offload_policy": "never"}
    assert ServerAddress.from_env({"NEO_HOST": "0.0.0.0", "NEO_GRPC_PORT": "9001"}) == ServerAddress(
        "0.0.0.0", 8000, 9001, 8002
    )
    with pytest.raises(ConfigError, match="environment variable block_size='x' is not a valid int"):
        knob_overrides(environ={"NEO_BLOCK_SIZE": "x"})
    with pytest.raises(ConfigError, match="NEO_HTTP_PORT='http' is not a port number"):
        ServerAddress.from_env({"NEO_HTTP_PORT": "http"})


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("bogus_knob", "1", "unknown config.pbtxt parameter 'bogus_knob'"),
        ("block_size", "sixteen", "config.pbtxt parameter block_size='sixteen' is not a valid int"),
    ],
)
def test_bad_parameter_fails_the_model_load_naming_it(tmp_path, key, value, message):
    repository = tmp_path / "repository"
    shutil.copytree(DEFAULT_MODEL_REPOSITORY, repository)
    config = repository / MODEL_NAME / "config.pbtxt"
    config.write_text(config.read_text() + f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n')
    with triton_server(repository=repository, wait=False) as server:
        with pytest.raises(ServerStartError, match="exited"):
            server.wait_ready(timeout=TIMEOUT_S)
        assert message in server.log()


# Generation ------------------------------------------------------------------------------------------------------


def test_grpc_stream_deltas_concatenate_to_the_engine_greedy_text(server, reference):
    result = run_stream(
        server,
        request_inputs(
            PROMPTS[0], GREEDY, return_finish_reason=True, return_num_output_tokens=True, return_num_input_tokens=True
        ),
    )
    assert result.error is None
    assert len(result.responses) >= 2, "streaming must deliver more than one response"
    assert result.text == reference[PROMPTS[0]]
    assert sum(n for [n] in result.output("num_output_tokens")) == MAX_TOKENS
    assert result.output("finish_reason")[-1] == [b"length"]
    assert result.output("num_input_tokens")[-1][0] > 0


def test_sixteen_concurrent_streams_complete(server, reference):
    prompts = [PROMPTS[i % 2] for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda p: run_stream(server, request_inputs(p, GREEDY)), prompts))
    assert [r.error for r in results] == [None] * 16
    assert [r.text for r in results] == [reference[p] for p in prompts]


def test_non_streaming_request_gets_one_response_with_the_prompt_prepended(server, reference):
    result = run_stream(server, request_inputs(PROMPTS[1], GREEDY, stream=False))
    assert result.error is None and len(result.responses) == 1
    assert result.text == PROMPTS[1] + reference[PROMPTS[1]]


def test_trtllm_style_scalar_inputs(server, reference):
    inputs = request_inputs(PROMPTS[0], None) + [
        tensor("max_tokens", [MAX_TOKENS], np.int32),
        tensor("temperature", [0.0], np.float32),
        tensor("seed", [7], np.uint64),
    ]
    inputs.append(tensor("sampling_parameters", [json.dumps({"ignore_eos": "true"}).encode()], np.object_))
    assert run_stream(server, inputs).text == reference[PROMPTS[0]]


def test_http_generate_and_generate_stream_return_the_same_text(server, reference):
    prompt = PROMPTS[1]
    whole = json.loads(http_post(server, "generate", {"text_input": prompt, "parameters": GREEDY}))
    assert whole["text_output"] == prompt + reference[prompt]
    events = http_post(
        server,
        "generate_stream",
        {
            "text_input": prompt,
            "stream": True,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "parameters": {"ignore_eos": True},
        },
    )
    chunks = [json.loads(line[len("data:") :]) for line in events.splitlines() if line.startswith("data:")]
    assert len(chunks) >= 2
    assert "".join(c["text_output"] for c in chunks) == reference[prompt]


# Cancellation and metrics ----------------------------------------------------------------------------------------


def test_cancelled_stream_is_aborted_frees_its_blocks_and_the_next_request_works(server, reference):
    # The gauges are set one by one, so a scrape can see a request gone before its blocks: wait for both.
    wait_for_metrics(server, lambda s: requests_in_engine(s) == 0 and kv_blocks_used(s) == 0, "an idle engine")
    stream = Stream(server).send(request_inputs(PROMPTS[0], LONG))
    for _ in range(3):
        stream.next()
    assert stream.result.error is None and not stream.done
    wait_for_metrics(
        server, lambda s: requests_in_engine(s) == 1 and kv_blocks_used(s) > 0, "one request in the engine, with blocks"
    )
    aborts_before = server.log().count("cancelled by its client")
    stream.close(cancel=True)
    wait_for_metrics(
        server,
        lambda s: requests_in_engine(s) == 0 and kv_blocks_used(s) == 0,
        "blocks freed after the cancel",
    )
    # Freed by the model's abort, not by the request running to its end.
    assert server.log().count("cancelled by its client") == aborts_before + 1, server.log_tail()
    assert run_stream(server, request_inputs(PROMPTS[0], GREEDY)).text == reference[PROMPTS[0]]


def test_metrics_move_as_requests_run_and_drain_to_zero(server):
    before = scrape_metrics(server.metrics_url)
    result = run_stream(server, request_inputs(PROMPTS[1], GREEDY))
    assert result.error is None
    after = wait_for_metrics(
        server,
        lambda s: (
            requests_in_engine(s) == 0
            and metric_value(s, "neo_generation_tokens_total")
            >= metric_value(before, "neo_generation_tokens_total") + MAX_TOKENS
        ),
        "token counters updated, no request left",
    )

    def grew(name: str) -> float:
        return metric_value(after, name) - metric_value(before, name)

    assert grew("neo_prompt_tokens_total") > 0
    for histogram in (
        "neo_time_to_first_token_seconds",
        "neo_time_per_output_token_seconds",
        "neo_e2e_request_latency_seconds",
        "neo_request_queue_time_seconds",
    ):
        assert grew(histogram + "_count") >= 1, histogram
        assert grew(histogram + "_sum") > 0 or histogram == "neo_request_queue_time_seconds", histogram
    assert metric_value(after, "neo_kv_blocks_total", pool="gpu") == KNOBS["num_gpu_blocks"]
    names = {name for name, _, _ in after}
    for name in ("neo_swapped_blocks_total", "neo_preemptions_total", "neo_kv_blocks_used"):
        assert name in names
    assert {labels["state"] for name, labels, _ in after if name == "neo_requests"} == {
        "waiting",
        "gpu_decode",
        "cpu_decode",
    }


# Bad requests ----------------------------------------------------------------------------------------------------

BAD_REQUESTS = {
    "missing text_input": ([tensor("stream", [True], np.bool_)], "text_input"),
    "wrong dtype": ([tensor("text_input", [1], np.int32)], "text_input"),
    "invalid JSON": (
        [tensor("text_input", [b"hi"], np.object_), tensor("sampling_parameters", [b"{not json"], np.object_)],
        "sampling_parameters is not valid JSON",
    ),
    "JSON nested 5000 deep": (
        [
            tensor("text_input", [b"hi"], np.object_),
            tensor("sampling_parameters", [b"[" * 5000 + b"]" * 5000], np.object_),
        ],
        "sampling_parameters nests too deeply to be read",
    ),
    "unknown sampling key": (
        request_inputs("hi", {"max_tokens": 4, "bogus": 1}),
        "unknown sampling parameter(s): bogus",
    ),
    "max_tokens 0": (request_inputs("hi", {"max_tokens": 0}), "max_tokens must be >= 1"),
    "max_tokens 1e9": (request_inputs("hi", {"max_tokens": 10**9}), "max_tokens 1000000000 exceeds"),
    "prompt over max_model_len": (request_inputs("hello " * 400, {"max_tokens": 4}), "max_model_len"),
    "stream without exclude_input_in_output": (
        request_inputs("hi", {"max_tokens": 4}, exclude_input_in_output=False),
        "exclude_input_in_output",
    ),
    "non-UTF-8 bytes": (request_inputs(b"caf\xe9 \xff", {"max_tokens": 4}), "text_input is not valid UTF-8"),
}


def test_bad_requests_get_errors_naming_the_problem_while_a_good_stream_runs(server, reference):
    good = Stream(server).send(request_inputs(PROMPTS[0], GREEDY))
    good.next()  # the good request is running before the bad ones arrive
    errors = {}
    for case, (inputs, _) in BAD_REQUESTS.items():
        result = run_stream(server, inputs)
        errors[case] = str(result.error) if result.error else f"no error; text {result.text!r}"
    try:
        good_result = good.collect()
    finally:
        good.close()
    assert good_result.error is None and good_result.text == reference[PROMPTS[0]]
    for case, (_, expected) in BAD_REQUESTS.items():
        assert expected in errors[case], f"{case}: {errors[case]}"
    failures = scrape_metrics(server.metrics_url)
    assert metric_value(failures, "neo_request_failures_total", reason="invalid_request") >= 7


# Shutdown --------------------------------------------------------------------------------------------------------


def test_sigterm_ends_in_flight_streams_with_an_error():
    with triton_server(KNOBS) as server:
        streams = [Stream(server).send(request_inputs(p, LONG)) for p in PROMPTS]
        for stream in streams:
            stream.next()
        started = time.monotonic()
        server.terminate()
        try:
            results = [stream.collect(timeout=30) for stream in streams]
        finally:
            for stream in streams:
                stream.close()
        assert all("shutting down" in str(r.error) for r in results), [(r.error, r.text) for r in results]
        assert server.process.wait(30) == 0, server.log_tail()
        assert time.monotonic() - started < 30


def test_serve_says_how_to_reach_it_and_stops_cleanly_on_sigterm(tmp_path):
    """`make serve`'s command: once the stack is ready its log ends with every endpoint and a command to try, which
    answers; SIGTERM to its process group stops tritonserver, the stub and the gateway within 15 s, cleanly."""
    import os
    import shlex
    import signal
    import subprocess
    import sys

    http, grpc, metrics, openai = free_ports(4)
    env = {
        **os.environ,
        "NEO_HTTP_PORT": str(http),
        "NEO_GRPC_PORT": str(grpc),
        "NEO_METRICS_PORT": str(metrics),
        "NEO_OPENAI_PORT": str(openai),
        "NEO_NUM_GPU_BLOCKS": "256",
        "NEO_CPU_KV_CACHE_GB": "0.05",
    }
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "neo_backend", "serve"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 300
        while "  or:   curl" not in log_path.read_text() and time.monotonic() < deadline:
            assert process.poll() is None, log_path.read_text()[-4000:]
            time.sleep(0.5)
        with urllib.request.urlopen(f"http://127.0.0.1:{openai}/health", timeout=10) as response:
            assert response.status == 200  # the banner waits for the gateway as well as for Triton
        time.sleep(2)
        tail = log_path.read_text().splitlines()[-7:]
        assert tail[0].endswith("ready: model 'neo'"), tail
        for needle in (
            f"127.0.0.1:{grpc}",
            f"http://127.0.0.1:{http}/v2/models/neo/generate",
            f"http://127.0.0.1:{metrics}/metrics",
            f"http://127.0.0.1:{openai}/v1",
        ):
            assert any(needle in line for line in tail), (needle, tail)
        command = shlex.split(next(line for line in tail if "try:" in line).split("try:", 1)[1])
        answer = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert answer.returncode == 0 and answer.stdout.strip(), answer
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        started = time.monotonic()
        code = process.wait(30)
    output = log_path.read_text()
    assert time.monotonic() - started < 15, output[-3000:]
    assert code == 0 and "terminate called" not in output, output[-3000:]
