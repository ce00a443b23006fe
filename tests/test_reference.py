"""The reference implementation's own cache tests (ferrox-core cache.rs), one
test per behaviour, ported. Where the design decides differently from the Rust
original (panics become exceptions), the test says so."""
import copy
import gc

import numpy as np
import pytest

from ferrox_kv import KvBlockPool, KvCache, KvPoolExhausted


def f32(*xs):
    return np.array(xs, dtype=np.float32)


def test_push_grows_seq_len_and_stores_values():
    c = KvCache(2, 2)
    c.push(f32(1, 2, 3, 4), f32(5, 6, 7, 8))
    c.push(f32(9, 10, 11, 12), f32(13, 14, 15, 16))
    assert c.seq_len == 2 and len(c) == 2
    k = c.k.reshape(-1)
    assert k.size == 8
    assert k[4] == 9.0
    assert c.v.reshape(-1)[4] == 13.0


def test_push_wrong_size_raises_value_error():
    c = KvCache(2, 2)
    with pytest.raises(ValueError, match="k_step must have 4 values"):
        c.push(f32(1, 2), f32(1, 2, 3, 4))
    assert c.seq_len == 0


def test_clear_resets_state():
    c = KvCache(2, 2)
    c.push(f32(1, 2, 3, 4), f32(5, 6, 7, 8))
    c.clear()
    assert c.seq_len == 0
    assert c.k.size == 0 and c.v.size == 0


def _three(c):
    for i in range(3):
        c.push(np.full(4, i + 1, np.float32), np.full(4, 10 * (i + 1), np.float32))


def test_truncate_rolls_back_to_exact_length_preserving_earlier_data():
    c = KvCache(2, 2)
    _three(c)
    c.truncate(1)
    assert c.seq_len == 1
    np.testing.assert_array_equal(c.k.reshape(-1), np.full(4, 1, np.float32))
    np.testing.assert_array_equal(c.v.reshape(-1), np.full(4, 10, np.float32))


def test_truncate_to_current_length_is_a_no_op():
    c = KvCache(2, 2)
    _three(c)
    before = c.k.copy()
    c.truncate(3)
    assert c.seq_len == 3
    np.testing.assert_array_equal(c.k, before)


def test_truncate_to_zero_empties_the_cache():
    c = KvCache(2, 2)
    _three(c)
    c.truncate(0)
    assert c.seq_len == 0 and c.k.shape == (0, 2, 2)


def test_truncate_beyond_current_length_raises_value_error():
    c = KvCache(2, 2)
    c.push(f32(1, 2, 3, 4), f32(1, 2, 3, 4))
    with pytest.raises(ValueError, match="truncate target 5 must not exceed current seq_len 1"):
        c.truncate(5)
    assert c.seq_len == 1


def test_push_after_truncate_continues_correctly():
    c = KvCache(1, 1)
    for k, v in [(1, 10), (2, 20), (3, 30)]:
        c.push(f32(k), f32(v))
    c.truncate(2)
    c.push(f32(99), f32(990))
    np.testing.assert_array_equal(c.k.reshape(-1), f32(1, 2, 99))
    np.testing.assert_array_equal(c.v.reshape(-1), f32(10, 20, 990))


def test_with_capacity_preallocates_and_never_reallocates_within_plan():
    c = KvCache.with_capacity(4, 8, 16)
    addr = c.k.__array_interface__["data"][0]
    for i in range(16):
        c.push(np.full(32, i, np.float32), np.full(32, -i, np.float32))
        assert c.k.__array_interface__["data"][0] == addr
    assert c.is_within_planned_capacity()
    assert c.allocated_bytes() == 16 * 32 * 2 * 4


def test_allocated_bytes_reflects_preallocated_capacity_not_just_used_length():
    c = KvCache.with_capacity(4, 8, 100)
    assert c.seq_len == 0
    assert c.allocated_bytes() >= 25_600


