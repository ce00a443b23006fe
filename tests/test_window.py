"""Sliding-window caches (``with_pool(..., window=W)``): attention equal to
``attend(window=W)`` over a whole cache, blocks back in the pool exactly when
the rules of _window.pxi say, refusals that change nothing, and a stateful
model of every operation with ``pool.check()`` after each step."""
import copy

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from support.numerics import DTYPES
from support.windows import Rule, assert_rule as _assert_rule, ceil as _ceil
from ferrox_kv import KvBlockPool, KvCache, KvPoolExhausted, attend_many, push_layers

H, D, NH = 2, 8, 4


def _rows(rng, t):
    return (rng.standard_normal((t, H, D)).astype(np.float32),
            rng.standard_normal((t, H, D)).astype(np.float32))


def _pool(dtype="float32", bs=4, total=64):
    return KvBlockPool(bs, total, H, D, dtype=dtype)


# -- attention: bit for bit against attend(window=W) over a whole cache ----------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window,bs,max_chunk", [(1, 4, None), (5, 4, None), (9, 4, 3),
                                                 (16, 8, 1), (7, 16, 20)])
def test_windowed_attend_equals_a_whole_cache_bit_for_bit(dtype, window, bs, max_chunk):
    rng = np.random.default_rng(window * 31 + bs)
    pw, pu = _pool(dtype, bs, 64), _pool(dtype, bs, 64)
    c = KvCache.with_pool(H, D, pw, 10_000, window=window, max_chunk=max_chunk)
    u = KvCache.with_pool(H, D, pu, 200)
    freed = False
    for step in range(40):
        t = int(rng.choice([1, 1, 1, 2, 3, 6, 11]))
        k, v = _rows(rng, t)
        c.extend(k, v)
        u.extend(k, v)
        pw.check()
        for q_len in sorted({1, t}):
            q = rng.standard_normal((q_len, NH, D)).astype(np.float32)
            a = c.attend(q, threads=1)
            b = u.attend(q, window=window, threads=1)
            assert a.tobytes() == b.tobytes(), (step, q_len)
            smaller = max(1, window // 2)      # a smaller window reads within the held rows
            assert (c.attend(q, window=smaller, threads=1).tobytes()
                    == u.attend(q, window=smaller, threads=1).tobytes())
            np.testing.assert_allclose(c.attend(q), b, rtol=2e-5, atol=2e-6)
        start = int(rng.integers(0, c.seq_len + 1))
        q = rng.standard_normal((1, NH, D)).astype(np.float32)
        assert (c.attend(q, start=start, threads=1).tobytes()
                == u.attend(q, window=window, start=start, threads=1).tobytes())
        assert np.array_equal(c.k, u.k[c.first_pos:]) and np.array_equal(c.v, u.v[c.first_pos:])
        freed = freed or c.first_pos > 0
    assert freed
    assert c.seq_len == u.seq_len
    assert c.blocks_held <= _ceil(window + max(max_chunk or bs, 11) - 1, bs) + 1


def test_attend_many_over_windowed_caches_equals_whole_caches():
    rng = np.random.default_rng(3)
    pw, pu = _pool(), _pool()
    cs = KvCache.with_pool_many(3, H, D, pw, 500, window=6)
    us = KvCache.with_pool_many(3, H, D, pu, 60)
    for i, (c, u) in enumerate(zip(cs, us)):
        k, v = _rows(rng, 20 + 7 * i)
        c.extend(k, v)
        u.extend(k, v)
    for _ in range(5):
        k, v = _rows(rng, 3)
        push_layers(cs, k, v)
        push_layers(us, k, v)
    pw.check()
    q = rng.standard_normal((3, 1, NH, D)).astype(np.float32)
    a = attend_many(cs, q, threads=1)
    b = attend_many(us, q, window=6, threads=1)
    assert a.tobytes() == b.tobytes()
    st_ = np.array([0, 40, 3])
    assert (attend_many(cs, q, start=st_, threads=1).tobytes()
            == attend_many(us, q, window=6, start=st_, threads=1).tobytes())


def test_attention_never_reads_a_position_the_window_gave_back():
    rng = np.random.default_rng(4)
    p = _pool()
    c = KvCache.with_pool(H, D, p, 100, window=5)
    k, v = _rows(rng, 30)
    c.extend(k, v)
    k, v = _rows(rng, 1)
    c.push(k[0], v[0])
    assert c.first_pos == 24
    # 2 queries: the first at 29 reads from 25, still held; 8 queries read from 19
    c.attend(rng.standard_normal((2, NH, D)).astype(np.float32))
    before = (c.block_table.tolist(), c.first_pos, p.free_blocks)
    with pytest.raises(ValueError, match="holds positions from 24 on.*read from position 19"):
        c.attend(rng.standard_normal((8, NH, D)).astype(np.float32))
    with pytest.raises(ValueError, match="window=6 is larger than the sliding window 5"):
        c.attend(rng.standard_normal((NH, D)).astype(np.float32), window=6)
    assert (c.block_table.tolist(), c.first_pos, p.free_blocks) == before
    u = KvCache.with_pool(H, D, p, 8)
    u.push(k[0], v[0])
    q = rng.standard_normal((2, 1, NH, D)).astype(np.float32)
    with pytest.raises(ValueError, match="caches\\[1\\] has window None and caches\\[0\\] 5"):
        attend_many([c, u], q)
    attend_many([c, u], q, window=3)       # an explicit window within both is fine
    p.check()


# -- blocks: given back exactly when the rules say -------------------------------------

@pytest.mark.parametrize("window,bs,max_chunk", [(1, 4, None), (6, 4, None), (13, 4, 5),
                                                 (3, 8, 1), (40, 4, 2)])
def test_blocks_go_back_exactly_as_the_rules_say(window, bs, max_chunk):
    rng = np.random.default_rng(window)
    p = KvBlockPool(bs, 200, H, D)
    c = KvCache.with_pool(H, D, p, 10_000, window=window, max_chunk=max_chunk)
    resv = _ceil(window + (max_chunk or bs) - 1, bs) + 1
    r = Rule(bs, window, resv)
    _assert_rule(c, r)
    assert p.free_blocks == 200 - resv
    for _ in range(60):
        t = int(rng.choice([1, 1, 2, 5, 17]))
        k, v = _rows(rng, t)
        table = c.block_table.tolist()
        trim, grow = r.plan(t)
        c.extend(k, v)
        r.append(t)
        _assert_rule(c, r)
        assert c.block_table.tolist()[:len(table) - trim] == table[trim:]
        assert p.free_blocks == 200 - c.blocks_held
        assert c.first_pos <= max(c.seq_len - t - window + 1, 0)   # what the last append reads
        p.check()


def test_decoding_within_the_reservation_never_takes_a_free_block():
    p = KvBlockPool(4, 64, H, D)
    c = KvCache.with_pool(H, D, p, 10_000, window=10, max_chunk=4)
    resv = c.blocks_held
    assert resv == _ceil(10 + 4 - 1, 4) + 1
    hog = p.allocate(p.free_blocks)          # nothing free: recycling only
    rng = np.random.default_rng(5)
    for _ in range(100):
        t = int(rng.integers(1, 5))
        c.extend(*_rows(rng, t))
        assert c.blocks_held == resv and p.free_blocks == 0
    p.check()
    p.free(hog)


def test_a_long_append_takes_blocks_for_its_step_and_gives_them_back_after():
    rng = np.random.default_rng(6)
    p = KvBlockPool(4, 64, H, D)
    c = KvCache.with_pool(H, D, p, 8192, window=8)       # resv: ceil(11/4) + 1 = 4
    assert c.blocks_held == 4
    c.extend(*_rows(rng, 70))                           # a prompt: 18 blocks for the step
    assert (c.blocks_held, c.first_pos) == (18, 0)
    k, v = _rows(rng, 1)
    c.push(k[0], v[0])                                   # at 70: keeps from 63, block 60
    assert (c.first_pos, c.blocks_held) == (60, 4)
    assert p.free_blocks == 60
    p.check()


def test_fork_shares_the_window_and_blocks_return_once():
    rng = np.random.default_rng(7)
    p = KvBlockPool(4, 64, H, D)
    u_pool = KvBlockPool(4, 400, H, D)
    c = KvCache.with_pool(H, D, p, 1000, window=7)
    u = KvCache.with_pool(H, D, u_pool, 200)
    k, v = _rows(rng, 25)
    c.extend(k, v)
    u.extend(k, v)
    rp = Rule(4, 7, _ceil(7 + 4 - 1, 4) + 1)
    rp.append(25)
    _assert_rule(c, rp)
    ch = c.fork()
    rc = rp.fork()
    uc = u.fork()
    assert (ch.window, ch.first_pos) == (7, c.first_pos)
    _assert_rule(ch, rc)
    p.check()
    for step in range(30):
        for cache, rule_, twin in ((c, rp, u), (ch, rc, uc)):
            k, v = _rows(rng, int(rng.choice([1, 3])))
            cache.extend(k, v)
            rule_.append(len(k))
            twin.extend(k, v)
            _assert_rule(cache, rule_)
            q = rng.standard_normal((NH, D)).astype(np.float32)
            assert cache.attend(q, threads=1).tobytes() == twin.attend(q, window=7,
                                                                      threads=1).tobytes()
            p.check()
        held = set(c.block_table.tolist()) | set(ch.block_table.tolist())
        assert p.free_blocks == 64 - len(held)
    c.close()
    p.check()
    assert p.free_blocks == 64 - ch.blocks_held
    ch.close()
    assert p.free_blocks == 64
    p.check()


def _windowed_and_whole(seed, window, whole_len):
    """rng, a pool, a windowed cache on it and a whole twin on another pool."""
    p = KvBlockPool(4, 32, H, D)
    return (np.random.default_rng(seed), p, KvCache.with_pool(H, D, p, 1000, window=window),
            KvCache.with_pool(H, D, KvBlockPool(4, 32, H, D), whole_len))


def test_truncate_within_the_window_works_and_into_freed_rows_is_refused():
    rng, p, c, u = _windowed_and_whole(8, 6, 100)
    k, v = _rows(rng, 30)
    c.extend(k, v)
    u.extend(k, v)
    k, v = _rows(rng, 4)                 # four drafts at 30: keeps from 25 (block 24)
    c.extend(k, v)
    u.extend(k, v)
    assert c.first_pos == 24
    before = (c.seq_len, c.first_pos, c.block_table.tolist(), p.free_blocks,
              c.k.tobytes(), c.v.tobytes(), p.stats())
    with pytest.raises(ValueError, match="cannot truncate to 28: .*window of 6.*before 24.*"
                                         "at least 29"):
        c.truncate(28)
    assert (c.seq_len, c.first_pos, c.block_table.tolist(), p.free_blocks,
            c.k.tobytes(), c.v.tobytes(), p.stats()) == before
    p.check()
    c.truncate(31)                       # one draft accepted: rolls back within the window
    u.truncate(31)
    k, v = _rows(rng, 2)
    c.extend(k, v)
    u.extend(k, v)
    q = rng.standard_normal((2, NH, D)).astype(np.float32)
    assert c.attend(q, threads=1).tobytes() == u.attend(q, window=6, threads=1).tobytes()
    c.truncate(29)                       # the lowest target: reads from 24 on
    p.check()


def test_truncate_into_shared_blocks_copies_and_trims_in_one_step():
    rng = np.random.default_rng(9)
    p = KvBlockPool(4, 64, H, D)
    c = KvCache.with_pool(H, D, p, 1000, window=3)      # 3 blocks, positions 0..11
    c.extend(*_rows(rng, 10))
    r = Rule(4, 3, 3)
    r.append(10)
    _assert_rule(c, r)
    ch = c.fork()                          # shares blocks 0 and 1
    rc = r.fork()
    shared_block = c.block_table[1]
    c.truncate(7)                          # back into block 1, which the child shares
    r.len = 7
    c.extend(*_rows(rng, 2))               # copies block 1, gives block 0 back
    r.append(2)
    _assert_rule(c, r)
    _assert_rule(ch, rc)
    assert c.first_pos == 4 and c.block_table[0] != shared_block
    assert ch.block_table[1] == shared_block
    assert not set(c.block_table.tolist()) & set(ch.block_table.tolist())
    p.check()
    assert p.free_blocks == 64 - c.blocks_held - ch.blocks_held


# -- copies, release, lifetime ----------------------------------------------------------

def test_copy_and_release_keep_the_window_and_the_rows():
    rng = np.random.default_rng(10)
    p = KvBlockPool(4, 32, H, D)
    c = KvCache.with_pool(H, D, p, 1000, window=5)
    u = KvCache.with_pool(H, D, KvBlockPool(4, 32, H, D), 100)
    for t in (21, 1):
        k, v = _rows(rng, t)
        c.extend(k, v)
        u.extend(k, v)
    assert c.first_pos == 16
    cc, dc = c.copy(), copy.deepcopy(c)
    for x in (cc, dc):
        assert (x.window, x.first_pos, x.seq_len, x.is_pooled) == (5, 16, 22, False)
        assert np.array_equal(x.k, c.k) and np.array_equal(x.v, c.v)
    held = c.blocks_held
    free = p.free_blocks
    c.release_to_pool()
    assert p.free_blocks == free + held and not c.is_pooled and c.window == 5
    c.release_to_pool()                        # idempotent: nothing given back twice
    assert p.free_blocks == free + held
    p.check()
    k2, v2 = _rows(rng, 3)
    for x in (c, cc):
        x.extend(k2, v2)
    u.extend(k2, v2)
    q = rng.standard_normal((NH, D)).astype(np.float32)
    for x in (c, cc):
        assert np.array_equal(x.k, u.k[x.first_pos:])
        assert x.attend(q, threads=1).tobytes() == u.attend(q, window=5, threads=1).tobytes()
    with pytest.raises(ValueError, match="cannot truncate"):
        cc.truncate(3)


def test_closing_and_collecting_windowed_caches_gives_every_block_back_once():
    rng = np.random.default_rng(11)
    p = KvBlockPool(4, 32, H, D)
    a = KvCache.with_pool(H, D, p, 1000, window=3)
    b = a.fork()
    for x in (a, b):
        x.extend(*_rows(rng, 19))
    p.check()
    del a
    p.check()
    b.close()
    b.close()
    assert p.free_blocks == 32 and p.used_blocks == 0
    p.check()


# -- bad input: a specific error, nothing changed ----------------------------------------

@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(window=0), ValueError, "window must be >= 1"),
    (dict(window=-3), ValueError, "window must be >= 1"),
    (dict(window="8"), TypeError, "window must be an integer"),
    (dict(window=2.5), TypeError, "window must be an integer"),
    (dict(window=True), TypeError, "window must be an integer number of positions, got bool"),
    (dict(window=False), TypeError, "window must be an integer number of positions, got bool"),
    (dict(window=4, max_chunk=True), TypeError, "max_chunk must be an integer number of positions"),
    (dict(window=4, max_chunk=0), ValueError, "max_chunk must be >= 1"),
    (dict(max_chunk=4), ValueError, "max_chunk= goes with window="),
    (dict(window=4, tokens=[1, 2, 3]), ValueError, "tokens= cannot be used with window="),
])
def test_bad_window_arguments_raise_and_change_nothing(kwargs, exc, match):
    p = KvBlockPool(4, 16, H, D, prefix_cache=True)
    stats = p.stats()
    with pytest.raises(exc, match=match):
        KvCache.with_pool(H, D, p, 100, **kwargs)
    with pytest.raises(exc, match=match):
        KvCache.with_pool_many(3, H, D, p, 100, **kwargs)
    assert p.stats() == stats
    p.check()


