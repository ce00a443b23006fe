"""Group extend: a prefill of 512 positions in one call, as bandwidth against
a C memcpy floor into fresh memory."""
import numpy as np

from ferrox_kv import KvBlockPool, KvCache, _core
from ferrox_kv.bench.common import BLOCK_SIZE, GEOMETRIES, Group, log
from ferrox_kv.bench.harness import best_of, rows
from ferrox_kv.bench.targets import Target


def bench_extend(res, geo, reps, t=512):
    h, d, _ = GEOMETRIES[geo]
    w = h * d
    ks, vs = rows(t, w, 3), rows(t, w, 4)
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


def run(r):
    for geo in r.geos:
        log(f"extend {geo}")
        bench_extend(r.res, geo, r.reps * (2 if r.quick else 3))


TARGETS = [
    Target("extend(512) vs floor bandwidth (8x128)", "extend.with_capacity.vs_floor", ">=",
           0.8, {"geometry": "llama8b"}),
]

GROUP = Group("extend", "prefill of 512 positions in one call, bandwidth", run,
              targets=lambda res: TARGETS)
