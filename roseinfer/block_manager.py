"""The KV cache manager: owns the block pool, every request's block table and the prefix cache.

Blocks are reference counted. A block whose count drops to zero goes to the back of an LRU free queue but
keeps its hash, so a later request with the same prefix can take it back until it is handed out again.
Where every layer slides, the blocks of a running request that fell out of the window are freed as it goes on
(vLLM's sliding-window manager): its table keeps its length, those entries naming a block of the pool (the first
it kept when they were freed), whose keys there no kernel reads (they start at the window) and the PyTorch path masks.
It reads a request's tokens and ``num_computed_tokens`` but never changes them: a prefix hit is reported
as a number of tokens, and the scheduler records it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from collections.abc import Sequence as TokenIds
from dataclasses import dataclass

from roseinfer.sequence import Sequence

ROOT_HASH = bytes(32)  # the parent of a request's first block
LONG_ROPE_ROOT = hashlib.sha256(b"long rope").digest()  # the same, for a request rotated by LongRoPE's long factors


def chain_hash(parent: bytes, token_ids: TokenIds[int]) -> bytes:
    """A block's prefix-cache key: SHA-256 over its parent's key and its tokens. Cryptographic, because the
    key stands for the whole prefix: a crafted collision of a weak hash would hand one request another's K/V."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


