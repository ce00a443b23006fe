"""One table of bad inputs: each raises its specific exception and leaves the
pool's counts and every cache's contents exactly as they were."""
import numpy as np
import pytest

from ferrox_kv import KvBlockPool, KvCache, KvPoolExhausted

H, D = 2, 4
W = H * D


def snapshot(pool, caches):
    return (pool.stats(),
            [(c.seq_len, c.blocks_held, c.capacity, c.is_pooled,
              c.block_table.tolist(), c.k.copy(), c.v.copy()) for c in caches])


def assert_same(a, b):
    assert a[0] == b[0]
    assert len(a[1]) == len(b[1])
    for x, y in zip(a[1], b[1]):
        assert x[:5] == y[:5]
        np.testing.assert_array_equal(x[5], y[5])
        np.testing.assert_array_equal(x[6], y[6])


@pytest.fixture
def world():
    """A pool with 1 block free, and a cache of each kind holding data; the
    pooled one is full, so its next position needs a block."""
    pool = KvBlockPool(2, 4, H, D)
    rng = np.random.default_rng(0)
    caches = [KvCache(H, D), KvCache.with_capacity(H, D, 3),
              KvCache.with_pool(H, D, pool, 4), KvCache.with_pool(H, D, pool, 1)]
    for c in caches:
        n = 4 if c.is_pooled and c.blocks_held == 2 else 2
        c.extend(rng.standard_normal((n, W)).astype(np.float32),
                 rng.standard_normal((n, W)).astype(np.float32))
    assert pool.free_blocks == 1
    drain = pool.allocate(1)           # now 0 free
    return pool, caches, drain


ok = np.zeros(W, np.float32)
ok_steps = np.zeros((3, W), np.float32)

# (id, callable(pool, caches), exception, message fragment)
CASES = [
    ("pool_block_size_zero", lambda p, cs: KvBlockPool(0, 4, H, D), ValueError, "block_size"),
    ("pool_block_size_negative", lambda p, cs: KvBlockPool(-1, 4, H, D), ValueError, "block_size"),
    ("pool_total_negative", lambda p, cs: KvBlockPool(2, -1, H, D), ValueError, "total_blocks"),
    ("pool_heads_zero", lambda p, cs: KvBlockPool(2, 4, 0, D), ValueError, "n_kv_heads"),
    ("pool_head_dim_negative", lambda p, cs: KvBlockPool(2, 4, H, -4), ValueError, "head_dim"),
    ("pool_v_head_dim_zero", lambda p, cs: KvBlockPool(2, 4, H, D, v_head_dim=0), ValueError, "v_head_dim"),
    ("pool_bytes_overflow", lambda p, cs: KvBlockPool(2**31, 2**31 - 1, 2**20, 2**20), ValueError, "overflow"),
    ("pool_huge_int", lambda p, cs: KvBlockPool(2, 2**80, H, D), ValueError, "total_blocks"),
    ("pool_float_size", lambda p, cs: KvBlockPool(2.5, 4, H, D), TypeError, "block_size"),
    ("cache_heads_zero", lambda p, cs: KvCache(0, D), ValueError, "n_kv_heads"),
    ("cache_head_dim_negative", lambda p, cs: KvCache(H, -1), ValueError, "head_dim"),
    ("cache_row_overflow", lambda p, cs: KvCache(2**40, 2**40), ValueError, "overflow"),
    ("capacity_negative", lambda p, cs: KvCache.with_capacity(H, D, -1), ValueError, "max_seq_len"),
    ("capacity_bytes_overflow", lambda p, cs: KvCache.with_capacity(2**20, 2**20, 2**40), ValueError, "overflow"),
    ("with_pool_negative", lambda p, cs: KvCache.with_pool(H, D, p, -3), ValueError, "max_seq_len"),
    ("with_pool_geometry", lambda p, cs: KvCache.with_pool(H, D + 1, p, 1), ValueError, "geometry"),
    ("with_pool_v_geometry", lambda p, cs: KvCache.with_pool(H, D, p, 1, v_head_dim=2), ValueError, "geometry"),
    ("with_pool_exhausted", lambda p, cs: KvCache.with_pool(H, D, p, 1), KvPoolExhausted, "exhausted"),
    ("with_pool_beyond_total", lambda p, cs: KvCache.with_pool(H, D, p, 10**12), KvPoolExhausted, "exhausted"),
    ("with_pool_not_a_pool", lambda p, cs: KvCache.with_pool(H, D, "pool", 1), TypeError, "pool"),
]
for i in range(4):
    CASES += [
        (f"push_k_short[{i}]", lambda p, cs, i=i: cs[i].push(np.zeros(W - 1, np.float32), ok), ValueError, "k_step"),
        (f"push_v_long[{i}]", lambda p, cs, i=i: cs[i].push(ok, np.zeros(W + 1)), ValueError, "v_step"),
        (f"push_k_shape[{i}]", lambda p, cs, i=i: cs[i].push(np.zeros((D, H), np.float32), ok), ValueError, "k_step"),
        (f"push_non_numeric[{i}]", lambda p, cs, i=i: cs[i].push(["a"] * W, ok), TypeError, "k_step"),
        (f"push_object[{i}]", lambda p, cs, i=i: cs[i].push(ok, [object()] * W), TypeError, "v_step"),
        (f"push_none[{i}]", lambda p, cs, i=i: cs[i].push(None, ok), TypeError, "k_step"),
        (f"extend_shape[{i}]", lambda p, cs, i=i: cs[i].extend(np.zeros((3, W + 1), np.float32), ok_steps), ValueError, "k_steps"),
        (f"extend_1d[{i}]", lambda p, cs, i=i: cs[i].extend(ok, ok), ValueError, "k_steps"),
        (f"extend_counts_differ[{i}]", lambda p, cs, i=i: cs[i].extend(ok_steps, ok_steps[:2]), ValueError, "positions"),
        (f"extend_non_numeric[{i}]", lambda p, cs, i=i: cs[i].extend(ok_steps, np.full((3, W), "x")), TypeError, "v_steps"),
        (f"truncate_beyond[{i}]", lambda p, cs, i=i: cs[i].truncate(cs[i].seq_len + 1), ValueError, "must not exceed"),
        (f"truncate_negative[{i}]", lambda p, cs, i=i: cs[i].truncate(-1), ValueError, ">= 0"),
        (f"advance_negative[{i}]", lambda p, cs, i=i: cs[i].advance_len(-2), ValueError, "n must be"),
        (f"advance_huge[{i}]", lambda p, cs, i=i: cs[i].advance_len(2**90), ValueError, "too large"),
    ]
