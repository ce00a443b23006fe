"""Behaviour beyond the reference: extend, advance_len, views, v_head_dim,
close/with, block tables against the arena, pool allocate/free and stats."""
import copy
import gc
import pickle

import numpy as np
import pytest

from ferrox_kv import KvBlockPool, KvCache, KvPoolExhausted


def make(kind, h, d, pool=None, max_len=0, vd=None):
    if kind == "new":
        return KvCache(h, d, v_head_dim=vd)
    if kind == "capacity":
        return KvCache.with_capacity(h, d, max_len, v_head_dim=vd)
    return KvCache.with_pool(h, d, pool, max_len, v_head_dim=vd)


KINDS = ["new", "capacity", "pool"]


@pytest.mark.parametrize("kind", KINDS)
def test_extend_appends_every_position_in_order(kind, make_rows):
    pool = KvBlockPool(3, 20, 2, 4)
    c = make(kind, 2, 4, pool, 5)
    k, v = make_rows(10, 8, 1), make_rows(10, 8, 2)
    c.push(k[0], v[0])
    c.extend(k[1:7].reshape(6, 2, 4), v[1:7])        # both accepted shapes
    c.extend(k[7:], v[7:])
    np.testing.assert_array_equal(c.k.reshape(10, 8), k)
    np.testing.assert_array_equal(c.v.reshape(10, 8), v)
    if kind == "pool":
        assert c.blocks_held == 4 and pool.free_blocks == 16


@pytest.mark.parametrize("kind", KINDS)
def test_extend_of_zero_positions_changes_nothing(kind):
    pool = KvBlockPool(2, 4, 1, 2)
    c = make(kind, 1, 2, pool, 2)
    c.extend(np.zeros((0, 2), np.float32), np.zeros((0, 2), np.float32))
    assert c.seq_len == 0 and pool.free_blocks == (3 if kind == "pool" else 4)


@pytest.mark.parametrize("kind", KINDS)
def test_advance_len_appends_zero_rows_even_into_reused_blocks(kind, make_rows):
    pool = KvBlockPool(2, 2, 1, 2)
    # dirty both blocks with data, give them back, then zero-advance into them
    dirty = KvCache.with_pool(1, 2, pool, 4)
    dirty.extend(make_rows(4, 2), make_rows(4, 2, 1))
    dirty.release_to_pool()
    c = make(kind, 1, 2, pool, 2)
    c.push(np.ones(2, np.float32), np.ones(2, np.float32))
    c.advance_len(3)
    assert c.seq_len == 4
    np.testing.assert_array_equal(c.k[1:].reshape(-1), np.zeros(6, np.float32))
    np.testing.assert_array_equal(c.v[1:].reshape(-1), np.zeros(6, np.float32))
    assert c.k[0].reshape(-1).tolist() == [1.0, 1.0]
    c.advance_len(0)
    assert c.seq_len == 4


def test_advance_len_is_all_or_nothing_when_the_pool_runs_short():
    pool = KvBlockPool(2, 2, 1, 1)
    c = KvCache.with_pool(1, 1, pool, 2)
    with pytest.raises(KvPoolExhausted) as ei:
        c.advance_len(5)             # needs 2 more blocks, 1 free
    assert ei.value.requested == 2 and ei.value.free == 1
    assert c.seq_len == 0 and c.blocks_held == 1 and pool.free_blocks == 1
    c.advance_len(4)
    assert c.seq_len == 4 and pool.free_blocks == 0


def test_split_v_head_dim_stores_each_width(make_rows):
    pool = KvBlockPool(4, 8, 2, 6, v_head_dim=4)
    for c in (KvCache(2, 6, v_head_dim=4), KvCache.with_pool(2, 6, pool, 3, v_head_dim=4)):
        k, v = make_rows(5, 12), make_rows(5, 8, 3)
        c.extend(k, v)
        assert c.k.shape == (5, 2, 6) and c.v.shape == (5, 2, 4)
        np.testing.assert_array_equal(c.v.reshape(5, 8), v)
        np.testing.assert_array_equal(c.k.reshape(5, 12), k)
    assert pool.value_blocks.shape == (8, 4, 2, 4)
    assert pool.block_bytes == 4 * 2 * (6 + 4) * 4


