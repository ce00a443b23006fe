"""A hostile or careless caller: inputs that run code (``__array__``) or lie
about themselves, sequences that change under a call, objects made with
``__new__`` and no ``__init__``, subclasses, sources that alias the cache,
fork under garbage-collector pressure. Each test pins one defect of the
reliability issue; the comment names it."""
import gc
import os
import subprocess
import sys
import threading
import time
import tracemalloc

import numpy as np
import pytest

import ferrox_kv
from support.numerics import ArrayHook
from ferrox_kv import KvBlockPool, KvCache, KvPoolExhausted, push_layers
from ferrox_kv import _core

H, D = 2, 4
W = H * D


def _layers(pool, n=4, h=H, d=D, max_len=8):
    return KvCache.with_pool_many(n, h, d, pool, max_len)


# -- 1. push_layers trusts a list it does not own ------------------------------

def test_push_layers_hook_that_empties_the_list_still_writes_the_caches_passed():
    pool = KvBlockPool(4, 16, H, D)
    layers = _layers(pool)
    mine = list(layers)
    rows = np.arange(4 * W, dtype=np.float32).reshape(4, W)
    push_layers(layers, ArrayHook(rows, layers.clear), rows)
    assert layers == []
    for i, c in enumerate(mine):
        assert c.seq_len == 1
        np.testing.assert_array_equal(c.k.reshape(W), rows[i])


def test_push_layers_hook_that_swaps_in_wider_caches_never_touches_them():
    pool = KvBlockPool(4, 16, H, D)
    wide_pool = KvBlockPool(4, 16, 64, 64)
    layers = _layers(pool)
    mine = list(layers)
    wide = _layers(wide_pool, h=64, d=64)

    def swap():
        layers[:] = wide

    rows = np.ones((4, W), np.float32)
    push_layers(layers, ArrayHook(rows, swap), rows)
    assert all(c.seq_len == 1 for c in mine)
    assert all(c.seq_len == 0 for c in wide)
    assert wide_pool.used_blocks == 4 * 2


def test_push_layers_hook_that_closes_a_cache_refuses_and_changes_nothing():
    pool = KvBlockPool(4, 16, H, D)
    layers = _layers(pool)
    rows = np.ones((4, W), np.float32)
    with pytest.raises(ValueError, match=r"caches\[2\]: KvCache is closed"):
        push_layers(layers, ArrayHook(rows, layers[2].close), rows)
    assert [c.seq_len for c in layers] == [0, 0, 0, 0]
    assert pool.used_blocks == 3 * 2


def test_push_layers_while_another_thread_replaces_the_list():
    h, d, n = 32, 128, 32
    pool = KvBlockPool(16, 8 * n, h, d)
    layers = KvCache.with_pool_many(n, h, d, pool, 16)
    rows = np.ones((n, h * d), np.float32)
    stop = threading.Event()
    errors = []

    def replace():
        try:
            while not stop.is_set():
                try:
                    layers[:] = KvCache.with_pool_many(n, h, d, pool, 16)
                except KvPoolExhausted:
                    pass
        except BaseException as e:          # surfaced below
            errors.append(e)

    t = threading.Thread(target=replace)
    t.start()
    deadline = time.monotonic() + 1.5
    pushes = 0
    try:
        while time.monotonic() < deadline:
            try:
                push_layers(layers, rows, rows)
                pushes += 1
            except (KvPoolExhausted, RuntimeError):
                pass                        # a full cache, or one the other thread is making
    finally:
        stop.set()
        t.join()
    assert not errors and pushes > 0
    del layers[:]
    gc.collect()
    assert pool.free_blocks == pool.total_blocks


# -- 2. a cache whose __init__ never ran ----------------------------------------

def _every_operation(c):
    one = np.ones(W, np.float32)
    two = np.ones((2, W), np.float32)
    return {
        "push": lambda: c.push(one, one),
        "extend": lambda: c.extend(two, two),
        "advance_len": lambda: c.advance_len(1),
        "truncate": lambda: c.truncate(0),
        "clear": c.clear,
        "release_to_pool": c.release_to_pool,
        "copy": c.copy,
        "fork": c.fork,
        "k": lambda: c.k,
        "v": lambda: c.v,
        "allocated_bytes": c.allocated_bytes,
        "is_within_planned_capacity": c.is_within_planned_capacity,
        "push_layers": lambda: push_layers([c], one[None], one[None]),
        "attend": lambda: c.attend(np.ones((H, D), np.float32)),
        "attend_many": lambda: ferrox_kv.attend_many([c], np.ones((1, 1, H, D), np.float32)),
        "with": lambda: c.__enter__(),
    }


