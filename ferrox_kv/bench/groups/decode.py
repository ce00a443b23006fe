"""Group decode: the cache's own work per token, every layer of a model, no
attention: ferrox's calls against a numpy cache written by hand and
transformers' ``DynamicCache.update``."""
from dataclasses import dataclass
from typing import Callable

import numpy as np

import ferrox_kv
from ferrox_kv import KvBlockPool, KvCache
from ferrox_kv.bench.common import BLOCK_SIZE, GEOMETRIES, Group, log
from ferrox_kv.bench.harness import best_of, rows
from ferrox_kv.bench.targets import Target


class _NumpyCache:
    """What a user writes by hand: preallocated arrays per layer."""

    def __init__(self, layers, h, d, max_len):
        self.K = [np.empty((max_len, h, d), np.float32) for _ in range(layers)]
        self.V = [np.empty((max_len, h, d), np.float32) for _ in range(layers)]
        self.n = [0] * layers

    def update(self, layer, k, v):
        n = self.n[layer]
        self.K[layer][n] = k
        self.V[layer][n] = v
        self.n[layer] = n + 1
        return self.K[layer][:n + 1], self.V[layer][:n + 1]


@dataclass
class _DecodeImpl:
    slug: str
    name: str
    make: Callable
    prefill: Callable
    step: Callable
    all_layers: bool = False     # step takes every layer's row at once: (layers, h, d)


def _decode_impls(h, d, layers, max_len, with_torch):
    def fx_make_cap():
        return [KvCache.with_capacity(h, d, max_len) for _ in range(layers)]

    def fx_make_pool():
        pool = KvBlockPool(BLOCK_SIZE, layers * (-(-max_len // BLOCK_SIZE)), h, d)
        return [KvCache.with_pool(h, d, pool, max_len) for _ in range(layers)]

    def fx_prefill(caches, ks, vs):
        for c in caches:
            c.extend(ks, vs)

    def fx_step_views(caches, k, v):
        for c in caches:
            c.push(k, v)
            c.k, c.v                               # zero-copy views for attention

    def fx_step_table(caches, k, v):
        for c in caches:
            c.push(k, v)
            c.block_table                          # what a paged kernel reads

    def fx_step_layers_views(caches, k, v):
        ferrox_kv.push_layers(caches, k, v)        # all layers, one call
        for c in caches:
            c.k, c.v

    def fx_step_layers_table(caches, k, v):
        ferrox_kv.push_layers(caches, k, v)
        for c in caches:
            c.block_table

    def np_make():
        return _NumpyCache(layers, h, d, max_len)

    def np_prefill(cache, ks, vs):
        t = ks.shape[0]
        for layer in range(layers):
            cache.K[layer][:t] = ks.reshape(t, h, d)
            cache.V[layer][:t] = vs.reshape(t, h, d)
            cache.n[layer] = t

    def np_step(cache, k, v):
        for layer in range(layers):
            cache.update(layer, k, v)

    impls = [
        _DecodeImpl("ferrox_views", "ferrox with_capacity, push + views", fx_make_cap,
                    fx_prefill, fx_step_views),
        _DecodeImpl("ferrox_pooled_table", "ferrox with_pool, push + block table",
                    fx_make_pool, fx_prefill, fx_step_table),
        _DecodeImpl("ferrox_push_layers_views", "ferrox push_layers + views", fx_make_cap,
                    fx_prefill, fx_step_layers_views, all_layers=True),
        _DecodeImpl("ferrox_push_layers_table", "ferrox push_layers, pooled, block table",
                    fx_make_pool, fx_prefill, fx_step_layers_table, all_layers=True),
        _DecodeImpl("ferrox_pooled_gather", "ferrox with_pool, push + gathered k/v",
                    fx_make_pool, fx_prefill, fx_step_views),
        _DecodeImpl("numpy", "numpy preallocated, views", np_make, np_prefill, np_step),
    ]
    if not with_torch:
        return impls
    import torch
    from transformers import DynamicCache

    def dc_prefill(cache, ks, vs):
        t = ks.shape[0]
        kt = torch.from_numpy(ks.reshape(1, t, h, d)).transpose(1, 2)
        vt = torch.from_numpy(vs.reshape(1, t, h, d)).transpose(1, 2)
        for layer in range(layers):
            cache.update(kt, vt, layer)

    def dc_step(cache, k, v):
        kt = torch.from_numpy(k).view(1, h, 1, d)
        vt = torch.from_numpy(v).view(1, h, 1, d)
        for layer in range(layers):
            cache.update(kt, vt, layer)

    impls.append(_DecodeImpl("dynamic_cache", "transformers DynamicCache.update",
                             DynamicCache, dc_prefill, dc_step))
    return impls


def bench_decode(res, geo, contexts, reps, tokens, with_torch):
    h, d, layers = GEOMETRIES[geo]
    w = h * d
    max_len = max(contexts) + tokens + 1
    impls = _decode_impls(h, d, layers, max_len, with_torch)
    # one new position per token, shaped (n_kv_heads, head_dim) as a model makes it
    k_tok = rows(tokens, w, 7).reshape(tokens, h, d)
    v_tok = rows(tokens, w, 8).reshape(tokens, h, d)
    # push_layers takes every layer's row at once: (layers, h, d) per token
    k_all = np.ascontiguousarray(np.broadcast_to(k_tok[:, None], (tokens, layers, h, d)))
    v_all = np.ascontiguousarray(np.broadcast_to(v_tok[:, None], (tokens, layers, h, d)))
    g = "decode"
    for ctx in contexts:
        ks, vs = rows(ctx, w, 9), rows(ctx, w, 10)
        variants = []
        for impl in impls:
            kk, vv = (k_all, v_all) if impl.all_layers else (k_tok, v_tok)

            def setup(impl=impl):
                state = impl.make()
                impl.prefill(state, ks, vs)
                return state

            def steps(state, impl=impl, kk=kk, vv=vv):
                for i in range(tokens):
                    impl.step(state, kk[i], vv[i])

            variants.append((impl.slug, setup, steps))
        per = {k: v / tokens * 1e6 for k, v in best_of(variants, reps).items()}
        base = per["ferrox_views"]
        for impl in impls:
            us = per[impl.slug]
            res.add(g, geo, f"decode.{impl.slug}", f"{impl.name} @ {ctx}", us, "us/token",
                    us / base, "ferrox with_capacity", context=ctx, layers=layers)


def run(r):
    contexts = r.contexts or ([128, 512] if r.quick else [128, 512, 1024, 2048])
    geos = r.geos[:1] if r.quick else ([g for g in r.geos if g != "wide"] or r.geos[:1])
    for geo in geos:
        log(f"decode {geo}, {GEOMETRIES[geo][2]} layers, contexts {contexts}")
        bench_decode(r.res, geo, contexts, 2 if r.quick else 3, 4 if r.quick else 16, r.hf_ok)


def targets(res):
    """DynamicCache per token against ferrox (cache work only), at the
    longest context of this run; a goal from 2048 positions on."""
    dc = [r for r in res.rows if r["slug"] == "decode.dynamic_cache"]
    if not dc:
        return []
    top = max(dc, key=lambda r: r["context"])
    ctx = top["context"]
    return [Target(f"DynamicCache / ferrox per token @ {ctx} ctx", "decode.dynamic_cache",
                   ">=" if ctx >= 2048 else "info", 100.0 if ctx >= 2048 else None,
                   {"context": ctx, "geometry": top["geometry"]})]


GROUP = Group("decode", "the cache's own work per token, every layer (no attention)", run,
              targets=targets, hf_rows="the decode rows of DynamicCache.update")
