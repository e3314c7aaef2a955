"""Paged KV block accounting for one pool (device or host)."""
from __future__ import annotations

from collections import deque

from .sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, name: str = "gpu") -> None:
        self.name = name
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def extra_blocks_for(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` must gain so its table covers `num_tokens` slots."""
        return max(0, self.blocks_needed(num_tokens) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int, reserve: int = 0) -> bool:
        return self.extra_blocks_for(seq, num_tokens) + reserve <= len(self._free)

    def grow(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Extend `seq`'s block table to cover `num_tokens` slots; returns the new blocks."""
        extra = self.extra_blocks_for(seq, num_tokens)
        if extra > len(self._free):
            raise RuntimeError(f"{self.name} pool: {extra} blocks needed, {len(self._free)} free")
        new = [self._free.popleft() for _ in range(extra)]
        seq.block_table.extend(new)
        return new

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self._free):
            raise RuntimeError(f"{self.name} pool: {num_blocks} blocks needed, {len(self._free)} free")
        return [self._free.popleft() for _ in range(num_blocks)]

    def release(self, blocks: list[int]) -> None:
        self._free.extend(blocks)

    def free(self, seq: Sequence) -> None:
        self.release(seq.block_table)
        seq.block_table = []
