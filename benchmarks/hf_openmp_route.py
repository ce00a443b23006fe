"""The ferrox attention's split on torch's OpenMP team against ferrox_kv's
worker pool, in the hf bench model (``ferrox_kv.bench.llama``): per-token
decode time of FerroxCache + the ferrox attention on each route, and
DynamicCache + SDPA, interleaved in one process at N torch threads.

    python benchmarks/hf_openmp_route.py --threads 2 --contexts 2048,8192

The pool variant looks torch's runtime up as missing (what
``FERROX_KV_TORCH_OPENMP=0`` gives); both variants use the same thread
count and give the same logits (printed)."""
import argparse

import torch

from ferrox_kv import KvBlockPool
from ferrox_kv.bench.llama import best_decode, make_model
from ferrox_kv.hf import ATTENTION, FerroxCache, kv_geometry
from ferrox_kv.hf import attention as A


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--contexts", default="2048,8192")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    from transformers import DynamicCache

    torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    cfg, model = make_model(max(contexts) + args.tokens + 2)
    layers, h, d = kv_geometry(cfg)
    runtime = A._torch_openmp()
    print(f"torch's OpenMP runtime, reached through {runtime}; {args.threads} torch threads")
    first = torch.tensor([[7]])
    for ctx in contexts:
        max_len = ctx + args.tokens + 2
        gen = torch.Generator().manual_seed(ctx)
        kv = [(torch.randn(1, h, ctx, d, generator=gen), torch.randn(1, h, ctx, d, generator=gen))
              for _ in range(layers)]
        pool = KvBlockPool(16, layers * (-(-max_len // 16)), h, d)

        def on(route):
            def make():
                A._OPENMP[:] = [route]
                return FerroxCache(cfg, pool=pool, max_seq_len=max_len)
            return make

        variants = {"dynamic": ("sdpa", lambda: DynamicCache(config=cfg)),
                    "pool": (ATTENTION, on(None)), "team": (ATTENTION, on(runtime))}
        best, logits = best_decode(model, variants, kv, args.tokens, first, args.reps)
        A._OPENMP[:] = [runtime]
        ms = {k: v * 1e3 for k, v in best.items()}
        print(f"@ {ctx}: DynamicCache + SDPA {ms['dynamic']:.2f} ms/token; FerroxCache, pool "
              f"{ms['pool']:.2f} ms ({ms['pool'] / ms['dynamic']:.3f}x), torch's team "
              f"{ms['team']:.2f} ms ({ms['team'] / ms['dynamic']:.3f}x); team / pool "
              f"{ms['team'] / ms['pool']:.3f}; first-step logits, max |team - pool| "
              f"{float((logits['team'] - logits['pool']).abs().max()):.3g}", flush=True)


if __name__ == "__main__":
    main()
