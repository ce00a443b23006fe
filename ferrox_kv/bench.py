"""The main job: ``ferrox-kv bench`` (also ``python -m ferrox_kv bench`` and,
as before, ``python -m ferrox_kv.bench``).

Measures ferrox_kv against the hardware's floor (a C loop doing the same
memory traffic with no Python per row) and against what users write instead
(a numpy array managed by hand, transformers' ``DynamicCache``, torch's SDPA
over contiguous tensors), and prints one table per group, then the targets.
Every figure is a ratio taken in the same run (these machines are shared and
noisy): each variant is timed several times, interleaved with the others, and
the best time of each is kept.

    ferrox-kv bench [--quick] [--json FILE] [--plot FILE.png] [--groups push,extend,...]
                    [--threads N] [--geometry NAME] [--contexts 512,2048,8192]

Groups that need torch/transformers (``hf``; the SDPA and DynamicCache rows
of ``attention`` and ``decode``) are skipped without them, with one line that
says so and how to install them.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import sys
import textwrap
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

import ferrox_kv
from ferrox_kv import KvBlockPool, KvCache
from ferrox_kv import _core

# name: (n_kv_heads, head_dim, layers)
GEOMETRIES = {
    "llama8b": (8, 128, 32),     # Llama-3-8B: 8 KV heads x 128, 32 layers
    "small": (2, 64, 32),
    "wide": (32, 128, 32),
}
BLOCK_SIZE = 16
HF_INSTALL = "pip install 'ferrox_kv[hf]'"
PLOT_INSTALL = "pip install 'ferrox_kv[plot]'"

# the attention group: Llama-3-8B's attention (32 query heads over 8 KV heads x 128)
ATTN_HEADS, ATTN_KV_HEADS, ATTN_DIM = 32, 8, 128

LEGEND = """\
How to read this: every ratio is taken within this one run (variants timed
several times, interleaved, best kept); "of" names the denominator.
  geometries   KV heads x head_dim x layers: llama8b 8x128x32 (Llama-3-8B),
               small 2x64x32, wide 32x128x32. attention and hf: 32 query heads
               over 8 KV heads x 128.
  [cached]     thread runs whose working set stays in the CPU caches: what
               limits them is ferrox's own overhead (GIL, locks).
  [stream]     thread runs that stream MiBs through DRAM: memory bandwidth
               limits them.
  floor        a C loop doing the same memory traffic with no Python per row
               (memcpy into fresh memory for copies; one read pass over K and V
               for attention): the hardware limit."""


def _log(msg):
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# Numbers a person can read: fixed point, sensible units, never 1.2e+04
# ---------------------------------------------------------------------------

def _micro():
    """"µs" where stdout can print it, else "us"."""
    enc = getattr(sys.stdout, "encoding", None) or "ascii"
    try:
        "µ".encode(enc)
    except (UnicodeEncodeError, LookupError):
        return "us"
    return "µs"


def fmt_num(x) -> str:
    """About three significant digits in fixed point: 1234, 123, 12.3, 1.23,
    0.123; below 0.001 ``<0.001``. Never scientific notation."""
    if x is None:
        return ""
    x = float(x)
    if math.isnan(x):
        return "n/a"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    a = abs(x)
    if a == 0:
        return "0"
    if a < 0.0005:
        return "<0.001" if x > 0 else ">-0.001"
    for limit, decimals in ((0.9995, 3), (9.995, 2), (99.95, 1)):
        if a < limit:
            return f"{x:.{decimals}f}"
    return f"{x:.0f}"


_TIME = (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9))
_TIME_IN = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_BYTES = (("GiB", 2.0 ** 30), ("MiB", 2.0 ** 20), ("KiB", 2.0 ** 10), ("B", 1.0))
_RATE_B = (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3), ("B/s", 1.0))
_RATE_POS = (("Gpos/s", 1e9), ("Mpos/s", 1e6), ("kpos/s", 1e3), ("pos/s", 1.0))


def _scaled(base, ladder):
    """(value, unit) from a ladder of (unit, size), largest first: the largest
    unit the value reaches (so 1234 us -> 1.23 ms), else the smallest."""
    for unit, size in ladder:
        if abs(base) >= size * 0.9995:
            return base / size, unit
    unit, size = ladder[-1]
    return base / size, unit


def fmt_quantity(value, unit: str) -> str:
    """``value`` in ``unit`` (as measured: "ns/pos", "us/token", "GB/s",
    "MiB", ...) rescaled to the unit that reads best, fixed point:
    ``fmt_quantity(12634, "us/token") == "12.6 ms/token"``."""
    if value is None:
        return ""
    if isinstance(value, (int, np.integer)) and unit == "":
        return str(int(value))
    value = float(value)
    if math.isnan(value) or math.isinf(value) or value == 0:
        return f"{fmt_num(value)} {unit}".strip()
    for family in (_RATE_B, _RATE_POS, _BYTES):
        sizes = dict(family)
        if unit in sizes:
            v, u = _scaled(value * sizes[unit], family)
            return f"{fmt_num(v)} {u}"
    if unit == "x":
        return f"{fmt_num(value)}x"
    head, sep, tail = unit.partition("/")
    if head in _TIME_IN:
        v, u = _scaled(value * _TIME_IN[head], _TIME)
        if u == "us":
            u = _micro()
        return f"{fmt_num(v)} {u}{sep}{tail}"
    return f"{fmt_num(value)} {unit}".strip()


# ---------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------

class Results:
    """Rows of (group, geometry, slug, name, value, unit, ratio, ratio_of,
    extra fields). ``slug`` is the row's stable identifier (what targets, the
    plot and JSON readers look rows up by); ``name`` is for people."""

    def __init__(self):
        self.rows = []

    def add(self, group, geometry, slug, name, value, unit, ratio=None, ratio_of=None, **extra):
        row = {"group": group, "geometry": geometry, "slug": slug, "name": name,
               "value": value, "unit": unit, "ratio": ratio, "ratio_of": ratio_of}
        row.update(extra)
        self.rows.append(row)
        return row

    def find(self, slug, **where):
        """The first row with this slug whose fields match ``where``."""
        for r in self.rows:
            if r["slug"] == slug and all(r.get(k) == v for k, v in where.items()):
                return r
        return None

    def ratio(self, slug, **where):
        r = self.find(slug, **where)
        return None if r is None else r["ratio"]

    def table(self, group, title="", name_width=50):
        rows = [r for r in self.rows if r["group"] == group]
        if not rows:
            return ""
        geo_w = max(8, max(len(str(r["geometry"])) for r in rows))
        cells = [(str(r["geometry"]), r["name"], fmt_quantity(r["value"], r["unit"]),
                  "" if r["ratio"] is None else fmt_num(r["ratio"]), r["ratio_of"] or "")
                 for r in rows]
        name_w = min(name_width, max(len(c[1]) for c in cells))
        val_w = max(10, max(len(c[2]) for c in cells))
        out = [f"\n== {group}" + (f": {title}" if title else ""),
               f"{'geometry':<{geo_w}}  {'measure':<{name_w}}  {'value':>{val_w}}  "
               f"{'ratio':>7}  of"]
        for geo, name, val, ratio, of in cells:
            lines = textwrap.wrap(name, name_w, subsequent_indent="  ") or [""]
            out.append(f"{geo:<{geo_w}}  {lines[0]:<{name_w}}  {val:>{val_w}}  {ratio:>7}  {of}")
            out.extend(f"{'':<{geo_w}}  {more}" for more in lines[1:])
        return "\n".join(out)


def best_of(variants, reps):
    """Run each (name, setup, run) ``reps`` times, interleaved; return the best
    seconds of each. ``setup()`` makes fresh state (untimed) that ``run``
    receives."""
    best = {name: float("inf") for name, _, _ in variants}
    for _ in range(reps):
        for name, setup, run in variants:
            state = setup()
            gc.disable()
            t0 = time.perf_counter()
            run(state)
            dt = time.perf_counter() - t0
            gc.enable()
            best[name] = min(best[name], dt)
            del state
    return best


def _rows(n, width, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, width), dtype=np.float32)


def _run_threads(n, fn):
    """Start n threads running fn(i) together; return wall seconds."""
    barrier = threading.Barrier(n + 1)
    errors = []

    def body(i):
        barrier.wait()
        try:
            fn(i)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    barrier.wait()
    t0 = time.perf_counter()
    for th in threads:
        th.join()
    dt = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return dt


def _loops_for(fn, target_s):
    """How many calls of fn(0) take about target_s (one untimed warm-up call)."""
    fn(0)
    t0 = time.perf_counter()
    fn(0)
    return max(1, int(target_s / max(time.perf_counter() - t0, 1e-7)))


def _thread_counts(max_threads):
    counts = [1]
    while counts[-1] * 2 <= max_threads:
        counts.append(counts[-1] * 2)
    if counts[-1] != max_threads:
        counts.append(max_threads)
    return counts


def _scaling(works, counts, reps):
    """For each (name, fn(i)) of ``works``: best seconds of ``counts`` threads
    each running fn, thread counts and works interleaved within every
    repetition (so a slow spell of a shared machine hits all of them)."""
    best = {(name, t): float("inf") for name, _ in works for t in counts}
    for _ in range(reps):
        for name, fn in works:
            for t in counts:
                best[name, t] = min(best[name, t], _run_threads(t, fn))
    return best


# ---------------------------------------------------------------------------
# Optional dependencies
# ---------------------------------------------------------------------------

def _try_import(name):
    try:
        return __import__(name)
    except Exception:   # ImportError, or a broken install: either way, not usable
        return None


def have_torch():
    return _try_import("torch") is not None


def have_hf():
    if not have_torch() or _try_import("transformers") is None:
        return False
    try:
        from transformers import DynamicCache  # noqa: F401
    except Exception:
        return False
    return True


class _Torch1:
    """torch on one thread for the block (the attention and hf groups compare
    one thread of ferrox with one thread of torch); restored after."""

    def __init__(self):
        self.torch = _try_import("torch")

    def __enter__(self):
        if self.torch is not None:
            self.old = self.torch.get_num_threads()
            self.torch.set_num_threads(1)
        return self.torch

    def __exit__(self, *exc):
        if self.torch is not None:
            self.torch.set_num_threads(self.old)


# ---------------------------------------------------------------------------
# Group: push
# ---------------------------------------------------------------------------

def bench_push(res, geo, n_rows, reps):
    h, d, _ = GEOMETRIES[geo]
    w = h * d
    ks, vs = _rows(n_rows, w, 1), _rows(n_rows, w, 2)
    steps = [(ks[i], vs[i]) for i in range(n_rows)]
    n_blocks = -(-n_rows // BLOCK_SIZE)

    def floor(_):
        kd, vd = np.empty_like(ks), np.empty_like(vs)
        _core._copy_floor(kd, ks, w)
        _core._copy_floor(vd, vs, w)

    def numpy_assign(state):
        K, V = state
        for i, (k, v) in enumerate(steps):
            K[i] = k
            V[i] = v

    def push_all(c):
        push = c.push
        for k, v in steps:
            push(k, v)

    variants = [
        ("floor", lambda: None, floor),
        ("numpy", lambda: (np.empty_like(ks), np.empty_like(vs)), numpy_assign),
        ("with_capacity", lambda: KvCache.with_capacity(h, d, n_rows), push_all),
        ("growable", lambda: KvCache(h, d), push_all),
        # Pooled against unpooled compares like with like. Memory in use: a
        # cache on a pool that already served one (as in a server, which makes
        # its pool once) against a with_capacity cache truncated to 0 and
        # refilled. Fresh memory: a new pool per run against a new
        # with_capacity cache per run, both taking first-touch page faults.
        ("with_capacity_reused", lambda: reused.truncate(0) or reused, push_all),
        ("pooled", lambda: KvCache.with_pool(h, d, warm_pool, n_rows), push_all),
        ("pooled_fresh", lambda: KvCache.with_pool(h, d, KvBlockPool(BLOCK_SIZE, n_blocks, h, d),
                                                   n_rows), push_all),
    ]
    warm_pool = KvBlockPool(BLOCK_SIZE, n_blocks, h, d)
    with KvCache.with_pool(h, d, warm_pool, n_rows) as c:
        push_all(c)    # touches every block of the arena once
    reused = KvCache.with_capacity(h, d, n_rows)
    push_all(reused)
    best = best_of(variants, reps)
    per = {k: v / n_rows * 1e9 for k, v in best.items()}
    g = "push"
    res.add(g, geo, "push.floor", "floor: C memcpy per row, fresh memory", per["floor"], "ns/pos")
    res.add(g, geo, "push.numpy", "numpy slice-assign into preallocated", per["numpy"], "ns/pos",
            per["numpy"] / per["floor"], "floor")
    res.add(g, geo, "push.with_capacity.vs_floor", "with_capacity push", per["with_capacity"],
            "ns/pos", per["with_capacity"] / per["floor"], "floor")
    res.add(g, geo, "push.with_capacity.vs_numpy", "with_capacity push", per["with_capacity"],
            "ns/pos", per["with_capacity"] / per["numpy"], "numpy")
    res.add(g, geo, "push.growable", "growable KvCache push", per["growable"], "ns/pos",
            per["growable"] / per["numpy"], "numpy")
    res.add(g, geo, "push.with_capacity_in_use", "with_capacity push, memory in use",
            per["with_capacity_reused"], "ns/pos", per["with_capacity_reused"] / per["floor"],
            "floor")
    res.add(g, geo, "push.pooled.vs_unpooled", "with_pool push, pool in use", per["pooled"],
            "ns/pos", per["pooled"] / per["with_capacity_reused"], "with_capacity in use",
            vs_floor=per["pooled"] / per["floor"])
    res.add(g, geo, "push.pooled_fresh", "with_pool push, new pool each run", per["pooled_fresh"],
            "ns/pos", per["pooled_fresh"] / per["with_capacity"], "with_capacity")


# ---------------------------------------------------------------------------
# Group: extend (prefill)
# ---------------------------------------------------------------------------

def bench_extend(res, geo, reps, t=512):
    h, d, _ = GEOMETRIES[geo]
    w = h * d
    ks, vs = _rows(t, w, 3), _rows(t, w, 4)
    nbytes = ks.nbytes + vs.nbytes
    n_blocks = -(-t // BLOCK_SIZE)

    def floor(_):
        kd, vd = np.empty_like(ks), np.empty_like(vs)
        _core._copy_floor(kd, ks, w * t)
        _core._copy_floor(vd, vs, w * t)

    variants = [
        ("floor", lambda: None, floor),
        ("numpy", lambda: None, lambda _: (np.empty_like(ks).__setitem__(slice(None), ks),
                                           np.empty_like(vs).__setitem__(slice(None), vs))),
        ("with_capacity", lambda: KvCache.with_capacity(h, d, t), lambda c: c.extend(ks, vs)),
        ("pooled", lambda: KvCache.with_pool(h, d, KvBlockPool(BLOCK_SIZE, n_blocks, h, d), t),
         lambda c: c.extend(ks, vs)),
    ]
    best = best_of(variants, reps)
    bw = {k: nbytes / v / 1e9 for k, v in best.items()}
    g = "extend"
    res.add(g, geo, "extend.floor", f"floor: memcpy {t} positions, fresh memory", bw["floor"],
            "GB/s", positions=t)
    res.add(g, geo, "extend.numpy", "numpy slice-assign of the block", bw["numpy"], "GB/s",
            bw["numpy"] / bw["floor"], "floor", positions=t)
    res.add(g, geo, "extend.with_capacity.vs_floor", f"with_capacity extend({t})",
            bw["with_capacity"], "GB/s", bw["with_capacity"] / bw["floor"], "floor", positions=t)
    res.add(g, geo, "extend.pooled.vs_floor", f"with_pool extend({t})", bw["pooled"], "GB/s",
            bw["pooled"] / bw["floor"], "floor", positions=t)


# ---------------------------------------------------------------------------
# Group: pool
# ---------------------------------------------------------------------------

def bench_pool(res, reps, iters):
    h, d = 8, 128
    pool = KvBlockPool(BLOCK_SIZE, 4096, h, d)
    g = "pool"

    def py_take_give(_):
        alloc, free = pool.allocate, pool.free
        for _ in range(iters):
            free(alloc(1))

    def cache_cycle(_):
        for _ in range(iters // 4):
            KvCache.with_pool(h, d, pool, BLOCK_SIZE).close()

    best = best_of([("c1", lambda: None, lambda _: _core._take_give_loop(pool, iters, 1)),
                    ("py", lambda: None, py_take_give),
                    ("cache", lambda: None, cache_cycle)], reps)
    c1 = best["c1"] / iters * 1e9
    res.add(g, "-", "pool.c_loop", "take+give 1 block, C loop, 1 thread", c1, "ns/block")
    two = min(_run_threads(2, lambda i: _core._take_give_loop(pool, iters, 1))
              for _ in range(reps))
    res.add(g, "-", "pool.c_loop_2threads", "take+give 1 block, C loop, 2 threads",
            two / (2 * iters) * 1e9, "ns/block", (two / (2 * iters) * 1e9) / c1, "1 thread")
    res.add(g, "-", "pool.python", "allocate(1)+free from Python", best["py"] / iters * 1e9,
            "ns/block", best["py"] / best["c1"], "C loop")
    res.add(g, "-", "pool.cache_cycle", "with_pool + close (one block), Python",
            best["cache"] / (iters // 4) * 1e9, "ns/cache")
    py2 = min(_run_threads(2, lambda i: py_take_give(None)) for _ in range(reps))
    res.add(g, "-", "pool.python_2threads", "allocate(1)+free, 2 Python threads",
            py2 / (2 * iters) * 1e9, "ns/block", py2 / 2 / best["py"], "1 thread")
    assert pool.free_blocks == pool.total_blocks


# ---------------------------------------------------------------------------
# Group: threads
# ---------------------------------------------------------------------------

def bench_threads(res, geo, max_threads, reps, rows_per_thread, target_s=0.1,
                  regime="stream", layer_bytes=64 << 20):
    """N threads, each with its own caches on one shared pool.

    regime "cached": every thread rewrites the same 512 positions (a working
    set that stays in the CPU caches), so what limits scaling is ferrox's own
    overhead (GIL, locks). regime "stream": each thread writes several MiB per
    round, so DRAM bandwidth limits it; the C copy floor shows how far the
    hardware itself scales there.
    """
    h, d, _ = GEOMETRIES[geo]
    w = h * d
    counts = _thread_counts(max_threads)
    chunk = 512
    n = max(chunk, rows_per_thread // chunk * chunk)
    pool = KvBlockPool(BLOCK_SIZE, max_threads * (-(-n // BLOCK_SIZE)), h, d)
    ks, vs = _rows(n, w, 5), _rows(n, w, 6)
    # every thread gets its own copy of the inputs, as real request threads
    # have: shared Python objects would make the threads fight over reference
    # counts (cache-line bouncing) and measure that instead
    src = [(ks.copy(), vs.copy()) for _ in range(max_threads)]
    steps = [[(k[i], v[i]) for i in range(n)] for k, v in src]
    caches = [KvCache.with_pool(h, d, pool, n) for _ in range(max_threads)]
    for c in caches:                    # touch the memory once: measure copies, not faults
        c.extend(ks, vs)
        c.clear()
    # the floor's own K and V destinations, touched like the caches: the same
    # bytes to the same number of places as extend writes
    floor_dst = [(np.zeros_like(ks), np.zeros_like(vs)) for _ in range(max_threads)]
    # push_layers: one position into all layers per call, the decode step's
    # coarse call. Tokens per thread sized to ~layer_bytes of K+V per thread.
    layers = GEOMETRIES[geo][2]
    n_tok = int(max(4, min(n, layer_bytes // (layers * 2 * w * 4))))
    lpool = KvBlockPool(BLOCK_SIZE, max_threads * layers * (-(-n_tok // BLOCK_SIZE)), h, d)
    lcaches = [[KvCache.with_pool(h, d, lpool, n_tok) for _ in range(layers)]
               for _ in range(max_threads)]
    lsrc = [(_rows(layers, w, 11), _rows(layers, w, 12)) for _ in range(max_threads)]
    for cs in lcaches:
        for c in cs:
            c.advance_len(n_tok)
            c.clear()

    def layers_work(i):
        cs = lcaches[i]
        for c in cs:
            c.clear()
        for _ in range(n_tok):
            ferrox_kv.push_layers(cs, lsrc[i][0], lsrc[i][1])

    def push_work(i):
        c = caches[i]
        c.clear()
        push = c.push
        for k, v in steps[i]:
            push(k, v)

    def extend_work(i):
        c = caches[i]
        c.clear()
        for j in range(0, n, chunk):
            c.extend(src[i][0][j:j + chunk], src[i][1][j:j + chunk])

    def floor_work(i):
        _core._copy_floor(floor_dst[i][0], src[i][0], w * chunk)
        _core._copy_floor(floor_dst[i][1], src[i][1], w * chunk)

    g = "threads"
    # (slug, display name, work, positions per call of work, bytes per call)
    works = [("push", "push", push_work, n, 2 * w * 4),
             ("extend", f"extend({chunk})", extend_work, n, chunk * 2 * w * 4),
             ("push_layers", f"push_layers({layers} layers)", layers_work, n_tok * layers,
              layers * 2 * w * 4),
             ("floor", f"floor: C copy, {chunk}-pos chunks", floor_work, n,
              chunk * 2 * w * 4)]
    for slug, name, fn, per, call_bytes in works:
        # repeat the work so that one thread runs >= target_s: short runs are noise
        loops = _loops_for(fn, target_s)

        def looped(i, fn=fn, loops=loops):
            for _ in range(loops):
                fn(i)

        best = _scaling([(slug, looped)], counts, reps)
        base = None
        for t in counts:
            rate = t * per * loops / best[slug, t]
            if base is None:
                base = rate
            res.add(g, geo, f"threads.{slug}.{regime}", f"[{regime}] {name}, {t} thread{'s' if t > 1 else ''}",
                    rate / 1e6, "Mpos/s", rate / base, "1 thread", threads=t, regime=regime,
                    bytes_per_call=call_bytes)
    for c in caches:
        c.close()
    for cs in lcaches:
        for c in cs:
            c.close()
    assert pool.free_blocks == pool.total_blocks
    assert lpool.free_blocks == lpool.total_blocks


# ---------------------------------------------------------------------------
# Group: decode (the cache's own work per token, every layer of a model)
# ---------------------------------------------------------------------------

class _NumpyCache:
    """What a user writes by hand: preallocated arrays per layer."""

    def __init__(self, layers, h, d, max_len):
        self.K = [np.empty((max_len, h, d), np.float32) for _ in range(layers)]
        self.V = [np.empty((max_len, h, d), np.float32) for _ in range(layers)]
        self.n = [0] * layers

    def update(self, layer, k, v):
        n = self.n[layer]
        self.K[layer][n] = k
        self.V[layer][n] = v
        self.n[layer] = n + 1
        return self.K[layer][:n + 1], self.V[layer][:n + 1]


@dataclass
class _DecodeImpl:
    slug: str
    name: str
    make: Callable
    prefill: Callable
    step: Callable
    all_layers: bool = False     # step takes every layer's row at once: (layers, h, d)


def _decode_impls(h, d, layers, max_len, with_torch):
    def fx_make_cap():
        return [KvCache.with_capacity(h, d, max_len) for _ in range(layers)]

    def fx_make_pool():
        pool = KvBlockPool(BLOCK_SIZE, layers * (-(-max_len // BLOCK_SIZE)), h, d)
        return [KvCache.with_pool(h, d, pool, max_len) for _ in range(layers)]

    def fx_prefill(caches, ks, vs):
        for c in caches:
            c.extend(ks, vs)

    def fx_step_views(caches, k, v):
        for c in caches:
            c.push(k, v)
            c.k, c.v                               # zero-copy views for attention

    def fx_step_table(caches, k, v):
        for c in caches:
            c.push(k, v)
            c.block_table                          # what a paged kernel reads

    def fx_step_layers_views(caches, k, v):
        ferrox_kv.push_layers(caches, k, v)        # all layers, one call
        for c in caches:
            c.k, c.v

    def fx_step_layers_table(caches, k, v):
        ferrox_kv.push_layers(caches, k, v)
        for c in caches:
            c.block_table

    def np_make():
        return _NumpyCache(layers, h, d, max_len)

    def np_prefill(cache, ks, vs):
        t = ks.shape[0]
        for layer in range(layers):
            cache.K[layer][:t] = ks.reshape(t, h, d)
            cache.V[layer][:t] = vs.reshape(t, h, d)
            cache.n[layer] = t

    def np_step(cache, k, v):
        for layer in range(layers):
            cache.update(layer, k, v)

    impls = [
        _DecodeImpl("ferrox_views", "ferrox with_capacity, push + views", fx_make_cap,
                    fx_prefill, fx_step_views),
        _DecodeImpl("ferrox_pooled_table", "ferrox with_pool, push + block table",
                    fx_make_pool, fx_prefill, fx_step_table),
        _DecodeImpl("ferrox_push_layers_views", "ferrox push_layers + views", fx_make_cap,
                    fx_prefill, fx_step_layers_views, all_layers=True),
        _DecodeImpl("ferrox_push_layers_table", "ferrox push_layers, pooled, block table",
                    fx_make_pool, fx_prefill, fx_step_layers_table, all_layers=True),
        _DecodeImpl("ferrox_pooled_gather", "ferrox with_pool, push + gathered k/v",
                    fx_make_pool, fx_prefill, fx_step_views),
        _DecodeImpl("numpy", "numpy preallocated, views", np_make, np_prefill, np_step),
    ]
    if not with_torch:
        return impls
    import torch
    from transformers import DynamicCache

    def dc_prefill(cache, ks, vs):
        t = ks.shape[0]
        kt = torch.from_numpy(ks.reshape(1, t, h, d)).transpose(1, 2)
        vt = torch.from_numpy(vs.reshape(1, t, h, d)).transpose(1, 2)
        for layer in range(layers):
            cache.update(kt, vt, layer)

    def dc_step(cache, k, v):
        kt = torch.from_numpy(k).view(1, h, 1, d)
        vt = torch.from_numpy(v).view(1, h, 1, d)
        for layer in range(layers):
            cache.update(kt, vt, layer)

    impls.append(_DecodeImpl("dynamic_cache", "transformers DynamicCache.update",
                             DynamicCache, dc_prefill, dc_step))
    return impls


def bench_decode(res, geo, contexts, reps, tokens, with_torch):
    h, d, layers = GEOMETRIES[geo]
    w = h * d
    max_len = max(contexts) + tokens + 1
    impls = _decode_impls(h, d, layers, max_len, with_torch)
    # one new position per token, shaped (n_kv_heads, head_dim) as a model makes it
    k_tok = _rows(tokens, w, 7).reshape(tokens, h, d)
    v_tok = _rows(tokens, w, 8).reshape(tokens, h, d)
    # push_layers takes every layer's row at once: (layers, h, d) per token
    k_all = np.ascontiguousarray(np.broadcast_to(k_tok[:, None], (tokens, layers, h, d)))
    v_all = np.ascontiguousarray(np.broadcast_to(v_tok[:, None], (tokens, layers, h, d)))
    g = "decode"
    for ctx in contexts:
        ks, vs = _rows(ctx, w, 9), _rows(ctx, w, 10)
        per = {}
        for impl in impls:
            kk, vv = (k_all, v_all) if impl.all_layers else (k_tok, v_tok)
            best = float("inf")
            for _ in range(reps):
                state = impl.make()
                impl.prefill(state, ks, vs)
                gc.disable()
                t0 = time.perf_counter()
                for i in range(tokens):
                    impl.step(state, kk[i], vv[i])
                best = min(best, time.perf_counter() - t0)
                gc.enable()
                del state
            per[impl.slug] = best / tokens * 1e6
        base = per["ferrox_views"]
        for impl in impls:
            us = per[impl.slug]
            res.add(g, geo, f"decode.{impl.slug}", f"{impl.name} @ {ctx}", us, "us/token",
                    us / base, "ferrox with_capacity", context=ctx, layers=layers)


# ---------------------------------------------------------------------------
# Group: attention (read in place vs torch SDPA, 1 torch thread)
# ---------------------------------------------------------------------------

def _causal_mask(torch, q_len, kv_len):
    """Bottom-right aligned: the q_len queries are the last positions."""
    qpos = torch.arange(kv_len - q_len, kv_len).view(-1, 1)
    return torch.arange(kv_len).view(1, -1) <= qpos


def bench_attention(res, contexts, reps, target_s, chunk, torch):
    """Decode attention (one query position, 32 heads over 8 KV heads x 128)
    over a pooled KvCache, against torch SDPA on contiguous tensors of the
    same data, a gather + SDPA, and the read floor; a causal chunk; and
    attend_many from 2 threads against the read floor from 2 threads."""
    H, KVH, D = ATTN_HEADS, ATTN_KV_HEADS, ATTN_DIM
    geo = "llama8b"
    g = "attention"
    F = torch.nn.functional if torch is not None else None
    row_bytes = 2 * KVH * D * 4
    rng = np.random.default_rng(20)
    for T in contexts:
        nb = -(-T // BLOCK_SIZE)
        pool = KvBlockPool(BLOCK_SIZE, 3 * nb, KVH, D)
        K = rng.standard_normal((T, KVH, D), dtype=np.float32)
        V = rng.standard_normal((T, KVH, D), dtype=np.float32)
        cache = KvCache.with_pool(KVH, D, pool, T)
        cache.extend(K, V)
        q = rng.standard_normal((H, D), dtype=np.float32)
        out = np.empty((H, D), np.float32)

        def attend_once(_):
            cache.attend(q, out=out)

        n = _loops_for(attend_once, target_s)
        variants = [
            ("attend", lambda: None, lambda _: [cache.attend(q) for _ in range(n)]),
            ("floor", lambda: None, lambda _: _core._read_floor([cache], n)),
        ]
        diff = None
        if torch is not None:
            # what DynamicCache hands attention: contiguous (1, KVH, T, D)
            kt = torch.from_numpy(np.ascontiguousarray(K.transpose(1, 0, 2)))[None]
            vt = torch.from_numpy(np.ascontiguousarray(V.transpose(1, 0, 2)))[None]
            qt = torch.from_numpy(q)[None, :, None, :]
            full = torch.ones(1, 1, 1, T, dtype=torch.bool)
            rep = H // KVH

            def sdpa(_):
                for _ in range(n):
                    F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

            def repeat_kv_sdpa(_):
                # transformers' path when a mask is present: repeat_kv, then a
                # masked SDPA over 32 heads
                for _ in range(n):
                    kr = kt[:, :, None].expand(1, KVH, rep, T, D).reshape(1, H, T, D)
                    vr = vt[:, :, None].expand(1, KVH, rep, T, D).reshape(1, H, T, D)
                    F.scaled_dot_product_attention(qt, kr, vr, attn_mask=full)

            def gather_sdpa(_):
                # what a paged cache without an in-place kernel does: gather
                # the blocks (cache.k / cache.v), then SDPA on the copies
                for _ in range(n):
                    kg = torch.from_numpy(cache.k).permute(1, 0, 2)[None]
                    vg = torch.from_numpy(cache.v).permute(1, 0, 2)[None]
                    F.scaled_dot_product_attention(qt, kg, vg, enable_gqa=True)

            variants += [("sdpa", lambda: None, sdpa),
                         ("repeat_kv_sdpa", lambda: None, repeat_kv_sdpa),
                         ("gather_sdpa", lambda: None, gather_sdpa)]
            ref = F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)[0, :, 0].numpy()
            diff = float(np.abs(cache.attend(q) - ref).max())
        best = best_of(variants, reps)
        us = {k: v / n * 1e6 for k, v in best.items()}
        ctx_bytes = T * row_bytes
        gbs = {k: ctx_bytes / (v * 1e-6) / 1e9 for k, v in us.items()}
        extra = dict(context=T, calls=n)
        res.add(g, geo, "attention.floor", f"read floor: K+V read once, C @ {T}", us["floor"],
                "us/call", read_gbs=gbs["floor"], **extra)
        if torch is not None:
            res.add(g, geo, "attention.sdpa", f"SDPA, contiguous (1,8,T,128), GQA @ {T}",
                    us["sdpa"], "us/call", us["sdpa"] / us["floor"], "read floor", **extra)
            res.add(g, geo, "attention.repeat_kv_sdpa", f"repeat_kv + masked SDPA @ {T}",
                    us["repeat_kv_sdpa"], "us/call", us["repeat_kv_sdpa"] / us["sdpa"], "SDPA",
                    **extra)
            res.add(g, geo, "attention.gather_sdpa", f"gather .k/.v + SDPA @ {T}",
                    us["gather_sdpa"], "us/call", us["gather_sdpa"] / us["sdpa"], "SDPA",
                    **extra)
            res.add(g, geo, "attention.attend.vs_sdpa", f"attend, pooled, in place @ {T}",
                    us["attend"], "us/call", us["attend"] / us["sdpa"], "SDPA",
                    max_abs_diff=diff, read_gbs=gbs["attend"], **extra)
            res.add(g, geo, "attention.attend.vs_gather", f"attend, pooled, in place @ {T}",
                    us["attend"], "us/call", us["gather_sdpa"] / us["attend"],
                    "speed-up over gather+SDPA", **extra)
        res.add(g, geo, "attention.attend.vs_floor", f"attend, pooled, in place @ {T}",
                us["attend"], "us/call", us["attend"] / us["floor"], "read floor",
                read_gbs=gbs["attend"], **extra)

        # -- 2 threads, each attending its own cache on the shared pool --------
        tcaches = [KvCache.with_pool(KVH, D, pool, T) for _ in range(2)]
        for c in tcaches:
            c.extend(K, V)
        tq = [q[None, None].copy() for _ in range(2)]
        tout = [np.empty((1, 1, H, D), np.float32) for _ in range(2)]

        def many_once(i):
            ferrox_kv.attend_many([tcaches[i]], tq[i], out=tout[i])

        def floor_once(i):
            _core._read_floor([tcaches[i]], 1)

        loops = {"attend_many": _loops_for(many_once, target_s),
                 "floor": _loops_for(floor_once, target_s)}

        def looped(fn, m):
            def work(i):
                for _ in range(m):
                    fn(i)
            return work

        best2 = _scaling([("attend_many", looped(many_once, loops["attend_many"])),
                          ("floor", looped(floor_once, loops["floor"]))], [1, 2], reps)
        scale = {}
        for name in ("attend_many", "floor"):
            scale[name] = 2 * best2[name, 1] / best2[name, 2]
            agg = 2 * loops[name] * ctx_bytes / best2[name, 2] / 1e9
            res.add(g, geo, f"attention.threads2.{name}",
                    f"[2 threads] {'attend_many' if name == 'attend_many' else 'read floor'}"
                    f" @ {T}", agg, "GB/s", scale[name], "1 thread", threads=2, **extra)
        res.add(g, geo, "attention.threads2.vs_floor", f"[2 threads] attend_many scaling @ {T}",
                scale["attend_many"], "x", scale["attend_many"] / scale["floor"],
                "floor's 2-thread scaling", threads=2, **extra)
        for c in tcaches + [cache]:
            c.close()
        assert pool.free_blocks == pool.total_blocks

    # -- a causal chunk (prefill of q_len positions over a longer context) ---
    q_len, T = chunk
    pool = KvBlockPool(BLOCK_SIZE, -(-T // BLOCK_SIZE), KVH, D)
    cache = KvCache.with_pool(KVH, D, pool, T)
    K = rng.standard_normal((T, KVH, D), dtype=np.float32)
    V = rng.standard_normal((T, KVH, D), dtype=np.float32)
    cache.extend(K, V)
    qc = rng.standard_normal((q_len, H, D), dtype=np.float32)
    variants = [("attend", lambda: None, lambda _: cache.attend(qc))]
    if torch is not None:
        kt = torch.from_numpy(np.ascontiguousarray(K.transpose(1, 0, 2)))[None]
        vt = torch.from_numpy(np.ascontiguousarray(V.transpose(1, 0, 2)))[None]
        qt = torch.from_numpy(np.ascontiguousarray(qc.transpose(1, 0, 2)))[None]
        mask = _causal_mask(torch, q_len, T)
        variants.append(("sdpa", lambda: None, lambda _: F.scaled_dot_product_attention(
            qt, kt, vt, attn_mask=mask, enable_gqa=True)))
    best = best_of(variants, reps)
    name = f"causal chunk: {q_len} queries over {T}"
    if torch is not None:
        res.add(g, geo, "attention.chunk.sdpa", f"SDPA, {name}", best["sdpa"] * 1e6, "us/call",
                context=T, q_len=q_len)
        res.add(g, geo, "attention.chunk.attend", f"attend, {name}", best["attend"] * 1e6,
                "us/call", best["attend"] / best["sdpa"], "SDPA, causal mask", context=T,
                q_len=q_len)
    else:
        res.add(g, geo, "attention.chunk.attend", f"attend, {name}", best["attend"] * 1e6,
                "us/call", context=T, q_len=q_len)
    cache.close()


# ---------------------------------------------------------------------------
# Group: memory
# ---------------------------------------------------------------------------

def _extend_layers(pool, layers, n, ks, vs):
    """A timed run: reserve ``layers`` caches of ``n`` positions on ``pool``,
    extend each with (ks, vs), let them go (what a prefix hit replaces)."""
    h, d = pool.n_kv_heads, pool.head_dim

    def run(_):
        got = KvCache.with_pool_many(layers, h, d, pool, n + 1)
        for c in got:
            c.extend(ks, vs)
        for c in got:
            c.close()
    return run


def bench_sharing(res, quick, reps):
    """Block sharing: forks, prefix reuse, and what the prefix cache's
    bookkeeping costs. 8 KV heads x 128, block size 16."""
    h, d = 8, 128
    w = h * d
    g = "sharing"
    bs = BLOCK_SIZE
    rng = np.random.default_rng(20)

    # 1. a parent and 8 forks, each decoding 64 positions
    ctx, plan, kids = 2048, 2112, 8
    pool = KvBlockPool(bs, (kids + 1) * (plan // bs + 1), h, d)
    parent = KvCache.with_pool(h, d, pool, plan)
    parent.advance_len(ctx)
    alone = pool.used_blocks
    forks = [parent.fork() for _ in range(kids)]
    step = _rows(1, w, 21)[0]
    for c in [parent] + forks:
        for _ in range(plan - ctx):
            c.push(step, step)
    held = pool.used_blocks
    res.add(g, "8x128", "sharing.fork_blocks", f"blocks held: parent of {ctx} + {kids} forks, "
            f"each +{plan - ctx}", held, "blocks", held / alone, "parent alone",
            unshared=(kids + 1) * alone / alone)
    for c in forks + [parent]:
        c.close()
    pool.check()

    # 2. 16 requests: a shared 1024-token prefix and 64 tokens of their own
    n_req, prefix, own = 16, 1024, 64
    per = -(-(prefix + own) // bs)
    pool = KvBlockPool(bs, n_req * per, h, d, prefix_cache=True)
    system = rng.integers(0, 32000, prefix).tolist()
    live = []
    for i in range(n_req):
        toks = system + rng.integers(0, 32000, own).tolist()
        c = KvCache.with_pool(h, d, pool, prefix + own, tokens=toks)
        c.advance_len(len(toks) - c.seq_len)
        pool.publish([c], toks)
        live.append(c)
    used = pool.used_blocks
    res.add(g, "8x128", "sharing.prefix_blocks", f"blocks in use: {n_req} requests, shared "
            f"{prefix}-token prefix + {own} own", used, "blocks", used / (n_req * per),
            "unshared")
    for c in live:
        c.close()
    pool.check()

    # 3. a full hit on 32 layers against extending the same rows
    layers, n_tok = (8, 1024) if quick else (32, 4096)
    per = -(-n_tok // bs) + 1
    pool = KvBlockPool(bs, 2 * layers * per, h, d, prefix_cache=True)
    toks = rng.integers(0, 32000, n_tok).tolist()
    ks, vs = _rows(n_tok, w, 22), _rows(n_tok, w, 23)
    first = KvCache.with_pool_many(layers, h, d, pool, n_tok + 1, tokens=toks)
    for c in first:
        c.extend(ks, vs)
    pool.publish(first, toks)

    def hit(_):
        got = KvCache.with_pool_many(layers, h, d, pool, n_tok + 1, tokens=toks)
        assert got[0].seq_len == (n_tok - 1) // bs * bs
        for c in got:
            c.close()

    extend = _extend_layers(pool, layers, n_tok, ks, vs)
    best = best_of([("hit", lambda: None, hit), ("extend", lambda: None, extend)], reps)
    res.add(g, "8x128", "sharing.hit_vs_extend", f"with_pool_many({layers} layers, tokens="
            f"{n_tok} ids), full hit", best["hit"] * 1e3, "ms", best["hit"] / best["extend"],
            f"extend into {layers} layers", layers=layers, tokens=n_tok)
    for c in first:
        c.close()
    pool.check()

    # 4. bookkeeping at a 0% hit rate: lookup + publish of 512 tokens, 32 layers.
    #    lookup = reserving with tokens= minus reserving without; publish timed
    #    alone on caches that already hold the rows; both against extend.
    layers, n_tok, loops = (8, 512, 20) if quick else (32, 512, 50)
    per = -(-n_tok // bs) + 1
    pool = KvBlockPool(bs, 4 * layers * per, h, d, prefix_cache=True)
    ks, vs = _rows(n_tok, w, 24), _rows(n_tok, w, 25)
    seeds = iter(range(10**6))

    def token_lists():
        return [np.random.default_rng(next(seeds)).integers(0, 2**31 - 1, n_tok).tolist()
                for _ in range(loops)]

    def reserve(lists):
        for toks in lists:
            for c in KvCache.with_pool_many(layers, h, d, pool, n_tok + 1, tokens=toks):
                c.close()

    def reserve_plain(lists):
        for _ in lists:
            for c in KvCache.with_pool_many(layers, h, d, pool, n_tok + 1):
                c.close()

    def filled_caches():
        got = KvCache.with_pool_many(layers, h, d, pool, n_tok + 1)
        for c in got:
            c.advance_len(n_tok)
        return got, token_lists()[0]

    def publish(state):
        pool.publish(*state)
        for c in state[0]:
            c.close()

    best = best_of([("lookup", token_lists, reserve), ("plain", token_lists, reserve_plain),
                    ("publish", filled_caches, publish),
                    ("extend", lambda: None, _extend_layers(pool, layers, n_tok, ks, vs))],
                   reps * 2)
    lookup = max(best["lookup"] - best["plain"], 0.0) / loops
    cost = lookup + best["publish"]
    res.add(g, "8x128", "sharing.bookkeeping", f"lookup + publish of {n_tok} new tokens, "
            f"{layers} layers", cost * 1e6, "us", cost / best["extend"],
            f"extend {n_tok} into {layers} layers", layers=layers,
            lookup_us=lookup * 1e6, publish_us=best["publish"] * 1e6)
    assert pool.stats()["prefix_hits"] == 0
    pool.check()


def _rss():
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


def bench_memory(res, geo):
    h, d, layers = GEOMETRIES[geo]
    g = "memory"
    total = 8192
    rss0 = _rss()
    pool = KvBlockPool(BLOCK_SIZE, total, h, d)
    arena = pool.total_blocks * pool.block_bytes
    rss1 = _rss()
    caches = [KvCache.with_pool(h, d, pool, 1000) for _ in range(layers)]
    for c in caches:
        c.advance_len(1000)
    used = sum(c.blocks_held for c in caches) * pool.block_bytes
    rss2 = _rss()
    res.add(g, geo, "memory.arena", "pool arena (K+V) reserved", arena / 2**20, "MiB")
    if rss0 is not None:
        res.add(g, geo, "memory.resident_new_pool", "resident after creating the pool",
                (rss1 - rss0) / 2**20, "MiB", (rss1 - rss0) / arena, "arena")
        res.add(g, geo, "memory.resident_vs_used", f"resident after {layers} layers x 1000 pos",
                (rss2 - rss0) / 2**20, "MiB", (rss2 - rss0) / used, "blocks used")
    c = caches[0]
    row_bytes = 2 * h * d * 4
    res.add(g, geo, "memory.pooled_allocated", "allocated_bytes, 1000-pos pooled cache",
            c.allocated_bytes(), "B", c.allocated_bytes() / (1000 * row_bytes), "bytes stored")
    grow = KvCache(h, d)
    grow.advance_len(1000)
    res.add(g, geo, "memory.growable_allocated", "allocated_bytes, 1000-pos growable cache",
            grow.allocated_bytes(), "B", grow.allocated_bytes() / (1000 * row_bytes),
            "bytes stored")
    for c in caches:
        c.close()


# ---------------------------------------------------------------------------
# The groups, listed once
# ---------------------------------------------------------------------------

@dataclass
class Run:
    """What a group's runner gets."""
    res: Results
    args: argparse.Namespace
    geos: list
    quick: bool
    reps: int
    torch_ok: bool       # torch importable
    hf_ok: bool          # torch and transformers importable
    contexts: list | None


