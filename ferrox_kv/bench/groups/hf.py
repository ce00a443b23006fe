"""Group hf: per-token decode time of a real (small) transformers model with
``FerroxCache`` (pooled, read in place by the "ferrox" attention) against
``DynamicCache`` and ``StaticCache`` with SDPA (transformers' default
attention), at 1 and N torch threads (the ferrox attention follows torch's
count). Each FerroxCache row also carries an estimate of the least a step
can take: the model's per-token floor (a pass at a ``FLOOR_CONTEXT``-position
context, the fastest variant's) plus a read from memory of the K/V bytes the
step reads (``llama.step_bound_fields``), as ``bound_ratio`` against
DynamicCache: a goal below it is out of reach on this machine by that
estimate (docs/benchmarks.md). Needs torch and
transformers (the model: ``llama.py``)."""
from ferrox_kv.bench.common import Group, Threads, log, thread_counts, thread_tag
from ferrox_kv.bench.llama import FLOOR_CONTEXT
from ferrox_kv.bench.targets import Figure, Target, step_bound


def bench_hf(res, contexts, quick=False, log=print, threads=1):
    import torch
    from transformers import DynamicCache, StaticCache

    import ferrox_kv.hf  # noqa: F401  (registers the "ferrox" attention)
    from ferrox_kv import KvBlockPool
    from ferrox_kv.bench.llama import best_decode, make_model, step_bound_fields
    from ferrox_kv.hf import ATTENTION, FerroxCache, kv_geometry

    tokens = 8 if quick else 16
    reps = 3 if quick else 5
    cfg, model = make_model(max(contexts) + tokens + 2)
    layers, h, d = kv_geometry(cfg)
    g = "hf"
    geo = f"llama-{layers}L"
    tag = thread_tag(threads)
    first = torch.tensor([[7]])
    # a decode step reads every weight once (matrix-vector products) except
    # the embedding table, of which it reads one row
    weights_mb = sum(p.numel() for n, p in model.named_parameters()
                     if "embed_tokens" not in n) * 4 / 1e6
    floor = None
    for ctx in [FLOOR_CONTEXT] + list(contexts):
        max_len = ctx + tokens + 2
        gen = torch.Generator().manual_seed(ctx)
        kv = [(torch.randn(1, h, ctx, d, generator=gen), torch.randn(1, h, ctx, d, generator=gen))
              for _ in range(layers)]
        pool = KvBlockPool(16, layers * (-(-max_len // 16)), h, d)
        # slug: (attention implementation, make the cache)
        variants = {
            "dynamic": ("sdpa", lambda: DynamicCache(config=cfg)),
            "static": ("sdpa", lambda: StaticCache(config=cfg, max_cache_len=max_len)),
            "ferrox": (ATTENTION, lambda: FerroxCache(cfg, pool=pool, max_seq_len=max_len)),
        }
        best, logits = best_decode(model, variants, kv, tokens, first, reps)
        # the same weights and K/V: the first step's logits agree across caches
        diff = {k: float((v - logits["dynamic"]).abs().max()) for k, v in logits.items()}
        log(f"hf decode @ {ctx}: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in best.items())
            + f" (first-step logits, max |ferrox - DynamicCache| {diff['ferrox']:.6f})")
        ms = {k: v * 1e3 for k, v in best.items()}
        assert pool.free_blocks == pool.total_blocks
        if floor is None:
            floor = min(ms.values())
            continue
        extra = dict(context=ctx, tokens=tokens, weights_read_mb=weights_mb, threads=threads)
        res.add(g, geo, "hf.dynamic", tag + f"DynamicCache + SDPA @ {ctx}", ms["dynamic"],
                "ms/token", **extra)
        res.add(g, geo, "hf.ferrox.vs_dynamic", tag + f"FerroxCache pooled + ferrox attn @ {ctx}",
                ms["ferrox"], "ms/token", ms["ferrox"] / ms["dynamic"], "DynamicCache",
                logits_max_diff=diff["ferrox"],
                **step_bound_fields(layers, h, d, ctx, "float32", threads, reps, floor, ms["dynamic"]),
                **extra)
        res.add(g, geo, "hf.ferrox.vs_static", tag + f"FerroxCache pooled + ferrox attn @ {ctx}",
                ms["ferrox"], "ms/token", ms["ferrox"] / ms["static"], "StaticCache", **extra)
        res.add(g, geo, "hf.static.vs_dynamic", tag + f"StaticCache + SDPA @ {ctx}", ms["static"],
                "ms/token", ms["static"] / ms["dynamic"], "DynamicCache",
                logits_max_diff=diff["static"], **extra)


def run(r):
    contexts = r.contexts or ([128, 512] if r.quick else [128, 2048, 8192])
    for n in thread_counts(r.args):
        log(f"hf: a 2-layer Llama (32 heads, 8 KV heads x 128) per-token decode at {n} "
            f"thread(s), contexts {contexts}")
        with Threads(n):
            bench_hf(r.res, contexts, quick=r.quick, log=log, threads=n)


GOALS = {128: 1.0, 2048: 0.6, 8192: 0.45}    # context: FerroxCache / DynamicCache per token, 1 thread
GOALS_N = {2048: 0.6, 8192: 0.2}              # the same at N threads


def targets(res):
    out = []
    for r in res.rows:
        n = r.get("threads", 1)
        lead = thread_tag(n)
        if r["slug"] == "hf.ferrox.vs_dynamic":
            T = r["context"]
            goal = (GOALS if n == 1 else GOALS_N).get(T)
            at = {"context": T, "threads": n}
            out.append(Target(lead + f"FerroxCache / DynamicCache per token @ {T}", r["slug"],
                              "<=" if goal else "info", goal, at,
                              related=[Figure("attention alone vs SDPA",
                                              "attention.attend.vs_sdpa", at, unit="x")],
                              bound_by=step_bound(r["slug"], at)))
        elif r["slug"] == "hf.static.vs_dynamic":
            out.append(Target(lead + f"  StaticCache / DynamicCache per token @ {r['context']}",
                              r["slug"], "info", None, {"context": r["context"], "threads": n}))
    return out


GROUP = Group("hf", "decode step of a 2-layer Llama, FerroxCache vs DynamicCache, at 1 and N threads",
              run, targets=targets, needs_hf=True)
