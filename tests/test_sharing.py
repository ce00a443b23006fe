"""Block sharing: reference counts, copy-on-write fork(), the prefix cache
(publish, verified reuse, salts, eviction) and their accounting. Every test
ends with pool.check(), which walks every invariant of the pool."""
import gc
import random

import numpy as np
import pytest

from ferrox_kv import KvBlockPool, KvCache, KvPoolExhausted, push_layers
from ferrox_kv import _core
from support.threads import run_threads

H, D = 1, 4
W = H * D


def rows(n, start=0.0):
    base = np.arange(start, start + n, dtype=np.float32)[:, None]
    return np.repeat(base, W, axis=1) + np.arange(W, dtype=np.float32) / 10


def filled(pool, n, max_len, start=0.0, **kw):
    c = KvCache.with_pool(H, D, pool, max_len, **kw)
    c.extend(rows(n, start)[c.seq_len:], -rows(n, start)[c.seq_len:])
    return c


# -- fork ------------------------------------------------------------------------

def test_fork_shares_full_blocks_copies_the_tail_and_reserves_the_plan():
    pool = KvBlockPool(4, 64, H, D)
    parent = filled(pool, 10, 16)                 # blocks: 2 full, 1 partial, 1 reserved
    child = parent.fork()
    pt, ct = parent.block_table.tolist(), child.block_table.tolist()
    assert ct[:2] == pt[:2]                       # full blocks shared
    assert ct[2] not in pt and len(ct) == len(pt) == 4    # own tail copy and reservation
    assert pool.used_blocks == 4 + 2
    np.testing.assert_array_equal(child.k, parent.k)
    child.push(np.full(W, 7.0), np.full(W, 8.0))
    parent.push(np.full(W, 1.0), np.full(W, 2.0))
    assert child.k[10, 0, 0] == 7.0 and parent.k[10, 0, 0] == 1.0
    np.testing.assert_array_equal(child.k[:10], parent.k[:10])
    pool.check()
    del parent
    gc.collect()
    np.testing.assert_array_equal(child.k[:10].reshape(-1, W), rows(10))
    pool.check()
    del child
    assert pool.used_blocks == 0
    pool.check()


def test_decoding_within_the_plan_never_fails_in_parent_or_children_of_an_exhausted_pool():
    pool = KvBlockPool(4, 12, H, D)
    parent = filled(pool, 8, 16)                  # 4 blocks, 2 full
    kids = [parent.fork(), parent.fork()]         # each: 2 shared + 2 own
    assert pool.free_blocks == 12 - 4 - 4
    hog = pool.allocate(pool.free_blocks)         # nothing left
    for c in [parent] + kids:
        for i in range(8):
            c.push(np.full(W, float(i)), np.zeros(W))
        assert c.seq_len == 16
    with pytest.raises(KvPoolExhausted):
        parent.push(np.zeros(W), np.zeros(W))     # beyond the plan
    pool.free(hog)
    pool.check()


def test_fork_without_room_for_the_childs_plan_is_refused_with_nothing_changed():
    pool = KvBlockPool(4, 5, H, D)
    parent = filled(pool, 9, 16)                  # 4 blocks, 2 full: a child needs 2
    hog = pool.allocate(pool.free_blocks)         # 1 free
    before = (pool.stats(), parent.block_table.tolist(), parent.k.copy())
    with pytest.raises(KvPoolExhausted) as e:
        parent.fork()
    assert (e.value.requested, e.value.free) == (0 + 2, 0) or e.value.free == 0
    assert pool.stats()["used_blocks"] == before[0]["used_blocks"]
    assert parent.block_table.tolist() == before[1]
    np.testing.assert_array_equal(parent.k, before[2])
    pool.free(hog)
    pool.check()


def test_a_write_after_truncating_into_shared_blocks_copies_them_first():
    pool = KvBlockPool(4, 32, H, D)
    parent = filled(pool, 12, 16)
    child = parent.fork()
    child.truncate(5)                             # back into shared block 1
    child.extend(rows(3, 100.0), rows(3, 100.0))
    np.testing.assert_array_equal(parent.k.reshape(-1, W), rows(12))      # untouched
    np.testing.assert_array_equal(child.k.reshape(-1, W),
                                  np.concatenate([rows(5), rows(3, 100.0)]))
    assert child.block_table[0] == parent.block_table[0]              # block 0 still shared
    assert child.block_table[1] != parent.block_table[1]              # block 1 copied
    pool.check()


