"""The KV cache manager: owns the block pool, block tables and the prefix cache.

Blocks are reference counted. A block whose count drops to zero goes to the back of an LRU free queue but
keeps its hash, so a later request with the same prefix can take it back until it is handed out again.
"""

from __future__ import annotations

from collections import OrderedDict

from roseinfer.sequence import Sequence


class Block:
    __slots__ = ("block_hash", "block_id", "ref_count", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None
        # Kept beside the hash so that a hash collision can never serve the wrong tokens.
        self.token_ids: tuple[int, ...] = ()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV cache needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks, least recently used first; values unused (an ordered set).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
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
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ----- prefix cache ----------------------------------------------------------------------------
    def _block_hashes(self, seq: Sequence, num_full_blocks: int) -> list[int]:
        hashes = seq.block_hashes
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash((parent, tuple(seq.token_ids[i * bs : (i + 1) * bs]))))
        return hashes

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Leading blocks of ``seq`` already in the cache. At least one token is always left to compute,
        because the last prompt token must run through the model to give the next token's logits."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        found: list[int] = []
        bs = self.block_size
        for i, h in enumerate(self._block_hashes(seq, max_blocks)):
            block_id = self._cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tuple(seq.token_ids[i * bs : (i + 1) * bs]):
                break
            found.append(block_id)
        self.prefix_query_tokens += seq.num_tokens
        self.prefix_hit_tokens += len(found) * bs
        return found

    def _register_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        num_full = num_tokens // self.block_size
        if num_full <= seq.num_registered_blocks:
            return
        hashes = self._block_hashes(seq, num_full)
        bs = self.block_size
        for i in range(seq.num_registered_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is None and hashes[i] not in self._cached:
                block.block_hash = hashes[i]
                block.token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
                self._cached[hashes[i]] = block.block_id
        seq.num_registered_blocks = num_full

    # ----- allocation ------------------------------------------------------------------------------
    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] | None = None) -> bool:
        """Give ``seq`` room for ``num_new_tokens`` more tokens after the computed ones (and after
        ``computed_blocks``, prefix-cache hits taken at admission). Returns False, changing nothing,
        when the pool is too small."""
        computed_blocks = computed_blocks or []
        num_computed = seq.num_computed_tokens + len(computed_blocks) * self.block_size
        total = num_computed + num_new_tokens
        num_new_blocks = self.blocks_needed(total) - len(seq.block_table) - len(computed_blocks)
        # Cached blocks that sit in the free queue stop being free once taken.
        num_revived = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        if num_new_blocks > len(self._free) - num_revived:
            return False
        for block_id in computed_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        if computed_blocks:
            seq.num_computed_tokens = num_computed
            seq.num_cached_tokens = num_computed
            seq.num_registered_blocks = len(seq.block_table)
        for _ in range(num_new_blocks):
            seq.block_table.append(self._take_free_block())
        if self.enable_prefix_caching:
            # Registered before the forward that fills them: every layer writes its K/V before any
            # attention reads, so a request scheduled in the same step may already share them.
            self._register_full_blocks(seq, total)
        return True

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

    def free(self, seq: Sequence) -> None:
        """Release the blocks of ``seq``; tail blocks first, so they are evicted before shared prefixes."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0

    def reset_prefix_cache(self) -> None:
        for block_id in self._cached.values():
            self.blocks[block_id].block_hash = None
            self.blocks[block_id].token_ids = ()
        self._cached.clear()