def test_a_windowed_reservation_that_does_not_fit_is_refused_whole():
    p = KvBlockPool(4, 10, H, D)
    with pytest.raises(KvPoolExhausted) as e:
        KvCache.with_pool_many(3, H, D, p, 10_000, window=9)    # 3 x (3 + 1)
    assert e.value.requested == 12 and e.value.free == 10
    assert p.free_blocks == 10
    cs = KvCache.with_pool_many(2, H, D, p, 10_000, window=9)
    assert [c.blocks_held for c in cs] == [4, 4] and p.free_blocks == 2
    small = KvCache.with_pool(H, D, p, 3, window=9)              # max_seq_len caps it
    assert small.blocks_held == 1
    p.check()


# -- one window per cache (with_pool_many(..., window=[...])) -----------------------------

def test_a_window_per_cache_reserves_each_its_need_in_one_acquisition():
    p = KvBlockPool(4, 40, H, D)
    wins = [6, None, 6, 2, None]
    need = [_ceil(6 + 4 - 1, 4) + 1, 25, _ceil(6 + 4 - 1, 4) + 1, _ceil(2 + 4 - 1, 4) + 1, 25]
    with pytest.raises(KvPoolExhausted) as e:
        KvCache.with_pool_many(5, H, D, p, 100, window=wins)
    assert (e.value.requested, e.value.free) == (sum(need), 40)
    assert p.free_blocks == 40 and p.stats()["refused"] == 1
    cs = KvCache.with_pool_many(5, H, D, p, 100, window=[6, None, 6, 2, 3], max_chunk=2)
    need = [_ceil(6 + 2 - 1, 4) + 1, 25, _ceil(6 + 2 - 1, 4) + 1, 2, 2]
    assert [c.window for c in cs] == [6, None, 6, 2, 3]
    assert [c.blocks_held for c in cs] == need and p.free_blocks == 40 - sum(need)
    ids = [b for c in cs for b in c.block_table.tolist()]
    assert len(set(ids)) == len(ids)
    p.check()
    # one sequence's layers, decoding: each windowed layer gives back what leaves its window
    rng = np.random.default_rng(30)
    for _ in range(50):
        for c in cs:
            c.push(*(x[0] for x in _rows(rng, 1)))
    assert [c.blocks_held for c in cs] == need
    assert p.stats()["window_freed"] == p.stats()["released"] > 0
    p.check()
    for c in cs:
        c.close()
    assert p.free_blocks == 40 and p.used_blocks == 0
    p.check()


