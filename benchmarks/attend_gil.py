"""Where does releasing the GIL around attention start to pay?

For decode contexts T from 16 to 1024 positions (8 KV heads x 128: T x 8 KiB
of K and V read per call), N threads (default 2) each call
``attend_many([cache], q)`` on their own pooled cache (one shared pool;
q: 32 query heads x 128), once with the GIL released for every call
(``set_attend_gil_release_threshold(0)``) and once with it held
(``set_attend_gil_release_threshold(2**62)``). Prints calls per second and
the ratios: released over held with N threads (above 1: releasing pays),
and released over held with one thread (the cost of releasing when nobody
else wants the GIL). Each figure is the best of --reps runs of --seconds,
the two settings and the thread counts interleaved. Ratios from one run.

    python benchmarks/attend_gil.py [--threads 2] [--seconds 0.3] [--reps 3]
"""
import argparse

import numpy as np

import ferrox_kv
from ferrox_kv import KvBlockPool, KvCache
from _threads import rounds_per_second

H, KVH, D = 32, 8, 128
CALLS_PER_ROUND = 16       # calls between two looks at the clock


def make(nthreads, T):
    rng = np.random.default_rng(T)
    pool = KvBlockPool(16, nthreads * (-(-T // 16)), KVH, D)
    caches = [KvCache.with_pool(KVH, D, pool, T) for _ in range(nthreads)]
    for c in caches:
        c.extend(rng.standard_normal((T, KVH, D), dtype=np.float32),
                 rng.standard_normal((T, KVH, D), dtype=np.float32))
    # every thread its own q and out: shared objects would bounce refcounts
    qs = [rng.standard_normal((1, 1, H, D), dtype=np.float32) for _ in range(nthreads)]
    outs = [np.empty((1, 1, H, D), np.float32) for _ in range(nthreads)]
    lists = [[c] for c in caches]

    def one_round(i):
        cl, q, out = lists[i], qs[i], outs[i]
        for _ in range(CALLS_PER_ROUND):
            ferrox_kv.attend_many(cl, q, out=out)

    return caches, one_round


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=0.3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--contexts", default="16,32,64,128,256,512,1024")
    args = ap.parse_args()
    n = args.threads
    contexts = [int(x) for x in args.contexts.split(",")]
    old = ferrox_kv.attend_gil_release_threshold()
    settings = {"hold": 2 ** 62, "release": 0}
    print(f"attend_many, decode (q {H}x{D}, {KVH} KV heads x {D}), {n} threads each on its own "
          f"pooled cache; best of {args.reps} x {args.seconds} s; default threshold {old} "
          "context bytes")
    print(f"{'context':>7} {'KiB/call':>8} | {'hold 1t':>8} {'rel 1t':>8} {'hold Nt':>8} "
          f"{'rel Nt':>8} (thousand calls/s) | {'rel/hold Nt':>11} {'rel/hold 1t':>11}")
    try:
        for T in contexts:
            caches, one_round = make(n, T)
            best = {}
            for _ in range(args.reps):
                for mode, thr in settings.items():
                    ferrox_kv.set_attend_gil_release_threshold(thr)
                    for t in (1, n):
                        rate = rounds_per_second(t, one_round, args.seconds) * CALLS_PER_ROUND
                        best[mode, t] = max(best.get((mode, t), 0.0), rate)
            for c in caches:
                c.close()
            k = {key: v / 1e3 for key, v in best.items()}
            print(f"{T:>7} {T * KVH * D * 8 // 1024:>8} | {k['hold', 1]:>8.1f} "
                  f"{k['release', 1]:>8.1f} {k['hold', n]:>8.1f} {k['release', n]:>8.1f}"
                  f"{'':>19} | "
                  f"{best['release', n] / best['hold', n]:>11.2f} "
                  f"{best['release', 1] / best['hold', 1]:>11.2f}")
    finally:
        ferrox_kv.set_attend_gil_release_threshold(old)


if __name__ == "__main__":
    main()
