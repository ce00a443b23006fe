"""Two threads pushing small rows (2x64, GIL held: too small to release it),
each into its own pooled cache, against one thread, under two settings of
`sys.setswitchinterval`: how much the GIL hand-over every few milliseconds
costs when each thread works through a cached (512 positions) or a streaming
(8192 positions) working set.

    python benchmarks/switch_interval.py [--reps 10] [--seconds 0.3]
"""
import argparse
import statistics
import sys

import numpy as np

import ferrox_kv as fk
from _threads import rounds_per_second


def ratios(n, reps, seconds, h=2, d=64):
    w = h * d
    pool = fk.KvBlockPool(16, 2 * (n // 16 + 1), h, d)
    caches = [fk.KvCache.with_pool(h, d, pool, n) for _ in range(2)]
    src = [np.random.default_rng(i).standard_normal((n, w), dtype=np.float32) for i in range(2)]
    steps = [[(k[j], k[j]) for j in range(n)] for k in src]

    def one_round(i):
        c = caches[i]
        c.clear()
        push = c.push
        for k, v in steps[i]:
            push(k, v)

    out = []
    for _ in range(reps):     # 1 and 2 threads interleaved
        r1 = rounds_per_second(1, one_round, seconds)
        r2 = rounds_per_second(2, one_round, seconds)
        out.append(r2 / r1)
    for c in caches:
        c.close()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--seconds", type=float, default=0.3)
    args = ap.parse_args()
    for interval in (0.005, 0.05):
        sys.setswitchinterval(interval)
        for n in (512, 8192):
            r = ratios(n, args.reps, args.seconds)
            print(f"switch interval {interval * 1e3:.0f} ms, {n} positions: 2 threads / 1 "
                  f"thread median {statistics.median(r):.2f} "
                  f"(runs: {' '.join(f'{x:.2f}' for x in r)})")


if __name__ == "__main__":
    main()
