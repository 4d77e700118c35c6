"""The paged KV cache's bookkeeping: a pool of fixed-size blocks, reference-counted and content-addressed.

The cache memory itself belongs to the backend (`backend.allocate_kv_cache`); this module only decides, with
integers, which blocks hold which sequence's tokens.

Automatic prefix caching: a block full of computed tokens is registered under a hash of its contents (the hash
of the block before it, its token ids, and for the first block the request's cache salt), so a later request
whose tokens begin the same way takes the block instead of computing it again. A registered block is read-only:
its owners only ever write past it. When its last owner lets it go it stays cached on the free list, ordered by
when it was last used, and is only reused (its hash dropped) when a new block is needed and nothing older is free.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

DEFAULT_BLOCK_SIZE = 16


class OutOfBlocksError(RuntimeError):
    """The pool has fewer free blocks than a request needs."""


def block_hashes(parent: bytes | None, token_ids: list[int], block_size: int, salt: str | None = None) -> list[bytes]:
    """The chained hashes of the full blocks of `token_ids`, continuing after a block whose hash is `parent`
    (None: these are the sequence's first blocks, and the salt enters the first one). SHA-256, so that one
    tenant cannot forge a collision with another's blocks."""
    if parent is None:  # a digest too, so that no salt can spell another chain's parent
        parent = hashlib.sha256(b"infero prefix root\0" + (salt or "").encode()).digest()
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = hashlib.sha256(parent)
        h.update(array("q", token_ids[start : start + block_size]).tobytes())
        parent = h.digest()
        hashes.append(parent)
    return hashes


class BlockPool:
    """`num_blocks` cache blocks of `block_size` tokens. A block has owners (sequences sharing a prompt or a
    cached prefix hold it together) or is free; a free block may still hold a cached prefix block."""

    def __init__(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE, enable_caching: bool = True):
        self.num_blocks, self.block_size, self.enable_caching = num_blocks, block_size, enable_caching
        # Least recently used first. Low block ids are handed out first, which keeps small runs readable.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._refs = [0] * num_blocks
        self._block_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}

    @property
    def num_free(self) -> int:
        """Blocks without an owner, cached or not: all of them can be allocated."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Registered blocks (with owners or not)."""
        return len(self._hash_of)

    @property
    def num_referenced(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        """`n` blocks for new tokens, the least recently used first; a cached block taken here loses its hash."""
        if n > len(self._free):
            raise OutOfBlocksError(f"need {n} KV blocks, {len(self._free)} free")
        taken = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            h = self._hash_of.pop(b, None)
            if h is not None:
                del self._block_of[h]
            self._refs[b] = 1
            taken.append(b)
        return taken

    def share(self, blocks: list[int]) -> list[int]:
        """Another owner for blocks whose contents are computed (read, never rewritten); a cached free block is
        taken off the free list."""
        for b in blocks:
            if self._refs[b] == 0:
                del self._free[b]
            self._refs[b] += 1
        return list(blocks)

    def free(self, blocks: list[int]) -> None:
        """Drop one owner of each block. Given in sequence order, the tail goes first: a later prompt is least
        likely to share it. A block that holds nothing cached goes to the front, to be reused before any cached one."""
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free[b] = None
                if b not in self._hash_of:
                    self._free.move_to_end(b, last=False)

    def cached_prefix(self, hashes: list[bytes]) -> list[int]:
        """The blocks registered under the longest run of `hashes` from the first (not yet shared: see `share`)."""
        blocks = []
        for h in hashes:
            b = self._block_of.get(h)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def num_free_among(self, blocks: list[int]) -> int:
        """How many of `blocks` are on the free list (sharing them takes them off it)."""
        return sum(self._refs[b] == 0 for b in blocks)

    def register(self, block: int, block_hash: bytes) -> None:
        """Record that `block` is full of computed tokens with this hash. A block already registered, or one whose
        contents another block already holds (two requests computed the same prefix at once), is left as it is."""
        if block not in self._hash_of and block_hash not in self._block_of:
            self._hash_of[block] = block_hash
            self._block_of[block_hash] = block

    def is_registered(self, block: int) -> bool:
        return block in self._hash_of