# The pool has no free block: the full pooled cache cannot grow.
CASES += [
    ("pooled_push_exhausted", lambda p, cs: cs[3].push(ok, ok), KvPoolExhausted, "exhausted"),
    ("pooled_extend_exhausted", lambda p, cs: cs[2].extend(ok_steps, ok_steps), KvPoolExhausted, "exhausted"),
    ("pooled_advance_exhausted", lambda p, cs: cs[3].advance_len(1), KvPoolExhausted, "exhausted"),
    ("pooled_advance_huge", lambda p, cs: cs[2].advance_len(10**12), KvPoolExhausted, "exhausted"),
    ("pool_allocate_exhausted", lambda p, cs: p.allocate(1), KvPoolExhausted, "exhausted"),
    ("pool_allocate_negative", lambda p, cs: p.allocate(-1), ValueError, "n must be"),
    ("pool_free_unheld", lambda p, cs: p.free([cs[2].block_table[0], cs[2].block_table[0]]), ValueError, "not held"),
    ("pool_free_out_of_range", lambda p, cs: p.free([99]), ValueError, "out of range"),
    ("pool_free_a_cache_block", lambda p, cs: p.free(cs[2].block_table[:1]), ValueError, "a cache holds"),
    ("pool_free_floats", lambda p, cs: p.free([1.0]), TypeError, "integers"),
    ("cache_reinit", lambda p, cs: cs[0].__init__(1, 1), ValueError, "already set up"),
    ("gil_threshold_negative", lambda p, cs: __import__("ferrox_kv").set_gil_release_threshold(-1),
     ValueError, "nbytes"),
    ("pool_allocate_float", lambda p, cs: p.allocate(1.5), TypeError, "n must be an integer"),
    ("with_pool_many_negative", lambda p, cs: KvCache.with_pool_many(-1, H, D, p, 1), ValueError, "count"),
    ("with_pool_many_exhausted", lambda p, cs: KvCache.with_pool_many(2, H, D, p, 1), KvPoolExhausted, "exhausted"),
    ("with_pool_many_geometry", lambda p, cs: KvCache.with_pool_many(1, H, 1, p, 1), ValueError, "geometry"),
    ("pooled_cache_reinit", lambda p, cs: cs[2].__init__(H, D), ValueError, "already set up"),
]


