"""The ``hf`` group of ``ferrox-kv bench``: per-token decode time of a real
(small) transformers model with ``FerroxCache`` (pooled, read in place by the
"ferrox" attention) against ``DynamicCache`` and ``StaticCache`` with SDPA
(transformers' default attention). Needs torch and transformers.

The model: a 2-layer Llama with Llama-3-8B's attention geometry (32 query
heads over 8 KV heads x 128, hidden 1024), random weights, float32, one torch
thread. The prompt is not run through the model: each cache is prefilled with
the same random K/V (``cache.update`` per layer, the way the model's own
layers store a prompt), then real decode steps of the model are timed. One
model serves every variant (its attention implementation is switched between
them), so the weights are the same."""
import gc
import time

LLAMA = dict(vocab_size=1024, hidden_size=1024, intermediate_size=1024, num_hidden_layers=2,
             num_attention_heads=32, num_key_value_heads=8, head_dim=128)


def available():
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except Exception:
        return False
    return True


def make_model(max_positions):
    import torch
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**LLAMA, max_position_embeddings=max(2048, max_positions))
    model = transformers.LlamaForCausalLM(cfg).eval()
    return cfg, model


def _prefill(cache, kv):
    """Every layer takes the same random (1, 8, T, 128) K/V a prompt would
    have left there. ``kwargs={}`` is the dict a model layer passes: with the
    "ferrox" attention, FerroxCache then hands back the new rows without
    gathering (the other caches ignore it)."""
    for layer, (k, v) in enumerate(kv):
        cache.update(k, v, layer, kwargs={})


