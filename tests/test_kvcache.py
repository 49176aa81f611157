"""Block manager unit tests: the block pool, ref counts, the prefix-cache hash
chain and its LRU eviction, slot mapping and KV sizing. Pure Python: requests
are ids and token lists, as the block manager sees them."""
import hashlib
from array import array

import pytest
import torch

from nanoserve.kvcache import (BlockManager, KVCacheSpec, check_fits, hash_block, plan_kv_cache,
                               compute_slot_mapping)

BS = 4


def toks(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def ref_counts(bm: BlockManager) -> list[int]:
    return [b.ref_cnt for b in bm.blocks]


# ---------------------------------------------------------------- allocate / free

def test_allocate_covers_tokens_and_counts_refs():
    bm = BlockManager(8, BS)
    assert bm.allocate_slots("a", toks(10), 10)
    table = bm.req_to_blocks["a"]
    assert len(table) == 3 and len(set(table)) == 3  # ceil(10 / 4)
    assert all(bm.blocks[b].ref_cnt == 1 for b in table)
    assert bm.num_free_blocks == 5
    assert bm.usage == pytest.approx(3 / 8)


def test_unused_slots_are_the_last_blocks_tails_sampled_at_the_peak():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    assert bm.allocate_slots("a", toks(5), 5)           # 2 blocks, 3 slots unused
    assert bm.allocate_slots("b", toks(4, 100), 4)      # 1 full block
    assert bm.unused_slots == 3
    assert (bm.peak_used_blocks, bm.unused_slots_at_peak) == (3, 3)
    assert bm.allocate_slots("a", toks(7), 7)           # same blocks, 1 slot unused
    assert bm.unused_slots == 1 and bm.unused_slots_at_peak == 1
    # A prefix hit shares a's full first block: shared blocks waste nothing.
    hits = bm.get_computed_blocks(toks(6))
    assert len(hits) == 1
    assert bm.allocate_slots("c", toks(6), 6, hits)     # + 1 new block, 2 unused
    assert bm.unused_slots == 3 and bm.peak_used_blocks == 4
    bm.free("a")
    bm.free("c")
    assert bm.unused_slots == 0
    assert (bm.peak_used_blocks, bm.unused_slots_at_peak) == (4, 3)  # the peak is kept
    bm.free("b")
    assert bm.unused_slots == 0 and bm.req_unused == {}


def test_allocate_grows_the_table_one_block_at_a_time():
    bm = BlockManager(8, BS)
    assert bm.allocate_slots("a", toks(4), 4)
    first = bm.req_to_blocks["a"]
    assert bm.allocate_slots("a", toks(5), 5)  # the fifth token needs a second block
    assert bm.req_to_blocks["a"][:1] == first and len(bm.req_to_blocks["a"]) == 2
    assert len(first) == 1  # a table handed out is never changed in place (a step's inputs hold it)
    assert bm.allocate_slots("a", toks(6), 6)  # still fits in the second block
    assert len(bm.req_to_blocks["a"]) == 2 and bm.num_free_blocks == 6


def test_allocate_fails_without_changing_anything():
    bm = BlockManager(3, BS)
    assert bm.allocate_slots("a", toks(8), 8)
    before = (ref_counts(bm), list(bm.free_blocks), dict(bm.req_to_blocks))
    assert not bm.allocate_slots("b", toks(8, 100), 8)  # needs 2 blocks, 1 free
    assert not bm.allocate_slots("a", toks(13), 13)     # needs 2 more
    assert (ref_counts(bm), list(bm.free_blocks), dict(bm.req_to_blocks)) == before
    assert "b" not in bm.req_to_blocks


def test_free_returns_every_block():
    bm = BlockManager(6, BS)
    bm.allocate_slots("a", toks(9), 9)
    bm.allocate_slots("b", toks(5, 50), 5)
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == bm.num_blocks
    assert ref_counts(bm) == [0] * 6
    assert "a" not in bm.req_to_blocks
    bm.free("never-allocated")  # freeing an unknown id is a no-op (abort of a waiting request)
    assert bm.num_free_blocks == 6


def test_constructor_rejects_empty_pool():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, BS)


# ---------------------------------------------------------------- prefix cache

def test_shared_prefix_hits_the_same_blocks_and_raises_ref_counts():
    bm = BlockManager(10, BS)
    bm.allocate_slots("a", toks(10), 10)           # blocks 0-3, 4-7 full and hashed
    a_table = bm.req_to_blocks["a"]
    prompt_b = toks(8) + [99, 98, 97]
    hits = bm.get_computed_blocks(prompt_b)
    assert hits == a_table[:2]
    assert bm.allocate_slots("b", prompt_b, len(prompt_b), hits)
    assert bm.req_to_blocks["b"][:2] == a_table[:2]
    assert bm.req_to_blocks["b"][2] not in a_table  # the divergent tail is its own block
    assert [bm.blocks[b].ref_cnt for b in a_table[:2]] == [2, 2]
    bm.free("a")
    assert [bm.blocks[b].ref_cnt for b in a_table[:2]] == [1, 1]  # still b's
    bm.free("b")
    assert bm.num_free_blocks == 10