def _group_push(r):
    for geo in r.geos:
        _log(f"push {geo}")
        bench_push(r.res, geo, 1024 if r.quick else 4096, r.reps)


def _group_extend(r):
    for geo in r.geos:
        _log(f"extend {geo}")
        bench_extend(r.res, geo, r.reps * (2 if r.quick else 3))


def _group_pool(r):
    _log("pool")
    bench_pool(r.res, r.reps, 20_000 if r.quick else 200_000)


def _group_threads(r):
    q = r.quick
    for geo in r.geos:
        _log(f"threads {geo} (1..{r.args.threads})")
        bench_threads(r.res, geo, r.args.threads, 2 if q else 5, 512,
                      target_s=0.02 if q else 0.15, regime="cached", layer_bytes=4 << 20)
        bench_threads(r.res, geo, r.args.threads, 2 if q else 5,
                      2048 if q else (8192 if geo != "wide" else 4096),
                      target_s=0.02 if q else 0.15, regime="stream")


def _group_decode(r):
    contexts = r.contexts or ([128, 512] if r.quick else [128, 512, 1024, 2048])
    geos = r.geos[:1] if r.quick else ([g for g in r.geos if g != "wide"] or r.geos[:1])
    for geo in geos:
        _log(f"decode {geo}, {GEOMETRIES[geo][2]} layers, contexts {contexts}")
        bench_decode(r.res, geo, contexts, 2 if r.quick else 3, 4 if r.quick else 16, r.hf_ok)