def test_a_copy_on_write_without_a_free_block_is_refused_with_nothing_changed():
    pool = KvBlockPool(4, 6, H, D)
    parent = filled(pool, 8, 8)                   # 2 full blocks
    child = parent.fork()                         # shares both, owns nothing more
    assert pool.used_blocks == 2
    hog = pool.allocate(4)
    child.truncate(6)
    before = (child.block_table.tolist(), child.seq_len, pool.stats())
    with pytest.raises(KvPoolExhausted):
        child.push(np.ones(W), np.ones(W))
    assert (child.block_table.tolist(), child.seq_len, pool.stats()["used_blocks"]) == (
        before[0], before[1], before[2]["used_blocks"])
    pool.free(hog[:1])
    child.push(np.ones(W), np.ones(W))            # now it can copy
    np.testing.assert_array_equal(parent.k.reshape(-1, W), rows(8))
    pool.check()


def test_fork_of_a_contiguous_cache_is_a_copy():
    c = KvCache.with_capacity(H, D, 8)
    c.extend(rows(5), rows(5))
    f = c.fork()
    assert not f.is_pooled and f.blocks_held == 0
    f.push(np.ones(W), np.ones(W))
    assert c.seq_len == 5 and f.seq_len == 6


def test_closing_a_parent_gives_back_only_what_no_child_holds():
    pool = KvBlockPool(4, 32, H, D)
    parent = filled(pool, 16, 16)                 # 4 full blocks
    child = parent.fork()
    assert pool.used_blocks == 4
    parent.close()
    assert pool.used_blocks == 4                  # the child holds them all
    child.close()
    assert pool.used_blocks == 0
    s = pool.stats()
    assert s["acquired"] == s["released"] == 4
    pool.check()


def test_shared_blocks_cannot_be_freed_by_hand():
    pool = KvBlockPool(4, 8, H, D)
    c = filled(pool, 8, 8)
    with pytest.raises(ValueError, match="not held from allocate"):
        pool.free(c.block_table)
    pool.check()


# -- the prefix cache ------------------------------------------------------------------

def test_a_published_prefix_is_reused_verified_and_at_most_len_minus_one():
    pool = KvBlockPool(4, 64, H, D, prefix_cache=True)
    toks = list(range(1, 13))                      # 12 tokens: 3 full blocks
    a = filled(pool, 12, 20, tokens=toks)
    assert a.seq_len == 0 or a.seq_len == 12
    assert pool.publish([a], toks) == 12
    b = KvCache.with_pool(H, D, pool, 20, tokens=toks + [99])
    assert b.seq_len == 12 and b.block_table.tolist()[:3] == a.block_table.tolist()[:3]
    np.testing.assert_array_equal(b.k, a.k)
    c = KvCache.with_pool(H, D, pool, 20, tokens=toks)   # the same 12: at most 11 reused
    assert c.seq_len == 8
    d = KvCache.with_pool(H, D, pool, 20, tokens=toks[:6] + [0] * 6)
    assert d.seq_len == 4                                 # the first block only
    s = pool.stats()
    assert (s["prefix_hits"], s["prefix_misses"], s["hit_tokens"]) == (3, 1, 24)
    pool.check()