def test_partial_block_is_never_a_hit():
    bm = BlockManager(10, BS)
    bm.allocate_slots("a", toks(7), 7)  # one full block, one partial
    assert len(bm.get_computed_blocks(toks(7) + [1])) == 1


def test_last_prompt_token_is_always_left_to_compute():
    # A prompt entirely in the cache still recomputes its last block: its last
    # token's logits are needed to sample.
    bm = BlockManager(10, BS)
    bm.allocate_slots("a", toks(8), 8)
    assert len(bm.get_computed_blocks(toks(8))) == 1
    assert len(bm.get_computed_blocks(toks(9))) == 2


def test_hash_chain_depends_on_the_parent():
    # The same tokens after a different prefix are a different block.
    bm = BlockManager(10, BS)
    bm.allocate_slots("a", [1, 1, 1, 1, 2, 2, 2, 2, 0], 9)
    assert bm.get_computed_blocks([2, 2, 2, 2, 0]) == []
    assert hash_block(None, (2, 2, 2, 2)) != hash_block(hash_block(None, (1, 1, 1, 1)), (2, 2, 2, 2))
    assert len(bm.get_computed_blocks([1, 1, 1, 1, 2, 2, 2, 2, 5])) == 2


def test_block_hash_is_chained_sha256():
    # A cryptographic hash, as vLLM's default: Python's hash() collides on
    # purpose-built inputs (e.g. ints equal mod 2**61 - 1), and a collision would
    # hand one request another's KV.
    root = hash_block(None, [1, 2, 3, 4])
    assert root == hashlib.sha256(array("q", [1, 2, 3, 4]).tobytes()).digest()
    assert hash_block(root, (5, 6, 7, 8)) == hashlib.sha256(root + array("q", [5, 6, 7, 8]).tobytes()).digest()
    assert hash_block(None, [5]) != hash_block(None, [5 + 2**61 - 1])


def test_blocks_are_cached_when_the_step_fills_them_not_before():
    bm = BlockManager(10, BS)
    bm.allocate_slots("a", toks(12), 3)  # a first chunk of 3 tokens: nothing full yet
    assert bm.get_computed_blocks(toks(12)) == []
    bm.allocate_slots("a", toks(12), 8)  # the chunk that fills two blocks
    assert bm.get_computed_blocks(toks(12)) == bm.req_to_blocks["a"][:2]


def test_freed_cached_block_is_reused_by_a_later_identical_prefix():
    bm = BlockManager(4, BS)
    bm.allocate_slots("a", toks(9), 9)
    a_table = bm.req_to_blocks["a"]
    bm.free("a")
    assert bm.num_free_blocks == 4
    hits = bm.get_computed_blocks(toks(9))
    assert hits == a_table[:2]
    assert bm.allocate_slots("b", toks(9), 9, hits)
    assert bm.req_to_blocks["b"][:2] == a_table[:2]
    assert bm.num_free_blocks == 1  # the two revived hits left the free list


def test_revived_hits_count_against_free_blocks():
    bm = BlockManager(4, BS)
    bm.allocate_slots("a", toks(9), 9)
    bm.free("a")
    # 2 cached hits (both on the free list) + 3 new blocks = 5 > 4: must fail cleanly.
    prompt = toks(8) + toks(12, 200)
    hits = bm.get_computed_blocks(prompt)
    assert len(hits) == 2
    assert not bm.allocate_slots("b", prompt, len(prompt), hits)
    assert bm.num_free_blocks == 4 and ref_counts(bm) == [0] * 4


def test_allocation_evicts_the_least_recently_freed_block():
    bm = BlockManager(3, BS)
    bm.allocate_slots("a", toks(4, 0), 4)
    bm.allocate_slots("b", toks(4, 10), 4)
    bm.allocate_slots("c", toks(4, 20), 4)
    a_block, = bm.req_to_blocks["a"]
    b_block, = bm.req_to_blocks["b"]
    for rid in ("a", "b", "c"):
        bm.free(rid)
    bm.allocate_slots("d", toks(4, 30), 4)  # takes the oldest freed block: a's
    assert bm.req_to_blocks["d"] == [a_block]
    assert bm.get_computed_blocks(toks(4, 0) + [0]) == []         # a's prefix is evicted
    assert bm.get_computed_blocks(toks(4, 10) + [0]) == [b_block]  # b's survives
    assert bm.blocks[a_block].block_hash is not None  # now d's hash, not a's


