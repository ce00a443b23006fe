"""Attention split over the core's worker threads: the thread count and its
rules, exactness against one thread, bit-for-bit runs at a fixed count,
many callers sharing the bounded pool, and fork while workers run."""
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import ferrox_kv
from ferrox_kv import KvBlockPool, KvCache, attend_many
from ferrox_kv import _core
from support.threads import run_threads


@pytest.fixture
def threads():
    """Restores the thread count and the split sizes after the test."""
    old_n = ferrox_kv.get_num_threads()
    old_split = _core._set_attend_split(*_core._set_attend_split(0, 1))
    yield ferrox_kv.set_num_threads
    ferrox_kv.set_num_threads(old_n)
    _core._set_attend_split(*old_split)


def _pooled(t, h=8, d=128, dtype="float32", seed=0, block=16):
    rng = np.random.default_rng(seed)
    pool = KvBlockPool(block, -(-t // block) + 2, h, d, dtype=dtype)
    c = KvCache.with_pool(h, d, pool, t)
    k = rng.standard_normal((t, h, d), dtype=np.float32)
    v = rng.standard_normal((t, h, d), dtype=np.float32)
    c.extend(k, v)
    return c


def test_the_default_is_the_cpus_this_process_may_use():
    out = subprocess.run([sys.executable, "-c", "import ferrox_kv; print(ferrox_kv.get_num_threads())"],
                         capture_output=True, text=True, timeout=60, cwd="/",
                         env={k: v for k, v in os.environ.items() if k != "FERROX_KV_NUM_THREADS"})
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == len(os.sched_getaffinity(0))


@pytest.mark.parametrize("env,ok", [("3", True), (" 5 ", True), ("0", False), ("-2", False),
                                    ("two", False), ("1.5", False), ("", False)])
def test_the_environment_variable_sets_the_count_or_is_refused_by_name(env, ok):
    out = subprocess.run([sys.executable, "-c", "import ferrox_kv; print(ferrox_kv.get_num_threads())"],
                         capture_output=True, text=True, timeout=60, cwd="/",
                         env={**os.environ, "FERROX_KV_NUM_THREADS": env})
    if ok:
        assert out.returncode == 0 and int(out.stdout) == int(env), out.stderr
    else:
        assert out.returncode != 0
        assert "ValueError" in out.stderr and "FERROX_KV_NUM_THREADS must be a positive integer" in out.stderr


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True, None, 2.0])
def test_a_bad_count_is_a_value_error_and_changes_nothing(threads, bad):
    before = ferrox_kv.get_num_threads()
    with pytest.raises(ValueError, match="thread count must be"):
        threads(bad)
    assert ferrox_kv.get_num_threads() == before
    c = _pooled(40, h=2, d=16)
    if bad is not None:                   # threads=None: the default count
        with pytest.raises(ValueError, match="threads must be"):
            c.attend(np.ones((2, 16), np.float32), threads=bad)
    assert ferrox_kv.get_num_threads() == before


def test_set_returns_the_previous_count_and_allows_more_than_the_cpus(threads):
    threads(3)
    assert threads(4 * os.cpu_count()) == 3
    assert ferrox_kv.get_num_threads() == 4 * os.cpu_count()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("n", [2, 3, 8, 16])
def test_a_split_decode_equals_one_thread_within_float32_rounding_and_repeats_bit_for_bit(threads, dtype, n):
    """llama8b's heads (32 query, 8 kv x 128) over 3000 rows: on 16 threads
    the context is split in chunks and merged. Measured bound: 1e-5 of the
    largest output (float32 rounding of the merge)."""
    threads(n)
    _core._set_attend_split(0, 64)
    c = _pooled(3000, dtype=dtype)
    q = np.random.default_rng(1).standard_normal((32, 128), dtype=np.float32)
    one = c.attend(q, threads=1)
    many = c.attend(q)
    assert _core._attend_threads_used() == n
    np.testing.assert_allclose(many, one, rtol=0, atol=1e-5 * np.abs(one).max())
    for _ in range(3):
        assert np.array_equal(c.attend(q), many)


