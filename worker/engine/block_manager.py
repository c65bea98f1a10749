"""The KV-cache block manager (pure Python): fixed-size blocks, per-request block tables,
and prefix caching.

A full block is keyed by the hash of its tokens and of the chain of blocks before it, so two
requests with the same prefix share the same physical blocks (reference counted). A block
whose count drops to zero goes to the end of the free list but keeps its key, so a later
request with that prefix can take it back; allocation takes the least recently freed block
and forgets its key then (LRU eviction).

The hash is stable (the same in every process and machine), so the shared KV tier
(worker/engine/kv_tier.py) keys blocks by it: a block this worker filled is listed for offloading
(take_filled), and one fetched from the tier joins the cache as if freed here (adopt).

A request of a LoRA adapter computes other keys and values for the same tokens: its chain starts
from the adapter's root (`root`, worker/model/lora.py) instead of none, so its blocks are never shared
with the base model's or another adapter's; the base model's hashes are those of a chain with no root.
A tenant's chain starts from its own root the same way (shared/prefix_scope.py, joined with its
adapter's), so a cache hit never tells one tenant what another sent.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple
from collections.abc import Sequence


@dataclass
class Block:
    id: int
    ref_count: int = 0
    key: tuple[int | None, tuple[int, ...]] | None = None  # (parent hash, tokens) once full and cached
    hash: int | None = None


@dataclass
class _Table:
    blocks: list[int] = field(default_factory=list)
    hashed: int = 0  # how many leading blocks are registered in the prefix cache
    root: int | None = None  # the parent of its first block: its tenant's and LoRA adapter's root (None: neither)


class NoFreeBlocks(RuntimeError):
    pass


class ChainBlock(NamedTuple):
    """A full block of a token sequence: its hash, its parent's hash (None for the first), its tokens."""

    hash: int
    parent: int | None
    tokens: tuple[int, ...]