def _group_attention(r):
    contexts = r.contexts or ([256, 1024] if r.quick else [512, 2048, 8192])
    chunk = (64, 512) if r.quick else (256, 2048)
    if r.contexts:     # a chunk no longer than the contexts asked for
        chunk = (min(chunk[0], max(r.contexts)), min(chunk[1], max(r.contexts)))
    _log(f"attention, contexts {contexts}, causal chunk {chunk[0]} over {chunk[1]}")
    with _Torch1() as torch:
        bench_attention(r.res, contexts, 3 if r.quick else 7, 0.02 if r.quick else 0.05,
                        chunk, torch if r.torch_ok else None)


def _group_sharing(r):
    _log("sharing: forks, prefix reuse, bookkeeping")
    bench_sharing(r.res, r.quick, r.reps)
    if r.hf_ok:
        from ferrox_kv import _bench_hf
        with _Torch1():
            _bench_hf.bench_chat(r.res, quick=r.quick, log=_log)


def _group_memory(r):
    _log("memory")
    bench_memory(r.res, r.geos[0])


def _group_hf(r):
    from ferrox_kv import _bench_hf
    contexts = r.contexts or ([128, 512] if r.quick else [128, 2048, 8192])
    _log(f"hf: a 2-layer Llama (32 heads, 8 KV heads x 128) per-token decode, "
         f"contexts {contexts}")
    with _Torch1():
        _bench_hf.bench_hf(r.res, contexts, quick=r.quick, log=_log)