class Block:
    __slots__ = ("block_hash", "block_id", "ref_count", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: bytes | None = None
        # Kept beside the hash: a cheap second check of the block's own tokens.
        self.token_ids: tuple[int, ...] = ()


@dataclass
class PrefixHit:
    """Leading blocks of a request found in the prefix cache."""

    block_ids: list[int]
    num_tokens: int  # tokens those blocks hold: computed already, once the request is admitted with them


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, sliding_window: int = 0
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV cache needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window  # > 0: every layer reads only the last this many keys
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks, least recently used first; values unused (an ordered set).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}  # block hash -> block id
        # request id -> its block table: block i holds the request's tokens [i * block_size, (i + 1) * block_size).
        self._block_tables: dict[str, list[int]] = {}
        # request id -> how many leading blocks of its table are registered in the prefix cache.
        self._num_registered_blocks: dict[str, int] = {}
        # request id -> how many leading blocks of its table fell out of the sliding window and were freed.
        self._num_dropped_blocks: dict[str, int] = {}
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0

    # ----- read-only views -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def num_block_tables(self) -> int:
        """Requests holding blocks."""
        return len(self._block_tables)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_block_ids(self, request_id: str) -> list[int]:
        """The block table of a request ([] when it holds none). The manager's own list: read, never change it."""
        return self._block_tables.get(request_id, [])

    # ----- prefix cache ----------------------------------------------------------------------------
    def _block_hashes(self, seq: Sequence, num_full_blocks: int) -> list[bytes]:
        hashes = seq.block_hashes
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else (LONG_ROPE_ROOT if seq.long_rope else ROOT_HASH)
            hashes.append(chain_hash(parent, seq.token_ids[i * bs : (i + 1) * bs]))
        return hashes

    def get_computed_blocks(self, seq: Sequence) -> PrefixHit:
        """Leading blocks of ``seq`` already in the cache, counted in the hit-rate stats (``count_admission``)."""
        hit = self.lookup_computed_blocks(seq)
        self.count_admission(seq, hit)
        return hit

    def count_admission(self, seq: Sequence, hit: PrefixHit) -> None:
        """Count an admission with ``hit`` in the hit-rate stats (``prefix_query_tokens``, ``prefix_hit_tokens``):
        once it got its blocks, so a request refused for want of them is not counted at every step it waits; a
        preempted request's recompute not at all (its hit is mostly its own freed blocks, as ``num_cached_tokens``)."""
        if self.enable_prefix_caching and seq.num_preemptions == 0:
            self.prefix_query_tokens += seq.num_tokens
            self.prefix_hit_tokens += hit.num_tokens
            seq.admission_hit_tokens = hit.num_tokens

    def uncount_admission(self, seq: Sequence) -> None:
        """Take back ``count_admission`` of an admission whose step never ran (``Scheduler.forget_step``)."""
        if self.enable_prefix_caching and seq.num_preemptions == 0:
            self.prefix_query_tokens -= seq.num_tokens
            self.prefix_hit_tokens -= seq.admission_hit_tokens

    def lookup_computed_blocks(self, seq: Sequence) -> PrefixHit:
        """Leading blocks of ``seq`` already in the cache, left out of the stats (a look ahead, not an admission).
        At least one token is always left to compute, because the last prompt token must run through the model
        to give the next token's logits."""
        if not self.enable_prefix_caching or seq.needs_prompt_logprobs:  # (those need every prompt token's logits)
            return PrefixHit([], 0)
        max_blocks = (seq.num_tokens - 1) // self.block_size
        found: list[int] = []
        bs = self.block_size
        # The request may hold more hashes than that (a block filled by a decode that preemption then undid).
        for i, h in enumerate(self._block_hashes(seq, max_blocks)[:max_blocks]):
            block_id = self._cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tuple(seq.token_ids[i * bs : (i + 1) * bs]):
                break
            found.append(block_id)
        return PrefixHit(found, len(found) * bs)

    def _register_full_blocks(self, seq: Sequence, table: list[int], num_tokens: int) -> None:
        num_full = num_tokens // self.block_size
        # (never below the window's dropped entries: they name another block, and the count set at a reset of the
        # prefix cache falls behind them once the window moves on)
        num_registered = max(
            self._num_registered_blocks.get(seq.request_id, 0), self._num_dropped_blocks.get(seq.request_id, 0)
        )
        if num_full <= num_registered:
            return
        hashes = self._block_hashes(seq, num_full)
        bs = self.block_size
        for i in range(num_registered, num_full):
            block = self.blocks[table[i]]
            if block.block_hash is None and hashes[i] not in self._cached:
                block.block_hash = hashes[i]
                block.token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
                self._cached[hashes[i]] = block.block_id
        self._num_registered_blocks[seq.request_id] = num_full

    # ----- allocation ------------------------------------------------------------------------------
    def allocate_slots(self, seq: Sequence, num_new_tokens: int, prefix_hit: PrefixHit | None = None) -> bool:
        """Give ``seq`` room for ``num_new_tokens`` more tokens after its computed ones (and, at admission,
        after ``prefix_hit``, whose blocks it then shares). Returns False, changing nothing, when the pool
        is too small. ``seq.num_computed_tokens`` is read, never written: the scheduler records the hit."""
        table = self._block_tables.get(seq.request_id)
        if prefix_hit is None and table is not None:
            total = seq.num_computed_tokens + num_new_tokens
            if total <= len(table) * self.block_size:  # fits in the blocks it holds: most decode steps
                if self.enable_prefix_caching:
                    self._register_full_blocks(seq, table, total)
                return True
        hit_blocks = prefix_hit.block_ids if prefix_hit is not None else []
        if hit_blocks and table:
            raise ValueError("prefix hits are taken at admission, before a request holds any block")
        total = seq.num_computed_tokens + len(hit_blocks) * self.block_size + num_new_tokens
        num_new_blocks = self.blocks_needed(total) - (len(table) if table else 0) - len(hit_blocks)
        # Cached blocks that sit in the free queue stop being free once taken.
        num_revived = sum(1 for b in hit_blocks if self.blocks[b].ref_count == 0)
        if num_new_blocks > len(self._free) - num_revived:
            return False
        if table is None:
            table = self._block_tables[seq.request_id] = []
        for block_id in hit_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
            table.append(block_id)
        if hit_blocks:
            self._num_registered_blocks[seq.request_id] = len(table)
        for _ in range(num_new_blocks):
            table.append(self._take_free_block())
        if self.enable_prefix_caching:
            # Registered before the forward that fills them: every layer writes its K/V before any
            # attention reads, so a request scheduled in the same step may already share them.
            self._register_full_blocks(seq, table, total)
        return True

    def free_outside_window(self, seq: Sequence) -> None:
        """Free the blocks of ``seq`` that its next tokens no longer read: those wholly before the window of its
        first uncomputed position. A freed block keeps its hash (a later request may still hit it); its table entry
        names the first block kept (any block would do: a masked key)."""
        if not self.sliding_window:
            return
        table = self._block_tables.get(seq.request_id)
        first_read = seq.num_computed_tokens - self.sliding_window + 1  # the first key position still read
        keep_from = max(first_read, 0) // self.block_size
        dropped = self._num_dropped_blocks.get(seq.request_id, 0)
        if table is None or keep_from <= dropped or keep_from >= len(table):
            return
        for i in range(dropped, keep_from):
            block = self.blocks[table[i]]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[table[i]] = None
            table[i] = table[keep_from]
        self._num_dropped_blocks[seq.request_id] = keep_from

    def _take_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) == block_id:
                del self._cached[block.block_hash]
            block.block_hash = None
            block.token_ids = ()
        block.ref_count = 1
        return block_id

    def free(self, request_id: str) -> None:
        """Release a request's blocks and drop its table; tail blocks first, so they are evicted before
        shared prefixes."""
        table = self._block_tables.pop(request_id, None)
        self._num_registered_blocks.pop(request_id, None)
        dropped = self._num_dropped_blocks.pop(request_id, 0)
        if table is None:
            return
        for block_id in reversed(table[dropped:]):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None

    def freed_by(self, request_ids: list[str]) -> set[int]:
        """The blocks that freeing these requests would return to the pool (those no other request holds)."""
        holders = Counter(
            block_id
            for request_id in request_ids
            for block_id in self._block_tables.get(request_id, [])[self._num_dropped_blocks.get(request_id, 0) :]
        )
        return {block_id for block_id, count in holders.items() if self.blocks[block_id].ref_count == count}

    def uncache_uncomputed(self, request_id: str, num_computed_tokens: int) -> None:
        """Drop from the prefix cache the blocks of a request past its computed tokens: they were registered when
        allocated, and the step that would have written their K/V was undone (the request was un-scheduled)."""
        table = self._block_tables.get(request_id, [])
        first = num_computed_tokens // self.block_size
        for block_id in table[first:]:
            block = self.blocks[block_id]
            if block.block_hash is not None and self._cached.get(block.block_hash) == block_id:
                del self._cached[block.block_hash]
            block.block_hash = None
            block.token_ids = ()
        if request_id in self._num_registered_blocks:
            self._num_registered_blocks[request_id] = min(self._num_registered_blocks[request_id], first)

    def reset_prefix_cache(self) -> None:
        for block_id in self._cached.values():
            self.blocks[block_id].block_hash = None
            self.blocks[block_id].token_ids = ()
        self._cached.clear()
        # The requests still here register their blocks again as they run (from the first one still held: a
        # sliding window's dropped entries name another block); else the cache never held them again.
        self._num_registered_blocks = {rid: self._num_dropped_blocks.get(rid, 0) for rid in self._block_tables}
