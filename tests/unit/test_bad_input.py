"""Bad requests and bad knobs get typed errors with clear messages; other requests keep going."""

from __future__ import annotations

import pytest

from neo_backend import ConfigError, EngineConfig, InvalidRequestError, LLMEngine, ModelLoadError, SamplingParams
from neo_backend.streaming import StreamingEngine

BAD_REQUESTS = [
    ("", {}, "empty"),
    ([], {}, "non-empty"),
    ([1, 2, 10**9], {}, "out of range"),
    ("x " * 5000, {}, "max_model_len"),
    ("hi", {"max_tokens": 0}, "max_tokens"),
    ("hi", {"max_tokens": -3}, "max_tokens"),
    ("hi", {"max_tokens": 10**9}, "max_tokens"),
    ("hi", {"temperature": -0.5}, "temperature"),
    ("hi", {"temperature": float("nan")}, "temperature"),
    ("hi", {"top_p": 0.0}, "top_p"),
    ("hi", {"top_p": 1.5}, "top_p"),
    ("hi", {"top_k": -7}, "top_k"),
    ("hi", {"no_such_knob": 1}, "no_such_knob"),
    ("hi", {"max_tokens": "12"}, "max_tokens must be an integer"),
    ("hi", {"temperature": "hot"}, "temperature must be a number"),
    ("hi", {"stop": 5}, "stop"),
    ("hi", {"stop": [""]}, "stop"),
    ("hi", {"ignore_eos": "yes"}, "ignore_eos"),
    ("hi", {"logprobs": 1000}, "logprobs"),
    ("hi", {"seed": -1}, "seed"),
    (12345, {}, "prompt must be"),
]


@pytest.fixture(scope="module", params=["off", "on"], ids=lambda mode: f"overlap_steps={mode}")
def front(request):
    front = StreamingEngine(
        EngineConfig(num_gpu_blocks=256, max_model_len=1024, cpu_kv_cache_gb=0.05, overlap_steps=request.param)
    )
    yield front
    front.shutdown()


@pytest.mark.parametrize("prompt,params,needle", BAD_REQUESTS)
def test_bad_request_raises_typed_error(front, prompt, params, needle):
    with pytest.raises(InvalidRequestError, match=needle):
        front.submit(prompt, params)


def test_bad_requests_do_not_disturb_a_running_stream(front):
    good = front.submit("The capital of France is", {"max_tokens": 24, "temperature": 0, "ignore_eos": True})
    for prompt, params, _ in BAD_REQUESTS:
        with pytest.raises(InvalidRequestError):
            front.submit(prompt, params)
    outputs = [good.get(timeout=120)]
    while not outputs[-1].finished:
        outputs.append(good.get(timeout=120))
    assert outputs[-1].finish_reason == "length" and outputs[-1].num_output_tokens == 24
    assert "Paris" in "".join(o.text for o in outputs)
    assert front.healthy and front.num_in_flight == 0
    assert front.engine.gpu_blocks.num_free_blocks == front.engine.gpu_blocks.num_blocks


def test_streaming_cancel_frees_blocks(front):
    stream = front.submit("Count to one hundred:", {"max_tokens": 500, "ignore_eos": True})
    stream.get(timeout=120)
    stream.cancel()
    last = stream.get(timeout=30)
    while not last.finished:
        last = stream.get(timeout=30)
    assert last.finish_reason == "abort"
    assert front.engine.gpu_blocks.num_free_blocks == front.engine.gpu_blocks.num_blocks


@pytest.mark.parametrize(
    "values,needle",
    [
        ({"offload_policy": "sometimes"}, "offload_policy"),
        ({"block_size": "12"}, "power of two"),
        ({"max_num_seqs": "0"}, "max_num_seqs"),
        ({"gpu_memory_utilization": "1.5"}, "gpu_memory_utilization"),
        ({"num_gpu_blocks": "many"}, "num_gpu_blocks"),
        ({"no_such_knob": "1"}, "unknown parameter 'no_such_knob'"),
        ({"gpu_sm_count": "0"}, "gpu_sm_count must be positive"),
        ({"gpu_sm_count": "eight"}, "gpu_sm_count='eight' is not a valid int"),
        ({"overlap_steps": "on", "tensor_parallel_size": "2"}, "overlap_steps=on needs tensor_parallel_size 1"),
    ],
)
def test_bad_knobs_raise_config_error(values, needle):
    with pytest.raises(ConfigError, match=needle):
        EngineConfig.from_strings(values)


def test_an_sm_partition_needs_cuda(tiny_model_dirs):
    """Where a partition cannot work the engine refuses to start with a message saying what to change: here no
    CUDA device (on CUDA, a torch without green contexts, a count the device cannot partition, too many SMs)."""
    with pytest.raises(ConfigError, match="gpu_sm_count=8 needs a CUDA device, but the engine runs on cpu"):
        LLMEngine(EngineConfig(model=str(tiny_model_dirs["llama3"]), device="cpu", gpu_sm_count=8))


def test_model_path_without_weights(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLMEngine(EngineConfig(model=str(tmp_path / "missing")))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="safetensors"):
        LLMEngine(EngineConfig(model=str(tmp_path)))
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file")
    with pytest.raises(ModelLoadError, match="GGUF"):
        LLMEngine(EngineConfig(model=str(tmp_path / "junk.gguf")))


def test_sampling_params_from_dict_is_strict():
    assert SamplingParams.from_dict({"stop": "x"}).stop == ["x"]
    assert SamplingParams.from_dict({"max_tokens": 5.0}).max_tokens == 5
    assert SamplingParams.from_dict({"top_k": -1}).top_k == 0