@dataclass
class Group:
    slug: str
    title: str
    run: Callable[[Run], None]
    needs_hf: bool = False     # the whole group needs torch and transformers
    torch_rows: str = ""       # rows skipped without torch (said in the skipped line)
    hf_rows: str = ""          # rows skipped without transformers


GROUPS = {g.slug: g for g in [
    Group("push", "one position per call, time per position", _group_push),
    Group("extend", "prefill of 512 positions in one call, bandwidth", _group_extend),
    Group("pool", "taking and giving back blocks", _group_pool),
    Group("threads", "aggregate throughput of N threads, own caches, one shared pool",
          _group_threads),
    Group("decode", "the cache's own work per token, every layer (no attention)",
          _group_decode, hf_rows="the decode rows of DynamicCache.update"),
    Group("attention", "decode attention, 32 query / 8 KV heads x 128, 1 torch thread",
          _group_attention, torch_rows="the attention rows against torch SDPA"),
    Group("sharing", "forks, prefix reuse and the prefix cache's bookkeeping",
          _group_sharing, hf_rows="the chat-turn prefill row of the sharing group"),
    Group("memory", "what a pool costs in resident memory", _group_memory),
    Group("hf", "decode step of a 2-layer Llama, FerroxCache vs DynamicCache, 1 torch thread",
          _group_hf, needs_hf=True),
]}