# Sliding windows (window=, max_chunk=) and int4's rotation (rotate=): a bool
# window is a TypeError (window=True asks for a window, not for one of 1).
BOOL_POS = "must be an integer number of positions, got bool"
q_ok = np.zeros((H, D), np.float32)
CASES += [
    ("window_zero", lambda p, cs: KvCache.with_pool(H, D, p, 4, window=0), ValueError, "window must be >= 1, got 0"),
    ("window_negative", lambda p, cs: KvCache.with_pool(H, D, p, 4, window=-3), ValueError, "window must be >= 1, got -3"),
    ("window_true", lambda p, cs: KvCache.with_pool(H, D, p, 4, window=True), TypeError, "window " + BOOL_POS),
    ("window_false", lambda p, cs: KvCache.with_pool(H, D, p, 4, window=False), TypeError, "window " + BOOL_POS),
    ("window_numpy_bool", lambda p, cs: KvCache.with_pool(H, D, p, 4, window=np.True_), TypeError, "window must be an integer"),
    ("window_float", lambda p, cs: KvCache.with_pool(H, D, p, 4, window=4.0), TypeError, "window must be an integer.*got float"),
    ("window_str", lambda p, cs: KvCache.with_pool(H, D, p, 4, window="4"), TypeError, "window must be an integer, got str"),
    ("window_huge", lambda p, cs: KvCache.with_pool(H, D, p, 4, window=2**80), ValueError, "window is too large"),
    ("window_many_true", lambda p, cs: KvCache.with_pool_many(2, H, D, p, 4, window=True), TypeError, "window " + BOOL_POS),
    ("window_many_zero", lambda p, cs: KvCache.with_pool_many(2, H, D, p, 4, window=0), ValueError, "window must be >= 1"),
    ("window_many_float", lambda p, cs: KvCache.with_pool_many(2, H, D, p, 4, window=2.5), TypeError, "window must be an integer"),
    ("window_many_entry_true", lambda p, cs: KvCache.with_pool_many(2, H, D, p, 4, window=[True, None]), TypeError, "window\\[0\\] " + BOOL_POS),
    ("window_many_entry_zero", lambda p, cs: KvCache.with_pool_many(2, H, D, p, 4, window=[None, 0]), ValueError, "window\\[1\\] must be >= 1"),
    ("window_many_entries_short", lambda p, cs: KvCache.with_pool_many(2, H, D, p, 4, window=[3]), ValueError, "window has 1 entries for 2 caches"),
    ("window_many_max_chunk_true", lambda p, cs: KvCache.with_pool_many(2, H, D, p, 4, window=[3, None], max_chunk=True), TypeError, "max_chunk " + BOOL_POS),
    ("window_many_huge", lambda p, cs: KvCache.with_pool_many(2, H, D, p, 4, window=2**63), ValueError, "window is too large"),
    ("window_contiguous_true", lambda p, cs: KvCache(H, D, window=True), TypeError, "window " + BOOL_POS),
    ("window_contiguous_zero", lambda p, cs: KvCache(H, D, window=0), ValueError, "window must be >= 1"),
    ("window_contiguous_float", lambda p, cs: KvCache(H, D, window=1.5), TypeError, "window must be an integer"),
    ("window_with_capacity", lambda p, cs: KvCache.with_capacity(H, D, 4, window=3), TypeError, "window"),
    ("max_chunk_true", lambda p, cs: KvCache.with_pool(H, D, p, 4, window=4, max_chunk=True), TypeError, "max_chunk " + BOOL_POS),
    ("max_chunk_zero", lambda p, cs: KvCache.with_pool(H, D, p, 4, window=4, max_chunk=0), ValueError, "max_chunk must be >= 1"),
    ("max_chunk_without_window", lambda p, cs: KvCache.with_pool(H, D, p, 4, max_chunk=2), ValueError, "max_chunk= goes with window="),
    ("rotate_int", lambda p, cs: KvBlockPool(4, 4, H, 32, dtype="int4", rotate=1), TypeError, "rotate must be True, False or None, got int"),
    ("rotate_str", lambda p, cs: KvCache(H, 32, dtype="int4", rotate="yes"), TypeError, "rotate must be True, False or None, got str"),
    ("rotate_float_capacity", lambda p, cs: KvCache.with_capacity(H, 32, 4, dtype="int4", rotate=1.0), TypeError, "rotate must be"),
    ("rotate_true_float32_pool", lambda p, cs: KvBlockPool(4, 4, H, D, rotate=True), ValueError, "rotate=True applies to dtype='int4' only"),
    ("rotate_true_int8_cache", lambda p, cs: KvCache(H, D, dtype="int8", rotate=True), ValueError, "rotate=True applies to dtype='int4' only"),
    ("with_pool_rotate", lambda p, cs: KvCache.with_pool(H, D, p, 1, rotate=False), TypeError, "rotate"),
    ("int4_head_dim", lambda p, cs: KvBlockPool(4, 4, H, D, dtype="int4"), ValueError, "multiples of 32"),
    ("int4_on_a_float32_pool", lambda p, cs: KvCache.with_pool(H, 32, KvBlockPool(2, 4, H, 32), 1, dtype="int4"), ValueError, "does not match the pool's dtype"),
    ("float32_on_an_int4_pool", lambda p, cs: KvCache.with_pool(H, 32, KvBlockPool(2, 4, H, 32, dtype="int4"), 1, dtype="float32"), ValueError, "does not match the pool's dtype"),
]
for i in range(4):
    CASES += [
        (f"attend_window_true[{i}]", lambda p, cs, i=i: cs[i].attend(q_ok, window=True), TypeError, "window " + BOOL_POS),
        (f"attend_window_zero[{i}]", lambda p, cs, i=i: cs[i].attend(q_ok, window=0), ValueError, "window must be >= 1"),
    ]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_and_changes_nothing(world, case):
    pool, caches, _ = world
    _, call, exc, fragment = case
    before = snapshot(pool, caches)
    before_refused = before[0]["refused"]
    with pytest.raises(exc, match=fragment):
        call(pool, caches)
    after = snapshot(pool, caches)
    if exc is KvPoolExhausted:
        # the one counter a refusal is meant to move
        assert after[0]["refused"] == before_refused + 1
        after[0]["refused"] = before_refused
    assert_same(before, after)
    pool.check()