@pytest.mark.parametrize("op", sorted(_every_operation(KvCache.__new__(KvCache))))
def test_cache_made_with_new_refuses_every_operation(op):
    c = KvCache.__new__(KvCache)
    with pytest.raises(ValueError, match="never initialised"):
        _every_operation(c)[op]()
    assert c.seq_len == 0 and len(c) == 0 and not c.closed


def test_cache_made_with_new_then_initialised_works_and_frees_once():
    c = KvCache.__new__(KvCache)
    with pytest.raises(ValueError, match="never initialised"):
        c.advance_len(1)                   # was accepted, then __init__ corrupted the heap
    c.__init__(1, 4)
    c.push(np.ones(4), np.ones(4))
    c.push(np.ones(4), np.ones(4))
    assert c.seq_len == 2
    with pytest.raises(ValueError, match="already set up"):
        c.__init__(1, 4)
    del c
    gc.collect()


class SkipsInit(KvCache):
    def __init__(self, tag):                # forgets super().__init__
        self.tag = tag


class CallsInit(KvCache):
    def __init__(self, tag, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tag = tag


def test_subclass_that_skips_super_init_refuses_operations():
    c = SkipsInit("x")
    with pytest.raises(ValueError, match="never initialised"):
        c.push(np.ones(W, np.float32), np.ones(W, np.float32))
    with pytest.raises(ValueError, match="never initialised"):
        c.advance_len(1)
    assert c.tag == "x"


def test_subclass_that_calls_super_init_is_a_full_cache():
    c = CallsInit("y", H, D, v_head_dim=3)
    c.push(np.ones(W, np.float32), np.ones(H * 3, np.float32))
    assert c.seq_len == 1 and c.tag == "y" and c.v.shape == (1, H, 3)
    pool = KvBlockPool(2, 4, H, D)
    p = KvCache.with_pool(H, D, pool, 4)
    push_layers([p, KvCache.with_capacity(H, D, 2)], np.ones((2, W)), np.ones((2, W)))
    with pytest.raises(ValueError, match="another geometry"):
        push_layers([p, c], np.ones((2, W)), np.ones((2, W)))


def test_pool_made_with_new_needs_its_arguments():
    with pytest.raises(TypeError, match="missing 4 required arguments"):
        KvBlockPool.__new__(KvBlockPool)
    pool = KvBlockPool.__new__(KvBlockPool, 2, 4, H, D)    # __cinit__ does all the set-up
    c = KvCache.with_pool(H, D, pool, 4)
    assert pool.free_blocks == 2 and c.blocks_held == 2
    with pytest.raises(TypeError):
        class Sub(KvBlockPool):             # final: no half-built subclasses
            pass


def test_cache_without_arguments_names_the_missing_ones():
    with pytest.raises(TypeError, match="missing 2 required arguments: 'n_kv_heads', 'head_dim'"):
        KvCache()


# -- 3. a source that is the cache's own memory ---------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("kind", ["contiguous", "pooled"])
def test_extend_from_the_caches_own_rows_after_truncate(kind, dtype):
    pool = KvBlockPool(4, 64, H, D, dtype=dtype)
    c = (KvCache.with_capacity(H, D, 64, dtype=dtype) if kind == "contiguous"
         else KvCache.with_pool(H, D, pool, 64))
    rows = np.arange(40 * W, dtype=np.float32).reshape(40, W)
    c.extend(rows, -rows)
    k, v = c._views() if kind == "contiguous" else (c.k, c.v)
    c.truncate(1)
    c.extend(k, v)                          # overlapping ranges of one buffer
    expect = np.concatenate([rows[:1], rows])
    np.testing.assert_array_equal(c.k.reshape(-1, W), expect)
    np.testing.assert_array_equal(c.v.reshape(-1, W), -expect)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_push_and_extend_from_the_pools_own_blocks(dtype):
    pool = KvBlockPool(4, 8, H, D, dtype=dtype)
    c = KvCache.with_pool(H, D, pool, 16)
    rows = np.arange(6 * W, dtype=np.float32).reshape(6, W)
    c.extend(rows, rows + 1)
    table = c.block_table
    kb, vb = pool.key_blocks, pool.value_blocks
    c.truncate(2)
    c.extend(kb[table[0]], vb[table[0]])    # block 0's rows into blocks 0 and 1
    c.push(kb[table[0], 0], vb[table[0], 0])
    expect = np.concatenate([rows[:2], rows[:4], rows[:1]])
    np.testing.assert_array_equal(c.k.reshape(-1, W), expect)
    np.testing.assert_array_equal(c.v.reshape(-1, W), expect + 1)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_windowed_cache_extended_from_its_own_rows_while_it_slides(dtype):
    """The append that grows a contiguous windowed cache moves its rows from
    the window on into a new buffer and frees the old one: a source in the
    old buffer is read first."""
    c = KvCache(H, D, dtype=dtype, window=5)
    rows = np.arange(70 * W, dtype=np.float32).reshape(70, W)
    c.extend(rows[:40], -rows[:40])         # capacity 80
    c.extend(rows[40:], -rows[40:])
    first, n = c.first_pos, c.seq_len
    k, v = c._views()                       # the held rows, in the buffer the append replaces
    c.extend(k, v)
    expect = np.concatenate([rows, rows[first:n]])
    assert c.first_pos > first
    np.testing.assert_array_equal(c.k.reshape(-1, W), expect[c.first_pos:])
    np.testing.assert_array_equal(c.v.reshape(-1, W), -expect[c.first_pos:])


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_windowed_pooled_cache_extended_from_the_block_it_gives_back(dtype):
    """A windowed append gives the blocks before the window back and takes
    blocks in one step, possibly the same ones: a source in such a block is
    read before any row is written."""
    pool = KvBlockPool(4, 8, H, D, dtype=dtype)
    c = KvCache.with_pool(H, D, pool, 1000, window=3)        # 3 blocks
    rows = np.arange(12 * W, dtype=np.float32).reshape(12, W)
    c.extend(rows, rows + 1)
    hog = pool.allocate(pool.free_blocks)                     # only its own blocks to recycle
    gone = c.block_table[0]
    src_k, src_v = pool.key_blocks[gone], pool.value_blocks[gone]
    c.extend(src_k, src_v)                                    # block `gone` leaves the window
    expect = np.concatenate([rows, rows[:4]])
    assert c.first_pos > 0 and pool.free_blocks == 0
    np.testing.assert_array_equal(c.k.reshape(-1, W), expect[c.first_pos:])
    np.testing.assert_array_equal(c.v.reshape(-1, W), expect[c.first_pos:] + 1)
    pool.free(hog)
    pool.check()


# -- 4-6. fork while other threads import, log, churn caches, under gc pressure --

_FORK_UNDER_GC = r"""
import gc, importlib, logging, os, sys, threading, time
import numpy as np
from ferrox_kv import KvBlockPool, KvCache, KvPoolExhausted

pool = KvBlockPool(2, 256, 1, 4)
stop = False

class Cycle:
    def __init__(self, cache):
        self.cache, self.me = cache, self       # only the collector frees it

def importer():
    while not stop:
        try:
            importlib.import_module("ferrox_kv_no_such_module")
        except ImportError:
            pass

def logger():
    i = 0
    while not stop:
        logging.getLogger(f"ferrox.test.{i % 50}").debug("x")
        i += 1

def churn():
    while not stop:
        try:
            c = KvCache.with_pool(1, 4, pool, 4)
            c.push(np.ones(4, np.float32), np.ones(4, np.float32))
            Cycle(KvCache.with_pool(1, 4, pool, 2))  # garbage in a cycle, pooled
            c.close()
        except KvPoolExhausted:
            gc.collect()

# a before-fork hook that allocates (so the collector can run in the fork window)
os.register_at_fork(before=lambda: [Cycle(None) for _ in range(50)],
                    after_in_child=lambda: [Cycle(None) for _ in range(50)])
gc.set_threshold(1, 1, 1)
threads = [threading.Thread(target=f) for f in (importer, logger, churn, churn)]
for t in threads: t.start()
hung = 0
for i in range(int(sys.argv[1])):
    Cycle(KvCache.with_pool(1, 4, pool, 2))
    pid = os.fork()
    if pid == 0:
        c = KvCache.with_pool(1, 4, pool, 4)      # the child's pool works
        c.close()
        gc.collect()
        os._exit(0)
    deadline = time.monotonic() + 10
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            if os.waitstatus_to_exitcode(status) != 0:
                print("child failed", status); sys.exit(3)
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9); os.waitpid(pid, 0); hung += 1
            break
        time.sleep(0.002)
stop = True
for t in threads: t.join()
gc.set_threshold(700, 10, 10)
gc.collect()
print("hung", hung, "free", pool.free_blocks, "of", pool.total_blocks)
"""


def test_fork_under_gc_pressure_with_import_and_logging_threads_never_hangs(tmp_path):
    # The parent itself can hang too (a before-fork hook's garbage collection
    # collecting a pooled cache while the pool locks are held), hence the
    # subprocess with a timeout.
    out = subprocess.run([sys.executable, "-c", _FORK_UNDER_GC, "60"], capture_output=True,
                         text=True, timeout=300, cwd=tmp_path)   # not the source tree
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    assert out.stdout.split() == ["hung", "0", "free", "256", "of", "256"], out.stdout


# -- 7. FerroxCache.update: see tests/test_hf.py ---------------------------------

# -- 8. allocate checks before it sizes anything --------------------------------

def test_allocate_more_than_the_pool_is_refused_before_any_memory_is_sized():
    pool = KvBlockPool(2, 8, 1, 1)
    tracemalloc.start()
    try:
        for n in (10**10, 10**9):
            with pytest.raises(KvPoolExhausted) as e:
                pool.allocate(n)
            assert e.value.requested == n and e.value.free == 8
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    assert pool.stats()["refused"] == 2 and pool.free_blocks == 8


# -- 9. push_layers over caches of two pools ------------------------------------

def test_push_layers_over_two_pools_reports_the_refusing_pool_and_leaves_the_other_alone():
    a_pool, b_pool = KvBlockPool(1, 4, 1, 2), KvBlockPool(1, 2, 1, 2)
    a = KvCache.with_pool(1, 2, a_pool, 1)
    b = KvCache.with_pool(1, 2, b_pool, 1)
    hog = KvCache.with_pool(1, 2, b_pool, 1)           # b_pool now has none free
    for c in (a, b):
        c.push([1.0, 2.0], [3.0, 4.0])                 # both full
    before = a_pool.stats()
    for order in ([a, b], [b, a]):
        with pytest.raises(KvPoolExhausted) as e:
            push_layers(order, np.ones((2, 2)), np.ones((2, 2)))
        assert (e.value.requested, e.value.free) == (1, 0)
    assert a_pool.stats() == before                     # no counter of the other pool moved
    assert b_pool.stats()["refused"] == 2
    assert (a.seq_len, b.seq_len, a.blocks_held, b.blocks_held) == (1, 1, 1, 1)
    del hog
    push_layers([a, b], np.ones((2, 2)), np.ones((2, 2)))
    assert (a.seq_len, b.seq_len) == (2, 2)


# -- smaller items --------------------------------------------------------------

def test_truncate_far_beyond_the_length_says_what_is_wrong():
    c = KvCache(1, 1)
    c.push([1.0], [1.0])
    with pytest.raises(ValueError, match="must not exceed current seq_len 1"):
        c.truncate(2**60)
    with pytest.raises(ValueError, match="must be >= 0"):
        c.truncate(-1)
    assert c.seq_len == 1


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64])
def test_zero_dimensional_steps_are_refused_alike_whatever_their_dtype(dtype):
    c = KvCache(1, 1)
    with pytest.raises(ValueError, match="k_step must have 1 values"):
        c.push(np.array(1, dtype), np.array([1.0], np.float32))
    assert c.seq_len == 0