def skipped_line(groups, torch_ok, hf_ok):
    """The one line that names what this run skips for lack of torch or
    transformers, and how to get it; None when nothing is skipped."""
    if hf_ok:
        return None
    parts = []
    for slug in groups:
        g = GROUPS[slug]
        if g.needs_hf:
            parts.append(f"the {slug} group")
        if g.torch_rows and not torch_ok:
            parts.append(g.torch_rows)
        if g.hf_rows:
            parts.append(g.hf_rows)
    if not parts:
        return None
    missing = "torch and transformers are" if not torch_ok else "transformers is"
    if not torch_ok and _try_import("transformers") is not None:
        missing = "torch is"
    return (f"skipped ({missing} not installed): {'; '.join(parts)}. "
            f"To run them: {HF_INSTALL}")


# ---------------------------------------------------------------------------
# Targets, with a one-line reason for each miss
# ---------------------------------------------------------------------------

@dataclass
class Target:
    label: str
    slug: str
    op: str                     # "<=", ">=", or "info"
    goal: float | None
    where: dict = field(default_factory=dict)
    hint: Callable | str = ""   # why a miss happens (factual; NOTES.md / README)
    value: Callable | None = None   # computes the value from the results instead


def _f(x, spec=".2f"):
    return "?" if x is None else format(x, spec)


