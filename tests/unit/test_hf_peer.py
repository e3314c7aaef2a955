"""bench/hf_peer.py on CPU: every system emits exactly the requested tokens, even where greedy would hit EOS."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import hf_peer  # noqa: E402

from neo_backend import EngineConfig  # noqa: E402


def test_every_system_emits_num_requests_times_output_len(tiny_model_dirs):
    model_dir = str(tiny_model_dirs["llama3"])
    prompts = hf_peer.make_prompts(1, 8, vocab=256, seed=0) * 2
    model = hf_peer.hf_model(model_dir, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        first = int(model(torch.tensor(prompts[:1])).logits[0, -1].argmax())
    model.config.eos_token_id = model.generation_config.eos_token_id = first  # greedy stops both at once
    for run in (hf_peer.hf_generate, hf_peer.hf_generate_batch):
        assert run(model, prompts, 4)["output_tokens"] == 8, run.__name__
    config = EngineConfig(model=model_dir, load_format="dummy", device="cpu", offload_policy="never")
    assert hf_peer.neo(config, prompts, 4)["output_tokens"] == 8
