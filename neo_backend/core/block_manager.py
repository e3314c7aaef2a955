"""Paged KV block accounting for one pool (device or host)."""

from __future__ import annotations

from collections import deque

from ..errors import SchedulerError
from .sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, name: str) -> None:
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

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.extra_blocks_for(seq, num_tokens) <= len(self._free)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Extend `seq`'s block table to cover `num_tokens` slots."""
        seq.block_table.extend(self.allocate(self.extra_blocks_for(seq, num_tokens)))

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self._free):
            raise SchedulerError(
                f"{self.name} KV pool: {num_blocks} blocks asked for, {len(self._free)} free; the "
                f"scheduler checks room before it allocates, so this is an engine bug: please "
                f"report it with the log"
            )
        return [self._free.popleft() for _ in range(num_blocks)]

    def release(self, blocks: list[int]) -> None:
        self._free.extend(blocks)

    def free(self, seq: Sequence) -> None:
        self.release(seq.block_table)
        seq.block_table = []
