"""The gRPC client: CLI and sync/asyncio APIs against a real tritonserver serving `neo` (no mocks)."""

from __future__ import annotations

import asyncio
import os
import re
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from server_utils import kv_blocks_used, requests_in_engine, wait_for_metrics, wait_idle

from client import AsyncNeoClient, NeoClient, ServerError, render_chat
from client.__main__ import parse_args, sampling_from_args
from loadtest.server import RunningServer, triton_server
from neo_backend.triton.server import free_ports

ROOT = Path(__file__).resolve().parents[2]
STATS_LINE = re.compile(
    r"TTFT (\d+\.\d) ms \| TPOT (\d+\.\d) ms \| (\d+\.\d) tokens/s \| (\d+) tokens in "
    r"\d+\.\d\d s \| finish_reason (\w+)"
)
GREEDY = {"max_tokens": 8, "temperature": 0}


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "client", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


# Without a server -------------------------------------------------------------------------------------------------


def test_default_chat_template_renders_like_the_default_model():
    from neo_backend import EngineConfig
    from neo_backend.models.loader import load_tokenizer, read_model_config, resolve_source

    config = EngineConfig()
    source = resolve_source(config)
    tokenizer = load_tokenizer(source, config, read_model_config(source))
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert render_chat("What is 2+2?") == tokenizer.apply_chat_template(messages)
    with_system = [{"role": "system", "content": "Be brief."}] + messages
    assert render_chat("What is 2+2?", system="Be brief.") == tokenizer.apply_chat_template(with_system)


