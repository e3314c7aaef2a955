"""Paged KV block accounting for one pool (device or host)."""

from __future__ import annotations

from ..errors import SchedulerError
from .sequence import Sequence

FREE = b"\x01"
USED = b"\x00"


class BlockManager:
    """The pool's blocks, handed out in runs of consecutive ids where it has one: a swap copies each run of host
    blocks in one piece per layer (`executor/swapper.py`). A request that grows takes the block after its last
    where that is free, and a new run starts past room for its own length again after the last run (next fit),
    so requests grow in place until the pool wraps around."""

    def __init__(self, num_blocks: int, block_size: int, name: str) -> None:
        self.name = name
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free_map = bytearray(FREE * num_blocks)
        self._num_free = num_blocks
        self._next_run = 0

    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self._num_free

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def extra_blocks_for(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` must gain so its table covers `num_tokens` slots."""
        return max(0, self.blocks_needed(num_tokens) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.extra_blocks_for(seq, num_tokens) <= self._num_free

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Extend `seq`'s block table to cover `num_tokens` slots."""
        last = seq.block_table[-1] if seq.block_table else None
        seq.block_table.extend(self.allocate(self.extra_blocks_for(seq, num_tokens), after=last))

    def allocate(self, num_blocks: int, after: int | None = None) -> list[int]:
        """`num_blocks` free blocks: those right after block `after` if free, else the first free run from the
        next-fit position, else the lowest free blocks."""
        if num_blocks > self._num_free:
            raise SchedulerError(
                f"{self.name} KV pool: {num_blocks} blocks asked for, {self._num_free} free; the "
                f"scheduler checks room before it allocates, so this is an engine bug: please "
                f"report it with the log"
            )
        if num_blocks == 0:
            return []
        run = FREE * num_blocks
        if after is not None and self._free_map[after + 1 : after + 1 + num_blocks] == run:
            start = after + 1
        else:
            start = self._free_map.find(run, self._next_run)
            if start < 0:
                start = self._free_map.find(run)
            if start >= 0:
                self._next_run = (start + 2 * num_blocks) % self.num_blocks
        blocks = list(range(start, start + num_blocks)) if start >= 0 else self._lowest_free(num_blocks)
        for block in blocks:
            self._free_map[block] = USED[0]
        self._num_free -= num_blocks
        return blocks

    def release(self, blocks: list[int]) -> None:
        for block in blocks:
            self._free_map[block] = FREE[0]
        self._num_free += len(blocks)

    def free(self, seq: Sequence) -> None:
        self.release(seq.block_table)
        seq.block_table = []

    def _lowest_free(self, num_blocks: int) -> list[int]:
        blocks, position = [], 0
        while len(blocks) < num_blocks:
            position = self._free_map.find(FREE, position)
            blocks.append(position)
            position += 1
        return blocks