def block_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    """A 128-bit hash of a block's tokens and of the chain before it (`parent`, its hash), the
    same in every process: Python's own hash() differs between builds and versions."""
    head = b"root" if parent is None else parent.to_bytes(16, "little")
    return int.from_bytes(hashlib.blake2b(head + array("q", tokens).tobytes(), digest_size=16).digest(), "little")


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must both be >= 1")
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._tables: dict[str, _Table] = {}
        self.prefix_queries = 0  # blocks looked up in the prefix cache
        self.prefix_hits = 0  # ... and found
        self._filled: list[int] = []  # blocks keyed since the last take_filled: computed here

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    def table(self, seq_id: str) -> list[int]:
        return self._tables[seq_id].blocks if seq_id in self._tables else []

    def blocks_needed(self, seq_id: str, num_tokens: int) -> int:
        """New blocks `seq_id` would need to hold `num_tokens` tokens."""
        have = len(self.table(seq_id))
        return max(0, -(-num_tokens // self.block_size) - have)

    # -- changes ---------------------------------------------------------------------------
    def allocate_prefix(self, seq_id: str, token_ids: Sequence[int], root: int | None = None) -> int:
        """Start a table for `seq_id`, sharing every cached full block of its prefix (the chain
        from `root`: its tenant's and LoRA adapter's, shared/prefix_scope.py).

        Returns how many tokens are already computed. The last token is never taken from the
        cache: its forward gives the logits of the first new token.
        """
        table = self._tables.setdefault(seq_id, _Table())
        assert not table.blocks, f"{seq_id} already has blocks"
        table.root = root
        if not self.prefix_caching:
            return 0
        for link in self._chain(token_ids, (len(token_ids) - 1) // self.block_size, parent=root):
            self.prefix_queries += 1
            block_id = self._cached_id(link)
            if block_id is None:
                break
            self.prefix_hits += 1
            self._take(block_id)
            table.blocks.append(block_id)
        table.hashed = len(table.blocks)
        return len(table.blocks) * self.block_size

    def append_slots(self, seq_id: str, num_tokens: int) -> None:
        """Grow `seq_id`'s table to hold `num_tokens` tokens. Raises NoFreeBlocks if it can't."""
        needed = self.blocks_needed(seq_id, num_tokens)
        if needed > self.num_free:
            raise NoFreeBlocks(f"{seq_id} needs {needed} blocks, {self.num_free} free")
        table = self._tables.setdefault(seq_id, _Table())
        for _ in range(needed):
            block_id = next(iter(self._free))  # least recently freed
            self._forget(block_id)
            self._take(block_id)
            table.blocks.append(block_id)

    def truncate(self, seq_id: str, num_tokens: int) -> None:
        """Shrink `seq_id`'s table to what `num_tokens` tokens need (speculative tokens that were
        rejected). The blocks given back were never registered: they go first in line for reuse."""
        table = self._tables[seq_id]
        keep = -(-num_tokens // self.block_size)
        assert table.hashed <= keep, f"{seq_id}: cannot drop registered blocks"
        while len(table.blocks) > keep:
            block = self.blocks[table.blocks.pop()]
            block.ref_count -= 1
            assert block.ref_count == 0 and block.key is None, f"block {block.id} was shared"
            self._free[block.id] = None
            self._free.move_to_end(block.id, last=False)

    def register(self, seq_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """Add `seq_id`'s blocks that are now full and computed to the prefix cache."""
        if not self.prefix_caching:
            return
        table = self._tables[seq_id]
        full = min(num_computed // self.block_size, len(table.blocks))
        parent = self.blocks[table.blocks[table.hashed - 1]].hash if table.hashed else table.root
        for i, link in enumerate(self._chain(token_ids, full, table.hashed, parent), start=table.hashed):
            block = self.blocks[table.blocks[i]]
            block.key, block.hash = (link.parent, link.tokens), link.hash
            if self._cached.setdefault(link.hash, block.id) == block.id:
                self._filled.append(block.id)
        table.hashed = max(table.hashed, full)

    def free(self, seq_id: str) -> None:
        """Release `seq_id`'s blocks; cached ones stay findable until reused."""
        table = self._tables.pop(seq_id, None)
        if table is None:
            return
        # Tail blocks first, so the head of a prefix (the most shareable part) is evicted last.
        for block_id in reversed(table.blocks):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None

    def missing_prefix(self, token_ids: Sequence[int], root: int | None = None) -> list[ChainBlock]:
        """The full blocks of `token_ids`' prefix (as allocate_prefix would take them) from the
        first that is not in the cache on. The cached ones before it that are free move to the
        recently-freed end, so that adopting the missing ones does not evict them."""
        if not self.prefix_caching:
            return []
        missing: list[ChainBlock] = []
        for link in self._chain(token_ids, (len(token_ids) - 1) // self.block_size, parent=root):
            block_id = None if missing else self._cached_id(link)
            if block_id is None:
                missing.append(link)
            elif self.blocks[block_id].ref_count == 0:
                self._free.move_to_end(block_id)
        return missing

    def adopt(self, link: ChainBlock) -> int | None:
        """Take the least recently freed block for a block computed elsewhere (the shared tier's),
        keyed as if computed here and freed just now; its id (the caller writes its keys and
        values), or None where no block is free."""
        if not self._free:
            return None
        block_id = next(iter(self._free))
        self._forget(block_id)
        block = self.blocks[block_id]
        block.key, block.hash = (link.parent, link.tokens), link.hash
        self._cached[link.hash] = block_id
        self._free.move_to_end(block_id)
        return block_id

    def take_filled(self) -> list[Block]:
        """The blocks keyed since the last call (filled by this worker's steps), once each."""
        filled, self._filled = self._filled, []
        return [self.blocks[i] for i in filled if self.blocks[i].hash is not None]

    def clear_prefix_cache(self) -> None:
        """Forget every cached prefix (after a failed step, whose blocks may hold garbage)."""
        for block in self.blocks:
            block.key = block.hash = None
        self._cached.clear()
        self._filled.clear()
        for table in self._tables.values():
            table.hashed = 0

    def _chain(self, token_ids: Sequence[int], end: int, first: int = 0,
               parent: int | None = None) -> Iterator[ChainBlock]:
        """Full blocks first .. end-1 of `token_ids`, each hashed once; `parent`: block first-1's hash."""
        for i in range(first, end):
            tokens = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
            h = block_hash(parent, tokens)
            yield ChainBlock(h, parent, tokens)
            parent = h

    def _cached_id(self, link: ChainBlock) -> int | None:
        """The cached block holding `link`, if any (its key compared too, not the hash alone)."""
        block_id = self._cached.get(link.hash)
        if block_id is None or self.blocks[block_id].key != (link.parent, link.tokens):
            return None
        return block_id

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self._free.pop(block_id, None)
        block.ref_count += 1

    def _forget(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.hash is not None and self._cached.get(block.hash) == block_id:
            del self._cached[block.hash]
        block.key = block.hash = None