def _floor2(res, geo, regime):
    return res.ratio(f"threads.floor.{regime}", geometry=geo, threads=2)


def _static_targets(res):
    thr = ferrox_kv.gil_release_threshold()
    kib = lambda b: f"{b // 1024} KiB" if b >= 1024 else f"{b} B"  # noqa: E731

    def row_bytes(geo):
        h, d, _ = GEOMETRIES[geo]
        return 2 * h * d * 4

    def push_gil(geo, cost="two threads take turns", note="GIL release threshold"):
        h, d, _ = GEOMETRIES[geo]
        return (f"one {h}x{d} position is {kib(row_bytes(geo))} (K+V), below the {kib(thr)} "
                f"GIL-release threshold, so the GIL is held by design and {cost} "
                f"(benchmarks/NOTES.md, '{note}')")

    def floor_says(geo, regime, what):
        def hint(res):
            fl = _floor2(res, geo, regime)
            return (f"{what}; the C-copy floor itself scaled {_f(fl)}x on 2 threads in this "
                    "run (benchmarks/NOTES.md, 'Two threads when memory bandwidth is not "
                    "the limit')")
        return hint

    def push_layers_hint(geo):
        h, d, layers = GEOMETRIES[geo]
        return (f"each call copies {kib(layers * row_bytes(geo))} without the GIL, but the "
                "Python between calls holds it; 2-thread figures move by +-0.3 between runs "
                "on the 2-vCPU VM (README, Performance)")

    return [
        Target("push 8x128 vs floor", "push.with_capacity.vs_floor", "<=", 1.25,
               {"geometry": "llama8b"},
               "a push is one Python call per position: push + truncate measured 138 ns at "
               "2x64, 227 ns at 8x128 (benchmarks/NOTES.md, 'How push reaches the caller's "
               "data')"),
        Target("push 8x128 vs numpy slice-assign", "push.with_capacity.vs_numpy", "<=", 0.7,
               {"geometry": "llama8b"},
               "both are one Python call per position; at 8x128 the 8 KiB copy dominates "
               "both (benchmarks/NOTES.md, 'How push reaches the caller's data')"),
        Target("push 2x64 vs numpy slice-assign", "push.with_capacity.vs_numpy", "<=", 0.45,
               {"geometry": "small"},
               "at 2x64 the per-call cost is all interpreter (benchmarks/NOTES.md, 'How push "
               "reaches the caller's data')"),
        Target("pooled push vs unpooled (8x128)", "push.pooled.vs_unpooled", "<=", 1.15,
               {"geometry": "llama8b"},
               "best-of-few on a shared VM: this ratio has moved 0.7-1.4 between trials "
               "(benchmarks/NOTES.md, 'Pooled push vs unpooled in --quick runs')"),
        Target("extend(512) vs floor bandwidth (8x128)", "extend.with_capacity.vs_floor", ">=",
               0.8, {"geometry": "llama8b"},
               "extend is the floor's memcpy plus one call's checks; a gap this size is "
               "this VM's bandwidth noise (--quick is best of 6): rerun without --quick"),
        Target("2 threads extend(512), cached (8x128)", "threads.extend.cached", ">=", 1.7,
               {"geometry": "llama8b", "threads": 2},
               floor_says("llama8b", "cached", "extend releases the GIL for each 4 MiB call")),
        Target("2 threads extend(512), cached, wide rows (32x128)", "threads.extend.cached",
               ">=", 1.7, {"geometry": "wide", "threads": 2},
               floor_says("wide", "cached", "512 positions of 32x128 are 16 MiB per thread, "
                          "past the L2 cache into DRAM")),
        Target("2 threads push, cached, wide rows (32x128)", "threads.push.cached", ">=", 1.7,
               {"geometry": "wide", "threads": 2}, push_gil("wide")),
        Target("2 threads push_layers, cached, wide rows (32x128)",
               "threads.push_layers.cached", ">=", 1.7, {"geometry": "wide", "threads": 2},
               push_layers_hint("wide")),
        Target("2 threads push_layers, cached (8x128)", "threads.push_layers.cached", ">=",
               1.7, {"geometry": "llama8b", "threads": 2}, push_layers_hint("llama8b")),
        Target("2 threads push, cached, small rows (2x64)", "threads.push.cached", ">=", 0.95,
               {"geometry": "small", "threads": 2},
               push_gil("small", "each 5 ms hand-over costs the taking thread a cold cache",
                        "Small-row pushes from two threads")),
        Target("2 threads push, stream, small rows (2x64)", "threads.push.stream", ">=", 0.95,
               {"geometry": "small", "threads": 2},
               "GIL held by design (1 KiB per call); streaming, each 5 ms hand-over costs the "
               "taking thread a cold cache: 0.78-0.86 measured (benchmarks/NOTES.md, "
               "'Small-row pushes from two threads')"),
        Target("2 threads extend(512), stream (8x128)", "threads.extend.stream", ">=", 1.7,
               {"geometry": "llama8b", "threads": 2},
               floor_says("llama8b", "stream", "streaming: DRAM bandwidth is the limit")),
        Target("2 threads extend(512), stream, wide rows (32x128)", "threads.extend.stream",
               ">=", 1.7, {"geometry": "wide", "threads": 2},
               floor_says("wide", "stream", "streaming: DRAM bandwidth is the limit")),
        Target("2 threads push_layers, stream, wide rows (32x128)",
               "threads.push_layers.stream", ">=", 1.7, {"geometry": "wide", "threads": 2},
               floor_says("wide", "stream", "streaming: DRAM bandwidth is the limit")),
        Target("  hardware: 2 threads C copy floor, stream (8x128)", "threads.floor.stream",
               "info", None, {"geometry": "llama8b", "threads": 2}),
        Target("  hardware: 2 threads C copy floor, stream (32x128)", "threads.floor.stream",
               "info", None, {"geometry": "wide", "threads": 2}),
        Target("  hardware: 2 threads C copy floor, cached (32x128)", "threads.floor.cached",
               "info", None, {"geometry": "wide", "threads": 2}),
        Target("blocks held by a parent + 8 forks vs the parent alone",
               "sharing.fork_blocks", "<=", 1.3, {},
               "each fork shares the full blocks and reserves its own plan beyond them"),
        Target("blocks in use, 16 requests sharing a 1024-token prefix vs unshared",
               "sharing.prefix_blocks", "<=", 0.15, {},
               "the shared prefix is held once; each request reserves its own 64 positions"),
        Target("with_pool_many on a full prefix hit vs extend of those rows",
               "sharing.hit_vs_extend", "<=", 0.05, {},
               "a hit moves block ids under the pool lock; extend copies every row"),
        Target("prefix bookkeeping (lookup + publish) at a 0% hit rate vs extend",
               "sharing.bookkeeping", "<=", 0.02, {},
               "hashing the tokens and indexing each block under the pool lock"),
        Target("prefill of chat turns 2-4 with prefix reuse vs without",
               "sharing.chat_prefill", "<=", 0.3, {},
               "the reused history is not computed; the rest runs through the ferrox "
               "kernel's causal path instead of SDPA's matrix products"),
    ]