def test_view_keeps_its_old_buffer_alive_after_the_cache_grows_1000x(make_rows):
    c = KvCache(2, 4)
    first = make_rows(4, 8)
    c.extend(first, first * 2)
    kview, vview = c.k, c.v
    assert not kview.flags.writeable
    for i in range(4000):
        c.push(np.full(8, i, np.float32), np.full(8, -i, np.float32))
    gc.collect()
    junk = [np.full(1 << 16, 7.0, np.float32) for _ in range(32)]  # reuse freed memory
    np.testing.assert_array_equal(kview.reshape(4, 8), first)
    np.testing.assert_array_equal(vview.reshape(4, 8), first * 2)
    del c, junk
    gc.collect()
    np.testing.assert_array_equal(kview.reshape(4, 8), first)


def test_view_survives_close_and_cache_deletion(make_rows):
    c = KvCache.with_capacity(1, 4, 8)
    data = make_rows(3, 4)
    c.extend(data, data)
    view = c.k
    c.close()
    assert c.seq_len == 0 and c.capacity == 0 and c.closed
    del c
    gc.collect()
    np.testing.assert_array_equal(view.reshape(3, 4), data)


def test_pooled_k_is_a_gathered_copy_that_matches_the_arena(make_rows):
    pool = KvBlockPool(2, 6, 1, 3)
    other = KvCache.with_pool(1, 3, pool, 2)       # so the table is not 0, 1, 2
    c = KvCache.with_pool(1, 3, pool, 5)
    other.release_to_pool()
    k, v = make_rows(5, 3), make_rows(5, 3, 9)
    c.extend(k, v)
    table = c.block_table
    assert table.dtype == np.int32 and len(table) == 3
    kb, vb = pool.key_blocks, pool.value_blocks
    for r in range(5):
        b, off = table[r // 2], r % 2
        np.testing.assert_array_equal(kb[b, off].reshape(-1), k[r])
        np.testing.assert_array_equal(vb[b, off].reshape(-1), v[r])
    view = c.k
    assert view.flags.writeable and view.flags.c_contiguous
    view[:] = 0                                      # a copy: the cache is untouched
    np.testing.assert_array_equal(c.k.reshape(5, 3), k)


def test_arena_views_keep_the_pool_memory_alive(make_rows):
    pool = KvBlockPool(2, 2, 1, 2)
    c = KvCache.with_pool(1, 2, pool, 2)
    c.extend(make_rows(2, 2), make_rows(2, 2, 1))
    kb = pool.key_blocks
    b = c.block_table[0]
    expected = kb[b].copy()
    del pool, c
    gc.collect()
    np.testing.assert_array_equal(kb[b], expected)
    assert not kb.flags.writeable


def test_cache_outlives_its_pool_object_and_still_returns_blocks(make_rows):
    pool = KvBlockPool(2, 4, 1, 2)
    c = KvCache.with_pool(1, 2, pool, 4)
    blocks = pool.key_blocks
    del pool
    gc.collect()
    c.extend(make_rows(4, 2), make_rows(4, 2))
    c.push(np.ones(2, np.float32), np.ones(2, np.float32))     # takes a 3rd block
    assert c.blocks_held == 3
    np.testing.assert_array_equal(c.k.reshape(5, 2)[:4], make_rows(4, 2))
    del c, blocks
    gc.collect()


def test_release_to_pool_keeps_rows_and_capacity_then_grows_unpooled(make_rows):
    pool = KvBlockPool(4, 4, 1, 2)
    c = KvCache.with_pool(1, 2, pool, 8)
    k = make_rows(6, 2)
    c.extend(k, -k)
    before = c.allocated_bytes()
    c.release_to_pool()
    assert pool.free_blocks == 4 and not c.is_pooled and c.blocks_held == 0
    assert c.allocated_bytes() == before and c.capacity == 8
    np.testing.assert_array_equal(c.k.reshape(6, 2), k)
    for i in range(20):
        c.push(np.full(2, i, np.float32), np.full(2, i, np.float32))
    assert c.seq_len == 26 and pool.free_blocks == 4
    assert not c.is_within_planned_capacity()


def test_truncate_keeps_blocks_so_regrowing_costs_none():
    pool = KvBlockPool(2, 8, 1, 1)
    c = KvCache.with_pool(1, 1, pool, 2)
    c.advance_len(7)
    held, free = c.blocks_held, pool.free_blocks
    c.truncate(1)
    assert c.blocks_held == held and pool.free_blocks == free
    c.advance_len(6)
    assert c.blocks_held == held and pool.free_blocks == free


def test_with_block_returns_blocks_exactly_once():
    pool = KvBlockPool(4, 4, 1, 1)
    with KvCache.with_pool(1, 1, pool, 9) as c:
        c.advance_len(9)
        assert pool.free_blocks == 1
    assert pool.free_blocks == 4 and c.seq_len == 0 and not c.is_pooled and c.closed
    c.close()                                      # idempotent
    with pytest.raises(ValueError, match="KvCache is closed"):
        c.push([0.0], [0.0])
    with pytest.raises(ValueError, match="KvCache is closed"):
        with c:
            pass
    del c
    gc.collect()
    assert pool.free_blocks == 4 and pool.stats()["released"] == 3


def test_is_within_planned_capacity_follows_the_current_length():
    c = KvCache.with_capacity(1, 1, 2)
    assert c.is_within_planned_capacity()
    c.advance_len(3)
    assert not c.is_within_planned_capacity()
    c.truncate(2)
    assert c.is_within_planned_capacity()
    clone = c.copy()
    assert clone.is_within_planned_capacity()
    assert clone.allocated_bytes() == 2 * 2 * 4      # capacity == length
    z = KvCache.with_capacity(1, 1, 0)
    assert z.is_within_planned_capacity()
    z.advance_len(1)
    assert not z.is_within_planned_capacity()
    assert not KvCache.with_pool(1, 1, KvBlockPool(1, 1, 1, 1), 0).is_within_planned_capacity()


def test_push_converts_other_dtypes_and_layouts(make_rows):
    c = KvCache(2, 3)
    c.push([1, 2, 3, 4, 5, 6], np.arange(6, dtype=np.float64).reshape(2, 3))
    c.push(np.arange(12, dtype=np.float32)[::2], np.arange(6, dtype=">f4"))
    np.testing.assert_array_equal(c.k.reshape(2, 6), [[1, 2, 3, 4, 5, 6], [0, 2, 4, 6, 8, 10]])
    np.testing.assert_array_equal(c.v.reshape(2, 6), [np.arange(6), np.arange(6)])


def test_pool_stats_count_everything():
    pool = KvBlockPool(2, 5, 1, 1)
    a = KvCache.with_pool(1, 1, pool, 4)
    b = KvCache.with_pool(1, 1, pool, 5)
    with pytest.raises(KvPoolExhausted):
        KvCache.with_pool(1, 1, pool, 1)
    a.release_to_pool()
    s = pool.stats()
    assert s == {"total_blocks": 5, "free_blocks": 2, "used_blocks": 3, "high_water": 5,
                 "acquired": 5, "released": 2, "refused": 1, "window_freed": 0, "block_size": 2,
                 "block_bytes": 16, "cached_blocks": 0, "prefix_hits": 0,
                 "prefix_misses": 0, "hit_tokens": 0, "evictions": 0}
    del b


def test_pool_allocate_and_free_are_all_or_nothing():
    pool = KvBlockPool(2, 4, 1, 1)
    ids = pool.allocate(3)
    assert sorted(ids.tolist()) == [0, 1, 2] and pool.free_blocks == 1
    with pytest.raises(KvPoolExhausted):
        pool.allocate(2)
    with pytest.raises(ValueError, match="not held"):
        pool.free([ids[0], ids[0]])                   # named twice, held once
    with pytest.raises(ValueError, match="out of range"):
        pool.free([ids[0], 4])
    assert pool.free_blocks == 1
    pool.free(ids)
    assert pool.free_blocks == 4
    with pytest.raises(ValueError, match="not held"):
        pool.free(ids)                                # double free refused
    assert pool.free_blocks == 4


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/statm"), reason="Linux /proc")
def test_untouched_pool_blocks_cost_no_resident_memory():
    rss0 = _rss_bytes()
    pool = KvBlockPool(16, 16384, 8, 128)            # 2 GiB of K+V arena
    assert pool.total_blocks * pool.block_bytes == 2 << 30
    c = KvCache.with_pool(8, 128, pool, 64)
    c.advance_len(64)                                # touches 4 blocks: 512 KiB
    assert _rss_bytes() - rss0 < 64 << 20            # far less than the arena
    del c


@pytest.mark.parametrize("kind", ["growable", "capacity", "pooled", "pool"])
def test_pickling_a_cache_or_a_pool_is_a_type_error_that_says_what_to_use(kind):
    pool = KvBlockPool(4, 8, 2, 4)
    obj = {"growable": lambda: KvCache(2, 4), "capacity": lambda: KvCache.with_capacity(2, 4, 8),
           "pooled": lambda: KvCache.with_pool(2, 4, pool, 8), "pool": lambda: pool}[kind]()
    if kind != "pool":
        obj.extend(np.ones((3, 8), np.float32), np.zeros((3, 8), np.float32))
    before = pool.stats()
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        with pytest.raises(TypeError, match="cannot be pickled") as e:
            pickle.dumps(obj, protocol=protocol)
        assert ("KvBlockPool(block_size" if kind == "pool" else "cache.copy()") in str(e.value)
    assert pool.stats() == before
    if kind != "pool":
        assert len(obj) == 3 and len(copy.deepcopy(obj)) == 3    # what the message offers
        np.testing.assert_array_equal(pickle.loads(pickle.dumps(obj.k)), obj.k)
    pool.check()


def test_a_capacity_passed_to_the_constructor_names_with_capacity():
    with pytest.raises(TypeError, match=r"max_seq_len belongs to KvCache\.with_capacity") as e:
        KvCache(8, 128, 64)
    assert "3 were given" in str(e.value) and "v_head_dim=" in str(e.value)
    with pytest.raises(TypeError, match="max_seq_len belongs"):
        KvCache(8, 128, 64, v_head_dim=64)

    class Layer(KvCache):                      # a subclass may take more arguments
        def __init__(self, n_kv_heads, head_dim, layer_idx):
            super().__init__(n_kv_heads, head_dim)
            self.layer_idx = layer_idx

    assert Layer(8, 128, 3).layer_idx == 3
    assert KvCache.with_capacity(8, 128, max_seq_len=64).capacity == 64


def test_repr_names_geometry_and_state():
    pool = KvBlockPool(4, 2, 1, 2)
    c = KvCache.with_pool(1, 2, pool, 1)
    assert "pooled" in repr(c) and "free_blocks=1" in repr(pool)


def test_push_layers_matches_pushing_each_layer(make_rows):
    from ferrox_kv import push_layers
    pool = KvBlockPool(2, 16, 2, 3, v_head_dim=2)
    layers = [KvCache.with_pool(2, 3, pool, 1, v_head_dim=2), KvCache(2, 3, v_head_dim=2),
              KvCache.with_capacity(2, 3, 2, v_head_dim=2)]
    ref = [KvCache(2, 3, v_head_dim=2) for _ in layers]
    for t in range(7):
        k, v = make_rows(3, 6, t), make_rows(3, 4, 100 + t)
        push_layers(layers, k.reshape(3, 2, 3), v)
        for i, r in enumerate(ref):
            r.push(k[i], v[i])
    for c, r in zip(layers, ref):
        np.testing.assert_array_equal(c.k, r.k)
        np.testing.assert_array_equal(c.v, r.v)
    assert layers[0].blocks_held == 4 and pool.free_blocks == 12


def test_push_layers_is_all_or_nothing_when_a_layer_cannot_get_a_block():
    from ferrox_kv import push_layers
    pool = KvBlockPool(1, 3, 1, 1)
    layers = [KvCache.with_pool(1, 1, pool, 1) for _ in range(3)]
    one = np.ones((3, 1), np.float32)
    push_layers(layers, one, one)                     # fills every block: 0 free
    pool.free([])                                     # (no-op)
    layers[2].release_to_pool()                       # 1 free; two layers need one each
    with pytest.raises(KvPoolExhausted) as ei:
        push_layers(layers, one * 2, one * 2)
    assert ei.value.requested == 2 and ei.value.free == 1
    assert [len(c) for c in layers] == [1, 1, 1]
    assert [c.blocks_held for c in layers] == [1, 1, 0] and pool.free_blocks == 1
    assert pool.stats()["acquired"] - pool.stats()["released"] == 2


def test_push_layers_from_two_threads_on_the_same_cache_raises(gil_release_zero=None):
    from ferrox_kv import push_layers
    layers = [KvCache(1, 2), KvCache(1, 2)]
    with pytest.raises(ValueError, match="more than once"):
        push_layers([layers[0], layers[0]], np.ones((2, 2)), np.ones((2, 2)))
    assert len(layers[0]) == 0


def test_with_pool_many_reserves_every_cache_or_none(make_rows):
    pool = KvBlockPool(4, 10, 2, 2)
    caches = KvCache.with_pool_many(3, 2, 2, pool, 9)          # 3 blocks each
    assert [c.blocks_held for c in caches] == [3, 3, 3] and pool.free_blocks == 1
    tables = [x for c in caches for x in c.block_table.tolist()]
    assert len(set(tables)) == 9
    before = pool.stats()
    with pytest.raises(KvPoolExhausted) as ei:
        KvCache.with_pool_many(2, 2, 2, pool, 1)
    assert (ei.value.requested, ei.value.free) == (2, 1)
    after = pool.stats()
    assert after["free_blocks"] == before["free_blocks"] == 1
    assert after["acquired"] == before["acquired"] and after["refused"] == before["refused"] + 1
    k = make_rows(9, 4)
    for c in caches:
        c.extend(k, k)
    assert pool.free_blocks == 1
    np.testing.assert_array_equal(caches[2].k.reshape(9, 4), k)
    assert KvCache.with_pool_many(0, 2, 2, pool, 5) == []
    with pytest.raises(ValueError, match="geometry"):
        KvCache.with_pool_many(1, 2, 3, pool, 1)
    with pytest.raises(ValueError, match="count"):
        KvCache.with_pool_many(-1, 2, 2, pool, 1)
    with pytest.raises(KvPoolExhausted) as ei:     # refused before anything is sized by count
        KvCache.with_pool_many(10**9, 2, 2, pool, 1)
    assert ei.value.requested == 10**9
    assert pool.free_blocks == 1
    del caches, c
    import gc
    gc.collect()
    assert pool.free_blocks == 10


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/statm") or
                    __import__("os").environ.get("FERROX_KV_ASAN") == "1",
                    reason="needs Linux /proc; AddressSanitizer quarantines freed memory")
