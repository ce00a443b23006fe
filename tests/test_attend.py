"""KvCache.attend and attend_many against a float64 numpy reference: grouped
heads, head sizes, block sizes, every kind of cache, causal chunks, windows,
left padding, large scores, bad input, and threads. Every test runs three
times: on one thread, and split over 2 and 3 worker threads with the split
forced on every call (decode chunks down to one row), so each shape, dtype
and NaN rule also holds for the split and its merge."""
import ctypes
import threading
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ferrox_kv
from support.numerics import DTYPES, stored
from ferrox_kv import KvBlockPool, KvCache, KvPoolExhausted, attend_many
from ferrox_kv import _core

@pytest.fixture(scope="module", autouse=True, params=[1, 2, 3], ids=["1-thread", "2-threads", "3-threads"])
def attend_threads(request):
    """The module's tests at this thread count, the split forced on every call."""
    old_n = ferrox_kv.set_num_threads(request.param)
    old_split = _core._set_attend_split(0, 1) if request.param > 1 else None
    yield request.param
    ferrox_kv.set_num_threads(old_n)
    if old_split is not None:
        _core._set_attend_split(*old_split)


# every storage dtype: the reference runs over the values the cache stores
# (rounded to float16 / bfloat16, or int8-dequantised)
each_dtype = pytest.mark.parametrize("dtype", DTYPES)


def _st(x, dtype):
    """What a cache of ``dtype`` stores of rows x (T, h, d)."""
    t, h, d = x.shape
    return stored(x.reshape(t, h * d), dtype, d).reshape(t, h, d)


def _q(q, dtype):
    """The queries a cache of ``dtype`` attends with: int8 caches quantise
    each query vector (one scale per vector of head_dim values, rint(x / s)
    * s with s = max|x| / 127 in float32; a vector below 2^-119 reads as
    zeros, a non-finite one as it is), so that K is dotted in integers;
    other dtypes read q as is.
    The cost of that against float queries is bounded in test_precision."""
    if dtype != "int8":
        return q
    q = np.asarray(q, np.float32)
    a = np.abs(q).max(-1, keepdims=True)
    with np.errstate(all="ignore"):
        s = a / np.float32(127)
        r = np.clip(np.rint(q / s), -127, 127) * s
    tiny = np.isfinite(a) & (a < np.float32(2.0 ** -119))
    return np.where(tiny, np.float32(0), np.where(np.isfinite(a), r, q)).astype(np.float32)


