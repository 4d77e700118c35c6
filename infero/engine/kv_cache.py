"""The paged KV cache's bookkeeping: a pool of fixed-size blocks and the block table of each sequence.

The cache memory itself belongs to the backend (`backend.allocate_kv_cache`); this module only decides, with
integers, which blocks hold which sequence's tokens.
"""

from __future__ import annotations

DEFAULT_BLOCK_SIZE = 16


class OutOfBlocksError(RuntimeError):
    """The pool has fewer free blocks than a request needs."""


class BlockPool:
    """A free list of `num_blocks` cache blocks of `block_size` tokens, reference-counted so that the
    sequences of an n > 1 request can share their prompt's blocks."""

    def __init__(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE):
        self.num_blocks, self.block_size = num_blocks, block_size
        # Popping from the end hands out low block ids first, which keeps small runs compact and readable.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocksError(f"need {n} KV blocks, {len(self._free)} free")
        taken = self._free[len(self._free) - n :][::-1]
        del self._free[len(self._free) - n :]
        for b in taken:
            self._refs[b] = 1
        return taken

    def share(self, blocks: list[int]) -> list[int]:
        """Another owner for blocks already allocated (their contents are read, never rewritten)."""
        for b in blocks:
            self._refs[b] += 1
        return list(blocks)

    def free(self, blocks: list[int]) -> None:
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)
