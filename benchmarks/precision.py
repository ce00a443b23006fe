"""The precision group: what each storage dtype costs and buys, ratios taken
in one run (issue 14's table). Geometry llama8b (8 KV heads x 128, 32 query
heads), pooled, block 16.

    python benchmarks/precision.py [--quick] [--json out.json]

Rows (slug: what, ratio of):
  precision.bytes.<dt>      bytes per position per layer (K+V, scales included), of float32
  precision.fit.<dt>        sequences of 2048 positions x 32 layers in a 1 GiB pool, of float32
  precision.attend.<dt>     decode attend at each context, of float32 attend on the same data
  precision.attend_floor.<dt>  decode attend, of its own read floor (the stored bytes read once)
  precision.extend.<dt>     extend(512) from float32, of a C conversion floor over the same rows
  precision.chunk.<dt>      causal chunk q_len 256 over 2048, of SDPA with a causal mask
"""
import argparse
import json
import sys

import numpy as np

from ferrox_kv import DTYPES, KvBlockPool, KvCache, _core
from ferrox_kv.bench import BLOCK_SIZE, Results, _loops_for, best_of

GEO = "llama8b"
KVH, D, H = 8, 128, 32
GROUP = "precision"


def bench_precision(res, quick=False, reps=5, torch=None):
    contexts = [2048] if quick else [2048, 8192]
    reps = 2 if quick else reps
    rng = np.random.default_rng(14)
    g = GROUP

    # -- bytes and fit -------------------------------------------------------------
    per_pos = {}
    for dt in DTYPES:
        pool = KvBlockPool(BLOCK_SIZE, 1, KVH, D, dtype=dt)
        per_pos[dt] = pool.block_bytes / BLOCK_SIZE
    gib = 2 ** 30
    seq_blocks = 32 * (2048 // BLOCK_SIZE)
    fit = {dt: int(gib // (per_pos[dt] * BLOCK_SIZE)) // seq_blocks for dt in DTYPES}
    for dt in DTYPES:
        res.add(g, GEO, f"precision.bytes.{dt}", f"{dt}: bytes per position per layer (K+V)",
                per_pos[dt], "B", per_pos[dt] / per_pos["float32"], "float32", dtype=dt)
    for dt in DTYPES:
        res.add(g, GEO, f"precision.fit.{dt}", f"{dt}: 2048-position x 32-layer sequences in 1 GiB",
                fit[dt], "seqs", fit[dt] / fit["float32"], "float32", dtype=dt)

    # -- decode attention: each dtype on the same data -------------------------
    for T in contexts:
        K = rng.standard_normal((T, KVH, D), dtype=np.float32)
        V = rng.standard_normal((T, KVH, D), dtype=np.float32)
        K[:, :, :4] *= 30                       # outlier channels, as real keys have
        q = rng.standard_normal((H, D), dtype=np.float32)
        caches = {}
        for dt in DTYPES:
            nb = -(-T // BLOCK_SIZE)
            c = KvCache.with_pool(KVH, D, KvBlockPool(BLOCK_SIZE, nb, KVH, D, dtype=dt), T)
            c.extend(K, V)
            caches[dt] = c
        n = _loops_for(lambda _: caches["float32"].attend(q), 0.05 if quick else 0.2)
        out = np.empty((H, D), np.float32)
        variants = []
        for dt, c in caches.items():
            variants.append((dt, lambda: None, lambda _, c=c: [c.attend(q, out=out) for _ in range(n)]))
            variants.append((f"floor.{dt}", lambda: None, lambda _, c=c: _core._read_floor([c], n)))
        best = best_of(variants, reps)
        us = {k: v / n * 1e6 for k, v in best.items()}
        exact = caches["float32"].attend(q)
        for dt in DTYPES:
            err = float(np.abs(caches[dt].attend(q) - exact).max())
            res.add(g, GEO, f"precision.attend.{dt}", f"{dt}: decode attend @ {T}", us[dt],
                    "us/call", us[dt] / us["float32"], "float32 attend", context=T, dtype=dt,
                    max_abs_err=err)
            res.add(g, GEO, f"precision.attend_floor.{dt}", f"{dt}: decode attend @ {T} vs its read floor",
                    us[dt], "us/call", us[dt] / us[f"floor.{dt}"], "own read floor", context=T,
                    dtype=dt, floor_us=us[f"floor.{dt}"])

    # -- extend(512) from float32: conversion in the copy loop vs a C floor -----
    t = 512
    ks = rng.standard_normal((t, KVH * D), dtype=np.float32)
    vs = rng.standard_normal((t, KVH * D), dtype=np.float32)
    nb = -(-t // BLOCK_SIZE)
    for dt in DTYPES:
        row = KvBlockPool(1, 1, KVH, D, dtype=dt).block_bytes // 2
        dk, dv = np.empty(t * row, np.uint8), np.empty(t * row, np.uint8)

        def floor(_, dt=dt, dk=dk, dv=dv):
            _core._convert_floor(dk, ks, KVH, D, dt)
            _core._convert_floor(dv, vs, KVH, D, dt)

        best = best_of([
            ("floor", lambda: None, floor),
            ("extend", lambda dt=dt: KvCache.with_pool(
                KVH, D, KvBlockPool(BLOCK_SIZE, nb, KVH, D, dtype=dt), t),
             lambda c: c.extend(ks, vs)),
        ], reps)
        res.add(g, GEO, f"precision.extend.{dt}", f"{dt}: extend({t}) from float32 vs C conversion",
                best["extend"] * 1e6, "us/call", best["extend"] / best["floor"], "C conversion floor",
                dtype=dt, floor_us=best["floor"] * 1e6)

    # -- causal chunk: q_len 256 over 2048 --------------------------------------
    if torch is not None:
        F = torch.nn.functional
        T, ql = 2048, 256
        K = rng.standard_normal((T, KVH, D), dtype=np.float32)
        V = rng.standard_normal((T, KVH, D), dtype=np.float32)
        Q = rng.standard_normal((ql, H, D), dtype=np.float32)
        kt = torch.from_numpy(np.ascontiguousarray(K.transpose(1, 0, 2)))[None]
        vt = torch.from_numpy(np.ascontiguousarray(V.transpose(1, 0, 2)))[None]
        qt = torch.from_numpy(np.ascontiguousarray(Q.transpose(1, 0, 2)))[None]
        mask = torch.ones(ql, T, dtype=torch.bool).tril(T - ql)
        for dt in ("float32", "bfloat16"):
            c = KvCache.with_pool(KVH, D, KvBlockPool(BLOCK_SIZE, T // BLOCK_SIZE, KVH, D, dtype=dt), T)
            c.extend(K, V)
            best = best_of([
                ("attend", lambda: None, lambda _, c=c: c.attend(Q)),
                ("sdpa", lambda: None, lambda _: F.scaled_dot_product_attention(
                    qt, kt, vt, attn_mask=mask, enable_gqa=True)),
            ], reps)
            res.add(g, GEO, f"precision.chunk.{dt}", f"{dt}: causal chunk {ql} over {T}",
                    best["attend"] * 1e6, "us/call", best["attend"] / best["sdpa"],
                    "SDPA causal", dtype=dt)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    try:
        import torch
        torch.set_num_threads(1)
    except ImportError:
        torch = None
    res = bench_precision(Results(), args.quick, args.reps, torch)
    print(res.table(GROUP, "storage dtypes, llama8b pooled, block 16"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": res.rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
