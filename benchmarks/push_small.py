"""The small-row push hot path: ns per push of one 2 x 64 position into a
with_capacity cache, best of 20 runs of 4096 pushes. Run it against two
builds (PYTHONPATH) to compare them.

    python benchmarks/push_small.py
"""
import time

import numpy as np

from ferrox_kv import KvCache

rows = [np.random.default_rng(i).random(128, dtype=np.float32) for i in range(4096)]
best = float("inf")
for _ in range(20):
    c = KvCache.with_capacity(2, 64, 4096)
    push = c.push
    t0 = time.perf_counter()
    for r in rows:
        push(r, r)
    best = min(best, time.perf_counter() - t0)
print(f"{best / len(rows) * 1e9:.1f} ns/push")
