"""Random sequences of every operation on several caches and one pool, checked
after every step against a small pure-Python model of the same API."""
import gc

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, consumes,
                                 invariant, rule)

from support.numerics import stored, values
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

    def __init__(self):
        super().__init__()
        self.pool = KvBlockPool(BS, TOTAL, H, D, v_head_dim=VD, dtype=self.DTYPE)
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
            c, m = KvCache(H, D, v_head_dim=VD, dtype=self.DTYPE), Model(False)
        elif kind == "capacity":
            c = KvCache.with_capacity(H, D, max_len, v_head_dim=VD, dtype=self.DTYPE)
            m = Model(False, plan=max_len)
        else:
            need = max(1, -(-max_len // BS))
            try:
                c = KvCache.with_pool(H, D, self.pool, max_len, v_head_dim=VD)
            except KvPoolExhausted as e:
                assert need > self.free and e.requested == need and e.free == self.free
                c = KvCache(H, D, v_head_dim=VD, dtype=self.DTYPE)
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
        k, v = self._row(KW), self._row(VW)
        self._grow(c, m, 1, lambda: c.push(np.array(k, np.float32), v), [k], [v])

    @rule(cm=caches, t=st.integers(0, 7))
    def extend(self, cm, t):
        c, m = cm
        ks = [self._row(KW) for _ in range(t)]
        vs = [self._row(VW) for _ in range(t)]
        ka = np.array(ks, np.float32).reshape(t, H, D)
        va = np.array(vs, np.float64).reshape(t, VW)
        self._grow(c, m, t, lambda: c.extend(ka, va), ks, vs)

    @rule(data=st.data())
    def push_layers(self, data):
        """One position into several caches at once: all or nothing."""
        if not self.live:
            return
        idx = data.draw(st.lists(st.integers(0, len(self.live) - 1), min_size=1,
                                 max_size=len(self.live), unique=True))
        group = [self.live[i] for i in idx]
        ks = [self._row(KW) for _ in group]
        vs = [self._row(VW) for _ in group]
        need = sum(self._need(m, 1) for _, m in group if m.pooled)
        try:
            push_layers([c for c, _ in group], np.array(ks, np.float32),
                        np.array(vs, np.float32).reshape(len(group), H, VD))
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
            made = KvCache.with_pool_many(count, H, D, self.pool, max_len, v_head_dim=VD)
        except KvPoolExhausted as e:
            assert per * count > self.free and e.requested == per * count
            c, m = KvCache(H, D, v_head_dim=VD, dtype=self.DTYPE), Model(False)
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
        self._grow(c, m, n, lambda: c.advance_len(n), [[0.0] * KW] * n, [[0.0] * VW] * n)

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
            assert c.dtype == self.DTYPE
            np.testing.assert_array_equal(
                values(c.k).reshape(-1, KW),
                stored(np.array(m.k, np.float32).reshape(-1, KW), self.DTYPE, D))
            np.testing.assert_array_equal(
                values(c.v).reshape(-1, VW),
                stored(np.array(m.v, np.float32).reshape(-1, VW), self.DTYPE, VD))
            assert c.is_within_planned_capacity() == (m.plan is not None and len(m.k) <= m.plan)
            if m.pooled:
                assert c.allocated_bytes() == m.blocks * self.pool.block_bytes
        tables = [x for c, m in self.live if m.pooled for x in c.block_table.tolist()]
        assert len(tables) == len(set(tables))        # no block held twice
        for c in self.closed:
            assert c.closed and c.seq_len == 0 and not c.is_pooled and c.blocks_held == 0
            assert c.k.shape == (0, H, D) and c.block_table.size == 0
            for op in (lambda: c.push([0.0] * KW, [0.0] * VW), lambda: c.truncate(0),
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


TestInt8CacheMachine = Int8CacheMachine.TestCase
TestBFloat16CacheMachine = BFloat16CacheMachine.TestCase
TestInt8CacheMachine.settings = TestBFloat16CacheMachine.settings = settings(
    max_examples=30, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------
# Sharing: fork, publish, prefix lookups and eviction on a small pool
# ---------------------------------------------------------------------------

SB, STOTAL, SW = 2, 14, 3            # block size, blocks, row width (1 head x 3)
VOCAB = 3                            # few token ids: prefixes repeat often


def _row(prefix):
    """The K row a model would compute at the last position of ``prefix``:
    a function of the token prefix, so every publisher of a prefix stores the
    same rows and any hit can be checked."""
    h = hash(tuple(prefix)) & 0xFFFFF
    return [float(h + j) for j in range(SW)]


class SharingMachine(RuleBasedStateMachine):
    """Caches whose rows follow their token ids; every hit, fork and
    copy-on-write must keep them so, and the pool must pass check()."""
    caches = Bundle("shared")
    DTYPE = "float32"

    def __init__(self):
        super().__init__()
        self.pool = KvBlockPool(SB, STOTAL, 1, SW, prefix_cache=True, dtype=self.DTYPE)
        self.live = []                 # [cache, tokens]
        self.raw = []
        self.slots = []

    def _rows(self, toks):
        return np.array([_row(toks[:i + 1]) for i in range(len(toks))], np.float32).reshape(-1, SW)

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
            c = KvCache.with_pool(1, SW, self.pool, len(toks) + extra, tokens=toks, salt=salt)
        except KvPoolExhausted:
            return self._keep(KvCache(1, SW, dtype=self.DTYPE), [])
        hit = c.seq_len
        assert hit % SB == 0 and hit <= len(toks) - 1
        np.testing.assert_array_equal(values(c.k).reshape(-1, SW),
                                      stored(self._rows(toks[:hit]), self.DTYPE, SW))
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
        row = _row(toks + [tok])
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
            return self._keep(KvCache(1, SW, dtype=self.DTYPE), [])
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
            np.testing.assert_array_equal(values(c.k).reshape(-1, SW),
                                          stored(self._rows(toks), self.DTYPE, SW))
            np.testing.assert_array_equal(values(c.v).reshape(-1, SW),
                                          stored(-self._rows(toks), self.DTYPE, SW))

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