def test_many_cache_lifetimes_do_not_grow_resident_memory(make_rows):
    pool = KvBlockPool(16, 64, 8, 128)
    k = make_rows(40, 1024)

    def churn(n):
        for _ in range(n):
            for c in (KvCache.with_pool(8, 128, pool, 40), KvCache(8, 128),
                      KvCache.with_capacity(8, 128, 40)):
                c.extend(k, k)
                c.truncate(3)
                c.copy()
                c.release_to_pool()
                c.k, c.v, c.block_table
            ids = pool.allocate(3)
            pool.free(ids)

    churn(200)                                    # warm up allocators
    before = _rss_bytes()
    churn(2000)                                   # ~ 2000 x 3 x 320 KiB allocated and freed
    assert _rss_bytes() - before < 16 << 20
    assert pool.free_blocks == 64


# -- large row buffers: their own 2 MiB-aligned mappings, huge-page advised ----

def _mapping(addr):
    """(start, end, VmFlags) of this process's mapping that holds ``addr``."""
    cur = None
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(maxsplit=1)[0]
            if not first.endswith(":"):             # a mapping's first line: "lo-hi perms ..."
                lo, hi = (int(x, 16) for x in first.split("-"))
                cur = (lo, hi) if lo <= addr < hi else None
            elif first == "VmFlags:" and cur is not None:
                return cur[0], cur[1], line.split()[1:]
    return None


