"""Two-thread scaling of extend when each thread rewrites the same T positions
of its own cache (a cache-resident working set), run for 0.5 s per figure:
how much ferrox's GIL release gives when memory bandwidth is not the limit,
next to the same bytes copied by a C loop with no GIL at all (the floor).

    python benchmarks/extend_scaling.py
"""
import numpy as np

import ferrox_kv as fk
from ferrox_kv import _core
from _threads import rounds_per_second


def run(nt, h, d, t, pooled, secs=0.5):
    """Positions per second of ``nt`` threads; ``pooled`` is True, False or
    "floor" (each thread memcpys its K and V into its own two arrays)."""
    w = h * d
    ks = np.random.default_rng(0).standard_normal((t, w), dtype=np.float32)
    srcs = [ks.copy() for _ in range(nt)]
    if pooled == "floor":
        dsts = [(np.zeros_like(ks), np.zeros_like(ks)) for _ in range(nt)]

        def copy_round(i):
            _core._copy_floor(dsts[i][0], srcs[i], w * t)
            _core._copy_floor(dsts[i][1], srcs[i], w * t)

        return rounds_per_second(nt, copy_round, secs) * t
    pool = fk.KvBlockPool(16, nt * (t // 16 + 1), h, d)
    cs = [fk.KvCache.with_pool(h, d, pool, t) if pooled else fk.KvCache.with_capacity(h, d, t)
          for _ in range(nt)]

    def one_round(i):
        cs[i].clear()
        cs[i].extend(srcs[i], srcs[i])

    return rounds_per_second(nt, one_round, secs) * t


def main():
    for h, d, t in [(2, 64, 512), (8, 128, 512), (32, 128, 512)]:
        for pooled in [False, True, "floor"]:
            r1 = max(run(1, h, d, t, pooled) for _ in range(3))
            r2 = max(run(2, h, d, t, pooled) for _ in range(3))
            kind = {False: "contiguous", True: "pooled", "floor": "C-copy floor"}[pooled]
            print(f"{h}x{d} extend({t}) {kind}: "
                  f"2 threads / 1 thread = {r2 / r1:.2f} ({r1 / 1e6:.1f} Mpos/s on one)")


if __name__ == "__main__":
    main()