def test_a_split_causal_chunk_and_a_batch_equal_one_thread(threads):
    threads(3)
    c = _pooled(300, h=2, d=64)
    q = np.random.default_rng(2).standard_normal((70, 8, 64), dtype=np.float32)
    for window in (None, 17):
        one = c.attend(q, window=window, threads=1)
        np.testing.assert_allclose(c.attend(q, window=window), one, rtol=0, atol=1e-5 * np.abs(one).max())
    cs = [_pooled(t, h=2, d=64, seed=t) for t in (50, 300, 120)]
    qb = np.random.default_rng(3).standard_normal((3, 1, 8, 64), dtype=np.float32)
    one = attend_many(cs, qb, start=[0, 7, 100], threads=1)
    np.testing.assert_allclose(attend_many(cs, qb, start=[0, 7, 100]), one, rtol=0,
                               atol=1e-5 * np.abs(one).max())


def test_small_calls_stay_on_the_calling_thread(threads):
    threads(4)
    _core._set_attend_split(1 << 20, 256)
    small = _pooled(64, h=2, d=64)                       # 64 KiB of K/V
    small.attend(np.ones((8, 64), np.float32))
    assert _core._attend_threads_used() == 1
    big = _pooled(1024, h=8, d=128)                      # 8 MiB
    big.attend(np.ones((32, 128), np.float32))
    assert _core._attend_threads_used() == 4
    big.attend(np.ones((32, 128), np.float32), threads=2)
    assert _core._attend_threads_used() == 2


def _os_threads():
    return len(os.listdir("/proc/self/task"))


def test_sixteen_callers_share_at_most_n_minus_one_workers_and_get_right_answers(threads):
    n = 3
    threads(n)
    _core._set_attend_split(0, 32)
    caches = [_pooled(600, h=4, d=64, seed=i) for i in range(4)]
    q = np.random.default_rng(4).standard_normal((16, 64), dtype=np.float32)
    qb = np.stack([q[None]] * 4)
    want = [c.attend(q, threads=1) for c in caches]
    want_many = attend_many(caches, qb, threads=1)
    for _ in range(500):                  # workers above an earlier, larger count exit
        if _core._worker_threads_alive() <= n - 1:
            break
        time.sleep(0.01)
    before = _os_threads() - _core._worker_threads_alive()
    peak = [0]
    # a cache serves one call at a time: each caller has copies
    mine = [(caches[i % 4].copy(), [c.copy() for c in caches]) for i in range(16)]

    def caller(i):
        own, others = mine[i]
        for r in range(20):
            if (i + r) % 3:
                got, ref = own.attend(q), want[i % 4]
            else:
                got, ref = attend_many(others, qb), want_many
            np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
            peak[0] = max(peak[0], _os_threads())

    errors = run_threads(16, caller)
    assert not errors, errors[0]
    assert _core._worker_threads_alive() <= n - 1
    # the test's own 16 threads, plus at most n - 1 workers
    assert peak[0] <= before + 16 + (n - 1), (peak[0], before)


def test_fork_while_workers_run_gives_the_child_a_working_pool(threads):
    threads(3)
    _core._set_attend_split(0, 32)
    c = _pooled(2000, h=4, d=64)
    q = np.random.default_rng(5).standard_normal((16, 64), dtype=np.float32)
    want = c.attend(q, threads=1)
    busy = c.copy()
    stop = threading.Event()
    results = []

    def spin():
        while not stop.is_set():
            results.append(np.array_equal(busy.attend(q), busy.attend(q)))

    t = threading.Thread(target=spin)
    t.start()
    try:
        for _ in range(3):
            pid = os.fork()
            if pid == 0:                                   # the child: attend at once, on workers
                code = 1
                try:
                    got = c.attend(q)
                    ok = (_core._attend_threads_used() == 3
                          and np.allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max()))
                    code = 0 if ok and _core._worker_threads_alive() == 2 else 3
                finally:
                    os._exit(code)
            _, status = os.waitpid(pid, 0)
            assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    finally:
        stop.set()
        t.join(60)
    assert results and all(results)
    np.testing.assert_allclose(c.attend(q), want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_lowering_the_count_ends_the_workers_above_it(threads):
    threads(5)
    c = _pooled(1024)
    c.attend(np.ones((32, 128), np.float32))
    assert _core._worker_threads_alive() == 4
    threads(2)
    for _ in range(500):
        if _core._worker_threads_alive() == 1:
            break
        time.sleep(0.01)
    assert _core._worker_threads_alive() == 1
    threads(3)
    c.attend(np.ones((32, 128), np.float32))
    assert _core._worker_threads_alive() == 2 and _core._attend_threads_used() == 3
