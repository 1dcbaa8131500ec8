from roseinfer.block_manager import KVCacheManager
from roseinfer.sampling_params import SamplingParams
from roseinfer.sequence import Sequence


def seq(tokens, rid="r"):
    return Sequence(rid, tokens, SamplingParams(), None, None)


def test_allocation_grows_by_blocks_and_frees_to_zero():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    s = seq(list(range(10)))
    assert kv.allocate_slots(s, 10)
    assert len(kv.get_block_ids("r")) == 3 and kv.num_used_blocks == 3
    s.num_computed_tokens = 10  # the scheduler's part, done here by hand
    s.token_ids.append(99)
    assert kv.allocate_slots(s, 1) and len(kv.get_block_ids("r")) == 3  # slot 11 fits the third block
    kv.free("r")
    assert kv.num_used_blocks == 0 and kv.get_block_ids("r") == [] and kv.num_block_tables == 0


def test_refuses_without_changing_anything_when_full():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    s = seq(list(range(12)))
    assert not kv.allocate_slots(s, 12)
    assert kv.get_block_ids("r") == [] and kv.num_block_tables == 0 and kv.num_free_blocks == 2


def test_prefix_blocks_are_shared_reference_counted_and_reused_after_free():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = seq(list(range(10)), "a")
    miss = kv.get_computed_blocks(a)
    assert miss.block_ids == [] and miss.num_tokens == 0
    assert kv.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    b = seq(list(range(8)) + [50, 51, 52], "b")
    hit = kv.get_computed_blocks(b)
    assert hit.block_ids == kv.get_block_ids("a")[:2]  # two full blocks in common, shared without copies
    assert hit.num_tokens == 8
    assert kv.allocate_slots(b, 3, hit)
    assert b.num_computed_tokens == 0  # the manager reports the hit; recording it is the scheduler's job
    assert kv.get_block_ids("b")[:2] == kv.get_block_ids("a")[:2] and len(kv.get_block_ids("b")) == 3
    assert kv.blocks[hit.block_ids[0]].ref_count == 2
    used = kv.num_used_blocks
    assert used == 3 + 1  # a's three blocks and b's own tail block
    kv.free("a")
    kv.free("b")
    assert kv.num_used_blocks == 0 and kv.num_block_tables == 0
    c = seq(list(range(8)) + [7], "c")
    assert kv.get_computed_blocks(c).block_ids == hit.block_ids  # freed blocks stay cached until reused


def test_a_full_prompt_hit_still_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = seq(list(range(8)), "a")
    kv.allocate_slots(a, 8)
    b = seq(list(range(8)), "b")
    hit = kv.get_computed_blocks(b)
    assert len(hit.block_ids) == 1 and hit.num_tokens == 4


def test_lru_evicts_the_oldest_freed_block_and_forgets_its_hash():
    kv = KVCacheManager(num_blocks=2, block_size=2)
    a = seq([1, 2, 3], "a")
    kv.allocate_slots(a, 3)
    kv.free("a")
    assert kv.num_cached_blocks == 1
    b = seq([9, 9, 9], "b")
    assert kv.allocate_slots(b, 3)  # needs both blocks: the cached one is evicted
    assert kv.num_cached_blocks == 1  # only b's first block is cached now
    assert kv.get_computed_blocks(seq([1, 2, 3], "c")).block_ids == []


def test_a_block_key_is_sha256_of_its_whole_prefix():
    import hashlib
    import struct

    from roseinfer.block_manager import ROOT_HASH, chain_hash

    first = chain_hash(ROOT_HASH, [1, 2, 3, 4])
    assert first == hashlib.sha256(bytes(32) + struct.pack("<4q", 1, 2, 3, 4)).digest()
    # Same tokens under another parent: another key, so a block's K/V (which attended to its prefix) is never
    # served after a different prefix.
    assert chain_hash(first, [5, 6, 7, 8]) != chain_hash(chain_hash(ROOT_HASH, [9, 2, 3, 4]), [5, 6, 7, 8])
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 0], "a")
    assert kv.allocate_slots(a, 9)
    assert kv.lookup_computed_blocks(seq([9, 2, 3, 4, 5, 6, 7, 8, 0], "b")).num_tokens == 0
    assert kv.lookup_computed_blocks(seq([1, 2, 3, 4, 5, 6, 7, 8, 0], "c")).num_tokens == 8