def _rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(os.environ.get("FERROX_KV_ASAN") == "1",
                    reason="ASan's allocator maps and poisons what it hands out")
def test_a_pool_of_a_hundred_million_blocks_costs_no_resident_memory_until_used():
    before = _rss()
    pool = KvBlockPool(1, 10**8, 1, 1)
    after = _rss()
    assert after - before < 16 << 20                       # was 381 MiB: an eager free list
    ids = pool.allocate(3)
    assert ids.tolist() == [0, 1, 2]
    pool.free(ids[1:2])
    assert pool.allocate(1).tolist() == [1]                # a returned block first
    assert pool.free_blocks == 10**8 - 3


# -- input that lies or is not what it says --------------------------------------

class LyingInterface:
    """Claims a shape its data cannot fill."""

    def __init__(self, shape, data=b"\0" * 8):
        self.__array_interface__ = {"shape": shape, "typestr": "<f4", "data": data,
                                    "version": 3}


class MutatingInterface:
    """Runs code (closing the cache) when numpy asks for its interface."""

    def __init__(self, cache, value):
        self.cache, self.value = cache, np.asarray(value, np.float32)

    @property
    def __array_interface__(self):
        self.cache.close()
        return self.value.__array_interface__


def test_array_interface_that_lies_about_its_size_is_refused():
    c = KvCache(H, D)
    with pytest.raises(TypeError, match="k_step"):
        c.push(LyingInterface((W,)), np.ones(W, np.float32))   # 8 bytes for 32
    assert c.seq_len == 0