def test_exhausted_error_reports_requested_and_free(world):
    pool, caches, drain = world
    pool.free(drain)
    with pytest.raises(KvPoolExhausted) as ei:
        caches[2].extend(np.zeros((5, W), np.float32), np.zeros((5, W), np.float32))
    assert (ei.value.requested, ei.value.free) == (3, 1)
    assert caches[2].seq_len == 4 and pool.free_blocks == 1


def _pl(caches, k, v):
    from ferrox_kv import push_layers
    return push_layers(caches, k, v)


ok_layers = np.zeros((4, W), np.float32)
PUSH_LAYERS_CASES = [
    ("empty", lambda p, cs: _pl([], ok_layers, ok_layers), ValueError, "empty"),
    ("not_a_cache", lambda p, cs: _pl(cs[:3] + ["x"], ok_layers, ok_layers), TypeError, "not KvCache"),
    ("geometry", lambda p, cs: _pl(cs[:3] + [KvCache(H, D + 1)], ok_layers, ok_layers), ValueError, "geometry"),
    ("duplicate", lambda p, cs: _pl([cs[0], cs[1], cs[2], cs[0]], ok_layers, ok_layers), ValueError, "more than once"),
    ("rows_mismatch", lambda p, cs: _pl(cs, ok_layers[:3], ok_layers), ValueError, "rows for 4"),
    ("v_rows_mismatch", lambda p, cs: _pl(cs, ok_layers, ok_layers[:2]), ValueError, "rows for 4"),
    ("shape", lambda p, cs: _pl(cs, np.zeros((4, W + 1), np.float32), ok_layers), ValueError, "k_steps"),
    ("non_numeric", lambda p, cs: _pl(cs, ok_layers, np.full((4, W), "v")), TypeError, "v_steps"),
    ("exhausted", lambda p, cs: _pl(cs, ok_layers, ok_layers), KvPoolExhausted, "exhausted"),
]


@pytest.mark.parametrize("case", PUSH_LAYERS_CASES, ids=[c[0] for c in PUSH_LAYERS_CASES])
def test_push_layers_bad_input_changes_nothing(world, case):
    test_bad_input_raises_and_changes_nothing(world, case)
