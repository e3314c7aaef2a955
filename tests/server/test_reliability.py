"""Reliability and security of the served model under load, cancellation storms, overload and hostile input, on a
real tritonserver over real gRPC: a short soak (loadtest.soak), a storm of cancelled and dropped streams,
admission control under a burst, property-based fuzzing of the request tensors, and the security properties
(loopback binding, no request-chosen files/models/paths, no eval/pickle of request data)."""

from __future__ import annotations

import ast
import ipaddress
import json
import os
import queue
import random
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_utils import wait_idle
from tritonclient.utils import InferenceServerException

from client import NeoClient, ServerError
from client.protocol import raw_inputs
from loadtest.metrics import engine_gauges, metric_value, scrape_metrics
from loadtest.server import RunningServer, triton_server
from loadtest.soak import run_soak, server_pids
from neo_backend.triton.server import MODEL_NAME, ServerAddress, build_command, find_tritonserver

REPO = Path(__file__).resolve().parents[2]
# Small pools; every decode on the CPU pool (offload_policy=always) with a tiny host pool, so both pools see
# traffic; max_num_seqs below the storm's size, so requests also wait in the queue.
KNOBS = {
    "num_gpu_blocks": 512,
    "max_num_seqs": 64,
    "max_model_len": 512,
    "cpu_kv_cache_gb": 0.1,
    "offload_policy": "always",
}
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def server() -> RunningServer:
    with triton_server(KNOBS) as running:
        yield running


def assert_serves(server: RunningServer) -> None:
    with NeoClient(server.grpc_url, timeout=TIMEOUT_S) as client:
        result = client.generate("The capital of France is", {"max_tokens": 6, "ignore_eos": True, "temperature": 0})
    assert result.finish_reason == "length" and result.num_output_tokens == 6


# 1. Soak ---------------------------------------------------------------------------------------------------------


@pytest.mark.slow  # `make soak` runs the same soak for longer
def test_short_soak_mixed_load_leaves_no_error_leak_or_memory_growth(server):
    report = run_soak(
        server.grpc_url,
        server.metrics_url,
        30,
        concurrency=6,
        seed=1,
        pids=server_pids(server.address.grpc_port),
        request_timeout=TIMEOUT_S,
    )
    print(report.summary())
    assert report.ok, report.summary()
    assert report.requests_sent >= 20 and all(report.sent[k] for k in ("stream", "cancel", "drop", "bad"))
    assert report.blocks_leaked == {"gpu": 0, "cpu": 0}
    assert len(report.memory_end.pids) >= 2, "the tritonserver and its python stub are both watched"


# 2. Cancellation storm -----------------------------------------------------------------------------------------


def storm_request(
    url: str, action: str, delay: float, max_tokens: int, prompt: str
) -> tuple[str, str | None, int, bool]:
    """One stream: run to the end ('complete'), cancel through stop_stream at `delay` s ('cancel'), or close the
    gRPC channel at `delay` s ('drop'). Returns (action, error, responses, whether it ended on its own)."""
    client = grpcclient.InferenceServerClient(url)
    responses: queue.Queue = queue.Queue()
    count, error, final = 0, None, False
    try:
        client.start_stream(callback=lambda result, error: responses.put((result, error)), stream_timeout=TIMEOUT_S)
        sampling = json.dumps({"max_tokens": max_tokens, "ignore_eos": True}).encode()
        client.async_stream_infer(MODEL_NAME, raw_inputs(prompt.encode(), sampling), enable_empty_final_response=True)
        stop_at = time.monotonic() + (delay if action != "complete" else TIMEOUT_S)
        while not final and time.monotonic() < stop_at:
            try:
                result, err = responses.get(timeout=max(0.01, stop_at - time.monotonic()))
            except queue.Empty:
                break
            if err is not None:
                return action, err.message(), count, True
            count += 1
            param = result.get_response().parameters.get("triton_final_response")
            final = bool(param and param.bool_param)
        if action == "complete" and not final:
            error = f"no final response within {TIMEOUT_S:g} s"
        if action == "drop" and not final:
            client._channel.close()
        return action, error, count, final
    finally:
        try:
            client.stop_stream(cancel_requests=not final)
        finally:
            client.close()