def test_array_interface_that_closes_the_cache_is_refused_after_conversion():
    pool = KvBlockPool(2, 4, H, D)
    c = KvCache.with_pool(H, D, pool, 4)
    with pytest.raises(ValueError, match="KvCache is closed"):
        c.push(MutatingInterface(c, np.ones(W)), np.ones(W, np.float32))
    assert pool.free_blocks == 4 and c.closed


@pytest.mark.parametrize("bad", [None, "abc", object(), [1, "x"], {"a": 1}, np.array(["a"] * W)])
def test_non_numeric_steps_raise_type_error(bad):
    c = KvCache(H, D)
    with pytest.raises(TypeError, match="k_step"):
        c.push(bad, np.ones(W, np.float32))
    assert c.seq_len == 0


def test_torch_tensors_of_other_dtypes_get_a_type_error_that_says_what_is_accepted():
    torch = pytest.importorskip("torch")
    c = KvCache(H, D)
    for dt in (torch.float64, torch.int64, torch.bool):
        with pytest.raises(TypeError, match=r"k_step is a torch tensor of dtype .*float32, "
                                            r"float16 or bfloat16.*to\('cpu', torch.float32\)"):
            c.push(torch.ones(W, dtype=dt), np.ones(W, np.float32))
        with pytest.raises(TypeError, match="v_steps is a torch tensor"):
            c.extend(np.ones((2, W), np.float32), torch.ones(2, W, dtype=dt))
    assert c.seq_len == 0
    c.push(torch.ones(W), torch.ones(W))                     # float32 CPU: accepted
    c.push(torch.ones(W, dtype=torch.bfloat16), torch.ones(W, dtype=torch.float16))
    assert c.seq_len == 2 and (c.k == 1).all()


