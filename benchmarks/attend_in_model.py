"""Attention inside a model's decode step, against the same call alone.

The hf group's 2-layer Llama (32 query / 8 KV heads x 128, hidden 1024, one
torch thread) decodes with FerroxCache and the "ferrox" attention at a given
context (the cache prefilled with random K/V); every attend_many call inside
the steps is timed, then the same call is timed alone, back to back (the
context then stays in the CPU caches). The difference is what a step's
weight reads cost attention by evicting the K/V between calls.

    python benchmarks/attend_in_model.py [--context 2048] [--steps 30]
"""
import argparse
import time

import numpy as np
import torch

import ferrox_kv.hf.attention as fhf
from ferrox_kv import KvBlockPool
from ferrox_kv.bench import llama
from ferrox_kv.hf import ATTENTION, FerroxCache


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(1)
    ctx = args.context
    cfg, model = llama.make_model(ctx + args.steps + 8)
    model.set_attn_implementation(ATTENTION)
    layers, h, d = 2, 8, 128
    kv = [(torch.randn(1, h, ctx, d), torch.randn(1, h, ctx, d)) for _ in range(layers)]
    pool = KvBlockPool(16, layers * (-(-(ctx + args.steps + 8) // 16)), h, d)
    cache = FerroxCache(cfg, pool=pool, max_seq_len=ctx + args.steps + 8)
    llama.prefill(cache, kv)

    real, spent = fhf.attend_many, []

    def timed(*a, **kw):
        t0 = time.perf_counter()
        out = real(*a, **kw)
        spent.append(time.perf_counter() - t0)
        return out

    fhf.attend_many = timed
    token = torch.tensor([[7]])
    with torch.no_grad():
        model(input_ids=token, cache=cache, use_cache=True)
        spent.clear()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            model(input_ids=token, cache=cache, use_cache=True)
        step = (time.perf_counter() - t0) / args.steps
    fhf.attend_many = real
    q = np.random.default_rng(0).standard_normal((1, 1, 32, 128), dtype=np.float32)
    alone = min(_timed(real, cache.layers[0].seqs, q) for _ in range(args.steps))
    print(f"context {ctx}: decode step {step * 1e3:.2f} ms; attend_many inside the step "
          f"{np.median(spent) * 1e3:.2f} ms per call (median of {len(spent)}), alone "
          f"{alone * 1e3:.2f} ms (best of {args.steps})")


def _timed(fn, *args):
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
