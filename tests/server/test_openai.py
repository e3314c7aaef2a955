"""The OpenAI-compatible gateway in front of a real tritonserver and the default model, driven by the official
`openai` SDK (and LangChain's OpenAI integrations): completions and chat, streaming and not, sampling parameters,
usage, logprobs, errors, a dropped stream, and the API key."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from server_utils import kv_blocks_used, requests_in_engine, wait_for_metrics, wait_idle
from starlette.testclient import TestClient

from client import NeoClient, ServerError, render_chat
from loadtest.records import read_records
from loadtest.server import RunningServer, triton_server
from neo_backend import EngineConfig
from neo_backend.models.tokenizer import Tokenizer
from neo_backend.triton.server import free_ports, launch_gateway, stop_gateway
from openai_frontend import GatewayConfig, create_app
from openai_frontend.errors import APIError, from_client_error
from openai_frontend.served_model import ServedModel

ROOT = Path(__file__).resolve().parents[2]
KNOBS = {"num_gpu_blocks": 256, "max_model_len": 512, "cpu_kv_cache_gb": 0.05, "max_num_seqs": 32}
MODEL = "neo"
PROMPT = "The capital of France is"
QUESTION = "What is the capital of France?"
TIMEOUT_S = 60.0
READY_TIMEOUT_S = 180.0


@contextlib.contextmanager
def gateway(server: RunningServer) -> Iterator[str]:
    """`python -m openai_frontend` in front of `server`, as `make serve` starts it; yields its base URL."""
    port = free_ports(1)[0]
    with tempfile.TemporaryDirectory(prefix="neo-test-gateway-") as work_dir:
        log_path = Path(work_dir) / "gateway.log"
        with open(log_path, "w") as log_file:
            process = launch_gateway(server.address, ["--host", "127.0.0.1", "--port", str(port)], stdout=log_file)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while http_status(f"{url}/health") != 200:
                assert process.poll() is None, f"gateway exited: {log_path.read_text()[-3000:]}"
                assert time.monotonic() < deadline, f"gateway not ready: {log_path.read_text()[-3000:]}"
                time.sleep(0.5)
            yield url
        finally:
            stop_gateway(process)


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def post_raw(url: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with triton_server(KNOBS) as running:
        yield running


@pytest.fixture(scope="module")
def base_url(server) -> Iterator[str]:
    with gateway(server) as url:
        yield url


@pytest.fixture(scope="module")
def api(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=TIMEOUT_S, max_retries=0)


@pytest.fixture(scope="module")
def grpc(server) -> Iterator[NeoClient]:
    with NeoClient(server.grpc_url, timeout=TIMEOUT_S) as c:
        yield c


# Completions and chat -----------------------------------------------------------------------------------------


def test_greedy_completion_equals_the_triton_client_and_counts_its_tokens(api, grpc):
    expected = grpc.generate(PROMPT, {"max_tokens": 12, "temperature": 0})
    response = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    choice = response.choices[0]
    assert choice.text == expected.text and choice.text.startswith(" Paris")
    assert choice.finish_reason == expected.finish_reason == "length"
    assert response.object == "text_completion" and response.model == MODEL
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (expected.num_input_tokens, 12)
    assert response.usage.total_tokens == expected.num_input_tokens + 12


def test_streamed_completion_equals_the_whole_one_and_ends_with_usage(api):
    whole = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    chunks = list(
        api.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) > 3, "the text should arrive in several chunks"
    assert "".join(texts) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert not chunks[-1].choices and chunks[-1].usage == whole.usage


def test_chat_uses_the_models_template_and_equals_the_triton_client(api, grpc):
    expected = grpc.generate(render_chat(QUESTION), {"max_tokens": 24, "temperature": 0})
    response = api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=24, temperature=0
    )
    choice = response.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == expected.text
    assert "Paris" in expected.text
    assert choice.finish_reason == expected.finish_reason
    assert response.usage.prompt_tokens == expected.num_input_tokens
    assert response.usage.completion_tokens == expected.num_output_tokens


def test_streamed_chat_sends_the_role_then_the_content(api):
    messages = [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": QUESTION}]
    whole = api.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=16, temperature=0)
    chunks = list(
        api.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_completion_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == whole.choices[0].message.content
    assert chunks[-1].usage == whole.usage and whole.usage.completion_tokens <= 16
    assert chunks[0].object == "chat.completion.chunk"


def test_a_chat_without_a_limit_is_not_cut_at_16_tokens(api):
    response = api.chat.completions.create(
        model=MODEL, temperature=0, stop=["."], messages=[{"role": "user", "content": "Write a story about a dragon."}]
    )
    assert response.choices[0].finish_reason == "stop"
    assert response.usage.completion_tokens > 16, "a chat's default length is not the completions default of 16"


def test_a_model_without_a_chat_template_refuses_chat():
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models
    from transformers import PreTrainedTokenizerFast

    served = ServedModel("127.0.0.1:1", MODEL, 1.0)
    served.config = EngineConfig()
    served.tokenizer = Tokenizer(PreTrainedTokenizerFast(tokenizer_object=RawTokenizer(models.BPE())), ())
    with pytest.raises(APIError) as info:
        served.render_chat([{"role": "user", "content": "hi"}])
    assert info.value.status == 400 and "no chat template" in info.value.message


# Parameters ---------------------------------------------------------------------------------------------------


def test_stop_string_ends_the_text_before_it(api):
    response = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=["."])
    assert response.choices[0].text == " Paris"
    assert response.choices[0].finish_reason == "stop"


def test_seeded_sampling_repeats_and_n_choices_differ(api):
    def sample(seed: int, n: int = 1) -> list[str]:
        response = api.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=1.0, seed=seed, n=n
        )
        return [c.text for c in sorted(response.choices, key=lambda c: c.index)]

    first = sample(7, n=2)
    assert first == sample(7, n=2), "the same seed must give the same choices"
    assert first[0] != first[1], "n choices of one seeded request must differ"
    assert sample(7) == first[:1], "choice 0 takes the request's seed"
    assert sample(8) != sample(7)


def test_a_list_of_prompts_gets_one_choice_each(api, grpc):
    prompts = [PROMPT, "1, 2, 3, 4,"]
    expected = [grpc.generate(p, {"max_tokens": 8, "temperature": 0}) for p in prompts]
    response = api.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0)
    assert [c.index for c in response.choices] == [0, 1]
    assert [c.text for c in response.choices] == [e.text for e in expected]
    assert response.usage.prompt_tokens == sum(e.num_input_tokens for e in expected)
    assert response.usage.completion_tokens == 16


def test_logprobs_of_completions_and_chat(api):
    response = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    logprobs = response.choices[0].logprobs
    assert "".join(logprobs.tokens) == response.choices[0].text
    assert len(logprobs.token_logprobs) == 6 and all(lp <= 0 for lp in logprobs.token_logprobs)
    # greedy: the sampled token is the most likely one
    assert all(
        len(top) == 2 and max(top.values()) == lp for top, lp in zip(logprobs.top_logprobs, logprobs.token_logprobs)
    )
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(6)]

    chat = api.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob == t.logprob for t in content)


def test_vllm_extra_parameters_reach_the_engine(api):
    response = api.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=20,
        temperature=0,
        extra_body={"ignore_eos": True, "min_tokens": 20, "top_k": 5, "repetition_penalty": 1.1},
    )
    assert response.usage.completion_tokens == 20 and response.choices[0].finish_reason == "length"


def test_langchain_chat_and_completion_models_answer_as_the_sdk_does(api, base_url):
    """LangChain's OpenAI integrations, as an application builds them on this server: the chat model's answer,
    streamed and not, and its token usage are the SDK's; a conversation with system and assistant turns goes
    through the model's template; the completion model's request (a list of prompts, unset fields sent as null)
    is accepted and answers what the SDK gets."""
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
    from langchain_openai import ChatOpenAI, OpenAI

    connection = dict(base_url=f"{base_url}/v1", api_key="unused", model=MODEL, timeout=TIMEOUT_S, max_retries=0)
    chat = ChatOpenAI(**connection, temperature=0, max_tokens=16, stream_usage=True)
    expected = api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_completion_tokens=16, temperature=0
    )
    reply = chat.invoke(QUESTION)
    assert reply.content == expected.choices[0].message.content and "Paris" in reply.content
    assert reply.usage_metadata["input_tokens"] == expected.usage.prompt_tokens
    assert reply.usage_metadata["output_tokens"] == expected.usage.completion_tokens
    chunks = list(chat.stream(QUESTION))
    assert "".join(chunk.content for chunk in chunks) == reply.content
    assert sum((chunk for chunk in chunks[1:]), chunks[0]).usage_metadata == reply.usage_metadata

    turns = [SystemMessage("You answer in one word."), HumanMessage("Name a colour."), AIMessage("Blue.")]
    conversation = chat.invoke([*turns, HumanMessage(QUESTION)])
    expected = api.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "You answer in one word."},
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": QUESTION},
        ],
        max_completion_tokens=16,
        temperature=0,
    )
    assert conversation.content == expected.choices[0].message.content

    completion = OpenAI(**connection, temperature=0, max_tokens=12).invoke(PROMPT)
    expected = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert completion == expected.choices[0].text and completion.startswith(" Paris")


# Errors -------------------------------------------------------------------------------------------------------


def test_bad_requests_get_their_status_while_another_stream_keeps_streaming(api, base_url, server):
    long_stream = api.completions.create(
        model=MODEL,
        prompt="Tell me a story.",
        max_tokens=120,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = iter(long_stream)
    streamed = [next(chunks)]

    def status_and_error(call) -> tuple[int, openai.APIStatusError]:
        with pytest.raises(openai.APIStatusError) as info:
            call()
        streamed.append(next(chunks))  # the long stream still moves between bad requests
        return info.value.status_code, info.value

    status, error = status_and_error(lambda: api.completions.create(model="gpt-4", prompt=PROMPT))
    assert status == 404 and "'gpt-4' does not exist" in error.message and error.body["param"] == "model"
    status, error = status_and_error(lambda: api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=-1))
    assert status == 400 and "max_tokens must be >= 1" in error.message
    status, error = status_and_error(
        lambda: api.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], extra_body={"best_of": 2}
        )
    )
    assert status == 400 and "unknown parameter 'best_of'" in error.message and error.body["param"] == "best_of"
    status, error = status_and_error(
        lambda: api.completions.create(model=MODEL, prompt="word " * 600, max_tokens=4, stream=True)
    )
    assert status == 400 and "max_model_len is 512" in error.message and error.body["param"] == "prompt"
    status, error = status_and_error(lambda: api.completions.create(model=MODEL, prompt=PROMPT, temperature="hot"))
    assert status == 400 and error.body["param"] == "temperature"

    status, body = post_raw(f"{base_url}/v1/chat/completions", b'{"model": "neo", "messages": [')
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    assert body["error"]["type"] == "invalid_request_error"
    streamed.extend(chunks)
    assert streamed[-1].usage.completion_tokens == 120
    assert "".join(c.choices[0].text for c in streamed if c.choices)


def test_unknown_route_and_method_are_openai_shaped_errors(base_url):
    status, body = post_raw(f"{base_url}/v1/embeddings", b"{}")
    assert status == 404 and body["error"]["message"] == "Not Found"
    assert http_status(f"{base_url}/v1/completions") == 405


def test_model_errors_map_to_their_status():
    def status(message: str) -> int:
        return from_client_error(ServerError("from server", server_message=message)).status

    assert status("server is at capacity: 4 requests waiting (max_queue_size=4); retry later") == 429
    assert status("engine is not running: stopped") == 503
    assert status("server is shutting down") == 503
    assert status("the model produced non-finite logits for this request") == 500


# Cancellation, models, health, API key -----------------------------------------------------------------------


def test_a_dropped_stream_frees_its_kv_blocks(api, server):
    wait_idle(server)
    stream = api.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me a long story."}],
        max_tokens=400,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for n, _ in enumerate(stream, 1):
        if n == 3:
            break
    samples = wait_for_metrics(server, lambda s: requests_in_engine(s) == 1, "the streaming request")
    assert kv_blocks_used(samples) > 0
    stream.close()
    wait_idle(server)


def test_a_client_that_gives_up_on_a_whole_answer_frees_its_kv_blocks(api, server):
    wait_idle(server)
    impatient = api.with_options(timeout=3.0)
    with pytest.raises(openai.APITimeoutError):
        impatient.completions.create(
            model=MODEL, prompt="Tell me a long story.", max_tokens=400, temperature=0, extra_body={"ignore_eos": True}
        )
    wait_idle(server)


def test_models_and_health(api, base_url):
    assert [m.id for m in api.models.list().data] == [MODEL]
    assert api.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        api.models.retrieve("gpt-4")
    assert http_status(f"{base_url}/health") == 200


def test_api_key_is_required_when_configured():
    nothing_there = f"127.0.0.1:{free_ports(1)[0]}"
    app = create_app(GatewayConfig(triton_url=nothing_there, api_key="sesame"))
    with TestClient(app) as http:  # no Triton behind it: the key is checked first
        body = {"model": MODEL, "prompt": PROMPT}
        assert http.post("/v1/completions", json=body).status_code == 401
        wrong = http.post("/v1/completions", json=body, headers={"Authorization": "Bearer open"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        right = http.post("/v1/completions", json=body, headers={"Authorization": "Bearer sesame"})
        assert right.status_code == 503 and "not ready" in right.json()["error"]["message"]
        assert http.get("/health").status_code == 503
        assert http.get("/v1/models", headers={"Authorization": "Bearer sesame"}).status_code == 200


# Load test over the OpenAI API ---------------------------------------------------------------------------------


def test_loadtest_drives_the_gateway(base_url, tmp_path):
    host, port = base_url.removeprefix("http://").split(":")
    env = {**os.environ, "NEO_OPENAI_HOST": host, "NEO_OPENAI_PORT": port}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "loadtest",
            "--api",
            "openai",
            "--duration",
            "10s",
            "--users",
            "4",
            "--input-tokens",
            "32",
            "--output-tokens",
            "8",
            "--results-dir",
            str(tmp_path),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-6:]
    assert "(openai)" in last[0]
    for line, metric in zip(last[2:5], ("TTFT", "TPOT", "E2E")):
        cells = line.split()
        assert cells[0] == metric and all(float(v) > 0 for v in cells[1:]), line
    ok, errors = map(int, re.search(r"requests: (\d+) ok, (\d+) errors", last[5]).groups())
    assert ok >= 4 and errors == 0, last[5]
    records = list(read_records(tmp_path / "requests.jsonl"))
    assert {r.output_tokens for r in records} == {8} and all(abs(r.input_tokens - 32) <= 1 for r in records)