def test_hit_refreshes_a_block_in_the_lru():
    bm = BlockManager(2, BS)
    bm.allocate_slots("a", toks(4, 0), 4)
    bm.allocate_slots("b", toks(4, 10), 4)
    a_block, = bm.req_to_blocks["a"]
    bm.free("a")
    bm.free("b")
    # a is hit and freed again: now b's block is the least recently used.
    bm.allocate_slots("a2", toks(4, 0) + [0], 5, bm.get_computed_blocks(toks(4, 0) + [0]))
    bm.free("a2")
    bm.allocate_slots("x", toks(4, 50), 4)
    assert bm.get_computed_blocks(toks(4, 0) + [0]) == [a_block]


def test_prefix_outlives_its_continuation_and_partial_blocks_go_first():
    bm = BlockManager(3, BS)
    bm.allocate_slots("a", toks(10), 10)  # full, full, partial
    first, second, partial = bm.req_to_blocks["a"]
    bm.free("a")
    assert list(bm.free_blocks) == [partial, second, first]
    bm.allocate_slots("b", toks(4, 100), 4)   # evicts nothing useful
    assert bm.req_to_blocks["b"] == [partial]
    bm.allocate_slots("c", toks(4, 200), 4)   # evicts the continuation, keeps the prefix
    assert bm.req_to_blocks["c"] == [second]
    assert bm.get_computed_blocks(toks(10)) == [first]


def test_prefix_caching_off_never_hits():
    bm = BlockManager(10, BS, enable_prefix_caching=False)
    bm.allocate_slots("a", toks(9), 9)
    assert bm.get_computed_blocks(toks(9)) == []
    assert all(b.block_hash is None for b in bm.blocks)
    bm.free("a")
    assert bm.num_free_blocks == 10


def test_reset_prefix_cache_forgets_free_blocks_only():
    bm = BlockManager(10, BS)
    bm.allocate_slots("a", toks(5, 0), 5)
    bm.allocate_slots("b", toks(5, 50), 5)
    bm.free("a")
    bm.reset_prefix_cache()
    assert bm.get_computed_blocks(toks(5, 0)) == []
    assert bm.get_computed_blocks(toks(5, 50)) == bm.req_to_blocks["b"][:1]


def test_prefix_query_counters():
    bm = BlockManager(10, BS)
    bm.record_prefix_query(10, 4)
    bm.record_prefix_query(6, 0)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (16, 4)


# ---------------------------------------------------------------- slot mapping and sizing

def test_slot_mapping_follows_the_block_table():
    block_tables = torch.tensor([[5, 2, 0], [7, 1, 3]], dtype=torch.int32)
    seq_ids = torch.tensor([0, 0, 0, 1, 1])
    positions = torch.tensor([0, 3, 4, 2, 9])
    got = compute_slot_mapping(block_tables, seq_ids, positions, block_size=4)
    assert got.tolist() == [5 * 4 + 0, 5 * 4 + 3, 2 * 4 + 0, 7 * 4 + 2, 3 * 4 + 1]


def test_bytes_per_block():
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float32, block_size=16)
    assert spec.bytes_per_block == 2 * 2 * 16 * 2 * 32 * 4  # K and V, layers, tokens, heads, dim, fp32


def test_plan_from_budget_and_override():
    spec = KVCacheSpec(2, 2, 32, torch.float32, 16)
    assert plan_kv_cache(spec, 10 * spec.bytes_per_block + 1, None).num_blocks == 10
    assert plan_kv_cache(spec, None, 7).num_blocks == 7
    with pytest.raises(ValueError, match="num_kv_blocks"):
        plan_kv_cache(spec, None, 0)
    with pytest.raises(ValueError, match="budget.*gpu-memory-utilization"):
        plan_kv_cache(spec, 0, None)


def test_budget_below_one_block_is_a_clear_error():
    # It used to plan 0 blocks, and the start-up log line then divided by zero.
    spec = KVCacheSpec(2, 2, 32, torch.float32, 16)
    with pytest.raises(ValueError, match=r"buys no block.*--kv-cache-memory-bytes to at least 16384"):
        plan_kv_cache(spec, spec.bytes_per_block - 1, None)
    assert plan_kv_cache(spec, spec.bytes_per_block, None).num_blocks == 1


def test_check_fits_names_the_knobs():
    spec = KVCacheSpec(2, 2, 32, torch.float32, 16)
    check_fits(plan_kv_cache(spec, None, 4), spec, 64)  # exactly enough: no error
    with pytest.raises(ValueError, match="KV cache too small") as e:
        check_fits(plan_kv_cache(spec, None, 3), spec, 64)
    msg = str(e.value)
    assert "max-model-len" in msg and "at most 48" in msg and "--num-kv-blocks to at least 4" in msg