def test_every_lookup_is_a_hit_or_a_miss_even_one_shorter_than_a_block():
    pool = KvBlockPool(4, 64, H, D, prefix_cache=True)

    def counts():
        s = pool.stats()
        return s["prefix_hits"], s["prefix_misses"], s["hit_tokens"]

    KvCache.with_pool(H, D, pool, 8, tokens=[1, 2, 3])       # shorter than a block
    KvCache.with_pool(H, D, pool, 8, tokens=[1, 2, 3, 4])    # 3 reusable positions: no block
    KvCache.with_pool(H, D, pool, 8, tokens=[])
    KvCache.with_pool_many(3, H, D, pool, 8, tokens=[7])     # one lookup for its 3 layers
    assert counts() == (0, 4, 0)
    a = filled(pool, 8, 8, tokens=list(range(1, 9)))         # nothing published yet: a miss
    assert pool.publish([a], list(range(1, 9))) == 8
    b = KvCache.with_pool(H, D, pool, 12, tokens=list(range(1, 10)))
    assert b.seq_len == 8
    KvCache.with_pool(H, D, pool, 8, tokens=[1, 2, 3])       # the published block is longer
    assert counts() == (1, 6, 8)
    KvCache.with_pool(H, D, pool, 8)                          # no tokens: no lookup
    assert counts() == (1, 6, 8)
    hold = pool.allocate(pool.free_blocks - 1)
    with pytest.raises(KvPoolExhausted):                       # refused: no lookup happened
        KvCache.with_pool(H, D, pool, 8, tokens=[1, 2, 3])
    with pytest.raises(KvPoolExhausted):
        KvCache.with_pool(H, D, pool, 4 * 65, tokens=[1, 2, 3])
    assert counts() == (1, 6, 8)
    pool.free(hold)
    del a, b
    pool.check()


def test_with_pool_many_reuses_every_layer_of_the_sequence():
    pool = KvBlockPool(2, 64, H, D, prefix_cache=True)
    toks = [5, 6, 7, 8, 9]
    layers = KvCache.with_pool_many(3, H, D, pool, 8, tokens=toks)
    for i, c in enumerate(layers):
        c.extend(rows(5, 10.0 * i), rows(5, 10.0 * i))
    assert pool.publish(layers, toks) == 4
    again = KvCache.with_pool_many(3, H, D, pool, 8, tokens=toks + [1])
    for i, c in enumerate(again):
        assert c.seq_len == 4
        np.testing.assert_array_equal(c.k.reshape(-1, W), rows(4, 10.0 * i))
    # another layer count is another model: no reuse
    other = KvCache.with_pool_many(2, H, D, pool, 8, tokens=toks + [1])
    assert [c.seq_len for c in other] == [0, 0]
    pool.check()


def test_salts_keep_tenants_apart():
    pool = KvBlockPool(4, 64, H, D, prefix_cache=True)
    toks = list(range(9))
    a = filled(pool, 9, 12, tokens=toks, salt="tenant-a")
    pool.publish([a], toks, salt="tenant-a")
    assert KvCache.with_pool(H, D, pool, 12, tokens=toks, salt="tenant-b").seq_len == 0
    assert KvCache.with_pool(H, D, pool, 12, tokens=toks).seq_len == 0
    assert KvCache.with_pool(H, D, pool, 12, tokens=toks, salt="tenant-a").seq_len == 8
    with pytest.raises(TypeError, match="salt"):
        KvCache.with_pool(H, D, pool, 12, tokens=toks, salt=["x"])
    pool.check()


def test_a_forced_hash_collision_never_serves_another_requests_blocks():
    pool = KvBlockPool(4, 64, H, D, prefix_cache=True)
    old = _core._set_constant_hash(True)          # every key equal
    try:
        x, y = [1, 2, 3, 4, 5], [9, 9, 9, 9, 5]
        a = filled(pool, 5, 8, 0.0, tokens=x)
        b = filled(pool, 5, 8, 50.0, tokens=y)
        pool.publish([a], x)
        pool.publish([b], y)
        pool.check()
        hx = KvCache.with_pool(H, D, pool, 8, tokens=x)
        hy = KvCache.with_pool(H, D, pool, 8, tokens=y)
        hz = KvCache.with_pool(H, D, pool, 8, tokens=[9, 9, 9, 8, 5])
        assert (hx.seq_len, hy.seq_len, hz.seq_len) == (4, 4, 0)
        np.testing.assert_array_equal(hx.k.reshape(-1, W), rows(4, 0.0))
        np.testing.assert_array_equal(hy.k.reshape(-1, W), rows(4, 50.0))
        pool.check()
    finally:
        _core._set_constant_hash(old)