def _addr(a):
    return a.__array_interface__["data"][0]


def _thp_on():
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_large_pool_arenas_are_their_own_huge_page_mappings(dtype):
    """From 2 MiB an arena is mapped on its own, 2 MiB aligned and advised
    for huge pages (a decode reads it from memory once a step), whatever
    malloc did before; it is unmapped with the pool."""
    junk = [np.ones(5 << 18, np.float32) for _ in range(4)]   # churn malloc's heap first
    del junk[::2]
    blocks = 32 if dtype == "float32" else 64                 # 2 MiB per arena
    pool = KvBlockPool(16, blocks, 8, 128, dtype=dtype)
    for view in (pool.key_blocks, pool.value_blocks):
        a = _addr(view)
        assert view.nbytes == 2 << 20 and a % (2 << 20) == 0
        lo, hi, flags = _mapping(a)
        assert lo == a and hi - lo == 2 << 20       # exactly the arena: nothing else shares it
        assert ("hg" in flags) == _thp_on()
        del view
    c = KvCache.with_pool(8, 128, pool, 32)
    c.extend(np.ones((32, 8, 128), np.float32), np.ones((32, 8, 128), np.float32))
    assert np.array_equal(c.k, np.ones((32, 8, 128), np.float32))
    ka = _addr(pool.key_blocks)
    c.close()
    del pool
    gc.collect()
    assert _mapping(ka) is None                     # unmapped with the pool
    small = KvBlockPool(16, 4, 8, 128, dtype=dtype)  # below 2 MiB: calloc, zero like the mapped ones
    assert not small.key_blocks.any() and not small.value_blocks.any()


