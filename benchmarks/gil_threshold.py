"""Where does releasing the GIL around a copy start to pay?

For copy sizes S (K and V bytes per call) from 4 KB to 1 MB, N threads each push
rows of S bytes into their own warm cache (working set ~1 MiB per thread, so the
copies stay in cache and the GIL is what is measured), once with the GIL held
around every copy and once with it released. Prints aggregate throughput
relative to one thread holding the GIL. Ratios from one run.

    python benchmarks/gil_threshold.py [--threads N] [--seconds S]
"""
import argparse

import numpy as np

import ferrox_kv
from ferrox_kv import KvCache
from _threads import rounds_per_second


def run(nthreads, row_bytes, work_bytes, min_seconds):
    d = row_bytes // 8                    # K and V rows of d float32 each
    n = max(8, work_bytes // row_bytes)
    src = np.random.default_rng(0).standard_normal((n, d), dtype=np.float32)
    steps = [(src[i], src[i]) for i in range(n)]
    caches = [KvCache.with_capacity(1, d, n) for _ in range(nthreads)]
    for c in caches:
        c.extend(src, src)

    def one_round(i):
        c = caches[i]
        c.clear()
        for k, v in steps:
            c.push(k, v)

    return rounds_per_second(nthreads, one_round, min_seconds) * n * row_bytes / 1e9  # GB/s


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=0.6)
    ap.add_argument("--work-kib", type=int, default=1024)
    args = ap.parse_args()
    old = ferrox_kv.gil_release_threshold()
    print(f"{'bytes/call':>10} {'hold 1t':>8} {'rel 1t':>8} {'hold Nt':>8} {'rel Nt':>8}"
          f"   (GB/s; N={args.threads})   rel/hold at N")
    try:
        for kb in [4, 8, 16, 32, 64, 128, 256, 1024]:
            row = kb * 1024
            out = {}
            for mode, thr in [("hold", 1 << 40), ("rel", 0)]:
                ferrox_kv.set_gil_release_threshold(thr)
                for t in (1, args.threads):
                    out[mode, t] = max(run(t, row, args.work_kib * 1024, args.seconds)
                                       for _ in range(2))
            n = args.threads
            print(f"{kb:>8}KB {out['hold', 1]:>8.2f} {out['rel', 1]:>8.2f} "
                  f"{out['hold', n]:>8.2f} {out['rel', n]:>8.2f}   "
                  f"x{out['hold', n] / out['hold', 1]:.2f} hold, "
                  f"x{out['rel', n] / out['hold', 1]:.2f} release   "
                  f"{out['rel', n] / out['hold', n]:.2f}")
    finally:
        ferrox_kv.set_gil_release_threshold(old)


if __name__ == "__main__":
    main()