def test_grow_as_you_go_cache_reports_not_within_planned_capacity():
    c = KvCache(2, 2)
    c.push(f32(1, 2, 3, 4), f32(1, 2, 3, 4))
    assert not c.is_within_planned_capacity()


def test_with_pool_acquires_one_block_and_reports_it_in_free_blocks():
    pool = KvBlockPool(4, 10, 2, 2)
    c = KvCache.with_pool(2, 2, pool, 0)
    assert pool.free_blocks == 9
    assert c.blocks_held == 1 and c.is_pooled


def test_with_pool_fails_without_mutating_the_pool_when_exhausted():
    pool = KvBlockPool(4, 0, 2, 2)
    with pytest.raises(KvPoolExhausted) as ei:
        KvCache.with_pool(2, 2, pool, 0)
    assert ei.value.requested == 1 and ei.value.free == 0
    assert pool.free_blocks == 0 and pool.used_blocks == 0


def test_push_acquires_additional_blocks_as_the_cache_crosses_block_boundaries():
    pool = KvBlockPool(2, 10, 1, 2)
    c = KvCache.with_pool(1, 2, pool, 0)
    seen = []
    for i in range(3):
        c.push(f32(i, i), f32(i, i))
        seen.append(pool.free_blocks)
    assert seen == [9, 9, 8]
    assert c.blocks_held == 2


def test_push_returns_pool_exhausted_and_leaves_state_unchanged_when_no_blocks_remain():
    pool = KvBlockPool(1, 1, 1, 2)
    c = KvCache.with_pool(1, 2, pool, 1)
    c.push(f32(1, 2), f32(3, 4))
    with pytest.raises(KvPoolExhausted):
        c.push(f32(5, 6), f32(7, 8))
    assert c.seq_len == 1 and c.blocks_held == 1 and pool.free_blocks == 0
    np.testing.assert_array_equal(c.k.reshape(-1), f32(1, 2))


def test_dropping_a_pooled_cache_returns_its_blocks_to_the_pool():
    pool = KvBlockPool(1, 2, 1, 1)
    c = KvCache.with_pool(1, 1, pool, 1)
    c.push(f32(1), f32(1))
    c.push(f32(2), f32(2))
    assert pool.free_blocks == 0
    del c
    gc.collect()
    assert pool.free_blocks == 2


def test_release_to_pool_is_explicit_and_idempotent():
    pool = KvBlockPool(4, 5, 1, 1)
    c = KvCache.with_pool(1, 1, pool, 4)
    assert pool.free_blocks == 4
    c.release_to_pool()
    assert pool.free_blocks == 5
    c.release_to_pool()
    assert pool.free_blocks == 5
    del c
    gc.collect()
    assert pool.free_blocks == 5


def test_two_pooled_caches_share_one_bounded_budget():
    pool = KvBlockPool(1, 1, 1, 1)
    a = KvCache.with_pool(1, 1, pool, 1)
    with pytest.raises(KvPoolExhausted):
        KvCache.with_pool(1, 1, pool, 1)
    del a
    b = KvCache.with_pool(1, 1, pool, 1)
    assert b.blocks_held == 1 and pool.free_blocks == 0


@pytest.mark.parametrize("how", ["copy", "__copy__", "deepcopy"])
def test_cloning_a_pooled_cache_detaches_the_clone_from_pool_accounting(how):
    pool = KvBlockPool(4, 3, 1, 1)
    c = KvCache.with_pool(1, 1, pool, 4)
    c.push(f32(7), f32(8))
    assert pool.free_blocks == 2
    clone = {"copy": KvCache.copy, "__copy__": copy.copy, "deepcopy": copy.deepcopy}[how](c)
    assert pool.free_blocks == 2
    assert not clone.is_pooled and clone.blocks_held == 0
    np.testing.assert_array_equal(clone.k, c.k)
    del clone
    gc.collect()
    assert pool.free_blocks == 2
    del c
    gc.collect()
    assert pool.free_blocks == 3