def test_publishing_an_already_cached_prefix_keeps_the_existing_blocks():
    pool = KvBlockPool(4, 64, H, D, prefix_cache=True)
    toks = list(range(8))
    a = filled(pool, 8, 8, 0.0, tokens=toks)
    pool.publish([a], toks)
    b = filled(pool, 8, 8, 70.0)                    # same tokens, its own (different) rows
    assert pool.publish([b], toks) == 8
    hit = KvCache.with_pool(H, D, pool, 12, tokens=toks + [1])
    assert hit.block_table.tolist()[:2] == a.block_table.tolist()
    np.testing.assert_array_equal(hit.k.reshape(-1, W), rows(8, 0.0))
    used = pool.used_blocks
    del b                                          # its copies were never published: freed
    assert pool.used_blocks == used - 2
    pool.check()


def test_a_published_block_is_immutable_its_publisher_copies_before_writing():
    pool = KvBlockPool(4, 64, H, D, prefix_cache=True)
    toks = list(range(8))
    a = filled(pool, 8, 12, tokens=toks)
    pool.publish([a], toks)
    a.truncate(2)
    a.extend(rows(6, 500.0), rows(6, 500.0))       # rewrites published blocks 0 and 1
    hit = KvCache.with_pool(H, D, pool, 12, tokens=toks + [1])
    np.testing.assert_array_equal(hit.k.reshape(-1, W), rows(8))       # what was published
    pool.check()


def test_cached_blocks_count_as_free_and_are_evicted_lru_tail_first():
    pool = KvBlockPool(2, 10, H, D, prefix_cache=True)
    x, y = [1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14]
    for toks, start in ((x, 0.0), (y, 100.0)):
        c = filled(pool, 6, 6, start, tokens=toks)
        pool.publish([c], toks[:6])
        del c
    s = pool.stats()
    assert s["cached_blocks"] == 6 and s["free_blocks"] == 10 and s["used_blocks"] == 0
    pool.check()
    # 4 never-used blocks, then one cached block: x was let go first, and a
    # chain loses its tail first
    taken = pool.allocate(5)
    s = pool.stats()
    assert s["evictions"] == 1 and s["cached_blocks"] == 5 and s["free_blocks"] == 5
    hy = KvCache.with_pool(H, D, pool, 6, tokens=y)
    hx = KvCache.with_pool(H, D, pool, 4, tokens=x)
    assert (hy.seq_len, hx.seq_len) == (6, 4)          # y whole, x without its tail
    np.testing.assert_array_equal(hx.k.reshape(-1, W), rows(4))
    pool.check()
    pool.free(taken)
    pool.check()


def test_evicting_a_head_drops_its_unreachable_descendants():
    pool = KvBlockPool(2, 6, H, D, prefix_cache=True)
    toks = [1, 2, 3, 4, 5, 6, 7]
    a = filled(pool, 6, 6, tokens=toks)
    pool.publish([a], toks[:6])                   # chain e1 - e2 - e3, all held by a
    h = KvCache.with_pool(H, D, pool, 2, tokens=toks[:3])
    assert h.seq_len == 2                         # holds e1 too
    a.truncate(1)
    a.push(np.full(W, 9.0), np.full(W, 9.0))      # a copies e1's block and lets go of it
    h.close()                                     # e1: cached, least recent; e2, e3 held by a
    s = pool.stats()
    assert s["cached_blocks"] == 1 and s["used_blocks"] == 3
    taken = pool.allocate(pool.free_blocks)       # the last one evicts e1, and e2, e3 with it
    assert pool.stats()["evictions"] == 1 and pool.used_blocks == 6
    pool.check()
    pool.free(taken)
    assert KvCache.with_pool(H, D, pool, 6, tokens=toks).seq_len == 0   # unreachable: gone
    a.truncate(2)
    a.push(np.full(W, 8.0), np.full(W, 8.0))      # e2's block is a's alone again: no copy
    assert pool.used_blocks == 3
    pool.check()


