"""Random sequences of every operation on several caches and one pool, checked
after every step against a small pure-Python model of the same API."""
import gc

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, consumes,
                                 invariant, precondition, rule)

from support.numerics import stored, values
from support.windows import Rule, assert_rule, ceil
from ferrox_kv import KvBlockPool, KvCache, KvPoolExhausted, push_layers

pytestmark = pytest.mark.usefixtures("young_gc")   # gc.collect() after every program

H, D, VD = 1, 3, 2
KW, VW = H * D, H * VD
BS, TOTAL = 3, 10


class Model:
    """What one cache should look like."""

    def __init__(self, pooled, blocks=0, plan=None):
        self.k, self.v = [], []
        self.pooled = pooled
        self.blocks = blocks
        self.plan = plan

    @property
    def cap_rows(self):
        return self.blocks * BS


class Slot:
    """Holds a cache for the bundle, so that dropping it really frees it
    (hypothesis keeps references to bundle values, not to what they hold)."""

    def __init__(self, cache, model):
        self.c, self.m = cache, model

    def __iter__(self):
        return iter((self.c, self.m))


class CacheMachine(RuleBasedStateMachine):
    caches = Bundle("caches")
    DTYPE = "float32"
    ROTATE = None                      # int4: None (rotated, the default) or False
    H, D, VD = H, D, VD

    def __init__(self):
        super().__init__()
        self.KW, self.VW = self.H * self.D, self.H * self.VD
        self.dt = dict(dtype=self.DTYPE, rotate=self.ROTATE)
        self.pool = KvBlockPool(BS, TOTAL, self.H, self.D, v_head_dim=self.VD, **self.dt)
        self.free = TOTAL
        self.live = []          # (cache, model)
        self.closed = []        # caches after close()
        self.counter = 0
        self.slots = []

    def _slot(self, c, m):
        slot = Slot(c, m)
        self.slots.append(slot)
        return slot

    def _row(self, width):
        self.counter += 1
        return [float(self.counter * 10 + j) for j in range(width)]

    def _need(self, m, n):
        """Blocks a pooled cache must take to hold n more rows."""
        short = len(m.k) + n - m.cap_rows
        return 0 if short <= 0 else -(-short // BS)

    @rule(target=caches, kind=st.sampled_from(["new", "capacity", "pool"]),
          max_len=st.integers(0, 12))
    def create(self, kind, max_len):
        if kind == "new":
            c, m = KvCache(self.H, self.D, v_head_dim=self.VD, **self.dt), Model(False)
        elif kind == "capacity":
            c = KvCache.with_capacity(self.H, self.D, max_len, v_head_dim=self.VD, **self.dt)
            m = Model(False, plan=max_len)
        else:
            need = max(1, -(-max_len // BS))
            try:
                c = KvCache.with_pool(self.H, self.D, self.pool, max_len, v_head_dim=self.VD)
            except KvPoolExhausted as e:
                assert need > self.free and e.requested == need and e.free == self.free
                c = KvCache(self.H, self.D, v_head_dim=self.VD, **self.dt)
                m = Model(False)
            else:
                assert need <= self.free
                self.free -= need
                m = Model(True, need)
        self.live.append((c, m))
        return self._slot(c, m)

    def _grow(self, c, m, n, call, krows, vrows):
        need = self._need(m, n) if m.pooled else 0
        try:
            call()
        except KvPoolExhausted as e:
            assert m.pooled and need > self.free and e.requested == need
            return
        assert need <= self.free
        self.free -= need
        m.blocks += need
        m.k += krows
        m.v += vrows

    @rule(cm=caches)
    def push(self, cm):
        c, m = cm
        k, v = self._row(self.KW), self._row(self.VW)
        self._grow(c, m, 1, lambda: c.push(np.array(k, np.float32), v), [k], [v])

    @rule(cm=caches, t=st.integers(0, 7))
    def extend(self, cm, t):
        c, m = cm
        ks = [self._row(self.KW) for _ in range(t)]
        vs = [self._row(self.VW) for _ in range(t)]
        ka = np.array(ks, np.float32).reshape(t, self.H, self.D)
        va = np.array(vs, np.float64).reshape(t, self.VW)
        self._grow(c, m, t, lambda: c.extend(ka, va), ks, vs)

    @rule(data=st.data())
    def push_layers(self, data):
        """One position into several caches at once: all or nothing."""
        if not self.live:
            return
        idx = data.draw(st.lists(st.integers(0, len(self.live) - 1), min_size=1,
                                 max_size=len(self.live), unique=True))
        group = [self.live[i] for i in idx]
        ks = [self._row(self.KW) for _ in group]
        vs = [self._row(self.VW) for _ in group]
        need = sum(self._need(m, 1) for _, m in group if m.pooled)
        try:
            push_layers([c for c, _ in group], np.array(ks, np.float32),
                        np.array(vs, np.float32).reshape(len(group), self.H, self.VD))
        except KvPoolExhausted as e:
            assert need > self.free and e.requested == need and e.free == self.free
            return
        assert need <= self.free
        for (c, m), k, v in zip(group, ks, vs):
            if m.pooled and self._need(m, 1):
                m.blocks += 1
                self.free -= 1
            m.k.append(k)
            m.v.append(v)

    @rule(target=caches, count=st.integers(1, 3), max_len=st.integers(0, 7))
    def create_many(self, count, max_len):
        per = max(1, -(-max_len // BS))
        try:
            made = KvCache.with_pool_many(count, self.H, self.D, self.pool, max_len,
                                          v_head_dim=self.VD)
        except KvPoolExhausted as e:
            assert per * count > self.free and e.requested == per * count
            c, m = KvCache(self.H, self.D, v_head_dim=self.VD, **self.dt), Model(False)
            self.live.append((c, m))
            return self._slot(c, m)
        assert per * count <= self.free
        self.free -= per * count
        slots = []
        for c in made:
            m = Model(True, per)
            self.live.append((c, m))
            slots.append(self._slot(c, m))
        return slots[0]        # the others live on in self.live (and get checked)

    @rule(cm=caches, n=st.integers(0, 7))
    def advance(self, cm, n):
        c, m = cm
        self._grow(c, m, n, lambda: c.advance_len(n), [[0.0] * self.KW] * n,
                   [[0.0] * self.VW] * n)

    @rule(cm=caches, data=st.data())
    def truncate(self, cm, data):
        c, m = cm
        n = data.draw(st.integers(0, len(m.k)))
        c.truncate(n)
        del m.k[n:], m.v[n:]

    @rule(cm=caches)
    def clear(self, cm):
        c, m = cm
        c.clear()
        m.k.clear(), m.v.clear()

    @rule(cm=caches)
    def release(self, cm):
        c, m = cm
        c.release_to_pool()
        if m.pooled:
            self.free += m.blocks
            m.pooled = False
            m.blocks = 0

    @rule(cm=consumes(caches))
    def close(self, cm):
        """close() is final: the cache leaves the bundle and every later
        operation on it raises ValueError (checked by the invariant)."""
        c, m = cm
        c.close()
        if m.pooled:
            self.free += m.blocks
        self.live = [(x, y) for x, y in self.live if x is not c]
        self.closed.append(c)

    @rule(target=caches, cm=caches)
    def copy(self, cm):
        c, m = cm
        clone = c.copy()
        mm = Model(False, plan=m.plan)
        mm.k, mm.v = list(m.k), list(m.v)
        self.live.append((clone, mm))
        return self._slot(clone, mm)

    @rule(cm=consumes(caches))
    def drop(self, cm):
        c, m = cm
        self.live = [(x, y) for x, y in self.live if x is not c]
        if m.pooled:
            self.free += m.blocks
        cm.c = None
        del c          # the last reference: blocks go back now, not at gc

    @invariant()
    def everything_matches(self):
        self.pool.check()
        assert self.pool.free_blocks == self.free
        assert sum(m.blocks for _, m in self.live if m.pooled) == TOTAL - self.free
        for c, m in self.live:
            assert c.seq_len == len(m.k) == len(c)
            assert c.is_pooled == m.pooled
            assert c.blocks_held == (m.blocks if m.pooled else 0)
            assert (c.dtype, c.rotate) == (self.DTYPE, self.DTYPE == "int4" and self.ROTATE is not False)
            np.testing.assert_array_equal(
                values(c.k).reshape(-1, self.KW),
                stored(np.array(m.k, np.float32).reshape(-1, self.KW), self.DTYPE, self.D, self.ROTATE))
            np.testing.assert_array_equal(
                values(c.v).reshape(-1, self.VW),
                stored(np.array(m.v, np.float32).reshape(-1, self.VW), self.DTYPE, self.VD, self.ROTATE))
            assert c.is_within_planned_capacity() == (m.plan is not None and len(m.k) <= m.plan)
            if m.pooled:
                assert c.allocated_bytes() == m.blocks * self.pool.block_bytes
        tables = [x for c, m in self.live if m.pooled for x in c.block_table.tolist()]
        assert len(tables) == len(set(tables))        # no block held twice
        for c in self.closed:
            assert c.closed and c.seq_len == 0 and not c.is_pooled and c.blocks_held == 0
            assert c.k.shape == (0, self.H, self.D) and c.block_table.size == 0
            for op in (lambda: c.push([0.0] * self.KW, [0.0] * self.VW), lambda: c.truncate(0),
                       c.copy, c.release_to_pool, c.allocated_bytes):
                try:
                    op()
                except ValueError as e:
                    assert str(e) == "KvCache is closed"
                else:
                    raise AssertionError("an operation on a closed cache did not raise")
            c.close()                                    # close() itself stays allowed

    def teardown(self):
        self.live.clear()
        self.closed.clear()
        for slot in self.slots:
            slot.c = None
        gc.collect()
        assert self.pool.free_blocks == TOTAL


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])


class Int8CacheMachine(CacheMachine):
    DTYPE = "int8"


class BFloat16CacheMachine(CacheMachine):
    DTYPE = "bfloat16"


class Int4CacheMachine(CacheMachine):
    """int4 rows (head dims of 32 and 64: Hadamard blocks of 32 and 64),
    Hadamard-rotated (the pool's default)."""
    DTYPE = "int4"
    H, D, VD = 1, 32, 64


class Int4PlainCacheMachine(Int4CacheMachine):
    ROTATE = False


TestInt8CacheMachine = Int8CacheMachine.TestCase
TestBFloat16CacheMachine = BFloat16CacheMachine.TestCase
TestInt4CacheMachine = Int4CacheMachine.TestCase
TestInt4PlainCacheMachine = Int4PlainCacheMachine.TestCase
TestInt8CacheMachine.settings = TestBFloat16CacheMachine.settings = settings(
    max_examples=30, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestInt4CacheMachine.settings = settings(max_examples=20, stateful_step_count=30, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
TestInt4PlainCacheMachine.settings = settings(max_examples=10, stateful_step_count=30,
                                              deadline=None,
                                              suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------
# Sliding windows: the pooled machine with window=W on every cache
# ---------------------------------------------------------------------------

WBS, WTOTAL, WNH = 3, 24, 2          # block size, blocks, query heads (over 1 KV head)


class WindowCacheMachine(RuleBasedStateMachine):
    """Windowed caches (with_pool, with_pool_many, KvCache(window=W), their
    forks, copies and released selves), each with an unwindowed twin of the
    same dtype on a pool of its own fed the same rows. After every step:
    pool.check(); first_pos, blocks held, seq_len and capacity as
    support.windows.Rule says; .k/.v the stored rows from first_pos on;
    every block not in a table free (so blocks go back exactly when they
    leave the window). attend equals the twin's attend(window=W) bit for
    bit, or is refused when it would read a position given back; a truncate
    into the freed region is refused with nothing changed."""
    DTYPE = "float32"
    ROTATE = None
    H, D = 1, 32

    def __init__(self):
        super().__init__()
        self.dt = dict(dtype=self.DTYPE, rotate=self.ROTATE)
        self.pool = KvBlockPool(WBS, WTOTAL, self.H, self.D, **self.dt)
        self.twins = KvBlockPool(WBS, 4000, self.H, self.D, **self.dt)
        self.live = []               # [cache, rule, twin, k rows, v rows]
        self.rng = np.random.default_rng(0)
        self.forked = False          # shared blocks: a trim may free nothing

    def _rows(self, t):
        return [self.rng.standard_normal((t, self.H * self.D)).astype(np.float32)
                for _ in "kv"]

    def _twin(self):
        return KvCache.with_pool(self.H, self.D, self.twins, 0)

    @rule(window=st.integers(1, 7), max_chunk=st.sampled_from([None, 1, 4]),
          max_len=st.integers(0, 40), count=st.sampled_from([0, 1, 1, 1, 2, 3]))
    def create(self, window, max_chunk, max_len, count):
        """count 0: KvCache(window=W); 1: with_pool; 2, 3: with_pool_many."""
        if count == 0:
            c = KvCache(self.H, self.D, window=window, **self.dt)
            self.live.append([c, Rule.contiguous(window), self._twin(), [], []])
            return
        resv = max(1, min(ceil(max_len, WBS), ceil(window + (max_chunk or WBS) - 1, WBS) + 1))
        free = self.pool.free_blocks
        try:
            if count == 1:
                made = [KvCache.with_pool(self.H, self.D, self.pool, max_len, window=window,
                                          max_chunk=max_chunk)]
            else:
                made = KvCache.with_pool_many(count, self.H, self.D, self.pool, max_len,
                                              window=window, max_chunk=max_chunk)
        except KvPoolExhausted as e:
            assert resv * count > free and e.requested == resv * count
            return
        assert self.pool.free_blocks == free - resv * count
        for c in made:
            assert (c.window, c.dtype) == (window, self.DTYPE)
            self.live.append([c, Rule(WBS, window, resv), self._twin(), [], []])

    def _pick(self, i):
        return self.live[i % len(self.live)]

    def _append(self, entries, t, call, rows=None):
        """Append t rows (random unless given) to each entry through
        ``call(ks, vs)``: all or nothing; the rules say which blocks move."""
        rows = rows or [self._rows(t) for _ in entries]
        plans = [e[1].plan(t) for e in entries]
        before = [(e[0].block_table.tolist(), e[0].first_pos, e[0].seq_len) for e in entries]
        free = self.pool.free_blocks
        try:
            call([k for k, _ in rows], [v for _, v in rows])
        except KvPoolExhausted:
            # blocks to add, or a shared block to copy before the write
            assert any(g for _, g in plans) or not all(e[1].private_at(e[1].len) for e in entries)
            if not self.forked:
                assert sum(g - tr for tr, g in plans) > free
            assert [(e[0].block_table.tolist(), e[0].first_pos, e[0].seq_len)
                    for e in entries] == before
            return
        if not self.forked:
            assert sum(g - tr for tr, g in plans) <= free
        for e, (k, v) in zip(entries, rows):
            e[1].append(t)
            e[2].extend(k, v)
            e[3] += list(k)
            e[4] += list(v)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 7), t=st.integers(0, 9))
    def extend(self, i, t):
        e = self._pick(i)
        self._append([e], t, lambda ks, vs: e[0].extend(ks[0], vs[0]))

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 7))
    def push(self, i):
        e = self._pick(i)
        self._append([e], 1, lambda ks, vs: e[0].push(ks[0][0], vs[0][0]))

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 7), n=st.integers(0, 4))
    def advance(self, i, n):
        e = self._pick(i)
        z = np.zeros((n, self.H * self.D), np.float32)
        self._append([e], n, lambda ks, vs: e[0].advance_len(n), rows=[(z, z)])

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def push_layers(self, data):
        """One position into several caches at once (all pooled or all
        contiguous): all or nothing."""
        pooled = data.draw(st.booleans())
        group = [e for e in self.live if e[0].is_pooled == pooled]
        if not group:
            return
        # indices, not entries: hypothesis keeps what it draws, and a drawn
        # cache would outlive its drop
        idx = data.draw(st.lists(st.integers(0, len(group) - 1), min_size=1,
                                 max_size=len(group), unique=True))
        group = [group[j] for j in idx]
        self._append(group, 1, lambda ks, vs: push_layers(
            [e[0] for e in group], np.concatenate(ks), np.concatenate(vs)))

    def _refused_truncate(self, c, n, r):
        before = (c.seq_len, c.first_pos, c.capacity, c.block_table.tolist(),
                  c.k.tobytes(), c.v.tobytes(), self.pool.stats())
        with pytest.raises(ValueError, match=f"cannot truncate to {n}: .*sliding window of {r.w}"
                                             f".*before {r.base}"):
            c.truncate(n)
        assert (c.seq_len, c.first_pos, c.capacity, c.block_table.tolist(),
                c.k.tobytes(), c.v.tobytes(), self.pool.stats()) == before

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 7), back=st.integers(0, 12), edge=st.booleans())
    def truncate(self, i, back, edge):
        """Back from the end, or (edge) on the cache whose window moved
        furthest, around the lowest target its window allows; there, one
        position below that target is refused first."""
        c, r, tw, ks, vs = self._pick(i) if not edge else max(self.live, key=lambda e: e[1].base)
        low = r.base + r.w - 1                 # the lowest target but 0 once base > 0
        if edge and r.base and 0 < low - 1 < c.seq_len:
            self._refused_truncate(c, low - 1, r)
        n = max(c.seq_len - back, 0) if not edge else min(max(low - 3 + back % 6, 0), c.seq_len)
        if r.truncate_ok(n):
            c.truncate(n)
            tw.truncate(n)
            r.truncate(n)
            del ks[n:], vs[n:]
        else:
            self._refused_truncate(c, n, r)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 7))
    def fork(self, i):
        c, r, tw, ks, vs = self._pick(i)
        try:
            ch = c.fork()
        except KvPoolExhausted:
            return
        assert (ch.window, ch.dtype) == (r.w, self.DTYPE)
        self.forked = self.forked or c.is_pooled
        self.live.append([ch, r.fork(), tw.fork(), list(ks), list(vs)])

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 7))
    def copy(self, i):
        c, r, tw, ks, vs = self._pick(i)
        cc = c.copy()
        assert (cc.window, cc.first_pos, cc.is_pooled) == (r.w, r.base, False)
        self.live.append([cc, r.copy(), tw.fork(), list(ks), list(vs)])

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 7))
    def release(self, i):
        c, r, tw, ks, vs = self._pick(i)
        c.release_to_pool()
        if r.pooled:
            r.release()
        assert c.window == r.w

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 7), close=st.booleans())
    def drop(self, i, close):
        c, r, tw, ks, vs = self.live.pop(i % len(self.live))
        if close:
            c.close()
        tw.close()
        del c          # the last reference: blocks go back now

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 7), q_len=st.integers(1, 3), smaller=st.booleans())
    def attend(self, i, q_len, smaller):
        c, r, tw, ks, vs = self._pick(i)
        if c.seq_len < q_len:
            return
        q = self.rng.standard_normal((q_len, WNH, self.D)).astype(np.float32)
        w = max(1, r.w // 2) if smaller else r.w
        if max(c.seq_len - q_len - w + 1, 0) < c.first_pos:
            with pytest.raises(ValueError, match="gave the rest back"):
                c.attend(q, window=w if smaller else None)
            return
        got = c.attend(q, window=w if smaller else None, threads=1)
        assert got.tobytes() == tw.attend(q, window=w, threads=1).tobytes()

    @invariant()
    def consistent(self):
        self.pool.check()
        held = set()
        for c, r, tw, ks, vs in self.live:
            assert_rule(c, r)
            assert (c.window, c.dtype) == (r.w, self.DTYPE)
            kw = self.H * self.D
            for got, rows in ((c.k, ks), (c.v, vs)):
                want = np.array(rows[r.base:], np.float32).reshape(-1, kw)
                assert np.array_equal(values(got).reshape(-1, kw),
                                      stored(want, self.DTYPE, self.D, self.ROTATE))
            assert np.array_equal(c.k, tw.k[c.first_pos:])
            held |= set(c.block_table.tolist())
        assert self.pool.free_blocks == WTOTAL - len(held)

    def teardown(self):
        self.live.clear()
        gc.collect()
        self.pool.check()
        assert self.pool.free_blocks == WTOTAL


class Int8WindowCacheMachine(WindowCacheMachine):
    DTYPE = "int8"


class Int4WindowCacheMachine(WindowCacheMachine):
    DTYPE = "int4"


TestWindowCacheMachine = WindowCacheMachine.TestCase
TestInt8WindowCacheMachine = Int8WindowCacheMachine.TestCase
TestInt4WindowCacheMachine = Int4WindowCacheMachine.TestCase
TestWindowCacheMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])
TestInt8WindowCacheMachine.settings = TestInt4WindowCacheMachine.settings = settings(
    max_examples=15, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------
# Sharing: fork, publish, prefix lookups and eviction on a small pool
# ---------------------------------------------------------------------------

SB, STOTAL, SW = 2, 14, 3            # block size, blocks, row width (1 head x 3)
VOCAB = 3                            # few token ids: prefixes repeat often


def _row(prefix, width=SW):
    """The K row a model would compute at the last position of ``prefix``:
    a function of the token prefix, so every publisher of a prefix stores the
    same rows and any hit can be checked."""
    h = hash(tuple(prefix)) & 0xFFFFF
    return [float(h + j) for j in range(width)]


class SharingMachine(RuleBasedStateMachine):
    """Caches whose rows follow their token ids; every hit, fork and
    copy-on-write must keep them so, and the pool must pass check()."""
    caches = Bundle("shared")
    DTYPE = "float32"
    ROTATE = None
    SW = SW

    def __init__(self):
        super().__init__()
        self.dt = dict(dtype=self.DTYPE, rotate=self.ROTATE)
        self.pool = KvBlockPool(SB, STOTAL, 1, self.SW, prefix_cache=True, **self.dt)
        self.live = []                 # [cache, tokens]
        self.raw = []
        self.slots = []

    def _rows(self, toks):
        return np.array([_row(toks[:i + 1], self.SW) for i in range(len(toks))],
                        np.float32).reshape(-1, self.SW)

    def _keep(self, c, toks):
        entry = [c, list(toks)]
        self.live.append(entry)
        slot = Slot(entry, None)
        self.slots.append(slot)
        return slot

    @rule(target=caches, toks=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=9),
          extra=st.integers(0, 4), salt=st.sampled_from([None, "t"]))
    def open(self, toks, extra, salt):
        try:
            c = KvCache.with_pool(1, self.SW, self.pool, len(toks) + extra, tokens=toks, salt=salt)
        except KvPoolExhausted:
            return self._keep(KvCache(1, self.SW, **self.dt), [])
        hit = c.seq_len
        assert hit % SB == 0 and hit <= len(toks) - 1
        np.testing.assert_array_equal(values(c.k).reshape(-1, self.SW),
                                      stored(self._rows(toks[:hit]), self.DTYPE, self.SW, self.ROTATE))
        rest = self._rows(toks)[hit:]
        try:
            c.extend(rest, -rest)
        except KvPoolExhausted:
            pass
        else:
            hit = len(toks)
        return self._keep(c, toks[:hit])

    @rule(cm=caches, tok=st.integers(0, VOCAB - 1))
    def push(self, cm, tok):
        c, toks = cm.c
        row = _row(toks + [tok], self.SW)
        before = (c.seq_len, c.block_table.tolist())
        try:
            c.push(np.array(row, np.float32), -np.array(row, np.float32))
        except KvPoolExhausted:
            assert (c.seq_len, c.block_table.tolist()) == before
            return
        toks.append(tok)

    @rule(cm=caches, data=st.data())
    def truncate(self, cm, data):
        c, toks = cm.c
        n = data.draw(st.integers(0, len(toks)))
        c.truncate(n)
        del toks[n:]

    @rule(target=caches, cm=caches)
    def fork(self, cm):
        c, toks = cm.c
        try:
            f = c.fork()
        except KvPoolExhausted:
            return self._keep(KvCache(1, self.SW, **self.dt), [])
        return self._keep(f, toks)

    @rule(cm=caches, salt=st.sampled_from([None, "t"]))
    def publish(self, cm, salt):
        c, toks = cm.c
        if c.is_pooled:
            assert self.pool.publish([c], toks, salt=salt) <= len(toks)

    @rule(n=st.integers(0, 6))
    def allocate(self, n):
        try:
            self.raw.append(self.pool.allocate(n))       # may evict cached blocks
        except KvPoolExhausted as e:
            assert e.free == self.pool.free_blocks < n

    @rule()
    def free_raw(self):
        if self.raw:
            self.pool.free(self.raw.pop())

    @rule(cm=consumes(caches))
    def drop(self, cm):
        c, _ = cm.c
        self.live = [e for e in self.live if e[0] is not c]
        cm.c = None
        del c

    @invariant()
    def rows_follow_tokens(self):
        self.pool.check()
        for c, toks in self.live:
            assert c.seq_len == len(toks)
            np.testing.assert_array_equal(values(c.k).reshape(-1, self.SW),
                                          stored(self._rows(toks), self.DTYPE, self.SW, self.ROTATE))
            np.testing.assert_array_equal(values(c.v).reshape(-1, self.SW),
                                          stored(-self._rows(toks), self.DTYPE, self.SW, self.ROTATE))

    def teardown(self):
        self.live.clear()
        for slot in self.slots:
            slot.c = None
        while self.raw:
            self.pool.free(self.raw.pop())
        gc.collect()
        self.pool.check()
        assert self.pool.used_blocks == 0


TestSharingMachine = SharingMachine.TestCase
TestSharingMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow])


class Int8SharingMachine(SharingMachine):
    """The same with int8 rows: their scales move with them through every
    hit, fork, copy-on-write and eviction."""
    DTYPE = "int8"


TestInt8SharingMachine = Int8SharingMachine.TestCase
TestInt8SharingMachine.settings = settings(max_examples=30, stateful_step_count=40, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])


class Int4SharingMachine(SharingMachine):
    """The same with int4 rows, Hadamard-rotated: scales and rotation move
    with them through every hit, fork, copy-on-write and eviction."""
    DTYPE = "int4"
    SW = 32


TestInt4SharingMachine = Int4SharingMachine.TestCase
TestInt4SharingMachine.settings = settings(max_examples=20, stateful_step_count=40, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])