def _decode(model, cache, tokens, first):
    """One untimed step, then ``tokens`` timed steps; seconds per token and
    the first step's logits."""
    import torch
    nxt = first
    with torch.no_grad():
        out = model(input_ids=nxt, cache=cache, use_cache=True)
        logits = out.logits[0, -1].clone()
        nxt = out.logits[:, -1:].argmax(-1)
        gc.disable()
        t0 = time.perf_counter()
        for _ in range(tokens):
            out = model(input_ids=nxt, cache=cache, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
        dt = time.perf_counter() - t0
        gc.enable()
    return dt / tokens, logits


def bench_hf(res, contexts, quick=False, log=print):
    import torch
    from transformers import DynamicCache, StaticCache

    import ferrox_kv.hf  # noqa: F401  (registers the "ferrox" attention)
    from ferrox_kv import KvBlockPool
    from ferrox_kv.hf import ATTENTION, FerroxCache, kv_geometry

    tokens = 8 if quick else 16
    reps = 3 if quick else 5
    cfg, model = make_model(max(contexts) + tokens + 2)
    layers, h, d = kv_geometry(cfg)
    g = "hf"
    geo = f"llama-{layers}L"
    first = torch.tensor([[7]])
    # a decode step reads every weight once (matrix-vector products) except
    # the embedding table, of which it reads one row
    weights_mb = sum(p.numel() for n, p in model.named_parameters()
                     if "embed_tokens" not in n) * 4 / 1e6
    for ctx in contexts:
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
        best = {k: float("inf") for k in variants}
        logits = {}
        for _ in range(reps):
            for slug, (impl, make) in variants.items():
                model.set_attn_implementation(impl)
                cache = make()
                _prefill(cache, kv)
                sec, lg = _decode(model, cache, tokens, first)
                best[slug] = min(best[slug], sec)
                logits.setdefault(slug, lg)
                if hasattr(cache, "close"):
                    cache.close()
                del cache
        model.set_attn_implementation("sdpa")
        # the same weights and K/V: the first step's logits agree across caches
        diff = {k: float((v - logits["dynamic"]).abs().max()) for k, v in logits.items()}
        log(f"hf decode @ {ctx}: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in best.items())
            + f" (first-step logits, max |ferrox - DynamicCache| {diff['ferrox']:.6f})")
        ms = {k: v * 1e3 for k, v in best.items()}
        extra = dict(context=ctx, tokens=tokens, weights_read_mb=weights_mb)
        res.add(g, geo, "hf.dynamic", f"DynamicCache + SDPA @ {ctx}", ms["dynamic"],
                "ms/token", **extra)
        res.add(g, geo, "hf.ferrox.vs_dynamic", f"FerroxCache pooled + ferrox attn @ {ctx}",
                ms["ferrox"], "ms/token", ms["ferrox"] / ms["dynamic"], "DynamicCache",
                logits_max_diff=diff["ferrox"], **extra)
        res.add(g, geo, "hf.ferrox.vs_static", f"FerroxCache pooled + ferrox attn @ {ctx}",
                ms["ferrox"], "ms/token", ms["ferrox"] / ms["static"], "StaticCache", **extra)
        res.add(g, geo, "hf.static.vs_dynamic", f"StaticCache + SDPA @ {ctx}", ms["static"],
                "ms/token", ms["static"] / ms["dynamic"], "DynamicCache",
                logits_max_diff=diff["static"], **extra)
        assert pool.free_blocks == pool.total_blocks


def bench_chat(res, quick=False, log=print):
    """Prefill time of chat turns 2-4 with prefix reuse (the prompt's
    published history is reused, only the rest is computed) against the same
    FerroxCache path without a prefix cache, on the hf group's model."""
    import torch

    import ferrox_kv.hf  # noqa: F401
    from ferrox_kv import KvBlockPool
    from ferrox_kv.hf import ATTENTION, FerroxCache, kv_geometry

    first, answer, user = (128, 8, 32) if quick else (512, 16, 64)
    turns = 4
    total = first + turns * (answer + user) + 16
    cfg, model = make_model(total)
    model.set_attn_implementation(ATTENTION)
    layers, h, d = kv_geometry(cfg)
    blocks = layers * (-(-total // 16)) * 3
    gen = torch.Generator().manual_seed(5)
    history = torch.randint(0, cfg.vocab_size, (1, first), generator=gen)
    times = {"reuse": [], "plain": []}
    prefix_pool = KvBlockPool(16, blocks, h, d, prefix_cache=True)
    plain_pool = KvBlockPool(16, blocks, h, d)
    with torch.no_grad():
        for turn in range(1, turns + 1):
            n = history.shape[1]
            for kind, pool in (("reuse", prefix_pool), ("plain", plain_pool)):
                best = float("inf")
                for _ in range(2 if quick else 3):
                    cache = FerroxCache(cfg, pool=pool, max_seq_len=n + answer + 1,
                                        tokens=history[0] if kind == "reuse" else None)
                    have = cache.get_seq_length()
                    t0 = time.perf_counter()
                    out = model(input_ids=history[:, have:], cache=cache, use_cache=True)
                    best = min(best, time.perf_counter() - t0)
                    if kind == "reuse":
                        ids = [out.logits[:, -1:].argmax(-1)]
                        for _ in range(answer - 1):
                            ids.append(model(input_ids=ids[-1], cache=cache,
                                             use_cache=True).logits[:, -1:].argmax(-1))
                        answer_ids = torch.cat(ids, dim=1)
                        cache.publish(torch.cat([history, answer_ids], dim=1)[0])
                    cache.close()
                if turn > 1:
                    times[kind].append(best)
            history = torch.cat([history, answer_ids,
                                 torch.randint(0, cfg.vocab_size, (1, user), generator=gen)], 1)
    reuse, plain = sum(times["reuse"]), sum(times["plain"])
    log(f"chat prefill, turns 2-{turns}: with reuse {reuse * 1e3:.1f} ms, without "
        f"{plain * 1e3:.1f} ms")
    res.add("sharing", f"llama-{layers}L", "sharing.chat_prefill",
            f"prefill of chat turns 2-{turns} with prefix reuse", reuse * 1e3, "ms",
            reuse / plain, "no prefix cache", first_prompt=first, answer=answer, user=user)
    prefix_pool.check()
