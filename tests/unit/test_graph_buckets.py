"""The sizes CUDA graphs are captured for: every batch and table width up to the maximum has a graph that fits
it, with the padding the docstrings promise."""

from __future__ import annotations

import pytest

from neo_backend.executor.cuda_graphs import batch_buckets, bucket_for, lane_buckets, width_buckets


@pytest.mark.parametrize("max_batch", [1, 7, 64, 200, 256])
def test_every_batch_has_a_graph_at_most_16_rows_larger(max_batch):
    buckets = batch_buckets(max_batch)
    assert buckets[-1] == max_batch
    for rows in range(1, max_batch + 1):
        assert 0 <= bucket_for(buckets, rows) - rows < 16


@pytest.mark.parametrize("max_batch", [8, 100, 256])
def test_lane_buckets_pad_a_third_at_most_from_8_rows_and_one_row_below(max_batch):
    buckets = lane_buckets(max_batch)
    assert buckets[-1] == max_batch
    for rows in range(8, max_batch + 1):
        bucket = bucket_for(buckets, rows)
        assert rows <= bucket and bucket - rows <= bucket / 3
    for rows in range(1, min(4, max_batch) + 1):
        assert bucket_for(buckets, rows) - rows <= 1, "a few rows pad at most one"


@pytest.mark.parametrize("max_blocks,block_size", [(512, 16), (8192, 16), (100, 16), (8, 16), (257, 32)])
def test_table_widths_fit_every_context_within_twice_its_blocks(max_blocks, block_size):
    """Beyond 512 tokens a context's graph is at most twice as wide as its table; up to 512 tokens one width."""
    widths = width_buckets(max_blocks, block_size)
    assert widths[-1] == max_blocks and widths == sorted(set(widths))
    smallest = min(max_blocks, 512 // block_size)
    for blocks in range(1, max_blocks + 1):
        width = bucket_for(widths, blocks)
        assert width >= blocks
        assert width <= max(smallest, 2 * blocks - 1) or width == max_blocks
