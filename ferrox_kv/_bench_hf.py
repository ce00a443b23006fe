"""The transformers group of ``python -m ferrox_kv.bench``: per-token decode
time of a tiny model with ``FerroxCache`` against ``DynamicCache``. Runs only
when torch and transformers are installed."""
import gc
import time


def available():
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except Exception:
        return False
    return True


def _model(layers=4):
    import torch
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096)
    return cfg, transformers.LlamaForCausalLM(cfg).eval()


def _decode_time(model, cache, ctx, tokens):
    """Prefill ``ctx`` positions, then time ``tokens`` single-token steps."""
    import torch
    g = torch.Generator().manual_seed(ctx)
    ids = torch.randint(1, model.config.vocab_size, (1, ctx), generator=g)
    with torch.no_grad():
        out = model(input_ids=ids, cache=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        gc.disable()
        t0 = time.perf_counter()
        for _ in range(tokens):
            out = model(input_ids=nxt, cache=cache, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
        dt = time.perf_counter() - t0
        gc.enable()
    return dt / tokens


def bench_hf(res, quick=False, log=print):
    import torch
    from transformers import DynamicCache

    from ferrox_kv import KvBlockPool
    from ferrox_kv.hf import FerroxCache, kv_geometry

    torch.set_num_threads(1)
    cfg, model = _model()
    layers, h, d = kv_geometry(cfg)
    tokens = 8 if quick else 32
    reps = 2 if quick else 5
    contexts = [128] if quick else [128, 1024]
    g = "hf"
    for ctx in contexts:
        max_len = ctx + tokens + 1
        pool = KvBlockPool(16, layers * (-(-max_len // 16)), h, d)
        makers = {
            "DynamicCache": lambda: DynamicCache(config=cfg),
            "FerroxCache (contiguous)": lambda: FerroxCache(cfg, max_seq_len=max_len),
            "FerroxCache (pooled)": lambda: FerroxCache(cfg, pool=pool, max_seq_len=max_len),
        }
        best = {k: float("inf") for k in makers}
        for _ in range(reps):
            for name, make in makers.items():
                cache = make()
                best[name] = min(best[name], _decode_time(model, cache, ctx, tokens))
                if hasattr(cache, "close"):
                    cache.close()
        log(f"hf decode @ {ctx}: " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in best.items()))
        base = best["DynamicCache"]
        for name, sec in best.items():
            res.add(g, f"tiny-llama{layers}L", f"{name}, per token @ {ctx} ctx", sec * 1e3,
                    "ms/token", sec / base, "DynamicCache", context=ctx,
                    key=f"hf_{name.split()[0]}_{name.split()[-1].strip('()')}_ctx{ctx}")
        assert pool.free_blocks == pool.total_blocks