def test_cancellation_storm_leaves_no_stuck_request_or_leaked_block(server):
    rng = random.Random(7)
    n = 120
    plan = []
    for i in range(n):
        action = "complete" if i % 2 else rng.choice(["cancel", "drop"])
        plan.append(
            (
                action,
                rng.uniform(0.0, 2.0),
                rng.randint(4, 10),
                " ".join(rng.choice(["the", "of", "river", "a", "city", "old"]) for _ in range(rng.randint(3, 40))),
            )
        )
    rng.shuffle(plan)
    swapped_before = metric_value(scrape_metrics(server.metrics_url), "neo_swapped_blocks_total", direction="out")
    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(lambda p: storm_request(server.grpc_url, *p), plan))
    completed = [(r, p) for r, p in zip(results, plan) if r[0] == "complete"]
    assert [r[1] for r, _ in completed] == [None] * len(completed), "every stream that was let run completed"
    # 'complete' streams: one response per token plus the empty final one (a delta may carry several tokens).
    assert all(r[2] >= 2 for r, _ in completed)
    interrupted_errors = [r[1] for r in results if r[0] != "complete" and r[1] is not None]
    assert all("cancel" in e.lower() for e in interrupted_errors), interrupted_errors[:5]
    samples = wait_idle(server)
    assert metric_value(samples, "neo_swapped_blocks_total", direction="out") > swapped_before, (
        "the storm should exercise the CPU pool (offload_policy=always)"
    )
    print(
        f"storm: {n} streams, {len(completed)} completed, "
        f"{sum(r[0] == 'cancel' and not r[3] for r in results)} cancelled and "
        f"{sum(r[0] == 'drop' and not r[3] for r in results)} dropped before their end; "
        f"after the drain: {engine_gauges(samples)}"
    )
    assert_serves(server)


# 3. Admission control ------------------------------------------------------------------------------------------


def test_burst_beyond_max_queue_size_is_refused_at_once_and_the_server_keeps_serving():
    knobs = {
        "max_queue_size": 4,
        "max_num_seqs": 2,
        "num_gpu_blocks": 128,
        "max_model_len": 256,
        "cpu_kv_cache_gb": 0.05,
        "offload_policy": "never",
    }
    burst = 24
    with triton_server(knobs) as small:

        def one(i: int) -> tuple[str, float, int]:
            started = time.monotonic()
            with NeoClient(small.grpc_url, timeout=TIMEOUT_S) as client:
                try:
                    result = client.generate(
                        f"Request {i}: tell me about the sea", {"max_tokens": 24, "ignore_eos": True}
                    )
                except ServerError as exc:
                    return str(exc), time.monotonic() - started, 0
            return "ok", time.monotonic() - started, result.num_output_tokens

        with ThreadPoolExecutor(burst) as pool:
            outcomes = list(pool.map(one, range(burst)))
        refused = [o for o in outcomes if o[0] != "ok"]
        served = [o for o in outcomes if o[0] == "ok"]
        assert refused and served, outcomes
        assert all("max_queue_size=4" in o[0] for o in refused), refused[:3]
        assert all(o[2] == 24 for o in served)
        # Refusals are immediate: far quicker than the served requests' whole generation.
        assert max(o[1] for o in refused) < 10.0, refused
        samples = wait_idle(small)
        assert metric_value(samples, "neo_request_failures_total", reason="queue_full") == len(refused)
        assert_serves(small)
        print(
            f"admission: burst {burst}, served {len(served)}, refused {len(refused)} "
            f"(slowest refusal {max(o[1] for o in refused):.2f} s, slowest served {max(o[1] for o in served):.2f} s)"
        )


# 4. Fuzzing ----------------------------------------------------------------------------------------------------

SAMPLING_KEYS = [
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
]
NUMBERS = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, -1, 1, 2**31, -(2**31), 2**63, 2**64]),
    st.floats(allow_nan=True, allow_infinity=True),
)
JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), NUMBERS, st.text(max_size=20)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=10,
)
SAMPLING_JSON = st.one_of(
    st.dictionaries(st.sampled_from(SAMPLING_KEYS), JSON_VALUES, max_size=4),
    st.dictionaries(st.sampled_from(SAMPLING_KEYS) | st.text(max_size=12), JSON_VALUES, max_size=3),
    JSON_VALUES,
).map(lambda v: json.dumps(v, allow_nan=True).encode())
SAMPLING_BYTES = st.one_of(SAMPLING_JSON, st.binary(max_size=64), st.text(max_size=40).map(str.encode))
PROMPTS = st.one_of(
    st.text(max_size=60).map(str.encode),
    st.binary(max_size=60),
    st.sampled_from([b"", b"\x00", "\u202e\U0001f600 \ud7ff".encode(), b"x" * 5000]),
)
SHAPES = st.sampled_from([[1], [1], [1], [0], [2], [1, 1]])


