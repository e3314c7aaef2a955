"""Tensor parallelism of the model: two ranks (processes over gloo) each holding half of every sharded weight give
the logits of the whole model, prefill and greedy decode steps through the paged KV cache, fp32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from neo_backend import EngineConfig
from neo_backend.errors import ConfigError
from neo_backend.layers.attention import AttentionMetadata, PrefillChunk
from neo_backend.layers.parallel import TensorParallel
from neo_backend.models.llama import LlamaForCausalLM
from neo_backend.models.loader import load_model, read_model_config, resolve_source

BLOCK_SIZE = 8
NUM_BLOCKS = 16
DECODE_STEPS = 6
TOLERANCE = 1e-5


def load(directory: Path, tp: TensorParallel) -> LlamaForCausalLM:
    source = resolve_source(EngineConfig(model=str(directory), load_format="hf"))
    return load_model(source, read_model_config(source), 512, torch.float32, torch.device("cpu"), tp)


def greedy_logits(model: LlamaForCausalLM, prompt: list[int]) -> torch.Tensor:
    """Logits of the prompt's last token, then of each greedy decode step, with the KV in one block table."""
    for layer in model.layers:
        shape = (NUM_BLOCKS, BLOCK_SIZE, layer.num_kv_heads, layer.head_dim)
        layer.attn.k_cache, layer.attn.v_cache = torch.zeros(shape), torch.zeros(shape)
    table = torch.arange(NUM_BLOCKS, dtype=torch.int32)
    no_decodes = torch.empty(0, NUM_BLOCKS, dtype=torch.int32), torch.empty(0, dtype=torch.int32)
    n = len(prompt)
    meta = AttentionMetadata(torch.arange(n), [PrefillChunk(0, n, 0, table)], n, *no_decodes)
    rows = []
    with torch.no_grad():
        hidden = model(torch.tensor(prompt), torch.arange(n), meta)
        rows.append(model.compute_logits(hidden[-1:])[0])
        for step in range(DECODE_STEPS):
            position = n + step
            meta = AttentionMetadata(
                torch.tensor([position]), [], 0, table.unsqueeze(0), torch.tensor([position + 1], dtype=torch.int32)
            )
            token = rows[-1].argmax().view(1)
            rows.append(model.compute_logits(model(token, torch.tensor([position]), meta))[0])
    return torch.stack(rows)


def _rank(rank: int, size: int, directory: Path, prompt: list[int], out: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=size)
    try:
        torch.set_num_threads(1)
        logits = greedy_logits(load(directory, TensorParallel(rank, size)), prompt)
        torch.save(logits, out / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_ranks_give_the_whole_model_s_logits(tiny_model_dirs, tmp_path):
    directory = tiny_model_dirs["llama3"]  # GQA 4/2: each rank holds 2 query heads and 1 KV head
    prompt = torch.randint(3, 500, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    reference = greedy_logits(load(directory, TensorParallel()), prompt)
    mp.start_processes(_rank, args=(2, directory, prompt, tmp_path), nprocs=2, join=True, start_method="spawn")
    for rank in range(2):
        ours = torch.load(tmp_path / f"rank{rank}.pt")
        assert ours.shape == reference.shape
        for step in range(ours.shape[0]):
            err = (ours[step] - reference[step]).norm() / reference[step].norm()
            assert err <= TOLERANCE, f"rank {rank}, step {step}: relative error {err:.2e}"
        assert torch.equal(ours.argmax(-1), reference.argmax(-1))


def test_head_counts_that_do_not_divide_are_a_config_error(tiny_model_dirs):
    source = resolve_source(EngineConfig(model=str(tiny_model_dirs["qwen2"])))  # one KV head
    with pytest.raises(ConfigError, match="tensor_parallel_size=2 does not divide the number of KV heads"):
        LlamaForCausalLM(read_model_config(source), 512, TensorParallel(0, 2))