def test_without_a_prefix_cache_tokens_and_publish_are_refused():
    pool = KvBlockPool(4, 16, H, D)
    c = filled(pool, 4, 4)
    with pytest.raises(ValueError, match="prefix_cache=True"):
        KvCache.with_pool(H, D, pool, 4, tokens=[1, 2, 3, 4])
    with pytest.raises(ValueError, match="prefix_cache=True"):
        pool.publish([c], [1, 2, 3, 4])
    assert pool.stats()["cached_blocks"] == 0 and not pool.prefix_cache
    pool.check()


@pytest.mark.parametrize("call,exc,msg", [
    (lambda p, a, b: p.publish([a], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]), ValueError, "10 ids"),
    (lambda p, a, b: p.publish([a, b], [1, 2, 3, 4]), ValueError, "one length"),
    (lambda p, a, b: p.publish([a], [[1, 2]]), ValueError, "one sequence"),
    (lambda p, a, b: p.publish([a], ["x"]), TypeError, "integer"),
    (lambda p, a, b: p.publish([a], [2**40]), ValueError, "int32"),
    (lambda p, a, b: p.publish([a, a], [1]), ValueError, "more than once"),
    (lambda p, a, b: p.publish([KvCache.with_capacity(H, D, 4)], [1]), ValueError, "not a pooled"),
    (lambda p, a, b: p.publish([], [1]), ValueError, "empty"),
    (lambda p, a, b: p.publish([a], [1], salt=3.5), TypeError, "salt"),
    (lambda p, a, b: KvCache.with_pool(H, D, p, 8, tokens="abc"), TypeError, "integer"),
    (lambda p, a, b: KvCache.with_pool(H, D, p, 8, salt="s"), ValueError, "salt= goes with tokens="),
])
def test_bad_publish_and_lookup_arguments_change_nothing(call, exc, msg):
    pool = KvBlockPool(4, 16, H, D, prefix_cache=True)
    a = filled(pool, 8, 8)
    b = filled(pool, 5, 8)
    before = pool.stats()
    with pytest.raises(exc, match=msg):
        call(pool, a, b)
    assert pool.stats() == before
    pool.check()


def test_eight_threads_with_shared_prefixes_lose_nothing():
    pool = KvBlockPool(4, 400, H, D, prefix_cache=True)
    prompts = [[s] * 3 + list(range(20)) for s in range(4)]

    def worker(seed):
        rng = random.Random(seed)
        for _ in range(150):
            toks = rng.choice(prompts)[: rng.randint(4, 23)]
            try:
                layers = KvCache.with_pool_many(2, H, D, pool, 32, tokens=toks)
            except KvPoolExhausted:
                continue
            have = layers[0].seq_len
            expect = rows(len(toks), float(toks[0] * 1000))
            for i, c in enumerate(layers):
                np.testing.assert_array_equal(c.k.reshape(-1, W), expect[:have] + i)
            for i, c in enumerate(layers):
                c.extend(expect[have:] + i, expect[have:] + i)
            if rng.random() < 0.3:
                f = layers[0].fork()
                f.truncate(rng.randint(0, f.seq_len))
                f.push(np.zeros(W), np.zeros(W))
                f.close()
            pool.publish(layers, toks)
            push_layers(layers, np.ones((2, W)), np.ones((2, W)))
            for c in layers:
                c.close()

    errors = run_threads(8, worker)
    assert not errors, errors[0]
    pool.check()
    s = pool.stats()
    assert s["used_blocks"] == 0 and s["prefix_hits"] > 0
    assert s["free_blocks"] == 400


def test_publishing_a_cache_with_its_fork_as_two_layers_publishes_nothing_shared():
    pool = KvBlockPool(2, 8, H, D, prefix_cache=True)
    c = filled(pool, 4, 4)
    f = c.fork()                                   # shares both full blocks
    assert pool.publish([c, f], [1, 2, 3, 4]) == 0
    pool.check()
    assert KvCache.with_pool_many(2, H, D, pool, 2, tokens=[1, 2, 3, 4, 5])[0].seq_len == 0
    del c, f
    pool.check()
    ids = pool.allocate(8)                         # every block comes back, ids in range
    assert sorted(ids.tolist()) == list(range(8))
    pool.free(ids)
    pool.check()


# -- int4 and sliding windows: the same sharing rules ----------------------------------

D4 = 32                                  # int4 head dims are multiples of 32