def test_chat_template_file(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text(
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    assert render_chat("hi", template=template.read_text()) == "[user] hi\n[assistant] "


def test_cli_flags_become_vllm_sampling_parameters():
    args = parse_args(
        ["p", "--max-tokens", "5", "--temperature", "0.5", "--top-k", "3", "--stop", "a", "b", "--ignore-eos"]
    )
    assert sampling_from_args(args) == {
        "max_tokens": 5,
        "temperature": 0.5,
        "top_k": 3,
        "stop": ["a", "b"],
        "ignore_eos": True,
    }
    assert sampling_from_args(parse_args(["p"])) == {"max_tokens": 128}


def test_unreachable_server_is_a_clear_error():
    url = f"127.0.0.1:{free_ports(1)[0]}"
    proc = run_cli("hello", "--url", url, "--timeout", "5")
    assert proc.returncode == 3, proc.stderr
    assert f"cannot reach a Triton gRPC endpoint at {url}" in proc.stderr
    assert proc.stdout == ""


# Against a real server ---------------------------------------------------------------------------------------------

KNOBS = {"num_gpu_blocks": 512, "max_model_len": 1024, "cpu_kv_cache_gb": 0.05, "max_num_seqs": 32}
LONG = {"max_tokens": 400, "ignore_eos": True}  # far longer than any test waits for


@pytest.fixture(scope="module")
def server() -> RunningServer:
    with triton_server(KNOBS) as running:
        yield running


def client_env(server: RunningServer) -> dict[str, str]:
    """The variables a client subprocess takes the server address from, as `make serve` sets them."""
    return {"NEO_HOST": server.address.host, "NEO_GRPC_PORT": str(server.address.grpc_port)}


def wait_streaming(server: RunningServer) -> None:
    """Until the gauges show the one streaming request and the KV blocks it holds. The monitor sets the gauges one
    at a time, so a scrape between two of its sets may show the request before its blocks."""
    wait_for_metrics(
        server,
        lambda s: requests_in_engine(s) == 1 and kv_blocks_used(s) > 0,
        "one request in the engine, holding KV blocks",
    )


def test_cli_streams_text_and_prints_stats(server):
    proc = run_cli(
        "The capital of France is", "--max-tokens", "8", "--temperature", "0", "--stats", env=client_env(server)
    )
    assert proc.returncode == 0, proc.stderr
    with NeoClient(server.grpc_url) as c:
        expected = c.generate("The capital of France is", GREEDY)
    assert expected.text.startswith(" Paris")
    assert proc.stdout == expected.text + "\n"
    stats = STATS_LINE.search(proc.stderr)
    assert stats, proc.stderr
    ttft, tpot, rate, tokens, reason = stats.groups()
    assert float(ttft) > 0 and float(tpot) > 0 and float(rate) > 0
    assert int(tokens) == expected.num_output_tokens and reason == expected.finish_reason


def test_cli_chat_mode(server):
    proc = run_cli(
        "What is the capital of France?", "--chat", "--max-tokens", "12", "--temperature", "0", env=client_env(server)
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_sync_api_streams_deltas_and_final_result(server):
    with NeoClient(server.grpc_url) as c:
        with c.stream("Count: one, two, three,", {**GREEDY, "max_tokens": 12, "ignore_eos": True}) as s:
            deltas = list(s)
    result = s.result
    assert len(deltas) > 1 and "".join(deltas) == result.text
    assert result.finish_reason == "length" and result.num_output_tokens == 12
    assert result.num_input_tokens and result.num_input_tokens > 5
    assert 0 < result.ttft < result.e2e and result.tpot > 0


def test_async_api_concurrent_streams_match_sync(server):
    prompts = [f"List {n} colours:" for n in range(2, 6)]

    async def run() -> list:
        async with AsyncNeoClient(server.grpc_url) as c:
            await c.check_ready()
            return await asyncio.gather(*(c.generate(p, GREEDY) for p in prompts))

    results = asyncio.run(run())
    with NeoClient(server.grpc_url) as c:
        assert [r.text for r in results] == [c.generate(p, GREEDY).text for p in prompts]
    assert all(r.finish_reason in ("length", "stop") and r.num_output_tokens >= 1 for r in results)


def test_missing_model_and_server_side_errors(server):
    proc = run_cli("hi", "--model", "no_such_model", env=client_env(server))
    assert proc.returncode == 4 and "does not serve model 'no_such_model'" in proc.stderr
    proc = run_cli("hi", "--max-tokens", "0", env=client_env(server))
    assert proc.returncode == 1 and "max_tokens" in proc.stderr
    with NeoClient(server.grpc_url) as c, pytest.raises(ServerError, match="top_p"):
        c.generate("hi", {"top_p": 7})


def test_timeout_is_an_error_and_frees_the_request(server):
    proc = run_cli(
        "Tell me a long story.", "--max-tokens", "400", "--ignore-eos", "--timeout", "1", env=client_env(server)
    )
    assert proc.returncode == 5, proc.stderr
    assert "did not complete within 1 s" in proc.stderr
    wait_idle(server)


def test_cancel_mid_stream_frees_kv_blocks(server):
    wait_idle(server)
    with NeoClient(server.grpc_url) as c:
        with c.stream("Tell me a long story.", LONG) as stream:
            for n, _ in enumerate(stream, 1):
                if n == 3:
                    break
            wait_streaming(server)
            stream.cancel()
        assert stream.result is None
        wait_idle(server)
        assert c.generate("The capital of France is", GREEDY).text.startswith(" Paris")


def popen_at_a_terminal(args: list[str], **kwargs) -> subprocess.Popen:
    """Start `args` with Ctrl-C (SIGINT) at its default, as a shell in the foreground starts it. A test run started
    in the background (`make test &`, a CI runner) ignores SIGINT, and an ignored signal is inherited, where a
    handler is reset to the default on exec: so one is installed here while the child starts."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(args, **kwargs)
    finally:
        signal.signal(signal.SIGINT, previous)


def test_ctrl_c_cancels_the_request_on_the_server(server):
    wait_idle(server)
    proc = popen_at_a_terminal(
        [sys.executable, "-m", "client", "Tell me a long story.", "--max-tokens", "400", "--ignore-eos"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, **client_env(server)},
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        assert ready and proc.stdout.read(1), "no streamed output before the interrupt"
        wait_streaming(server)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "cancelled on the server" in err.decode()
    wait_idle(server)