def test_a_window_per_cache_of_one_value_is_the_single_window():
    p = KvBlockPool(4, 40, H, D, prefix_cache=True)
    a = KvCache.with_pool_many(3, H, D, p, 100, window=(5, 5, 5))
    assert [c.window for c in a] == [5, 5, 5] and [c.blocks_held for c in a] == [3, 3, 3]
    b = KvCache.with_pool_many(2, H, D, p, 8, window=np.array([None, None]),
                               tokens=np.arange(9))      # all None: tokens= is honoured
    assert [c.window for c in b] == [None, None] and p.stats()["prefix_misses"] == 1
    assert KvCache.with_pool_many(0, H, D, p, 8, window=[]) == []
    p.check()


@pytest.mark.parametrize("window,kwargs,exc,match", [
    ([4, None], {}, ValueError, "window has 2 entries for 3 caches"),
    ([4, None, 4, 4], {}, ValueError, "window has 4 entries for 3 caches"),
    ([4, "8", None], {}, TypeError, "window\\[1\\] must be an integer, got str"),
    ([4, None, 2.5], {}, TypeError, "window\\[2\\] must be an integer, got float"),
    ([4, 0, None], {}, ValueError, "window\\[1\\] must be >= 1, got 0"),
    ([None, -2, None], {}, ValueError, "window\\[1\\] must be >= 1, got -2"),
    ([4, None, 4], dict(max_chunk=0), ValueError, "max_chunk must be >= 1"),
    ([None, 4, None], dict(tokens=[1, 2, 3]), ValueError,
     "tokens= cannot be used with window\\[1\\]=4"),
    (object(), {}, TypeError, "window must be an integer, None, or a sequence of 3"),
])
def test_a_bad_window_per_cache_raises_and_changes_nothing(window, kwargs, exc, match):
    p = KvBlockPool(4, 64, H, D, prefix_cache=True)
    keep = KvCache.with_pool(H, D, p, 10, window=3)
    before = (p.stats(), keep.block_table.tolist(), keep.seq_len)
    with pytest.raises(exc, match=match):
        KvCache.with_pool_many(3, H, D, p, 100, window=window, **kwargs)
    assert (p.stats(), keep.block_table.tolist(), keep.seq_len) == before
    assert p.free_blocks == 64 - keep.blocks_held
    p.check()