def _dynamic_targets(res):
    """Targets whose rows depend on the run (thread/floor pairs, contexts)."""
    out = []
    for geo, label in [("llama8b", "8x128"), ("wide", "32x128")]:
        for regime in ["cached", "stream"]:
            fx = res.ratio(f"threads.extend.{regime}", geometry=geo, threads=2)
            hw = _floor2(res, geo, regime)
            if fx is not None and hw:
                out.append(Target(f"  extend 2-thread scaling / floor's, {regime} ({label})",
                                  "", "info", None, value=lambda res, v=fx / hw: v))
    # decode: DynamicCache per token vs ferrox (cache work only), longest context
    dc = [r for r in res.rows if r["slug"] == "decode.dynamic_cache"]
    if dc:
        top = max(dc, key=lambda r: r["context"])
        ctx = top["context"]
        out.append(Target(
            f"DynamicCache / ferrox per token @ {ctx} ctx", "decode.dynamic_cache",
            ">=" if ctx >= 2048 else "info", 100.0 if ctx >= 2048 else None,
            {"context": ctx, "geometry": top["geometry"]},
            "DynamicCache's cost is torch.cat of the history (memory bandwidth), ferrox's "
            "is Python calls per layer: the ratio follows this machine's bandwidth/interpreter"
            " balance"))
    # attention, per context
    thr = ferrox_kv.attend_gil_release_threshold()
    for r in res.rows:
        if r["group"] != "attention" or "context" not in r or r["slug"].startswith(
                "attention.chunk"):
            continue
        T = r["context"]
        if r["slug"] == "attention.attend.vs_sdpa":
            def hint(res, T=T):
                a = res.find("attention.attend.vs_floor", context=T)
                f = res.find("attention.floor", context=T)
                return (f"attend read K/V at {_f(a and a['read_gbs'], '.1f')} GB/s against the "
                        f"read floor's {_f(f and f['read_gbs'], '.1f')} GB/s: the score/exp/"
                        "rescale arithmetic per chunk (_attn.h) is the rest")
            out.append(Target(f"attend vs SDPA (contiguous) @ {T}", r["slug"],
                              "<=" if T >= 512 else "info", 1.0 if T >= 512 else None,
                              {"context": T}, hint))
        elif r["slug"] == "attention.attend.vs_gather":
            out.append(Target(f"attend speed-up over gather + SDPA @ {T}", r["slug"],
                              ">=" if T >= 2048 else "info", 3.0 if T >= 2048 else None,
                              {"context": T},
                              "gathering copies the whole context each call; SDPA then "
                              "reads the copy: compare attend vs SDPA above"))
        elif r["slug"] == "attention.attend.vs_floor":
            out.append(Target(f"attend vs read floor (stretch) @ {T}", r["slug"],
                              "<=" if T >= 2048 else "info", 1.3 if T >= 2048 else None,
                              {"context": T},
                              "stretch goal; the floor only reads, attend also scores, "
                              "exponentiates and rescales each chunk (a first block-major "
                              "kernel measured 2.4-2.8x)"))
        elif r["slug"] == "attention.threads2.vs_floor":
            def hint2(res, T=T):
                a = res.ratio("attention.threads2.attend_many", context=T)
                f = res.ratio("attention.threads2.floor", context=T)
                held = T * 8 * 128 * 2 * 4 < thr
                return (f"attend_many scaled {_f(a)}x on 2 threads, the read floor {_f(f)}x; "
                        + (f"calls under {thr} context bytes hold the GIL by design "
                           "(benchmarks/attend_gil.py)" if held else
                           "the GIL is released for these calls: the floor only loads, while "
                           "attend also runs about 4 multiply-adds per float it reads"))
            out.append(Target(f"attend_many 2-thread scaling / floor's @ {T}", r["slug"],
                              ">=", 0.9, {"context": T}, hint2))
    # hf: FerroxCache (pooled, ferrox attention) / DynamicCache per token
    goals = {128: 1.0, 2048: 0.6, 8192: 0.45}
    for r in res.rows:
        if r["slug"] == "hf.ferrox.vs_dynamic":
            T = r["context"]
            goal = goals.get(T)

            def hint3(res, T=T):
                if T <= 512:
                    w = (res.find("hf.ferrox.vs_dynamic", context=T) or {}).get("weights_read_mb")
                    return (f"at {T} context the model's own work (reading {_f(w, '.0f')} MB of "
                            "weights per token) dominates, the same for every cache; the ferrox "
                            "path adds per-layer conversions (q to float32 numpy, the output "
                            "back to torch); --quick times 8 tokens")
                a = res.ratio("attention.attend.vs_sdpa", context=T)
                return ("attention alone ran at " + (f"{a:.2f}x SDPA" if a is not None else
                                                     "? (run the attention group)")
                        + f" at {T} in this run; the rest is the model, the same for both")
            out.append(Target(f"FerroxCache / DynamicCache per token @ {T}", r["slug"],
                              "<=" if goal else "info", goal, {"context": T}, hint3))
        elif r["slug"] == "hf.static.vs_dynamic":
            out.append(Target(f"  StaticCache / DynamicCache per token @ {r['context']}",
                              r["slug"], "info", None, {"context": r["context"]}))
    return out


def evaluate_targets(res):
    """[(target, value, verdict, hint)] for every target this run has a figure for."""
    out = []
    for t in _static_targets(res) + _dynamic_targets(res):
        value = t.value(res) if t.value else res.ratio(t.slug, **t.where)
        if value is None:
            continue
        if t.op == "info":
            verdict = ""
        else:
            ok = value <= t.goal if t.op == "<=" else value >= t.goal
            verdict = "met" if ok else "MISSED"
        hint = ""
        if verdict == "MISSED" and t.hint:
            hint = t.hint(res) if callable(t.hint) else t.hint
        out.append((t, value, verdict, hint))
    return out


def targets_text(evaluated):
    if not evaluated:
        return "", []
    label_w = max(len(t.label) for t, *_ in evaluated)
    lines = ["\n== targets (this run)",
             f"{'target':<{label_w}}  {'value':>7}  {'goal':<7}  verdict"]
    doc = []
    for t, value, verdict, hint in evaluated:
        goal_s = "" if t.goal is None else f"{t.op} {t.goal:g}"
        lines.append(f"{t.label:<{label_w}}  {fmt_num(value):>7}  {goal_s:<7}  {verdict}")
        if hint:
            lines.append(f"{'':<4}why: {hint}")
        doc.append({"target": t.label, "slug": t.slug, "where": t.where, "value": value,
                    "goal": goal_s, "met": verdict == "met", "hint": hint})
    return "\n".join(lines), doc


# ---------------------------------------------------------------------------
# The plot (matplotlib, optional)
# ---------------------------------------------------------------------------

def have_matplotlib():
    return _try_import("matplotlib") is not None


