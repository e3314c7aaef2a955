"""The pieces that CUDA graphs capture for steps that prefill (`MixedGraphs`), run eagerly on the CPU with each
layer's attention between them: the model's own forward for a step of new and continued prompt chunks beside
decodes (their block tables as wide as a decode graph's), and the rows padded up to the bucket write nowhere but the
scratch block."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from neo_backend import EngineConfig, LLMEngine, SamplingParams
from neo_backend.core.sequence import Sequence
from neo_backend.executor.cuda_graphs import MixedGraphs, bucket_for, mixed_buckets
from neo_backend.executor.gemm_libraries import GemmLibraries


class EagerPieces(MixedGraphs):
    """`MixedGraphs` whose pieces run as launched instead of replayed (no CUDA graphs on the CPU)."""

    def _capture(self) -> None:
        pass

    def _replay(self, rows: int, piece: int) -> None:
        self._piece(piece, rows)


def _sequence(name: str, tokens: list[int], computed: int, blocks: list[int]) -> Sequence:
    seq = Sequence(name, None, tokens, SamplingParams(temperature=0))
    seq.num_computed_tokens = computed
    seq.block_table = blocks
    return seq


@pytest.mark.parametrize("max_rows", [64, 300, 512])
def test_mixed_buckets_are_16_then_multiples_of_32_then_the_maximum(max_rows):
    buckets = mixed_buckets(max_rows)
    assert buckets[-1] == max_rows and buckets == sorted(set(buckets))
    assert buckets[0] == 16 and all(b % 32 == 0 for b in buckets[1:-1])
    assert all(later - earlier <= 32 for earlier, later in zip(buckets, buckets[1:]))
    assert mixed_buckets(8) == [8]


@torch.inference_mode()
def test_pieces_give_the_forward_of_a_mixed_step(tiny_model_dirs):
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_model_dirs["llama3"]),
            device="cpu",
            dtype="float32",
            num_gpu_blocks=64,
            block_size=16,
            offload_policy="never",
        )
    )
    runner = engine.runner
    gen = torch.Generator().manual_seed(5)
    for cache in runner.k_caches + runner.v_caches:
        cache.copy_(torch.randn(cache.shape, generator=gen))
    tokens = lambda n: torch.randint(3, 300, (n,), generator=gen).tolist()  # noqa: E731
    new = _sequence("new", tokens(21), 0, [0, 1])
    continued = _sequence("continued", tokens(40), 17, [2, 3, 4])
    decodes = [
        _sequence(f"decode{i}", tokens(30 + 9 * i), 29 + 9 * i, [10 + 4 * i + b for b in range(4)]) for i in range(3)
    ]
    sub = runner.prepare([(new, 21), (continued, 23)], decodes, []).sub
    rows = sub.input_ids.numel()
    pieces = EagerPieces(runner.model, runner.device, 64, runner.num_gpu_blocks * 16, GemmLibraries(runner.model))
    assert rows == 47 and pieces.buckets == [16, 32, 64]

    expected = runner.model(sub.input_ids, sub.positions, sub.meta)
    pool = [cache[: runner.num_gpu_blocks].clone() for cache in runner.k_caches + runner.v_caches]
    scratch_before = runner.k_caches[0][runner.num_gpu_blocks].clone()
    got = pieces.run(sub.input_ids, sub.positions, sub.meta)

    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    tables = sub.meta.decode_block_tables
    assert tables.shape[1] == bucket_for(runner.table_widths, 4), "decodes attend over a decode graph's width"
    assert tables[:, :4].tolist() == [seq.block_table for seq in decodes] and not tables[:, 4:].any()
    exact = replace(sub.meta, decode_block_tables=tables[:, :4].contiguous())
    torch.testing.assert_close(runner.model(sub.input_ids, sub.positions, exact), expected, rtol=0, atol=0)
    for before, cache in zip(pool, runner.k_caches + runner.v_caches):
        torch.testing.assert_close(cache[: runner.num_gpu_blocks], before, rtol=1e-5, atol=1e-5)
    assert not torch.equal(runner.k_caches[0][runner.num_gpu_blocks], scratch_before), "padded rows store there"