def _rand(n, seed):
    return np.random.default_rng(seed).standard_normal((n, D4)).astype(np.float32)


@pytest.mark.parametrize("rotate", [None, False])
def test_int4_fork_copy_on_write_and_prefix_hits_keep_the_stored_rows(rotate):
    from support.numerics import stored
    pool = KvBlockPool(4, 32, 1, D4, prefix_cache=True, dtype="int4", rotate=rotate)
    k, v = _rand(12, 1), _rand(12, 2)
    toks = list(range(1, 13))
    parent = KvCache.with_pool(1, D4, pool, 16)
    parent.extend(k, v)
    want_k, want_v = stored(k, "int4", D4, rotate), stored(v, "int4", D4, rotate)
    child = parent.fork()
    assert (child.dtype, child.rotate) == ("int4", rotate is not False)
    assert child.block_table.tolist()[:3] == parent.block_table.tolist()[:3]
    child.truncate(5)                     # back into shared block 1: the write copies it
    k2, v2 = _rand(3, 3), _rand(3, 4)
    child.extend(k2, v2)
    assert child.block_table[0] == parent.block_table[0]
    assert child.block_table[1] != parent.block_table[1]
    for c, wk, wv in ((parent, want_k, want_v),
                      (child, np.concatenate([want_k[:5], stored(k2, "int4", D4, rotate)]),
                       np.concatenate([want_v[:5], stored(v2, "int4", D4, rotate)]))):
        assert np.array_equal(c.k.reshape(-1, D4), wk) and np.array_equal(c.v.reshape(-1, D4), wv)
    assert pool.publish([parent], toks) == 12
    hit = KvCache.with_pool(1, D4, pool, 16, tokens=toks + [0])
    assert hit.seq_len == 12 and hit.block_table.tolist()[:3] == parent.block_table.tolist()[:3]
    assert hit.k.tobytes() == parent.k.tobytes() and hit.v.tobytes() == parent.v.tobytes()
    pool.check()
    del parent, child, hit, c
    gc.collect()
    pool.check()
    assert pool.free_blocks == 32             # the published blocks stay cached, and count free


@pytest.mark.parametrize("dtype", ["float32", "int4"])
def test_windowed_fork_and_copy_keep_the_window_and_release_gives_each_block_back_once(dtype):
    total = 40
    pool = KvBlockPool(4, total, 1, D4, dtype=dtype)
    parent = KvCache.with_pool(1, D4, pool, 1000, window=6)
    parent.extend(_rand(21, 5), _rand(21, 6))
    parent.push(_rand(1, 7)[0], _rand(1, 8)[0])
    assert parent.first_pos > 0

    def held(*caches):
        return set().union(*(x.block_table.tolist() for x in caches))

    child = parent.fork()
    copied = parent.copy()
    for x in (child, copied):
        assert (x.window, x.first_pos, x.seq_len, x.dtype) == (6, parent.first_pos, 22, dtype)
        assert x.k.tobytes() == parent.k.tobytes() and x.v.tobytes() == parent.v.tobytes()
    assert not copied.is_pooled and copied.blocks_held == 0
    shared = set(parent.block_table.tolist()) & set(child.block_table.tolist())
    assert shared and pool.free_blocks == total - len(held(parent, child))
    pool.check()
    for step in range(6):                 # the windows move on; shared blocks leave them
        for x, seed in ((parent, 10), (child, 20)):
            x.extend(_rand(3, seed + step), _rand(3, seed + step))
        assert pool.free_blocks == total - len(held(parent, child))
        pool.check()
    assert not set(parent.block_table.tolist()) & set(child.block_table.tolist())
    free = pool.free_blocks
    n_parent = parent.blocks_held
    parent.release_to_pool()
    assert parent.window == 6 and not parent.is_pooled
    assert pool.free_blocks == free + n_parent
    parent.release_to_pool()              # idempotent: nothing given back twice
    child.release_to_pool()
    child.release_to_pool()
    assert pool.free_blocks == total
    pool.check()
    s = pool.stats()
    assert s["acquired"] == s["released"]
    del parent, child, copied
    gc.collect()
    assert pool.free_blocks == total
    pool.check()