def plot(res, path):
    """Two panels: (a) per-token decode cost against context, log-log; (b) push
    and extend time against their floors."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.2))

    # (a) the most end-to-end comparison this run has: the hf group (a real
    # model's decode step, everything included), else the attention group
    series, title = [], ""
    hf = [("hf.ferrox.vs_dynamic", "FerroxCache pooled, ferrox attention (in place)", "C0"),
          ("hf.dynamic", "DynamicCache + SDPA (transformers default)", "C1"),
          ("hf.static.vs_dynamic", "StaticCache + SDPA", "C2")]
    attn = [("attention.attend.vs_floor", "ferrox attend, pooled, in place", "C0"),
            ("attention.sdpa", "SDPA over contiguous tensors (what DynamicCache hands it)",
             "C1"),
            ("attention.gather_sdpa", "gather .k/.v + SDPA", "C3"),
            ("attention.floor", "read floor (K+V read once, C)", "0.5")]
    for group, choice, t in [("hf", hf, "(a) decode step of a 2-layer Llama (32 q / 8 KV heads "
                              "x 128), 1 torch thread"),
                             ("attention", attn, "(a) one layer's decode attention (32 q / 8 KV "
                              "heads x 128), 1 thread")]:
        for slug, label, color in choice:
            pts = sorted((r["context"], r["value"], r["unit"]) for r in res.rows
                         if r["slug"] == slug)
            if pts:
                series.append((label, color, pts))
        if series:
            title = t
            break
    if series:
        ys_all, xs_all = [], set()
        for label, color, pts in series:
            xs = [p[0] for p in pts]
            scale = _TIME_IN[pts[0][2].split("/")[0]] * 1e3          # to ms
            ys = [p[1] * scale for p in pts]
            ax1.plot(xs, ys, "o-", color=color, label=label)
            ys_all += ys
            xs_all.update(xs)
        ax1.set_xscale("log")
        ax1.set_yscale("log")
        # ticks a person can read: the contexts measured, and 1-2-5 times
        ax1.set_xticks(sorted(xs_all))
        ax1.set_xticklabels([str(x) for x in sorted(xs_all)])
        ax1.xaxis.set_minor_formatter(NullFormatter())
        lo, hi = min(ys_all), max(ys_all)
        ticks = [m * 10.0 ** e for e in range(math.floor(math.log10(lo)) - 1,
                                              math.ceil(math.log10(hi)) + 1) for m in (1, 2, 5)]
        ticks = [t for t in ticks if lo / 1.3 <= t <= hi * 1.3] or [lo, hi]
        ax1.set_ylim(min(lo, ticks[0]) / 1.15, max(hi, ticks[-1]) * 1.15)
        ax1.set_yticks(ticks)
        ax1.set_yticklabels([fmt_num(t) for t in ticks])
        ax1.yaxis.set_minor_formatter(NullFormatter())
        ax1.set_xlabel("context (positions already in the cache, log scale)")
        ax1.set_ylabel("time per token (ms, log scale)")
        ax1.set_title(title, fontsize=10)
        ax1.legend(fontsize=8)
        ax1.grid(True, which="major", alpha=0.3)
    else:
        ax1.text(0.5, 0.5, "no per-token figures in this run\n(run the hf or attention group)",
                 ha="center", va="center", transform=ax1.transAxes)
        ax1.set_title("(a) per-token decode cost against context", fontsize=10)
        ax1.set_axis_off()

    # (b) push and extend against their floors, as time / floor's time
    bars = []
    for geo in GEOMETRIES:
        floor = res.find("push.floor", geometry=geo)
        for slug, label in [("push.with_capacity.vs_floor", "push, with_capacity"),
                            ("push.pooled.vs_unpooled", "push, with_pool (pool in use)")]:
            r = res.find(slug, geometry=geo)
            if r is not None and floor is not None:
                bars.append((geo, label, r["value"] / floor["value"]))
        for slug, label in [("extend.with_capacity.vs_floor", "extend(512), with_capacity"),
                            ("extend.pooled.vs_floor", "extend(512), with_pool")]:
            r = res.find(slug, geometry=geo)
            if r is not None and r["ratio"]:
                bars.append((geo, label, 1.0 / r["ratio"]))   # bandwidth ratio -> time ratio
    if bars:
        geos = [g for g in GEOMETRIES if any(b[0] == g for b in bars)]
        labels = list(dict.fromkeys(b[1] for b in bars))
        width = 0.8 / len(labels)
        for j, label in enumerate(labels):
            xs, ys = [], []
            for i, geo in enumerate(geos):
                for b in bars:
                    if b[0] == geo and b[1] == label:
                        xs.append(i + (j - (len(labels) - 1) / 2) * width)
                        ys.append(b[2])
            ax2.bar(xs, ys, width, label=label, color=f"C{j}")
        ax2.axhline(1.0, color="k", lw=1, ls="--")
        ax2.axhline(1.25, color="C3", lw=1, ls=":", label="targets: push <= 1.25, "
                    "extend >= 0.8 of floor bandwidth")
        ax2.set_ylim(0, max(b[2] for b in bars + [(0, 0, 1.25)]) * 1.7)
        ax2.set_xticks(range(len(geos)))
        ax2.set_xticklabels([f"{g}\n{GEOMETRIES[g][0]}x{GEOMETRIES[g][1]}" for g in geos])
        ax2.set_ylabel("time / floor's time (1 = hardware limit; lower is better)")
        ax2.set_title("(b) push and extend against their floor (C memcpy, fresh memory)",
                      fontsize=10)
        ax2.legend(fontsize=8, loc="upper left")
        ax2.grid(True, axis="y", alpha=0.3)
    else:
        ax2.text(0.5, 0.5, "no push/extend figures in this run\n(run the push and extend "
                 "groups)", ha="center", va="center", transform=ax2.transAxes)
        ax2.set_title("(b) push and extend against their floor", fontsize=10)
        ax2.set_axis_off()
    fig.suptitle(f"ferrox_kv {ferrox_kv.__version__} bench, {os.cpu_count()} CPUs, "
                 f"{platform.machine()}; ratios from one run", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------

def _int_list(text):
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}")
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"contexts must be positive integers: {text!r}")
    return vals


def _group_list(text):
    vals = [x.strip() for x in text.split(",") if x.strip()]
    bad = [v for v in vals if v not in GROUPS]
    if bad or not vals:
        raise argparse.ArgumentTypeError(
            f"unknown group(s) {', '.join(bad) or '(none)'}; choose from {', '.join(GROUPS)}")
    return vals


def add_arguments(ap):
    """The bench's options (shared by ``ferrox-kv bench`` and
    ``python -m ferrox_kv.bench``)."""
    ap.add_argument("--quick", action="store_true", help="a smoke run, about a minute")
    ap.add_argument("--json", metavar="FILE", help="write every figure here as JSON")
    ap.add_argument("--plot", metavar="FILE.png",
                    help=f"draw per-token cost against context and push/extend against their "
                    f"floors (needs matplotlib: {PLOT_INSTALL})")
    ap.add_argument("--threads", type=int, default=max(2, os.cpu_count() or 2),
                    help="most threads in the threads group (default: CPU count, at least 2)")
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), action="append",
                    help="run only this geometry (repeatable); default: all three")
    ap.add_argument("--groups", type=_group_list, default=list(GROUPS),
                    help=f"comma-separated groups to run (default: all: {','.join(GROUPS)})")
    ap.add_argument("--contexts", type=_int_list, default=None, metavar="N,N,...",
                    help="contexts (positions) for the decode, attention and hf groups "
                    "(default: per group; --quick uses short ones)")
    return ap


def run(args):
    """Run the bench for parsed ``args``; return the exit status."""
    if args.threads < 1:
        print("--threads must be >= 1", file=sys.stderr)
        return 2
    geos = args.geometry or list(GEOMETRIES)
    groups = [g for g in GROUPS if g in args.groups]     # registry order
    q = args.quick
    needs_torch = any(GROUPS[g].needs_hf or GROUPS[g].torch_rows or GROUPS[g].hf_rows
                      for g in groups)
    torch_ok = have_torch() if needs_torch else False
    hf_ok = have_hf() if needs_torch else False
    skipped = skipped_line(groups, torch_ok, hf_ok) if needs_torch else None
    plot_path = args.plot
    plot_note = None
    if plot_path and not have_matplotlib():
        plot_note = f"--plot: not drawn, matplotlib is not installed. To draw it: {PLOT_INSTALL}"
        plot_path = None
        print(plot_note, flush=True)

    res = Results()
    t_start = time.perf_counter()
    _log(f"ferrox_kv {ferrox_kv.__version__}, numpy {np.__version__}, "
         f"{os.cpu_count()} CPUs, groups {','.join(groups)}, geometries {geos}"
         f"{' (quick)' if q else ''}")
    r = Run(res=res, args=args, geos=geos, quick=q, reps=3 if q else 9, torch_ok=torch_ok,
            hf_ok=hf_ok, contexts=args.contexts)
    for slug in groups:
        g = GROUPS[slug]
        if g.needs_hf and not hf_ok:
            continue
        g.run(r)

    print(f"ferrox_kv {ferrox_kv.__version__} bench: {os.cpu_count()} CPUs, "
          f"attention SIMD path {ferrox_kv.simd_path()}{', quick run' if q else ''}")
    print(LEGEND)
    if skipped:
        print(skipped)
    for slug in groups:
        text = res.table(slug, GROUPS[slug].title)
        if text:
            print(text)
    target_text, targets = targets_text(evaluate_targets(res))
    print(target_text)
    elapsed = time.perf_counter() - t_start
    print(f"\n(ran {elapsed:.0f} s; ratios are from this one run; 'of' names the denominator)")
    if plot_path:
        plot(res, plot_path)
        print(f"plot: {plot_path}")
    if args.json:
        doc = {
            "ferrox_kv": ferrox_kv.__version__,
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                        "python": platform.python_version(), "numpy": np.__version__,
                        "processor": platform.processor() or platform.machine(),
                        "simd_path": ferrox_kv.simd_path()},
            "args": {k: v for k, v in vars(args).items() if k != "func"},
            "gil_release_bytes": ferrox_kv.gil_release_threshold(),
            "attend_gil_release_bytes": ferrox_kv.attend_gil_release_threshold(),
            "elapsed_s": elapsed,
            "skipped": skipped,
            "results": res.rows,
            "targets": targets,
        }
        if torch_ok:
            doc["machine"]["torch"] = sys.modules["torch"].__version__
        if hf_ok:
            doc["machine"]["transformers"] = sys.modules["transformers"].__version__
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        _log(f"wrote {args.json}")
    return 0


def main(argv=None, prog="python -m ferrox_kv.bench"):
    """``python -m ferrox_kv.bench``: the same as ``ferrox-kv bench``."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
