"""Decode attend of every storage dtype from memory, against its read floor
and float32 (benchmarks/NOTES.md, "bfloat16 scores on AMX, and the
from-memory walk"): pooled caches of 32 query heads over 8 x 128, each call
and each read floor timed alone after an eviction, best of 2 * reps + 1.
Usage: python benchmarks/mem_dtypes.py [context] [threads] [reps]"""
import sys

import numpy as np
import torch  # the bench imports torch: attend routes on its team

import ferrox_kv
from ferrox_kv import KvBlockPool, KvCache, _core
from ferrox_kv.bench.harness import best_from_memory

T = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
th = int(sys.argv[2]) if len(sys.argv) > 2 else 2
reps = int(sys.argv[3]) if len(sys.argv) > 3 else 6
torch.set_num_threads(th)
ferrox_kv.set_num_threads(th)
rng = np.random.default_rng(0)
K = rng.standard_normal((T, 8, 128), dtype=np.float32)
V = rng.standard_normal((T, 8, 128), dtype=np.float32)
q = rng.standard_normal((32, 128), dtype=np.float32)
calls = []
keep = []
for dt in ("float32", "float16", "bfloat16", "int8"):
    pool = KvBlockPool(16, -(-T // 16), 8, 128, dtype=dt)
    c = KvCache.with_pool(8, 128, pool, T)
    c.extend(K, V)
    keep.append((pool, c))
    calls.append((dt, lambda c=c: c.attend(q, threads=th)))
    calls.append((dt + ".floor", lambda c=c: _core._read_floor([c], 1, th)))
us = best_from_memory(calls, reps)
f32 = us["float32"]
for dt in ("float32", "float16", "bfloat16", "int8"):
    fl = us[dt + ".floor"]
    print(f"{dt:9s} attend {us[dt]:8.1f} us  floor {fl:8.1f}  /floor {us[dt] / fl:.3f}"
          f"  vs f32 {us[dt] / f32:.3f}")