def test_large_contiguous_rows_are_a_huge_page_mapping():
    c = KvCache.with_capacity(8, 128, 1024)         # 4 MiB of K then 4 MiB of V in one buffer
    c.push(np.ones((8, 128), np.float32), np.full((8, 128), 2, np.float32))
    a = _addr(c.k)
    lo, hi, flags = _mapping(a)
    assert a == lo and lo % (2 << 20) == 0 and hi - lo == 8 << 20
    assert ("hg" in flags) == _thp_on()
    assert c.v[0, 0, 0] == 2 and len(c) == 1
    c.close()


def test_a_row_buffer_that_cannot_be_mapped_is_a_memory_error_and_changes_nothing():
    """2**53 bytes exceed any process's address space: the mapping fails,
    the error names the size, and a live pool and cache are as they were."""
    pool = KvBlockPool(16, 4, 8, 128)
    c = KvCache.with_pool(8, 128, pool, 32)
    c.push(np.ones((8, 128), np.float32), np.ones((8, 128), np.float32))
    before = (pool.free_blocks, len(c), c.k.copy())
    with pytest.raises(MemoryError, match="cannot allocate 9007199254740992 bytes"):
        KvCache.with_capacity(8, 128, 2**40)
    with pytest.raises(MemoryError, match="cannot allocate a pool of 1048576 blocks"):
        KvBlockPool(2**16, 2**20, 8, 128)
    assert (pool.free_blocks, len(c)) == before[:2] and np.array_equal(c.k, before[2])
    pool.check()
    c.close()
    assert pool.free_blocks == pool.total_blocks
