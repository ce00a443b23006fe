"""Group threads: aggregate throughput of N threads, each with its own caches
on one shared pool, in two regimes (a working set that stays in the CPU
caches, and one that streams through DRAM), beside a C copy floor that shows
how far the hardware itself scales."""
import numpy as np

import ferrox_kv
from ferrox_kv import KvBlockPool, KvCache, _core
from ferrox_kv.bench.common import BLOCK_SIZE, GEOMETRIES, Group, log
from ferrox_kv.bench.harness import loops_for, rows, scaling, thread_counts, usable_cpus
from ferrox_kv.bench.targets import Figure, Target


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
    counts = thread_counts(max_threads)
    chunk = 512
    n = max(chunk, rows_per_thread // chunk * chunk)
    pool = KvBlockPool(BLOCK_SIZE, max_threads * (-(-n // BLOCK_SIZE)), h, d)
    ks, vs = rows(n, w, 5), rows(n, w, 6)
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
    lsrc = [(rows(layers, w, 11), rows(layers, w, 12)) for _ in range(max_threads)]
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
    for k, (slug, name, fn, per, call_bytes) in enumerate(works):
        # repeat the work so that one thread runs >= target_s: short runs are noise
        loops = loops_for(fn, target_s)

        def looped(i, fn=fn, loops=loops):
            for _ in range(loops):
                fn(i)

        def progress(done, total, _name, t, k=k, slug=slug):
            log(f"threads {geo} [{regime}] {slug} ({k + 1}/{len(works)}): {t} thread"
                f"{'s' if t > 1 else ''}, run {done + 1}/{total}")

        best = scaling([(slug, looped)], counts, reps, progress=progress)
        base = None
        for t in counts:
            rate = t * per * loops / best[slug, t]
            if base is None:
                base = rate
            label = f"[{regime}] {name}, {t} thread{'s' if t > 1 else ''}"
            res.add(g, geo, f"threads.{slug}.{regime}", label, rate / 1e6, "Mpos/s", rate / base,
                    "1 thread", threads=t, regime=regime, bytes_per_call=call_bytes)
    for c in caches:
        c.close()
    for cs in lcaches:
        for c in cs:
            c.close()
    assert pool.free_blocks == pool.total_blocks
    assert lpool.free_blocks == lpool.total_blocks


def oversubscribed(threads, cpus=None):
    """The warning for more threads than this process's CPUs, else None."""
    cpus = usable_cpus() if cpus is None else cpus
    if threads <= cpus:
        return None
    return (f"warning: --threads {threads} exceeds the {cpus} CPU{'s' if cpus > 1 else ''} "
            f"this process can run on: counts above {cpus} measure time-slicing, not "
            f"scaling, and each such run takes about {threads}/{cpus} times as long as one "
            "on a machine with enough CPUs")


def run(r):
    q = r.quick
    warn = oversubscribed(r.args.threads)
    if warn:
        log(warn)
    for geo in r.geos:
        log(f"threads {geo} (1..{r.args.threads})")
        bench_threads(r.res, geo, r.args.threads, 2 if q else 5, 512,
                      target_s=0.02 if q else 0.15, regime="cached", layer_bytes=4 << 20)
        bench_threads(r.res, geo, r.args.threads, 2 if q else 5,
                      2048 if q else (8192 if geo != "wide" else 4096),
                      target_s=0.02 if q else 0.15, regime="stream")


def _floor2(geo, regime):
    """The C copy floor's own 2-thread scaling: the hardware's limit."""
    return Figure("C-copy floor's 2-thread scaling", f"threads.floor.{regime}",
                  {"geometry": geo, "threads": 2}, unit="x")


def _scaling(label, slug, geo, goal, bound=None):
    return Target(label, slug, ">=", goal, {"geometry": geo, "threads": 2},
                  bound_by=_floor2(geo, bound) if bound else None)


STATIC = [
    _scaling("2 threads extend(512), cached (8x128)", "threads.extend.cached", "llama8b", 1.7,
             "cached"),
    _scaling("2 threads extend(512), cached, wide rows (32x128)", "threads.extend.cached",
             "wide", 1.7, "cached"),
    _scaling("2 threads push, cached, wide rows (32x128)", "threads.push.cached", "wide", 1.7),
    _scaling("2 threads push_layers, cached, wide rows (32x128)", "threads.push_layers.cached",
             "wide", 1.7),
    _scaling("2 threads push_layers, cached (8x128)", "threads.push_layers.cached", "llama8b",
             1.7),
    _scaling("2 threads push, cached, small rows (2x64)", "threads.push.cached", "small", 0.95),
    _scaling("2 threads push, stream, small rows (2x64)", "threads.push.stream", "small", 0.95),
    _scaling("2 threads extend(512), stream (8x128)", "threads.extend.stream", "llama8b", 1.7,
             "stream"),
    _scaling("2 threads extend(512), stream, wide rows (32x128)", "threads.extend.stream",
             "wide", 1.7, "stream"),
    _scaling("2 threads push_layers, stream, wide rows (32x128)", "threads.push_layers.stream",
             "wide", 1.7, "stream"),
    Target("  hardware: 2 threads C copy floor, stream (8x128)", "threads.floor.stream",
           "info", None, {"geometry": "llama8b", "threads": 2}),
    Target("  hardware: 2 threads C copy floor, stream (32x128)", "threads.floor.stream",
           "info", None, {"geometry": "wide", "threads": 2}),
    Target("  hardware: 2 threads C copy floor, cached (32x128)", "threads.floor.cached",
           "info", None, {"geometry": "wide", "threads": 2}),
]


def targets(res):
    out = list(STATIC)
    for geo, label in [("llama8b", "8x128"), ("wide", "32x128")]:
        for regime in ["cached", "stream"]:
            fx = res.ratio(f"threads.extend.{regime}", geometry=geo, threads=2)
            hw = res.ratio(f"threads.floor.{regime}", geometry=geo, threads=2)
            if fx is not None and hw:
                out.append(Target(f"  extend 2-thread scaling / floor's, {regime} ({label})",
                                  "", "info", None, value=lambda res, v=fx / hw: v))
    return out


GROUP = Group("threads", "aggregate throughput of N threads, own caches, one shared pool", run,
              targets=targets)
