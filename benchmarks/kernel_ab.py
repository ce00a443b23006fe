"""Two builds of ferrox_kv's attention kernel, interleaved in one run: decode
``attend`` at 2048 and 8192 positions per storage dtype, and a causal chunk
(256 queries over 2048), llama8b heads (32 query, 8 KV x 128), pooled, block
16, one thread. Each round runs every row once in a subprocess per build,
the builds alternating; a row's figure is its best round; the ratio is B's
time over A's.

  python benchmarks/kernel_ab.py A_DIR B_DIR [--rounds 5] [--rows kernel|house]

``--rows house``: the rows a move of code must leave alone (issue 22), one
thread, the same llama8b heads: push (pooled, one position), extend (512
positions, pooled), decode ``attend`` float32 at 2048, ``FerroxCache.update``
of one token on a 2-layer config, and the hf bench model's decode per token
at 2048 (FerroxCache and the ferrox attention; needs torch and
transformers).

A_DIR and B_DIR are directories that ``import ferrox_kv`` finds a built
package in (an installed site-packages, or a checkout built in place).
"""
import argparse
import json
import os
import subprocess
import sys

ROW = r"""
import json, time, numpy as np, ferrox_kv
from ferrox_kv import KvBlockPool, KvCache
if hasattr(ferrox_kv, "set_num_threads"):
    ferrox_kv.set_num_threads(1)
rng = np.random.default_rng(7)
out = {}
def best(fn, n):
    fn()
    t = min(_time(fn, n) for _ in range(5))
    return t / n * 1e6
def _time(fn, n):
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return time.perf_counter() - t0
for T in (2048, 8192):
    K = rng.standard_normal((T, 8, 128), dtype=np.float32)
    V = rng.standard_normal((T, 8, 128), dtype=np.float32)
    q = rng.standard_normal((32, 128), dtype=np.float32)
    for dt in ferrox_kv.DTYPES:
        c = KvCache.with_pool(8, 128, KvBlockPool(16, T // 16, 8, 128, dtype=dt), T)
        c.extend(K, V)
        out[f"attend {dt} @ {T}"] = best(lambda: c.attend(q), 20 if T == 2048 else 6)
T = 2048
K = rng.standard_normal((T, 8, 128), dtype=np.float32)
c = KvCache.with_pool(8, 128, KvBlockPool(16, T // 16, 8, 128), T)
c.extend(K, K)
Q = rng.standard_normal((256, 32, 128), dtype=np.float32)
out["causal chunk 256 over 2048, float32"] = best(lambda: c.attend(Q), 2)
print(json.dumps(out))
"""

HOUSE = r"""
import json, time, numpy as np, torch, ferrox_kv
from ferrox_kv import KvBlockPool, KvCache
torch.set_num_threads(1)
if hasattr(ferrox_kv, "set_num_threads"):
    ferrox_kv.set_num_threads(1)
rng = np.random.default_rng(7)
out = {}
def best(fn, n, setup=None):
    ts = []
    for _ in range(6):
        if setup: setup()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        ts.append(time.perf_counter() - t0)
    return min(ts[1:]) / n * 1e6
pool = KvBlockPool(16, 4096, 8, 128)
row = rng.standard_normal((8, 128), dtype=np.float32)
rows = rng.standard_normal((512, 8, 128), dtype=np.float32)
box = []
def fresh():
    for c in box: c.release_to_pool()
    box[:] = [KvCache.with_pool(8, 128, pool, 4096)]
out["push, pooled, per push"] = best(lambda: box[0].push(row, row), 2000, fresh)
out["extend 512 rows, pooled"] = best(lambda: box[0].extend(rows, rows), 4, fresh)
fresh()
T = 2048
K = rng.standard_normal((T, 8, 128), dtype=np.float32)
c = KvCache.with_pool(8, 128, KvBlockPool(16, T // 16, 8, 128), T)
c.extend(K, K)
q = rng.standard_normal((32, 128), dtype=np.float32)
out["attend float32 @ 2048, decode"] = best(lambda: c.attend(q), 20)
import transformers
from ferrox_kv.hf import ATTENTION, FerroxCache
from ferrox_kv.bench.llama import LLAMA, best_decode, make_model
cfg = transformers.LlamaConfig(**LLAMA)
k1 = torch.randn(1, 8, 1, 128)
hold = []
def fresh_hf():
    hold[:] = [FerroxCache(cfg, max_seq_len=4096)]
def upd():
    cache = hold[0]
    for layer in range(2):
        cache.update(k1, k1, layer)
out["FerroxCache.update, per update"] = best(upd, 200, fresh_hf) / 2
cfg, model = make_model(T + 20)
kv = [(torch.randn(1, 8, T, 128), torch.randn(1, 8, T, 128)) for _ in range(2)]
model.set_attn_implementation(ATTENTION)
pool = KvBlockPool(16, 2 * (T // 16 + 2), 8, 128)
b, _ = best_decode(model, {"ferrox": (ATTENTION, lambda: FerroxCache(cfg, pool=pool, max_seq_len=T + 20))},
                   kv, 8, torch.tensor([[7]]), 3)
out["hf bench model @ 2048, per token"] = b["ferrox"] * 1e6
print(json.dumps(out))
"""
SCRIPTS = {"kernel": ROW, "house": HOUSE}


def one(path, rows="kernel"):
    env = dict(os.environ, PYTHONPATH=path)
    p = subprocess.run([sys.executable, "-c", SCRIPTS[rows]], env=env, capture_output=True, text=True,
                       timeout=600, cwd="/")
    if p.returncode != 0:
        raise SystemExit(f"{path}: {p.stderr}")
    return json.loads(p.stdout)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", choices=list(SCRIPTS), default="kernel")
    args = ap.parse_args()
    best = {"a": {}, "b": {}}
    for r in range(args.rounds):
        for side in (("a", "b") if r % 2 == 0 else ("b", "a")):
            for k, v in one(getattr(args, side), args.rows).items():
                best[side][k] = min(v, best[side].get(k, float("inf")))
        print(f"round {r + 1} of {args.rounds} done", file=sys.stderr)
    print(f"{'row':<42} {'A us':>10} {'B us':>10} {'B / A':>7}")
    for k in best["a"]:
        a, b = best["a"][k], best["b"][k]
        print(f"{k:<42} {a:>10.1f} {b:>10.1f} {b / a:>7.3f}")


if __name__ == "__main__":
    main()
