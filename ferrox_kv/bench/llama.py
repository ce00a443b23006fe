"""The small transformers model the ``hf`` group and the sharing group's
chat-turn row time, and the steps they share (a prefill of random K/V, a
timed decode, the best of several interleaved). Needs torch and transformers; imported only by those groups.

The model: a 2-layer Llama with Llama-3-8B's attention geometry (32 query
heads over 8 KV heads x 128, hidden 1024), random weights, float32, one torch
thread. The prompt is not run through the model: each cache is prefilled with
the same random K/V (``cache.update`` per layer, the way the model's own
layers store a prompt), then real decode steps of the model are timed. One
model serves every variant (its attention implementation is switched between
them), so the weights are the same."""
import functools
import gc
import time

FLOOR_CONTEXT = 16      # the per-token floor's context: next to no attention

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


def prefill(cache, kv):
    """Every layer takes the same random (1, 8, T, 128) K/V a prompt would
    have left there. ``kwargs={}`` is the dict a model layer passes: with the
    "ferrox" attention, FerroxCache then hands back the new rows without
    gathering (the other caches ignore it)."""
    for layer, (k, v) in enumerate(kv):
        cache.update(k, v, layer, kwargs={})


def decode(model, cache, tokens, first):
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


def best_decode(model, variants, kv, tokens, first, reps):
    """Each variant ``slug: (attention implementation, make the cache)``
    prefilled with ``kv`` and decoded, ``reps`` times interleaved: the best
    seconds per token of each, and each one's first-step logits. The model's
    attention is left at "sdpa"."""
    best = {k: float("inf") for k in variants}
    logits = {}
    for _ in range(reps):
        for slug, (impl, make) in variants.items():
            model.set_attn_implementation(impl)
            cache = make()
            prefill(cache, kv)
            sec, lg = decode(model, cache, tokens, first)
            best[slug] = min(best[slug], sec)
            logits.setdefault(slug, lg)
            if hasattr(cache, "close"):
                cache.close()
            del cache
    model.set_attn_implementation("sdpa")
    return best, logits


def step_bound_fields(layers, h, d, ctx, dtype, threads, reps, floor_ms, dynamic_ms):
    """The fields of a model row that bound its step from below:
    ``floor_ms`` (the model's per-token time at ``FLOOR_CONTEXT``
    positions), ``kv_floor_ms`` (reading from memory the K/V bytes one step
    reads: every layer's ``ctx`` positions, pooled in ``dtype`` as
    FerroxCache stores them, ``_read_floor`` on ``threads`` threads timed
    alone after an eviction) and ``bound_ratio``, their sum over
    DynamicCache's step. Both are reads from memory, timed apart: a step
    that overlaps them a little can come in under their sum, so it is an
    estimate of the least a step takes, not a proof."""
    import numpy as np

    from ferrox_kv import KvBlockPool, KvCache, _core
    from ferrox_kv.bench.common import BLOCK_SIZE
    from ferrox_kv.bench.harness import best_from_memory
    pool = KvBlockPool(BLOCK_SIZE, layers * -(-ctx // BLOCK_SIZE), h, d, dtype=dtype)
    caches = [KvCache.with_pool(h, d, pool, ctx) for _ in range(layers)]
    rows = np.zeros((ctx, h, d), np.float32)
    for c in caches:
        c.extend(rows, rows)
    read = functools.partial(_core._read_floor, caches, 1, threads)
    kv_ms = best_from_memory([("floor", read)], reps)["floor"] / 1e3
    for c in caches:
        c.close()
    assert pool.free_blocks == pool.total_blocks
    return dict(floor_ms=floor_ms, kv_floor_ms=kv_ms, bound_ratio=(floor_ms + kv_ms) / dynamic_ms)