def test_window_freed_counts_blocks_out_of_use_once_across_a_fork():
    rng = np.random.default_rng(31)
    p = KvBlockPool(4, 64, H, D)
    c = KvCache.with_pool(H, D, p, 1000, window=5)
    c.extend(*_rows(rng, 4))
    child = c.fork()
    for _ in range(12):                     # both move on: the shared block is freed once
        for x in (c, child):
            x.push(*(r[0] for r in _rows(rng, 1)))
    s = p.stats()
    assert s["window_freed"] == s["released"] and s["window_freed"] >= 1
    shared_freed = s["window_freed"]
    c.close()
    child.close()
    s = p.stats()
    assert s["window_freed"] == shared_freed and s["released"] > shared_freed
    assert p.free_blocks == 64
    p.check()


def test_an_append_the_pool_cannot_cover_changes_nothing():
    rng = np.random.default_rng(12)
    p = KvBlockPool(4, 8, H, D)
    c = KvCache.with_pool(H, D, p, 1000, window=4)      # 3 blocks
    hog = p.allocate(p.free_blocks)
    c.extend(*_rows(rng, 12))
    before = (c.seq_len, c.first_pos, c.block_table.tolist(), c.k.tobytes(), p.stats())
    with pytest.raises(KvPoolExhausted):
        c.extend(*_rows(rng, 20))          # needs more than it gives back
    stats = p.stats()
    assert stats.pop("refused") == before[-1].pop("refused") + 1
    assert (c.seq_len, c.first_pos, c.block_table.tolist(), c.k.tobytes(), stats) == before
    p.check()
    p.free(hog)