def reference(k, v, q, scale=None, window=None, start=0):
    """k (T, h, d), v (T, h, vd), q (q_len, n_heads, d) -> (q_len, n_heads, vd),
    float64: query t sits at position T - q_len + t."""
    k, v, q = (np.asarray(x, np.float64) for x in (k, v, q))
    t_all, h, d = k.shape
    q_len, nh, _ = q.shape
    g = nh // h
    scale = 1 / np.sqrt(d) if scale is None else scale
    out = np.zeros((q_len, nh, v.shape[2]))
    for t in range(q_len):
        p = t_all - q_len + t
        lo = max(start, p - window + 1 if window else 0)
        if lo > p:
            continue
        for j in range(nh):
            s = k[lo:p + 1, j // g] @ q[t, j] * scale
            w = np.exp(s - s.max())
            out[t, j] = (w / w.sum()) @ v[lo:p + 1, j // g]
    return out


def _data(t, h, d, vd, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    return ((rng.standard_normal((t, h, d)) * scale).astype(np.float32),
            rng.standard_normal((t, h, vd)).astype(np.float32))


def _cache(kind, h, d, vd, t, block_size=16, dtype="float32"):
    if kind == "growable":
        return KvCache(h, d, v_head_dim=vd, dtype=dtype)
    if kind == "capacity":
        return KvCache.with_capacity(h, d, t, v_head_dim=vd, dtype=dtype)
    pool = KvBlockPool(block_size, -(-t // block_size) + 4, h, d, v_head_dim=vd, dtype=dtype)
    if kind == "pooled-shuffled":          # blocks out of order in the arena
        hold = pool.allocate(3)
        c = KvCache.with_pool(h, d, pool, t, v_head_dim=vd)
        pool.free(hold)
        return c
    return KvCache.with_pool(h, d, pool, t, v_head_dim=vd)


def _check(out, ref, tol=2e-5):
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol * max(1.0, np.abs(ref).max()))


@pytest.mark.parametrize("h,nh", [(8, 8), (2, 8), (1, 8), (4, 32), (8, 32)])
@pytest.mark.parametrize("kind", ["growable", "capacity", "pooled", "pooled-shuffled"])
@each_dtype
def test_decode_matches_the_reference_for_every_head_grouping(h, nh, kind, dtype):
    d, t = 64, 70
    k, v = _data(t, h, d, d)
    c = _cache(kind, h, d, d, t, dtype=dtype)
    c.extend(k, v)
    q = np.random.default_rng(1).standard_normal((nh, d)).astype(np.float32)
    out = c.attend(q)
    assert out.shape == (nh, d) and out.dtype == np.float32
    _check(out, reference(_st(k, dtype), _st(v, dtype), _q(q, dtype)[None])[0])


@pytest.mark.parametrize("d,vd", [(64, 64), (80, 80), (96, 96), (128, 128), (192, 128), (64, 32)])
@each_dtype
def test_head_sizes_and_a_v_head_dim_of_its_own(d, vd, dtype):
    k, v = _data(45, 2, d, vd, seed=d)
    c = _cache("pooled", 2, d, vd, 45, block_size=16, dtype=dtype)
    c.extend(k, v)
    q = np.random.default_rng(d).standard_normal((3, 8, d)).astype(np.float32)
    out = c.attend(q)
    assert out.shape == (3, 8, vd)
    _check(out, reference(_st(k, dtype), _st(v, dtype), _q(q, dtype)))


@pytest.mark.parametrize("block_size", [1, 7, 16, 32])
@pytest.mark.parametrize("t", [1, 6, 7, 8, 33, 100])
@each_dtype
def test_block_sizes_with_contexts_that_cross_block_boundaries(block_size, t, dtype):
    k, v = _data(t, 2, 16, 16, seed=t)
    c = _cache("pooled-shuffled", 2, 16, 16, t, block_size, dtype=dtype)
    for i in range(t):                      # pushed one by one, as in decoding
        c.push(k[i], v[i])
    q = np.random.default_rng(t).standard_normal((min(t, 4), 4, 16)).astype(np.float32)
    _check(c.attend(q), reference(_st(k, dtype), _st(v, dtype), _q(q, dtype)))


@pytest.mark.parametrize("q_len", [1, 2, 5, 17, 33, 64])
@pytest.mark.parametrize("window", [None, 1, 5, 16, 40])
@each_dtype
def test_causal_chunks_with_and_without_a_window(q_len, window, dtype):
    k, v = _data(80, 2, 32, 32, seed=q_len)
    c = _cache("pooled", 2, 32, 32, 80, block_size=7, dtype=dtype)
    c.extend(k, v)
    q = np.random.default_rng(q_len).standard_normal((q_len, 8, 32)).astype(np.float32)
    _check(c.attend(q, window=window), reference(_st(k, dtype), _st(v, dtype), _q(q, dtype), window=window))


@each_dtype
def test_after_truncate_release_copy_and_fork_attention_sees_the_rows_kept(dtype):
    k, v = _data(50, 2, 16, 16, seed=3)
    k, v = _st(k, dtype), _st(v, dtype)      # values the cache stores exactly
    pool = KvBlockPool(8, 32, 2, 16, dtype=dtype)
    c = KvCache.with_pool(2, 16, pool, 64)
    c.extend(k, v)
    q = np.random.default_rng(3).standard_normal((2, 4, 16)).astype(np.float32)
    c.truncate(30)
    _check(c.attend(q), reference(k[:30], v[:30], _q(q, dtype)))
    f = c.fork()
    f.extend(k[30:40] * 2, v[30:40])
    _check(f.attend(q), reference(np.concatenate([k[:30], _st(k[30:40] * 2, dtype)]), v[:40], _q(q, dtype)))
    _check(c.attend(q), reference(k[:30], v[:30], _q(q, dtype)))          # the parent is untouched
    cp = c.copy()
    _check(cp.attend(q), reference(k[:30], v[:30], _q(q, dtype)))
    c.release_to_pool()
    _check(c.attend(q), reference(k[:30], v[:30], _q(q, dtype)))


def test_large_magnitude_scores_stay_finite_and_exact():
    k, v = _data(300, 1, 64, 64, seed=5, scale=60.0)       # q.k around 1e4
    c = _cache("pooled", 1, 64, 64, 300)
    c.extend(k, v)
    q = (np.random.default_rng(5).standard_normal((4, 4, 64)) * 60).astype(np.float32)
    out = c.attend(q, scale=1.0)
    assert np.isfinite(out).all()
    _check(out, reference(k, v, q, scale=1.0), tol=1e-4)


def _sdpa_numerics_caches(t=6, h=2, d=8):
    """A contiguous and a pooled cache (shuffled blocks) holding the same rows."""
    k, v = _data(t, h, d, d, seed=21)
    caches = [_cache("capacity", h, d, d, t), _cache("pooled-shuffled", h, d, d, t, block_size=4)]
    return k, v, caches


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("many", [False, True], ids=["attend", "attend_many"])
def test_a_nan_or_inf_in_q_gives_nan_as_sdpa_does(bad, many):
    k, v, caches = _sdpa_numerics_caches()
    q = np.random.default_rng(22).standard_normal((2, 4, 8)).astype(np.float32)
    q[1, 0, 3] = bad                                        # position 1, query head 0
    for c in caches:
        c.extend(k, v)
        out = attend_many([c], q[None])[0] if many else c.attend(q)
        assert np.isnan(out[1, 0]).all(), out[1, 0]
        ok = np.ones(out.shape[:2], bool)
        ok[1, 0] = False
        _check(out[ok], reference(k, v, q)[ok])             # every other query is untouched


@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("many", [False, True], ids=["attend", "attend_many"])
def test_a_nan_in_one_k_row_propagates_as_one_in_v_does(where, many):
    k, v, caches = _sdpa_numerics_caches()
    (k if where == "k" else v)[3, 1, 0] = np.nan           # row 3, kv head 1
    q = np.random.default_rng(23).standard_normal((4, 4, 8)).astype(np.float32)
    for c in caches:
        c.extend(k, v)
        out = attend_many([c], q[None])[0] if many else c.attend(q)
        # positions 2..5 are queried; those at >= 3 see row 3; heads 2, 3 read kv
        # head 1: a NaN score poisons the whole output vector, a NaN value its dim
        assert np.isnan(out[1:, 2:] if where == "k" else out[1:, 2:, 0]).all()
        if where == "v":
            assert np.isfinite(out[:, :, 1:]).all()
        assert np.isfinite(out[0]).all() and np.isfinite(out[:, :2]).all()
        _check(out[:, :2], reference(k, v, q)[:, :2])


def test_a_plus_inf_score_is_nan_and_a_minus_inf_score_has_weight_zero():
    k, v, caches = _sdpa_numerics_caches()
    q = np.ones((1, 4, 8), np.float32)
    k[2, 0, 0] = np.inf                                     # score +inf for kv head 0
    k[4, 1, 0] = -np.inf                                    # score -inf for kv head 1
    for c in caches:
        c.extend(k, v)
        out = c.attend(q)
        assert np.isnan(out[0, :2]).all()
        keep = [0, 1, 2, 3, 5]
        _check(out[0, 2:], reference(k[keep], v[keep], q)[0, 2:])


@pytest.mark.parametrize("scale", [1e38, -1e38, 3.4e38, 1e20])
@pytest.mark.parametrize("many", [False, True], ids=["attend", "attend_many"])
def test_any_finite_scale_gives_the_exact_softmax(scale, many):
    # scores of 3 (rows 1 and 4) and 1 or 2 elsewhere: with a huge positive
    # scale the answer is the mean of V over the top rows, with a huge
    # negative one the mean over the bottom rows (the issue: zeros)
    h, d, t = 1, 4, 6
    k = np.zeros((t, h, d), np.float32)
    k[:, 0, 0] = [1, 3, 2, 1, 3, 2]
    v = np.random.default_rng(24).standard_normal((t, h, d)).astype(np.float32)
    q = np.ones((1, 2, d), np.float32)
    for kind in ("capacity", "pooled-shuffled"):
        c = _cache(kind, h, d, d, t, block_size=4)
        c.extend(k, v)
        out = attend_many([c], q[None], scale=scale)[0] if many else c.attend(q, scale=scale)
        rows = [1, 4] if scale > 0 else [0, 3]
        want = v[rows, 0].mean(axis=0)
        np.testing.assert_allclose(out[0], np.stack([want, want]), rtol=1e-6, atol=1e-6)
        if scale == 1e20:
            _check(out, reference(k, v, q, scale=scale))


def test_scale_and_out_are_honoured_and_out_may_alias_q():
    k, v = _data(20, 2, 8, 8, seed=6)
    c = _cache("capacity", 2, 8, 8, 20)
    c.extend(k, v)
    q = np.random.default_rng(6).standard_normal((3, 4, 8)).astype(np.float32)
    out = np.empty((3, 4, 8), np.float32)
    got = c.attend(q, scale=0.3, out=out)
    assert got is out
    _check(out, reference(k, v, q, scale=0.3))
    qq = q.copy()
    c.attend(qq, out=qq)                                    # in place over its own input
    _check(qq, reference(k, v, q))


@each_dtype
def test_attend_many_matches_attend_per_sequence_with_lengths_and_left_padding(dtype):
    pool = KvBlockPool(4, 64, 2, 16, dtype=dtype)
    lens, pads = [9, 23, 40], [0, 5, 17]
    caches, datas = [], []
    for i, n in enumerate(lens):
        k, v = (_st(x, dtype) for x in _data(n, 2, 16, 16, seed=10 + i))
        c = KvCache.with_pool(2, 16, pool, n)
        c.extend(k, v)
        caches.append(c)
        datas.append((k, v))
    q = np.random.default_rng(7).standard_normal((3, 4, 8, 16)).astype(np.float32)
    out = attend_many(caches, q, start=pads)
    assert out.shape == (3, 4, 8, 16)
    for i, (k, v) in enumerate(datas):
        _check(out[i], reference(k, v, _q(q[i], dtype), start=pads[i]))
    out_w = attend_many(caches, q, window=6)
    for i, (k, v) in enumerate(datas):
        _check(out_w[i], reference(k, v, _q(q[i], dtype), window=6))


@pytest.mark.parametrize("top", [1e-44, 1e-40, 1e-37, 2.0 ** -119, 1e-30])
def test_an_int8_cache_attends_with_a_tiny_query_as_with_zeros_or_its_value(top):
    # a query vector whose largest value is tiny (denormal, or so small that
    # max/127 is): no NaN from quantising it; below 2^-119 it reads as zeros
    # (the scores then differ from the exact ones by under 2^-119 |k|)
    rng = np.random.default_rng(5)
    k = rng.standard_normal((20, 2, 32)).astype(np.float32)
    v = rng.standard_normal((20, 2, 32)).astype(np.float32)
    q = np.zeros((4, 32), np.float32)
    q[:, 0] = top
    q[1, 5] = -top
    c = KvCache(2, 32, dtype="int8")
    c.extend(k, v)
    out = c.attend(q)
    assert np.isfinite(out).all()
    _check(out, reference(_st(k, "int8"), _st(v, "int8"), _q(q[None], "int8"))[0])
    if top < 2.0 ** -119:
        np.testing.assert_allclose(out, np.broadcast_to(_st(v, "int8").mean(0).repeat(2, 0), out.shape),
                                   rtol=1e-5, atol=1e-6)


def test_a_query_that_sees_nothing_gets_zeros():
    k, v = _data(10, 1, 8, 8)
    c = _cache("growable", 1, 8, 8, 10)
    c.extend(k, v)
    q = np.ones((3, 2, 8), np.float32)
    out = c.attend(q, start=9)                             # positions 7 and 8 see nothing
    assert (out[:2] == 0).all()
    _check(out, reference(k, v, q, start=9))


def _bad_cases():
    return [
        ("heads_not_multiple", lambda c: c.attend(np.ones((3, 8), np.float32)), "multiple"),
        ("head_dim", lambda c: c.attend(np.ones((4, 7), np.float32)), "head_dim"),
        ("q_len_zero", lambda c: c.attend(np.ones((0, 4, 8), np.float32)), "q_len"),
        ("q_len_too_long", lambda c: c.attend(np.ones((6, 4, 8), np.float32)), "exceeds"),
        ("ndim_1", lambda c: c.attend(np.ones(8, np.float32)), "dimensions"),
        ("ndim_4", lambda c: c.attend(np.ones((1, 1, 4, 8), np.float32)), "dimensions"),
        ("window_zero", lambda c: c.attend(np.ones((4, 8), np.float32), window=0), "window"),
        ("out_shape", lambda c: c.attend(np.ones((4, 8), np.float32),
                                         out=np.empty((4, 7), np.float32)), "out"),
        ("out_dtype", lambda c: c.attend(np.ones((4, 8), np.float32),
                                         out=np.empty((4, 8), np.float64)), "out"),
        ("scale_nan", lambda c: c.attend(np.ones((4, 8), np.float32), scale=float("nan")), "scale"),
        ("start_negative", lambda c: c.attend(np.ones((4, 8), np.float32), start=-1), "start"),
    ]


@pytest.mark.parametrize("name,call,msg", _bad_cases(), ids=[b[0] for b in _bad_cases()])
def test_bad_input_raises_value_error_and_changes_nothing(name, call, msg):
    pool = KvBlockPool(2, 8, 2, 8)
    c = KvCache.with_pool(2, 8, pool, 8)
    k, v = _data(5, 2, 8, 8)
    c.extend(k, v)
    before = (c.seq_len, c.block_table.tolist(), c.k.copy(), pool.stats())
    with pytest.raises(ValueError, match=msg):
        call(c)
    assert (c.seq_len, c.block_table.tolist()) == tuple(before[:2])
    np.testing.assert_array_equal(c.k, before[2])
    assert pool.stats() == before[3]


def test_an_empty_cache_and_bad_batches_are_refused():
    c = KvCache(2, 8)
    with pytest.raises(ValueError, match="empty"):
        c.attend(np.ones((4, 8), np.float32))
    c.push(np.ones(16), np.ones(16))
    with pytest.raises(ValueError, match="q has 1 sequences for 2 caches"):
        attend_many([c, c.copy()], np.ones((1, 1, 4, 8), np.float32))
    with pytest.raises(ValueError, match="start has 1 entries for 2 caches"):
        attend_many([c, c.copy()], np.ones((2, 1, 4, 8), np.float32), start=[0])
    with pytest.raises(ValueError, match="appears more than once"):
        attend_many([c, c], np.ones((2, 1, 4, 8), np.float32))
    with pytest.raises(ValueError, match="another geometry"):
        attend_many([c, KvCache.with_capacity(1, 8, 1)], np.ones((2, 1, 4, 8), np.float32))
    with pytest.raises(TypeError, match="not KvCache"):
        attend_many([c, "x"], np.ones((2, 1, 4, 8), np.float32))


def _writable(a):
    """A writable array over the memory of the read-only view ``a`` (what a
    caller holding a raw pointer to the storage can pass as ``out``)."""
    ptr = ctypes.cast(a.ctypes.data, ctypes.POINTER(ctypes.c_float))
    return np.ctypeslib.as_array(ptr, shape=a.shape)


@pytest.mark.parametrize("where", ["contiguous", "pool-arena", "attend_many"])
def test_out_over_the_storage_the_call_reads_gets_the_right_answer(where):
    # q_len * n_heads > 256 (the kernel's query block): later passes read V rows
    # that earlier passes wrote when the output went straight into out
    t, h, d = 300, 1, 16
    k, v = _data(t, h, d, d, seed=11)
    q = np.random.default_rng(11).standard_normal((t, h, d)).astype(np.float32)
    if where == "pool-arena":
        pool = KvBlockPool(16, 24, h, d)
        c = KvCache.with_pool(h, d, pool, t)
        c.extend(k, v)
        assert c.block_table.tolist() == list(range(19))      # rows in arena order
        out = _writable(pool.value_blocks).reshape(-1, h, d)[:t]
    else:
        c = _cache("capacity", h, d, d, t)
        c.extend(k, v)
        out = _writable(c.v)
    ref = reference(k, v, q)
    if where == "attend_many":
        got = attend_many([c], q[None], out=out[None])
        assert np.shares_memory(got, out)
        got = got[0]
    else:
        got = c.attend(q, out=out)
        assert got is out
    _check(got, ref)
    _check(c.v, ref)                                         # the caller asked for it there


@pytest.mark.parametrize("scale", ["0.5", b"0.5", 1j, np.complex64(0.5), [0.5], object()])
def test_scale_must_be_a_real_number(scale):
    c = _cache("pooled", 2, 8, 8, 5)
    c.extend(*_data(5, 2, 8, 8))
    before = (c.seq_len, c.k.copy())
    with pytest.raises(TypeError, match="scale must be a real number"):
        c.attend(np.ones((4, 8), np.float32), scale=scale)
    with pytest.raises(TypeError, match="scale must be a real number"):
        attend_many([c], np.ones((1, 1, 4, 8), np.float32), scale=scale)
    assert c.seq_len == before[0]
    np.testing.assert_array_equal(c.k, before[1])


@pytest.mark.parametrize("scale", [0.5, 1, np.float32(0.5), np.float64(0.5), np.int64(1),
                                   np.array(0.5), Fraction(1, 2), True])
def test_scale_takes_any_real_number(scale):
    k, v = _data(5, 2, 8, 8)
    c = _cache("capacity", 2, 8, 8, 5)
    c.extend(k, v)
    q = np.random.default_rng(3).standard_normal((1, 4, 8)).astype(np.float32)
    _check(c.attend(q, scale=scale), reference(k, v, q, scale=float(scale)))


def test_a_scale_beyond_the_float_range_is_a_value_error():
    c = _cache("capacity", 2, 8, 8, 5)
    c.extend(*_data(5, 2, 8, 8))
    for scale in (10 ** 400, 1e39, float("inf")):
        with pytest.raises(ValueError, match="scale"):
            c.attend(np.ones((4, 8), np.float32), scale=scale)


def test_the_simd_path_is_named():
    assert _core.simd_path() in ("x86-64-v4 (AVX-512, 16-float vectors)", "x86-64-v3 (AVX2+FMA)",
                                 "baseline (SSE2)") or _core.simd_path()


@pytest.fixture(params=[(4, 16), (3, 8), (0, 8)], ids=["16-float", "8-float", "baseline"])
def attend_width(request):
    """Attention capped at this (x86-64 level, vector width): each level's
    instantiation in the shipped extension (16 floats only where the CPU
    has AVX-512; a level above the CPU's runs the CPU's)."""
    level, width = request.param
    old_level, old_width = _core._set_attend_max_level(level), _core._set_attend_max_width(width)
    yield width
    _core._set_attend_max_width(old_width)
    _core._set_attend_max_level(old_level)


def _cpu_has(flag):
    """Whether /proc/cpuinfo lists this CPU flag (False where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            return f" {flag} " in f.read()
    except OSError:
        return False


def test_the_width_hook_names_the_path_and_refuses_other_widths():
    old = _core._set_attend_max_width(8)
    try:
        assert "16-float" not in _core.simd_path()
        _core._set_attend_max_width(16)
        compiler = _core.build_info()["compiler"].split()
        builds_w16 = compiler[0] == "clang" or (compiler[0] == "gcc" and int(compiler[1].split(".")[0]) >= 12)
        assert ("16-float" in _core.simd_path()) == (_cpu_has("avx512bw") and builds_w16
                                                      and "x86-64" in _core.simd_path())
        for bad in (0, 4, 12, 32):
            with pytest.raises(ValueError, match="width must be 8 or 16"):
                _core._set_attend_max_width(bad)
        assert "16-float" not in _core.simd_path() or _core._set_attend_max_width(16) == 16
    finally:
        _core._set_attend_max_width(old)


def test_the_level_hook_runs_the_baseline_and_refuses_other_levels():
    old = _core._set_attend_max_level(0)
    try:
        if "x86-64" in _core.build_info()["kernel"]:      # a build that dispatches
            assert _core.simd_path() == "baseline (SSE2)"
            assert "exact integer conversion" in _core.simd_path("float16")
        for bad in (1, 2, 5, -1):
            with pytest.raises(ValueError, match="level must be 0, 3 or 4"):
                _core._set_attend_max_level(bad)
        assert _core._set_attend_max_level(4) == 0
    finally:
        _core._set_attend_max_level(old)


# decode (G = 4, 1 query head per kv head, MQA), short chunks, and chunks of
# more than 32 query vectors per kv head (the packed path with K transposed),
# over head dims that are multiples of 16 (the 16-float path) and not (80 is,
# 72 and 20 are not: the 8-float path on any CPU)
@pytest.mark.parametrize("h,nh,d,vd,t,q_len,window,bs", [
    (8, 32, 128, 128, 300, 1, None, 16),
    (4, 4, 96, 96, 90, 1, 13, 1),
    (1, 8, 64, 64, 77, 3, None, 7),
    (2, 8, 64, 64, 200, 40, None, 7),
    (1, 32, 128, 128, 130, 17, 50, 16),
    (2, 16, 80, 80, 101, 49, 30, 32),
    (2, 8, 72, 72, 60, 33, None, 16),
    (1, 4, 20, 12, 40, 12, 5, 3),
])
@each_dtype
def test_both_vector_widths_match_the_reference(attend_width, h, nh, d, vd, t, q_len, window, bs, dtype):
    k, v = _data(t, h, d, vd, seed=t)
    c = _cache("pooled-shuffled", h, d, vd, t, bs, dtype=dtype)
    c.extend(k, v)
    q = np.random.default_rng(t).standard_normal((q_len, nh, d)).astype(np.float32)
    ref = reference(_st(k, dtype), _st(v, dtype), _q(q, dtype), window=window)
    _check(c.attend(q, window=window), ref)
    other = _cache("growable", h, d, vd, t, dtype=dtype)
    other.extend(k[: t - 5], v[: t - 5])
    both = attend_many([c, other], np.stack([q[-1:], q[:1]]), window=window)
    _check(both[0, 0], ref[-1])
    _check(both[1, 0], reference(_st(k[: t - 5], dtype), _st(v[: t - 5], dtype), _q(q[:1], dtype),
                                 window=window)[0])


# head dims that are multiples of 64 take the VNNI tile, 96 and 80 the
# AVX2 one in either setting; q_len 3 x 8 query heads is an unpacked pass
@pytest.mark.parametrize("h,nh,d,t,q_len,bs", [
    (8, 32, 128, 300, 1, 16),
    (1, 8, 64, 77, 3, 7),
    (2, 8, 192, 60, 1, 5),
    (4, 4, 96, 90, 1, 1),
    (2, 4, 80, 33, 2, 16),
])
def test_int8_scores_by_vnni_equal_those_of_the_avx2_integer_tile(h, nh, d, t, q_len, bs):
    # both tiles take the same exact int32 group sums; only the order of the
    # float sum over a row's scaled groups differs
    k, v = _data(t, h, d, d, seed=t, scale=4.0)
    c = _cache("pooled-shuffled", h, d, d, t, bs, dtype="int8")
    c.extend(k, v)
    q = np.random.default_rng(t).standard_normal((q_len, nh, d)).astype(np.float32)
    old = _core._set_attend_vnni(False)
    try:
        avx2, avx2_path = c.attend(q), _core.simd_path("int8")
        assert _core._set_attend_vnni(True) is False
        vnni, vnni_path = c.attend(q), _core.simd_path("int8")
    finally:
        _core._set_attend_vnni(old)
    ref = reference(_st(k, "int8"), _st(v, "int8"), _q(q, "int8"))
    _check(avx2, ref)
    _check(vnni, ref)
    np.testing.assert_allclose(vnni, avx2, rtol=1e-5, atol=1e-6 * np.abs(avx2).max())
    assert "vpdpbusd" not in avx2_path
    if "x86-64-v4" in _core.simd_path() and _core.build_info()["compiler"].startswith("gcc"):
        assert ("vpdpbusd" in vnni_path) == _cpu_has("avx512_vnni")    # a build that dispatches


@pytest.mark.parametrize("bad", [1, 0, None, "yes"])
def test_the_vnni_hook_takes_a_bool_only_and_changes_nothing_else(bad):
    before = _core.simd_path("int8")
    with pytest.raises(TypeError, match="on must be a bool"):
        _core._set_attend_vnni(bad)
    assert _core.simd_path("int8") == before


@settings(max_examples=60, deadline=None)
@given(h=st.sampled_from([1, 2, 4]), group=st.sampled_from([1, 2, 3, 8]),
       d=st.sampled_from([1, 3, 8, 20, 64]), vd=st.sampled_from([1, 5, 16, 64]),
       t=st.integers(1, 90), q_len=st.integers(1, 12), bs=st.integers(1, 20),
       window=st.one_of(st.none(), st.integers(1, 30)), start=st.integers(0, 20),
       pooled=st.booleans(), seed=st.integers(0, 9))
def test_any_shape_matches_the_reference(h, group, d, vd, t, q_len, bs, window, start, pooled, seed):
    q_len = min(q_len, t)
    k, v = _data(t, h, d, vd, seed=seed)
    c = _cache("pooled" if pooled else "growable", h, d, vd, t, bs)
    c.extend(k, v)
    q = np.random.default_rng(seed).standard_normal((q_len, h * group, d)).astype(np.float32)
    _check(c.attend(q, window=window, start=start), reference(k, v, q, window=window, start=start))


def test_threads_attend_while_others_push_and_close_on_the_same_pool():
    h, d = 2, 32
    pool = KvBlockPool(8, 512, h, d)
    stop = threading.Event()
    errors = []

    def churn(seed):
        rng = np.random.default_rng(seed)
        try:
            while not stop.is_set():
                try:
                    c = KvCache.with_pool(h, d, pool, 64)
                except KvPoolExhausted:
                    continue
                c.extend(rng.standard_normal((40, h * d)).astype(np.float32),
                         rng.standard_normal((40, h * d)).astype(np.float32))
                c.close()
        except BaseException as e:
            errors.append(e)

    def reader(seed):
        try:
            k, v = _data(200, h, d, d, seed=seed)
            c = KvCache.with_pool(h, d, pool, 256)
            c.extend(k, v)
            q = np.random.default_rng(seed).standard_normal((3, 8, d)).astype(np.float32)
            ref = reference(k, v, q)
            for _ in range(200):
                _check(c.attend(q), ref)
                _check(attend_many([c], q[None])[0], ref)
            c.close()
        except BaseException as e:
            errors.append(e)

    old = _core.set_attend_gil_release_threshold(0)        # every call without the GIL
    try:
        churners = [threading.Thread(target=churn, args=(i,)) for i in range(2)]
        readers = [threading.Thread(target=reader, args=(10 + i,)) for i in range(3)]
        for t in churners + readers:
            t.start()
        for t in readers:
            t.join()
        stop.set()
        for t in churners:
            t.join()
    finally:
        _core.set_attend_gil_release_threshold(old)
    assert not errors, errors[0]
    pool.check()
    assert pool.free_blocks == pool.total_blocks


@pytest.mark.parametrize("h,d", [(8, 64), (3, 96)])    # 16 scales a row; 9: 8 at a time + 1
@pytest.mark.parametrize("kind", ["growable", "pooled-shuffled"])
def test_int8_attend_reads_each_rows_scales_subnormal_and_non_finite_ones_too(h, d, kind):
    # the kernel converts a row's float16 scales 8 at a time, the rest one
    # by one.  Groups of values ~1e-4 have subnormal scales (~1e-6, below
    # float16's smallest normal); q is 1e4 there and V's output columns are
    # checked at their own magnitude, so a scale read as 0 or misplaced fails
    k, v = _data(24, h, d, d, seed=11)
    q = np.random.default_rng(12).standard_normal((4, 2 * h, d)).astype(np.float32)
    k[:, 0, :32] *= 1e-4                                # first scale of every K row
    q[:, :2, :32] *= 1e4
    k[:, h - 1, d - 32:] *= 1e-4                        # last scale (the tail for 3 x 96)
    q[:, 2 * (h - 1):, d - 32:] *= 1e4
    v[:, h // 2, 32:64] *= 1e-4
    c = _cache(kind, h, d, d, 24, block_size=4, dtype="int8")
    c.extend(k, v)
    ks, vs = _st(k, "int8"), _st(v, "int8")
    assert 0 < np.abs(ks[:, 0, :32]).max() < 6.1e-5 * 127    # stored through subnormal scales
    out, ref = c.attend(q), reference(ks, vs, _q(q, "int8"))
    _check(out, ref)
    tiny = slice(2 * (h // 2), 2 * (h // 2) + 2)
    np.testing.assert_allclose(out[:, tiny, 32:64], ref[:, tiny, 32:64], rtol=2e-5, atol=2e-5 * 1e-4)
    bad = v.copy()
    bad[21, h - 1, d - 32:] = np.inf                    # its group reads back as 32 NaN
    c2 = _cache(kind, h, d, d, 24, block_size=4, dtype="int8")
    c2.extend(k, bad)
    out = c2.attend(q)
    want = np.zeros(out.shape, bool)
    want[1:, 2 * (h - 1):, d - 32:] = True              # the queries that see row 21, those columns
    np.testing.assert_array_equal(np.isnan(out), want)
    _check(out[0], ref[0])
