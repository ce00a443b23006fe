"""Every public entry point driven with arbitrary objects: numbers of every
size, strings, arrays of every dtype and shape, array-likes whose conversion
runs code that closes caches or empties lists. Only the documented exception
types may come out, and after every call the pool passes ``check()`` and no
block is lost. Bounded: a few hundred short programs."""
import gc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes, arrays

import ferrox_kv
from support.numerics import ArrayHook
from ferrox_kv import KvBlockPool, KvCache, KvPoolExhausted

pytestmark = pytest.mark.usefixtures("young_gc")   # gc.collect() after every program

H, D, BS = 2, 3, 4
W = H * D
ALLOWED = (ValueError, TypeError, KvPoolExhausted, MemoryError)   # MemoryError: a huge plan


def _values(world):
    W = world.w
    plain = st.one_of(
        st.none(), st.booleans(), st.integers(-2**70, 2**70), st.integers(-3, 12),
        st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=3),
        st.binary(max_size=8), st.lists(st.floats(-9, 9), max_size=12), st.just(object()),
        arrays(st.sampled_from([np.float32, np.float64, np.float16, np.int32, np.uint8,
                                np.bool_, np.complex64]),
               array_shapes(min_dims=0, max_dims=4, max_side=5)),
        arrays(np.float32, st.sampled_from([(W,), (H, world.d), (3, W), (2, H, world.d),
                                            (1, 2, W)])),
    )
    actions = st.sampled_from(["close", "clear_list", "truncate", "nothing"])
    hooked = st.builds(lambda v, a: ArrayHook(v, world.action(a)),
                       arrays(np.float32, st.sampled_from([(W,), (2, W), (1, W)])), actions)
    return st.one_of(plain, hooked)


class World:
    def __init__(self, dtype="float32"):
        self.dtype = dtype
        self.d = 32 if dtype == "int4" else D          # int4 head dims: multiples of 32
        self.w = H * self.d
        self.pool = KvBlockPool(BS, 24, H, self.d, prefix_cache=True, dtype=dtype)
        self.caches = []
        self.raw = []                  # ids from allocate(): the caller frees them

    def action(self, name):
        def run():
            if name == "close" and self.caches:
                self.caches[0].close()
            elif name == "clear_list":
                self.caches.clear()
            elif name == "truncate" and self.caches:
                try:
                    self.caches[-1].truncate(0)
                except ValueError:
                    pass
        return run

    def pick(self, data):
        if not self.caches:
            return KvCache(H, self.d, dtype=self.dtype)
        return data.draw(st.sampled_from(self.caches))


OPS = ["new", "with_capacity", "with_pool", "with_pool_many", "push", "extend", "advance_len",
       "truncate", "push_layers", "fork", "copy", "release", "close", "allocate", "free",
       "attend", "attend_many", "publish", "pool"]


def _call(world, op, data, any_value):
    w, pool, D = world, world.pool, world.d
    a = lambda: data.draw(any_value)                     # noqa: E731
    # a sliding window: none, a sensible one, or anything at all
    win = lambda: data.draw(st.one_of(st.none(), st.integers(1, 9), any_value))  # noqa: E731
    if op == "new":
        w.caches.append(KvCache(a(), a(), dtype=data.draw(st.sampled_from([w.dtype, a()])),
                                rotate=data.draw(st.sampled_from([None, False, a()])),
                                window=win())
                        if data.draw(st.booleans()) else KvCache(H, D, dtype=w.dtype, window=win()))
    elif op == "with_capacity":
        w.caches.append(KvCache.with_capacity(H, D, a(), dtype=w.dtype))
    elif op == "with_pool":
        w.caches.append(KvCache.with_pool(H, D, pool, a(), tokens=data.draw(
            st.one_of(st.none(), st.lists(st.integers(0, 3), max_size=20), st.just("x"))),
            window=win(), max_chunk=data.draw(st.sampled_from([None, 2, a()]))))
    elif op == "with_pool_many":
        w.caches += KvCache.with_pool_many(a(), H, D, pool, data.draw(st.integers(0, 12)),
                                           window=win())
    elif op == "push":
        w.pick(data).push(a(), a())
    elif op == "extend":
        w.pick(data).extend(a(), a())
    elif op == "advance_len":
        w.pick(data).advance_len(a())
    elif op == "truncate":
        w.pick(data).truncate(a())
    elif op == "push_layers":
        ferrox_kv.push_layers(data.draw(st.sampled_from([w.caches, list(w.caches[:2]), [a()]])),
                              a(), a())
    elif op == "fork":
        w.caches.append(w.pick(data).fork())
    elif op == "copy":
        w.caches.append(w.pick(data).copy())
    elif op == "release":
        w.pick(data).release_to_pool()
    elif op == "close":
        w.pick(data).close()
    elif op == "allocate":
        w.raw.append(pool.allocate(a()))
    elif op == "free":
        pool.free(w.raw.pop() if w.raw and data.draw(st.booleans()) else a())
    elif op == "attend":
        w.pick(data).attend(a(), scale=data.draw(st.sampled_from([None, a()])),
                            window=data.draw(st.sampled_from([None, a()])))
    elif op == "attend_many":
        ferrox_kv.attend_many(data.draw(st.sampled_from([w.caches, w.caches[:1], [a()]])), a())
    elif op == "publish":
        pool.publish(data.draw(st.sampled_from([w.caches[:1], w.caches, [a()]])), a())
    elif op == "pool":
        KvBlockPool(a(), a(), a(), a(), v_head_dim=data.draw(st.sampled_from([None, a()])),
                    dtype=data.draw(st.sampled_from(["float32", "bfloat16", "int4", a()])),
                    rotate=data.draw(st.sampled_from([None, True, False, a()])))


def _program(dtype, data):
    world = World(dtype)
    any_value = _values(world)
    for _ in range(data.draw(st.integers(1, 25))):
        op = data.draw(st.sampled_from(OPS))
        try:
            _call(world, op, data, any_value)
        except ALLOWED:
            pass
        world.pool.check()
    world.caches.clear()
    for ids in world.raw:              # the fuzz's own free() may have freed some already
        for i in ids.tolist():
            try:
                world.pool.free([i])
            except ValueError:
                pass
    gc.collect()
    world.pool.check()
    assert world.pool.used_blocks == 0


OVERFLOW = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
INVALID = pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")


@OVERFLOW
@INVALID
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_arbitrary_calls_raise_only_documented_errors_and_lose_nothing(dtype, data):
    _program(dtype, data)


@OVERFLOW
@INVALID
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_arbitrary_calls_on_an_int4_pool_raise_only_documented_errors_and_lose_nothing(data):
    _program("int4", data)