def test_windowed_caches_take_no_part_in_the_prefix_cache():
    """Option (a) of issue 26: no hit and no publish for a windowed cache, so
    it can never be served a row of another sequence."""
    rng = np.random.default_rng(13)
    p = KvBlockPool(4, 64, H, D, prefix_cache=True)
    toks = np.arange(20, dtype=np.int32)
    full = KvCache.with_pool(H, D, p, 40)
    k, v = _rows(rng, 20)
    full.extend(k, v)
    assert p.publish([full], toks) == 20
    win = KvCache.with_pool(H, D, p, 40, window=6)
    win.extend(k, v)
    stats = p.stats()
    with pytest.raises(ValueError, match="sliding window \\(6\\).*no part in the prefix"):
        p.publish([win], toks)
    with pytest.raises(ValueError, match="tokens= cannot be used with window="):
        KvCache.with_pool(H, D, p, 40, tokens=toks, window=6)
    assert p.stats() == stats
    # a fresh windowed cache starts empty whatever is published: its rows are its own
    again = KvCache.with_pool(H, D, p, 40, window=6)
    assert again.seq_len == 0 and not set(again.block_table.tolist()) & set(
        full.block_table.tolist())
    p.check()


def test_windowed_caches_cannot_be_saved(tmp_path):
    p = KvBlockPool(4, 16, H, D)
    c = KvCache.with_pool(H, D, p, 40, window=6)
    c.extend(*_rows(np.random.default_rng(0), 5))
    with pytest.raises(ValueError, match="sliding window \\(6\\) cannot be saved"):
        c.save(tmp_path / "x.fkv")
    assert not (tmp_path / "x.fkv").exists()