def test_too_small_num_kv_blocks_suggests_only_knobs_that_work():
    # With --num-kv-blocks set, the byte budget is ignored, so it must not be suggested.
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32, block_size=16)
    plan = plan_kv_cache(spec, None, num_kv_blocks=2)
    with pytest.raises(ValueError) as e:
        check_fits(plan, spec, max_model_len=100)
    msg = str(e.value)
    assert "--num-kv-blocks to at least 7" in msg and "--max-model-len to at most 32" in msg
    assert "--kv-cache-memory-bytes" not in msg


# ---------------------------------------------------------------- sliding window

def test_blocks_before_the_window_go_back_and_the_null_block_takes_their_place():
    bm = BlockManager(8, BS, sliding_window=6)
    assert bm.num_blocks == 7 and 0 not in bm.free_blocks  # block 0: the null block, never allocated
    bm.allocate_slots("a", toks(18), 18)                     # 5 blocks: tokens 0..17
    table = bm.req_to_blocks["a"]
    assert 0 not in table and bm.num_free_blocks == 2
    bm.free_skipped_blocks("a", 14)                          # a query at 14 reads from 9: blocks 0, 1 are freed
    assert bm.req_to_blocks["a"] == [0, 0] + table[2:] and table[0] != 0  # a new list; the old one kept
    assert bm.num_free_blocks == 4 and [bm.blocks[b].ref_cnt for b in table[:2]] == [0, 0]
    bm.free_skipped_blocks("a", 16)                          # from 11: no block more is wholly before it
    assert bm.num_free_blocks == 4
    bm.allocate_slots("a", toks(22), 22)
    bm.free_skipped_blocks("a", 21)                          # from 16
    assert bm.req_to_blocks["a"][:4] == [0, 0, 0, 0] and bm.num_free_blocks == 5
    bm.free("a")                                             # the rest, each once
    assert bm.num_free_blocks == 7 and all(b.ref_cnt == 0 for b in bm.blocks)
    stats = bm.make_stats()
    assert stats.num_total_blocks == stats.num_free_blocks == 7


def test_a_freed_window_block_stays_in_the_prefix_cache():
    """Freed out of the window, a full block keeps its hash: a later prompt with the
    same prefix hits it (until it is evicted), as any freed cached block; the blocks
    before the hit's window are not taken back, the null block stands in for them."""
    bm = BlockManager(8, BS, sliding_window=4)
    bm.allocate_slots("a", toks(12), 12)
    first, second = bm.req_to_blocks["a"][:2]
    bm.free_skipped_blocks("a", 11)  # a query at 11 reads from 8: blocks 0, 1
    assert bm.get_computed_blocks(toks(10)) == [0, second]  # a query at 8 reads from 5: block 1 on
    assert bm.allocate_slots("b", toks(10), 10, bm.get_computed_blocks(toks(10)))[:2] == [0, second]
    assert bm.blocks[second].ref_cnt == 1 and bm.blocks[first].ref_cnt == 0 and first in bm.free_blocks
    bm.free("b")
    bm.free("a")
    assert bm.num_free_blocks == 7 and all(b.ref_cnt == 0 for b in bm.blocks)


def test_a_window_hit_needs_only_the_blocks_its_window_reads():
    """vLLM's SlidingWindowManager: a prompt hits the longest prefix whose next query's window
    is cached, though blocks before it were evicted; the blocks it then fills chain their
    hashes to the whole prefix (the same as without a window), so later prompts hit them."""
    bm = BlockManager(10, BS, sliding_window=6)
    prompt = toks(30) + [1, 2]
    bm.allocate_slots("a", prompt, 30)  # tokens 0..29: 8 blocks, the first 7 full and cached
    table = bm.req_to_blocks["a"]
    bm.free("a")
    for b in table[:2]:  # evicted: their hashes gone
        del bm.cached[bm.blocks[b].block_hash]
        bm.blocks[b].block_hash = None
    hits = bm.get_computed_blocks(prompt)  # 7 blocks before the last token; a query at 28 reads from 23
    assert hits == [0] * 5 + table[5:7]
    assert bm.get_computed_blocks(prompt[:20] + [9] * 12) == [0] * 3 + table[3:5]  # at 20: reads from 15
    plain = BlockManager(10, BS)
    assert bm.allocate_slots("b", prompt, 32, hits) is not None and bm.num_free_blocks == 9 - 2 - 1
    plain.allocate_slots("b", prompt, 32)
    assert bm.req_hashes["b"] == plain.req_hashes["b"]  # the chain from the tokens, not the null block
    assert bm.blocks[0].block_hash is None and 0 not in bm.cached.values()
