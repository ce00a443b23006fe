"""Group push: one position per call, time per position, against a C memcpy
floor, numpy slice-assign and the pooled/unpooled variants."""
import numpy as np

from ferrox_kv import KvBlockPool, KvCache, _core
from ferrox_kv.bench.common import BLOCK_SIZE, GEOMETRIES, Group, log
from ferrox_kv.bench.harness import best_of, rows
from ferrox_kv.bench.targets import Target


def bench_push(res, geo, n_rows, reps):
    h, d, _ = GEOMETRIES[geo]
    w = h * d
    ks, vs = rows(n_rows, w, 1), rows(n_rows, w, 2)
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


def run(r):
    for geo in r.geos:
        log(f"push {geo}")
        bench_push(r.res, geo, 1024 if r.quick else 4096, r.reps)


TARGETS = [
    Target("push 8x128 vs floor", "push.with_capacity.vs_floor", "<=", 1.25,
           {"geometry": "llama8b"}),
    Target("push 8x128 vs numpy slice-assign", "push.with_capacity.vs_numpy", "<=", 0.7,
           {"geometry": "llama8b"}),
    Target("push 2x64 vs numpy slice-assign", "push.with_capacity.vs_numpy", "<=", 0.45,
           {"geometry": "small"}),
    Target("pooled push vs unpooled (8x128)", "push.pooled.vs_unpooled", "<=", 1.15,
           {"geometry": "llama8b"}),
]

GROUP = Group("push", "one position per call, time per position", run,
              targets=lambda res: TARGETS)