def bytes_tensor(name: str, values: list[bytes], shape: list[int]) -> grpcclient.InferInput:
    size = int(np.prod(shape))
    array = np.array((values * size)[:size] if values else [b""] * size, dtype=np.object_).reshape(shape)
    tensor = grpcclient.InferInput(name, shape, "BYTES")
    tensor.set_data_from_numpy(array)
    return tensor


def numeric_tensor(name: str, value: Any, dtype: Any, datatype: str, shape: list[int]) -> grpcclient.InferInput:
    array = np.full(shape, value, dtype=dtype)
    tensor = grpcclient.InferInput(name, shape, datatype)
    tensor.set_data_from_numpy(array)
    return tensor


NUMERIC_TYPES = [
    (np.int32, "INT32", st.integers(-(2**31), 2**31 - 1)),
    (np.int64, "INT64", st.integers(-(2**63), 2**63 - 1)),
    (np.uint64, "UINT64", st.integers(0, 2**64 - 1)),
    (np.float32, "FP32", st.floats(width=32, allow_nan=True, allow_infinity=True)),
    (np.bool_, "BOOL", st.booleans()),
]


@st.composite
def numeric_input(draw, name: str) -> grpcclient.InferInput:
    dtype, datatype, values = draw(st.sampled_from(NUMERIC_TYPES))
    return numeric_tensor(name, draw(values), dtype, datatype, draw(SHAPES))


EDGE_FLOATS = st.one_of(st.floats(-2, 5), st.sampled_from([0.0, -0.0, 1e-45, 1e308, float("nan"), float("inf")]))
NEAR_VALID_SAMPLING = st.fixed_dictionaries(
    {},
    optional={
        "max_tokens": st.integers(-3, 24) | st.sampled_from([2**31, 2**63, -(2**63)]),
        "min_tokens": st.integers(-3, 30),
        "temperature": EDGE_FLOATS,
        "top_p": EDGE_FLOATS,
        "top_k": st.integers(-3, 100000),
        "seed": st.integers(-(2**64), 2**64),
        "ignore_eos": st.booleans(),
        "stop": st.lists(st.text(max_size=12), max_size=5) | st.text(max_size=12),
        "stop_token_ids": st.lists(st.integers(-5, 2**40), max_size=4),
        "repetition_penalty": EDGE_FLOATS,
        "presence_penalty": EDGE_FLOATS,
        "frequency_penalty": EDGE_FLOATS,
        "logprobs": st.integers(-2, 30),
    },
)


@st.composite
def near_valid_request(draw) -> list[grpcclient.InferInput]:
    """A well-formed request whose values are fuzzed: reaches sampling and generation, not only validation."""
    sampling = json.dumps(draw(NEAR_VALID_SAMPLING), allow_nan=True).encode()
    prompt = draw(st.text(min_size=1, max_size=80)).encode("utf-8", "surrogatepass")
    return raw_inputs(prompt, sampling, stream=draw(st.booleans()))


@st.composite
def fuzz_request(draw) -> tuple[str, list[grpcclient.InferInput]]:
    """("near-valid", inputs) or ("malformed", inputs): tensors of any name, shape and type."""
    if draw(st.booleans()):
        return "near-valid", draw(near_valid_request())
    inputs = []
    prompt = draw(st.sampled_from(["bytes", "bytes", "bytes", "numeric", "missing"]))
    if prompt == "bytes":
        inputs.append(bytes_tensor("text_input", [draw(PROMPTS)], draw(SHAPES)))
    elif prompt == "numeric":
        inputs.append(draw(numeric_input("text_input")))
    if draw(st.booleans()):
        inputs.append(bytes_tensor("sampling_parameters", [draw(SAMPLING_BYTES)], draw(SHAPES)))
    for name in draw(
        st.lists(
            st.sampled_from(
                [
                    "stream",
                    "exclude_input_in_output",
                    "return_finish_reason",
                    "return_logprobs",
                    "max_tokens",
                    "temperature",
                    "top_k",
                    "seed",
                    "min_tokens",
                ]
            ),
            max_size=3,
            unique=True,
        )
    ):
        inputs.append(draw(numeric_input(name)))
    if draw(st.integers(0, 5)) == 0:
        inputs.append(
            bytes_tensor("stop_words", [draw(st.text(max_size=300).map(str.encode))], [draw(st.integers(0, 40))])
        )
    return "malformed", inputs