def test_rows_move_only_between_caches_of_one_window():
    from ferrox_kv._core import _assign
    p = KvBlockPool(4, 16, H, D)
    a = KvCache.with_pool(H, D, p, 8, window=6)
    b = KvCache.with_pool(H, D, p, 8)
    a.push(*[x[0] for x in _rows(np.random.default_rng(0), 1)])
    stats = p.stats()
    with pytest.raises(ValueError, match="caches\\[1\\] has window None and its source "
                                         "caches\\[0\\] 6"):
        _assign([a, b], [0, 0])
    assert p.stats() == stats and b.seq_len == 0
    _assign([a, b], [0, 1])                # each its own: fine
    p.check()


def test_clear_starts_a_window_over_at_position_zero():
    rng, p, c, u = _windowed_and_whole(14, 5, 40)
    c.extend(*_rows(rng, 30))
    c.push(*[x[0] for x in _rows(rng, 1)])
    held, table = c.blocks_held, c.block_table.tolist()
    assert c.first_pos > 0
    ch = c.fork()
    c.clear()
    assert (c.seq_len, c.first_pos, c.blocks_held, c.block_table.tolist()) == (0, 0, held, table)
    k, v = _rows(rng, 9)
    c.extend(k, v)                          # copies the blocks the child shares first
    u.extend(k, v)
    assert np.array_equal(c.k, u.k[c.first_pos:])
    q = rng.standard_normal((NH, D)).astype(np.float32)
    assert c.attend(q, threads=1).tobytes() == u.attend(q, window=5, threads=1).tobytes()
    assert ch.seq_len == 31
    p.check()


