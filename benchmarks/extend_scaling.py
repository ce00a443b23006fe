"""Two-thread scaling of extend when each thread rewrites the same T positions
of its own cache (a cache-resident working set), run for 0.5 s per figure:
how much ferrox's GIL release gives when memory bandwidth is not the limit.

    python benchmarks/extend_scaling.py
"""
import numpy as np

import ferrox_kv as fk
from _threads import rounds_per_second


def run(nt, h, d, t, pooled, secs=0.5):
    w = h * d
    ks = np.random.default_rng(0).standard_normal((t, w), dtype=np.float32)
    pool = fk.KvBlockPool(16, nt * (t // 16 + 1), h, d)
    cs = [fk.KvCache.with_pool(h, d, pool, t) if pooled else fk.KvCache.with_capacity(h, d, t)
          for _ in range(nt)]
    srcs = [ks.copy() for _ in range(nt)]

    def one_round(i):
        cs[i].clear()
        cs[i].extend(srcs[i], srcs[i])

    return rounds_per_second(nt, one_round, secs) * t


def main():
    for h, d, t in [(2, 64, 512), (8, 128, 512), (32, 128, 512)]:
        for pooled in [False, True]:
            r1 = max(run(1, h, d, t, pooled) for _ in range(3))
            r2 = max(run(2, h, d, t, pooled) for _ in range(3))
            print(f"{h}x{d} extend({t}) {'pooled' if pooled else 'contiguous'}: "
                  f"2 threads / 1 thread = {r2 / r1:.2f} ({r1 / 1e6:.1f} Mpos/s on one)")


if __name__ == "__main__":
    main()