def test_blocks_out_of_the_sliding_window_are_freed_keep_their_hash_and_are_not_freed_twice():
    kv = KVCacheManager(num_blocks=8, block_size=4, sliding_window=5)
    a = seq(list(range(14)), "a")
    assert kv.allocate_slots(a, 14)
    table = list(kv.get_block_ids("a"))
    a.num_computed_tokens = 9  # the next token, at 9, reads keys 5..9: block 0 is out of the window
    kv.free_outside_window(a)
    assert kv.num_used_blocks == 3 and kv.get_block_ids("a") == [table[1], *table[1:]]
    a.num_computed_tokens = 14  # keys 10.. : blocks 0 and 1 out
    kv.free_outside_window(a)
    kv.free_outside_window(a)  # (nothing more)
    assert kv.num_used_blocks == 2 and kv.get_block_ids("a") == [table[1], table[2], *table[2:]]
    b = seq(list(range(8)) + [70, 71], "b")
    hit = kv.get_computed_blocks(b)  # the freed blocks still hold a's first 8 tokens: a later prompt takes them
    assert hit.block_ids == table[:2] and kv.allocate_slots(b, 2, hit)
    kv.free("a")
    kv.free("b")
    assert kv.num_used_blocks == 0 and all(block.ref_count == 0 for block in kv.blocks)


def test_a_prefix_cache_reset_then_a_window_move_registers_no_block_under_another_blocks_tokens():
    """After a reset of the prefix cache a request registers its blocks again from its first one still held; the
    window moving on before its next allocation left that count behind the dropped entries, which name another
    block: that block was registered as holding the dropped blocks' tokens (a later prompt would read them)."""
    kv = KVCacheManager(num_blocks=16, block_size=4, sliding_window=5)
    a = seq(list(range(12)), "a")
    assert kv.allocate_slots(a, 12)
    a.num_computed_tokens = 12
    a.token_ids.append(12)
    kv.reset_prefix_cache()
    kv.free_outside_window(a)  # (blocks 0 and 1 leave the window: their entries name block 2 now)
    assert kv.allocate_slots(a, 1)
    table = kv.get_block_ids("a")
    registered = {b.block_id: b.token_ids for b in kv.blocks if b.block_hash is not None}
    assert registered == {table[2]: (8, 9, 10, 11)}


def test_without_a_sliding_window_nothing_is_freed_early():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = seq(list(range(14)), "a")
    assert kv.allocate_slots(a, 14)
    a.num_computed_tokens = 14
    kv.free_outside_window(a)
    assert kv.num_used_blocks == 4


def test_blocks_a_step_allocated_but_did_not_compute_serve_no_prefix_hit_until_computed():
    """A request un-scheduled in the step that allocated it (a preemption's victim later in the step): its blocks
    registered at allocation hold no K/V; another request with those tokens must not be served them."""
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = seq(list(range(8)), "a")
    assert kv.allocate_slots(a, 8)  # both full blocks registered as they are allocated
    a.num_computed_tokens = 4  # (a chunk of 4 computed; the step of the next 4 undone: that block never written)
    kv.uncache_uncomputed("a", 4)
    b = seq([*range(8), 9], "b")
    hit = kv.get_computed_blocks(b)
    assert hit.num_tokens == 4 and hit.block_ids == kv.get_block_ids("a")[:1]
    assert kv.allocate_slots(a, 4)  # scheduled again: registered again, and this time computed
    a.num_computed_tokens = 8
    kv.free("a")
    assert kv.get_computed_blocks(b).num_tokens == 8