# -- found by review: numbers that lie, caches that share blocks, hooks ----------

class LyingInt:
    """An __index__ that returns something that is not an int (whose
    comparisons lie and whose conversion to C gives another number)."""

    class Liar(float):
        def __lt__(self, other):
            return False

        def __gt__(self, other):
            return False

    def __index__(self):
        return LyingInt.Liar(-3.0)


@pytest.mark.parametrize("call", [
    lambda c, p: c.truncate(LyingInt()),
    lambda c, p: c.advance_len(LyingInt()),
    lambda c, p: KvCache.with_capacity(H, D, LyingInt()),
    lambda c, p: KvBlockPool(LyingInt(), 4, H, D),
    lambda c, p: p.allocate(LyingInt()),
    lambda c, p: c.attend(np.ones((H, D), np.float32), window=LyingInt()),
    lambda c, p: _core._assign([c, c.fork()], [0, LyingInt()]),
])
def test_an_index_that_returns_a_non_int_is_a_type_error(call):
    pool = KvBlockPool(2, 8, H, D)
    c = KvCache.with_pool(H, D, pool, 4)
    c.push(np.ones(W, np.float32), np.ones(W, np.float32))
    with pytest.raises(TypeError, match="must be an integer"):
        call(c, pool)
    assert c.seq_len == 1
    pool.check()


def test_a_huge_scale_that_does_not_fit_float32_is_refused():
    c = KvCache(H, D)
    c.push(np.ones(W, np.float32), np.ones(W, np.float32))
    with pytest.raises(ValueError, match="finite float32"):
        c.attend(np.ones((H, D), np.float32), scale=1e300)


def test_copy_floor_hook_checks_its_destination():
    src = np.ones(64, np.float32)
    with pytest.raises(ValueError, match="writeable and C-contiguous"):
        _core._copy_floor(np.empty(64, np.float32)[::-1], src, 8)