def fuzz_call(url: str, inputs: list[grpcclient.InferInput]) -> str:
    """Send one request; 'error: ...' or 'response' (the first response suffices: the request is then cancelled)."""
    client = grpcclient.InferenceServerClient(url)
    responses: queue.Queue = queue.Queue()
    got_final = False
    try:
        client.start_stream(callback=lambda result, error: responses.put((result, error)), stream_timeout=TIMEOUT_S)
        try:
            client.async_stream_infer(MODEL_NAME, inputs, enable_empty_final_response=True)
        except InferenceServerException as exc:  # refused by the client library (e.g. a dtype it cannot send)
            return f"error: {exc.message()}"
        result, error = responses.get(timeout=TIMEOUT_S)  # queue.Empty here means the server never answered
        if error is not None:
            return f"error: {error.message()}"
        param = result.get_response().parameters.get("triton_final_response")
        got_final = bool(param and param.bool_param)
        return "response"
    finally:
        try:
            client.stop_stream(cancel_requests=not got_final)
        finally:
            client.close()


def test_fuzzed_requests_get_a_response_or_a_clear_error(server):
    """Every fuzzed request is answered or refused with a message, none kills the server; and the fuzzing reached
    both ends: near-valid requests got as far as generation, and malformed ones were refused."""
    outcomes: Counter = Counter()

    @settings(
        max_examples=60,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(case=fuzz_request())
    def one_request(case: tuple[str, list[grpcclient.InferInput]]) -> None:
        kind, inputs = case
        outcome = fuzz_call(server.grpc_url, inputs)
        if outcome.startswith("error"):
            message = outcome[len("error: ") :]
            assert message.strip(), "an error must say something"
            assert "internal error" not in message.lower(), message
        tensors = [(i.name(), i.shape(), i.datatype()) for i in inputs]
        assert server.process.poll() is None, f"server died on {tensors}"
        outcomes[kind, outcome.split(":")[0]] += 1

    one_request()
    assert outcomes["near-valid", "response"] > 0, f"no fuzzed request reached generation: {outcomes}"
    assert outcomes["malformed", "error"] > 0, f"no malformed request was refused: {outcomes}"


def test_server_is_ready_and_drained_after_the_fuzzing(server):
    assert server.is_ready(timeout=5)
    wait_idle(server)
    assert_serves(server)


# 5. Security ---------------------------------------------------------------------------------------------------


def listening_addresses(pids: list[int]) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state owned by `pids`, from /proc."""
    inodes = set()
    for pid in pids:
        fd_dir = Path(f"/proc/{pid}/fd")
        for fd in fd_dir.iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    found = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:
                continue
            address_hex, port_hex = local.split(":")
            raw = bytes.fromhex(address_hex)
            if width == 8:
                address = ipaddress.IPv4Address(raw[::-1])
            else:  # four host-order (little-endian) 32-bit words
                address = ipaddress.IPv6Address(b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))
                address = address.ipv4_mapped or address  # ::ffff:127.0.0.1 is IPv4 loopback
            found.add((str(address), int(port_hex, 16)))
    return found


def test_servers_bind_to_loopback_by_default(server):
    assert ServerAddress.from_env({}).host == "127.0.0.1"
    command = build_command(find_tritonserver(), Path("/repo"), None, ServerAddress())
    for flag in ("--http-address=127.0.0.1", "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1"):
        assert flag in command
    assert not any("model-control-mode" in part for part in command), "models are loaded once, not by requests"
    listening = listening_addresses(server_pids(server.address.grpc_port))
    ports = {server.address.http_port, server.address.grpc_port, server.address.metrics_port}
    assert ports <= {port for _, port in listening}, listening
    # gRPC listens on ::ffff:127.0.0.1 (tcp6, IPv4-mapped); the python backend's stub channel is loopback too.
    assert all(ipaddress.ip_address(address).is_loopback for address, _ in listening), listening


@pytest.mark.parametrize(
    "key, value",
    [
        ("model", "/etc/passwd"),
        ("tokenizer", "/root/.ssh/id_rsa"),
        ("load_format", "pt"),
        ("download_dir", "/tmp/evil"),
        ("trust_remote_code", True),
        ("cache_dir", "/"),
        ("chat_template", "{{x}}"),
    ],
)
def test_requests_cannot_choose_files_models_or_paths(server, key, value):
    for via in ("sampling_parameters", "request parameters"):
        client = grpcclient.InferenceServerClient(server.grpc_url)
        responses: queue.Queue = queue.Queue()
        try:
            client.start_stream(callback=lambda result, error: responses.put((result, error)), stream_timeout=TIMEOUT_S)
            if via == "sampling_parameters":
                inputs = raw_inputs(b"hello", json.dumps({"max_tokens": 2, key: value}).encode())
                client.async_stream_infer(MODEL_NAME, inputs, enable_empty_final_response=True)
            else:
                client.async_stream_infer(
                    MODEL_NAME,
                    raw_inputs(b"hello", None),
                    enable_empty_final_response=True,
                    parameters={"max_tokens": 2, key: value},
                )
            _, error = responses.get(timeout=TIMEOUT_S)
        finally:
            client.stop_stream(cancel_requests=True)
            client.close()
        assert error is not None and f"unknown sampling parameter(s): {key}" in error.message(), (via, error)


def test_model_repository_cannot_be_changed_over_the_api(server):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        config = json.dumps({"backend": "python", "parameters": {"model": {"string_value": "/etc/passwd"}}})
        for call in (
            lambda: client.load_model(MODEL_NAME, config=config),
            lambda: client.unload_model(MODEL_NAME),
            lambda: client.load_model("other"),
        ):
            with pytest.raises(InferenceServerException):
                call()
        with pytest.raises(InferenceServerException, match="unknown model|not found"):
            client.infer("../neo", raw_inputs(b"hi", None, stream=False), client_timeout=TIMEOUT_S)
    finally:
        client.close()
    assert server.is_ready(timeout=5)


UNSAFE_CALLS = {
    "eval",
    "exec",
    "compile",
    "pickle.load",
    "pickle.loads",
    "cPickle.loads",
    "marshal.loads",
    "dill.loads",
    "shelve.open",
    "yaml.load",
    "yaml.unsafe_load",
    "__import__",
    "os.system",
    "os.popen",
}


def test_no_eval_exec_or_pickle_in_the_request_path():
    found = []
    for root in (REPO / "neo_backend", REPO / "model_repository"):
        for path in root.rglob("*.py"):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Call):
                    func = node.func
                    name = (
                        func.id
                        if isinstance(func, ast.Name)
                        else f"{func.value.id}.{func.attr}"
                        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
                        else ""
                    )
                    if name in UNSAFE_CALLS:
                        found.append(f"{path.relative_to(REPO)}:{node.lineno} {name}")
                elif isinstance(node, (ast.Import, ast.ImportFrom)):
                    modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                    found += [
                        f"{path.relative_to(REPO)}:{node.lineno} import {m}"
                        for m in modules
                        if m.split(".")[0] in ("pickle", "cPickle", "marshal", "dill", "shelve")
                    ]
    assert not found, found


def test_grpc_can_be_restricted_to_clients_with_a_key():
    """Authentication through Triton's own option, passed as `make serve` passes NEO_TRITON_ARGS."""
    key = "x-neo-key"
    restricted = [f"--grpc-restricted-protocol=health,inference:{key}=s3cret"]
    knobs = {"num_gpu_blocks": 64, "max_model_len": 256, "cpu_kv_cache_gb": 0.05}
    with triton_server(knobs, extra_args=restricted) as running:
        client = grpcclient.InferenceServerClient(running.grpc_url)
        with pytest.raises(InferenceServerException, match="(?i)unauthenticated|restricted|header"):
            client.is_server_ready(client_timeout=10)
        assert client.is_server_ready(headers={f"triton-grpc-protocol-{key}": "s3cret"}, client_timeout=10)
        client.close()
