"""Concurrency contract: many threads on one pool, misuse of one cache, fork,
and the garbage collector running inside pool operations."""
import gc
import os
import random
import threading
import time

import numpy as np
import pytest

import ferrox_kv
from ferrox_kv import KvBlockPool, KvCache, KvPoolExhausted
from ferrox_kv import _core
from support.numerics import stored, values
from support.threads import run_threads


@pytest.fixture
def gil_always_released():
    """Release the GIL around every copy, to maximise interleaving."""
    old = ferrox_kv.set_gil_release_threshold(0)
    yield
    ferrox_kv.set_gil_release_threshold(old)


def _worker(pool, seed, steps, h, d, window=None):
    """Random operations on caches of one pool; windowed caches (window=W:
    pooled ones and contiguous ones) check the rows from first_pos on and a
    truncate into the region they gave back is refused."""
    dt = pool.dtype
    rng = random.Random(seed)
    w = h * d
    live = []                                  # (cache, expected k rows, expected v rows)
    counter = seed * (1_000_000 if dt == "float32" else 10_000)   # int8 scales stay finite
    for _ in range(steps):
        op = rng.random()
        if op < 0.15 or not live:
            try:
                c = KvCache.with_pool(h, d, pool, rng.randint(0, 24), window=window)
            except KvPoolExhausted:
                c = KvCache(h, d, dtype=dt, window=window)
            live.append([c, [], []])
            continue
        entry = rng.choice(live)
        c, ks, vs = entry
        if op < 0.45:
            counter += 1
            k = np.full(w, counter, np.float32)
            try:
                c.push(k, -k)
            except KvPoolExhausted:
                continue
            ks.append(k), vs.append(-k)
        elif op < 0.65:
            t = rng.randint(1, 40)
            base = np.arange(t * w, dtype=np.float32).reshape(t, w) + counter
            counter += t * w
            try:
                c.extend(base, base * 2)
            except KvPoolExhausted:
                continue
            ks.extend(base), vs.extend(base * 2)
        elif op < 0.70:
            group = rng.sample(live, rng.randint(1, len(live)))
            counter += 1
            rows = np.arange(len(group) * w, dtype=np.float32).reshape(len(group), w) + counter
            counter += len(group) * w
            try:
                ferrox_kv.push_layers([g[0] for g in group], rows, -rows)
            except KvPoolExhausted:
                continue
            for g, row in zip(group, rows):
                g[1].append(row), g[2].append(-row)
        elif op < 0.75:
            n = rng.randint(0, len(ks))
            if window and 0 < n < len(ks) and max(n - window + 1, 0) < c.first_pos:
                with pytest.raises(ValueError, match=f"cannot truncate to {n}"):
                    c.truncate(n)
                continue
            c.truncate(n)
            del ks[n:], vs[n:]
        elif op < 0.82:
            c.release_to_pool()
        elif op < 0.90:
            live.remove(entry)             # drop: blocks go back
            del c, entry
        else:
            _check_rows(c, ks, vs, dt, w, d)
    for c, ks, vs in live:
        _check_rows(c, ks, vs, dt, w, d)


def _check_rows(c, ks, vs, dt, w, d):
    """The cache's rows (from first_pos on) are the stored ones."""
    assert c.seq_len == len(ks)
    for got, rows in ((c.k, ks), (c.v, vs)):
        np.testing.assert_array_equal(
            values(got).reshape(-1, w),
            stored(np.array(rows[c.first_pos:], np.float32).reshape(-1, w), dt, d))


@pytest.mark.parametrize("threshold,dtype,d,window", [
    ("default", "float32", 8, None), ("always", "float32", 8, None), ("always", "int8", 8, None),
    ("always", "bfloat16", 8, None), ("always", "int4", 32, None), ("always", "float32", 8, 5),
    ("always", "int4", 32, 3)])
def test_eight_threads_share_one_pool_and_every_block_comes_back(threshold, dtype, d, window,
                                                                 request):
    if threshold == "always":
        request.getfixturevalue("gil_always_released")
    pool = KvBlockPool(4, 64, 2, d, dtype=dtype)
    steps = 300 if dtype == "int4" else 600        # int4's reference rows cost more to make
    errors = run_threads(8, lambda s: _worker(pool, s, steps, 2, d, window))
    if errors:
        raise errors[0]
    gc.collect()
    pool.check()
    s = pool.stats()
    assert s["free_blocks"] == 64 and s["acquired"] == s["released"] > 0
    assert s["high_water"] <= 64


