"""A prefix file's load, as ratios within one run (best of REPS, interleaved):
the one-pass load (each record read into one buffer, verified there, copied
into its reserved blocks) and the read-whole load (the file read into one
buffer, verified, then imported: the path a warm pool takes, forced here on
a fresh pool), each against `extend` of the same rows (the store group's
`store.file_load` baseline). 8 KV heads x 128, block 16, float32.

    python benchmarks/store_file_load.py [LAYERS] [TOKENS] [REPS]    # 32 4096 5
"""
import os
import shutil
import sys
import tempfile

from ferrox_kv import KvBlockPool
from ferrox_kv.bench.common import BLOCK_SIZE
from ferrox_kv.bench.groups.store import D, H, _extend, _published
from ferrox_kv.bench.harness import best_of
from ferrox_kv.store import _pool


def main(layers=32, n_tok=4096, reps=5):
    pool, _, ks, vs, per = _published(layers, n_tok, 40)
    folder = tempfile.mkdtemp(prefix="ferrox_kv-load-")
    path = os.path.join(folder, "prefixes.fxkv")
    streamed = _pool._import_streamed
    try:
        pool.save_prefixes(path, fingerprint="bench")
        del pool

        def fresh():
            return KvBlockPool(BLOCK_SIZE, 2 * layers * per, H, D, prefix_cache=True)

        def load(p):
            assert p.load_prefixes(path, fingerprint="bench")["entries"] == n_tok // BLOCK_SIZE

        def read_whole(p):
            _pool._import_streamed = lambda *a: None       # as for a warm pool
            try:
                load(p)
            finally:
                _pool._import_streamed = streamed
        setup, extend = _extend(layers, n_tok, per, ks, vs)
        best = best_of([("one_pass", fresh, load), ("read_whole", fresh, read_whole),
                        ("extend", setup, extend)], reps)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    e = best["extend"]
    print(f"{layers} layers x {n_tok} tokens, best of {reps}: one-pass "
          f"{best['one_pass'] * 1e3:.0f} ms = {best['one_pass'] / e:.2f}x extend; read-whole "
          f"{best['read_whole'] * 1e3:.0f} ms = {best['read_whole'] / e:.2f}x; extend "
          f"{e * 1e3:.0f} ms")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:4]))