# -- a stateful model --------------------------------------------------------------------

BS, TOTAL = 3, 24


class WindowMachine(RuleBasedStateMachine):
    """Windowed caches on one pool, each with an unwindowed twin on another
    pool fed the same rows: blocks, first positions and refusals as Rule
    says, attention equal to the twin's windowed attention, pool.check()
    after every step, every block not in a table free."""

    def __init__(self):
        super().__init__()
        self.pool = KvBlockPool(BS, TOTAL, H, D)
        self.twins = KvBlockPool(BS, 4000, H, D)
        self.live = []                    # [cache, rule, twin]
        self.rng = np.random.default_rng(0)

    @rule(window=st.integers(1, 10), max_chunk=st.sampled_from([None, 1, 4]),
          max_len=st.integers(0, 40))
    def create(self, window, max_chunk, max_len):
        resv = max(1, min(_ceil(max_len, BS), _ceil(window + (max_chunk or BS) - 1, BS) + 1))
        free = self.pool.free_blocks
        try:
            c = KvCache.with_pool(H, D, self.pool, max_len, window=window, max_chunk=max_chunk)
        except KvPoolExhausted as e:
            assert resv > free and e.requested == resv
            return
        r = Rule(BS, window, resv)
        self.live.append([c, r, KvCache.with_pool(H, D, self.twins, 0)])

    def _pick(self, i):
        return self.live[i % len(self.live)]

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 7), t=st.integers(0, 9))
    def extend(self, i, t):
        c, r, tw = self._pick(i)
        k, v = _rows(self.rng, t)
        trim, grow = r.plan(t)
        try:
            c.extend(k, v)
        except KvPoolExhausted:
            assert grow > 0 or not r.private_at(r.len)     # blocks to add, or to copy on write
            _assert_rule(c, r)
            return
        r.append(t)
        tw.extend(k, v)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 7))
    def push(self, i):
        c, r, tw = self._pick(i)
        k, v = _rows(self.rng, 1)
        try:
            c.push(k[0], v[0])
        except KvPoolExhausted:
            _assert_rule(c, r)
            return
        r.append(1)
        tw.push(k[0], v[0])

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 7), back=st.integers(0, 12))
    def truncate(self, i, back):
        c, r, tw = self._pick(i)
        n = max(c.seq_len - back, 0)
        if r.truncate_ok(n):
            c.truncate(n)
            tw.truncate(n)
            r.truncate(n)
        else:
            table = c.block_table.tolist()
            with pytest.raises(ValueError, match="cannot truncate"):
                c.truncate(n)
            assert c.block_table.tolist() == table

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 7))
    def fork(self, i):
        c, r, tw = self._pick(i)
        try:
            ch = c.fork()
        except KvPoolExhausted:
            return
        self.live.append([ch, r.fork(), tw.fork()])

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 7))
    def release(self, i):
        c, r, tw = self._pick(i)
        c.release_to_pool()
        if r.pooled:
            r.release()

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 7))
    def drop(self, i):
        c, r, tw = self.live.pop(i % len(self.live))
        c.close()
        tw.close()

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 7), q_len=st.integers(1, 3))
    def attend(self, i, q_len):
        c, r, tw = self._pick(i)
        if c.seq_len < q_len:
            return
        q = self.rng.standard_normal((q_len, NH, D)).astype(np.float32)
        if max(c.seq_len - q_len - r.w + 1, 0) < c.first_pos:
            with pytest.raises(ValueError, match="gave the rest back"):
                c.attend(q)
            return
        assert c.attend(q, threads=1).tobytes() == tw.attend(q, window=r.w,
                                                              threads=1).tobytes()

    @invariant()
    def consistent(self):
        self.pool.check()
        held = set()
        for c, r, tw in self.live:
            _assert_rule(c, r)
            assert np.array_equal(c.k, tw.k[c.first_pos:])
            held |= set(c.block_table.tolist())
        assert self.pool.free_blocks == TOTAL - len(held)


WindowMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_window_machine = WindowMachine.TestCase


# -- contiguous windowed caches ------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_a_contiguous_windowed_cache_equals_a_whole_one_and_stays_small(dtype):
    rng = np.random.default_rng(15)
    c = KvCache(H, D, dtype=dtype, window=7)
    u = KvCache(H, D, dtype=dtype)
    most = 0
    for step in range(150):
        t = int(rng.choice([1, 1, 2, 9]))
        k, v = _rows(rng, t)
        c.extend(k, v)
        u.extend(k, v)
        q = rng.standard_normal((t, NH, D)).astype(np.float32)
        assert c.attend(q, threads=1).tobytes() == u.attend(q, window=7, threads=1).tobytes()
        assert np.array_equal(c.k, u.k[c.first_pos:]) and np.array_equal(c.v, u.v[c.first_pos:])
        assert c.first_pos <= max(c.seq_len - t - 7 + 1, 0)
        most = max(most, c.capacity - c.first_pos)
    assert c.first_pos > 0 and c.seq_len == u.seq_len
    assert most <= 2 * (7 + 9) and c.allocated_bytes() < u.allocated_bytes() / 4
    with pytest.raises(ValueError, match="cannot truncate"):
        c.truncate(c.first_pos + 3)
    c.truncate(c.first_pos + 6)


def test_a_contiguous_cache_refuses_a_bad_window():
    with pytest.raises(ValueError, match="window must be >= 1"):
        KvCache(H, D, window=0)
    with pytest.raises(TypeError, match="window must be an integer number of positions, got bool"):
        KvCache(H, D, window=True)
    c = KvCache(H, D)
    c.push(np.ones(H * D, np.float32), np.ones(H * D, np.float32))
    with pytest.raises(TypeError, match="window must be an integer number of positions, got bool"):
        c.attend(np.ones((NH, D), np.float32), window=True)
    with pytest.raises(TypeError, match="window must be an integer"):
        KvCache(H, D, window=1.5)
    assert KvCache(H, D).window is None and KvCache(H, D, window=3).window == 3


@pytest.mark.parametrize("max_seq_len,window,max_chunk", [
    (0, None, None), (1, None, None), (100, None, None), (100, 6, None), (100, 6, 2),
    (100, 2, 3), (5, 64, None), (100, 1, 1), (4, 3, 50)])
def test_reservation_blocks_is_what_with_pool_reserves(max_seq_len, window, max_chunk):
    p = KvBlockPool(4, 64, H, D)
    want = p.reservation_blocks(max_seq_len, window=window, max_chunk=max_chunk)
    c = KvCache.with_pool(H, D, p, max_seq_len, window=window, max_chunk=max_chunk)
    assert c.blocks_held == want == 64 - p.free_blocks
    c.close()
    p.check()


@pytest.mark.parametrize("kw,exc,match", [
    ({"max_seq_len": -1}, ValueError, "max_seq_len"),
    ({"max_seq_len": 1.5}, TypeError, "max_seq_len"),
    ({"max_seq_len": 8, "window": 0}, ValueError, "window"),
    ({"max_seq_len": 8, "window": True}, TypeError, "window"),
    ({"max_seq_len": 8, "window": 4, "max_chunk": 0}, ValueError, "max_chunk"),
    ({"max_seq_len": 8, "max_chunk": 2}, ValueError, "max_chunk= goes with window=")])
def test_reservation_blocks_refuses_what_with_pool_refuses(kw, exc, match):
    p = KvBlockPool(4, 8, H, D)
    with pytest.raises(exc, match=match):
        p.reservation_blocks(**kw)
    with pytest.raises(exc, match=match):
        KvCache.with_pool(H, D, p, kw.pop("max_seq_len"), **kw)
    assert p.free_blocks == 8 and p.stats()["refused"] == 0
    p.check()