def test_one_cache_from_two_threads_raises_runtime_error_and_stays_consistent(gil_always_released):
    c = KvCache(8, 128)
    big = np.ones((2048, 1024), np.float32)           # 8 MiB per extend, GIL released
    stop = threading.Event()
    extends = []

    def writer():
        n = 0
        while not stop.is_set() and n < 400:
            c.extend(big, big)
            n += 1
        extends.append(n)

    t = threading.Thread(target=writer)
    t.start()
    busy = pushes = 0
    deadline = time.monotonic() + 20
    step = np.full(1024, 2.0, np.float32)
    while time.monotonic() < deadline and busy < 5 and t.is_alive():
        try:
            c.push(step, step)
            pushes += 1
        except RuntimeError as e:
            assert "another thread" in str(e)
            busy += 1
    stop.set()
    t.join()
    assert busy >= 1, "the misuse was never detected"
    assert c.seq_len == extends[0] * 2048 + pushes
    k = c.k.reshape(-1, 1024)
    assert int((k[:, 0] == 2.0).sum()) == pushes and int((k[:, 0] == 1.0).sum()) == extends[0] * 2048


@pytest.mark.parametrize("dtype,d", [("float32", 2), ("int8", 2), ("int4", 32)])
def test_fork_child_never_inherits_a_held_pool_lock(dtype, d):
    pool = KvBlockPool(2, 8, 1, d, dtype=dtype)
    held = KvCache.with_pool(1, d, pool, 4)
    holder = threading.Thread(target=_core._hold_pool_lock, args=(pool, 0.5))
    holder.start()
    time.sleep(0.1)                                   # the lock is held now
    pid = os.fork()
    if pid == 0:                                      # child: must not deadlock
        code = 1
        try:
            c = KvCache.with_pool(1, d, pool, 4)
            c.push(np.ones(d, np.float32), np.ones(d, np.float32))
            ok = pool.free_blocks == 4 and held.blocks_held == 2
            c.release_to_pool()
            code = 0 if ok and pool.free_blocks == 6 else 2
        finally:
            os._exit(code)
    holder.join()
    deadline = time.monotonic() + 20
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the child deadlocked on an inherited pool lock")
        time.sleep(0.02)
    assert os.waitstatus_to_exitcode(status) == 0
    assert pool.free_blocks == 6                       # the parent is untouched


class _Cycle:
    def __init__(self, cache):
        self.cache = cache
        self.me = self                                # only gc frees it


def test_gc_inside_pool_operations_never_reenters_the_free_list():
    pool = KvBlockPool(1, 64, 1, 1)
    calls = []

    def on_gc(phase, info):
        if phase == "start":                          # pool work from inside the collector
            ids = pool.allocate(1)
            pool.free(ids)
            calls.append(1)

    old = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    gc.callbacks.append(on_gc)
    result = []

    def run():
        for i in range(2000):
            try:
                c = KvCache.with_pool(1, 1, pool, 2)
            except KvPoolExhausted:
                gc.collect()
                continue
            c.push(np.ones(1, np.float32), np.ones(1, np.float32))
            _Cycle(c)                                 # garbage collected later, any time
        result.append(True)

    try:
        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(60)
        assert not t.is_alive(), "deadlock: a pool lock was held while gc ran"
    finally:
        gc.callbacks.remove(on_gc)
        gc.set_threshold(*old)
    assert result and calls
    gc.collect()
    assert pool.free_blocks == 64


_FORK_UNDER_LOAD = r"""
import os, threading, numpy as np
from ferrox_kv import KvBlockPool, KvCache
pool = KvBlockPool(1, 64, 1, 4)
stop = False
def churn():                                   # pool operations with the GIL held
    one = np.ones(4, np.float32)
    while not stop:
        c = KvCache.with_pool(1, 4, pool, 1)
        for _ in range(8):
            c.push(one, one)                   # takes a block per position
        ids = pool.allocate(2)
        pool.free(ids)
        c.close()
threads = [threading.Thread(target=churn) for _ in range(2)]
for t in threads: t.start()
for i in range(200):
    pid = os.fork()
    if pid == 0:
        c = KvCache.with_pool(1, 4, pool, 2)   # the child's pool must be usable
        c.close()
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
stop = True
for t in threads: t.join()
assert pool.free_blocks == 64
print("ok")
"""


def test_fork_while_other_threads_use_the_pool_never_deadlocks():
    import subprocess
    import sys
    import tempfile
    out = subprocess.run([sys.executable, "-c", _FORK_UNDER_LOAD], capture_output=True,
                         cwd=tempfile.gettempdir(),                 # not the source tree
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
