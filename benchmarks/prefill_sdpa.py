"""Prefill into an empty cache: the ferrox kernel or torch's SDPA?

ferrox_kv.hf's attention takes SDPA on the incoming K/V for a prefill of at
least SDPA_PREFILL_MIN positions into an empty cache. This measures where
that pays: for q_len positions (causal, 32 query heads over 8 KV heads x
128, 1 torch thread), the ferrox path as the hf function runs it (q to a
float32 numpy array, attend_many over the cache, the output back to torch)
against torch SDPA with is_causal on the (1, H, q_len, D) tensors.

    python benchmarks/prefill_sdpa.py [--reps 7]
"""
import argparse
import time

import numpy as np
import torch

from ferrox_kv import KvBlockPool, KvCache, attend_many


def best(fn, reps):
    t = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        t = min(t, time.perf_counter() - t0)
    return t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--q-lens", type=lambda s: [int(x) for x in s.split(",")],
                    default=[4, 8, 16, 32, 48, 64, 96, 128, 256, 512, 1024, 2048])
    args = ap.parse_args()
    torch.set_num_threads(1)
    nh, h, d = 32, 8, 128
    print(f"{'q_len':>6} {'ferrox':>10} {'sdpa':>10} {'ferrox/sdpa':>12}")
    for q_len in args.q_lens:
        g = torch.Generator().manual_seed(q_len)
        q = torch.randn(1, nh, q_len, d, generator=g)
        k = torch.randn(1, h, q_len, d, generator=g)
        v = torch.randn(1, h, q_len, d, generator=g)
        pool = KvBlockPool(16, q_len // 16 + 2, h, d)
        c = KvCache.with_pool(h, d, pool, q_len)
        c.extend(k[0].transpose(0, 1).contiguous().numpy(), v[0].transpose(0, 1).contiguous().numpy())

        def ferrox():
            qn = q.transpose(1, 2).contiguous().numpy()
            return torch.from_numpy(attend_many([c], qn))

        def sdpa():
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2).contiguous()

        np.testing.assert_allclose(ferrox().numpy(), sdpa().numpy(), rtol=1e-4, atol=1e-4)
        tf, ts = best(ferrox, args.reps), best(sdpa, args.reps)
        print(f"{q_len:>6} {tf * 1e6:>8.0f}us {ts * 1e6:>8.0f}us {tf / ts:>12.2f}")


if __name__ == "__main__":
    main()
