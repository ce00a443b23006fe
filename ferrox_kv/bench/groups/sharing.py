"""Group sharing: block sharing (forks, prefix reuse), what the prefix
cache's bookkeeping costs, and, with transformers, the prefill of chat turns
with prefix reuse on the hf group's model."""
import time

import numpy as np

from ferrox_kv import KvBlockPool, KvCache
from ferrox_kv.bench.common import BLOCK_SIZE, Group, Torch1, log
from ferrox_kv.bench.harness import best_of, rows
from ferrox_kv.bench.targets import Target


def _extend_layers(pool, layers, n, ks, vs):
    """A timed run: reserve ``layers`` caches of ``n`` positions on ``pool``,
    extend each with (ks, vs), let them go (what a prefix hit replaces)."""
    h, d = pool.n_kv_heads, pool.head_dim

    def run(_):
        got = KvCache.with_pool_many(layers, h, d, pool, n + 1)
        for c in got:
            c.extend(ks, vs)
        for c in got:
            c.close()
    return run


def bench_sharing(res, quick, reps):
    """Block sharing: forks, prefix reuse, and what the prefix cache's
    bookkeeping costs. 8 KV heads x 128, block size 16."""
    h, d = 8, 128
    w = h * d
    g = "sharing"
    bs = BLOCK_SIZE
    rng = np.random.default_rng(20)

    # 1. a parent and 8 forks, each decoding 64 positions
    ctx, plan, kids = 2048, 2112, 8
    pool = KvBlockPool(bs, (kids + 1) * (plan // bs + 1), h, d)
    parent = KvCache.with_pool(h, d, pool, plan)
    parent.advance_len(ctx)
    alone = pool.used_blocks
    forks = [parent.fork() for _ in range(kids)]
    step = rows(1, w, 21)[0]
    for c in [parent] + forks:
        for _ in range(plan - ctx):
            c.push(step, step)
    held = pool.used_blocks
    res.add(g, "8x128", "sharing.fork_blocks", f"blocks held: parent of {ctx} + {kids} forks, "
            f"each +{plan - ctx}", held, "blocks", held / alone, "parent alone",
            unshared=(kids + 1) * alone / alone)
    for c in forks + [parent]:
        c.close()
    pool.check()

    # 2. 16 requests: a shared 1024-token prefix and 64 tokens of their own
    n_req, prefix, own = 16, 1024, 64
    per = -(-(prefix + own) // bs)
    pool = KvBlockPool(bs, n_req * per, h, d, prefix_cache=True)
    system = rng.integers(0, 32000, prefix).tolist()
    live = []
    for i in range(n_req):
        toks = system + rng.integers(0, 32000, own).tolist()
        c = KvCache.with_pool(h, d, pool, prefix + own, tokens=toks)
        c.advance_len(len(toks) - c.seq_len)
        pool.publish([c], toks)
        live.append(c)
    used = pool.used_blocks
    res.add(g, "8x128", "sharing.prefix_blocks", f"blocks in use: {n_req} requests, shared "
            f"{prefix}-token prefix + {own} own", used, "blocks", used / (n_req * per),
            "unshared")
    for c in live:
        c.close()
    pool.check()

    # 3. a full hit on 32 layers against extending the same rows
    layers, n_tok = (8, 1024) if quick else (32, 4096)
    per = -(-n_tok // bs) + 1
    pool = KvBlockPool(bs, 2 * layers * per, h, d, prefix_cache=True)
    toks = rng.integers(0, 32000, n_tok).tolist()
    ks, vs = rows(n_tok, w, 22), rows(n_tok, w, 23)
    first = KvCache.with_pool_many(layers, h, d, pool, n_tok + 1, tokens=toks)
    for c in first:
        c.extend(ks, vs)
    pool.publish(first, toks)

    def hit(_):
        got = KvCache.with_pool_many(layers, h, d, pool, n_tok + 1, tokens=toks)
        assert got[0].seq_len == (n_tok - 1) // bs * bs
        for c in got:
            c.close()

    extend = _extend_layers(pool, layers, n_tok, ks, vs)
    best = best_of([("hit", lambda: None, hit), ("extend", lambda: None, extend)], reps)
    res.add(g, "8x128", "sharing.hit_vs_extend", f"with_pool_many({layers} layers, tokens="
            f"{n_tok} ids), full hit", best["hit"] * 1e3, "ms", best["hit"] / best["extend"],
            f"extend into {layers} layers", layers=layers, tokens=n_tok)
    for c in first:
        c.close()
    pool.check()

    # 4. bookkeeping at a 0% hit rate: lookup + publish of 512 tokens, 32 layers.
    #    lookup = reserving with tokens= minus reserving without; publish timed
    #    alone on caches that already hold the rows; both against extend.
    layers, n_tok, loops = (8, 512, 20) if quick else (32, 512, 50)
    per = -(-n_tok // bs) + 1
    pool = KvBlockPool(bs, 4 * layers * per, h, d, prefix_cache=True)
    ks, vs = rows(n_tok, w, 24), rows(n_tok, w, 25)
    seeds = iter(range(10**6))

    def token_lists():
        return [np.random.default_rng(next(seeds)).integers(0, 2**31 - 1, n_tok).tolist()
                for _ in range(loops)]

    def reserve(lists):
        for toks in lists:
            for c in KvCache.with_pool_many(layers, h, d, pool, n_tok + 1, tokens=toks):
                c.close()

    def reserve_plain(lists):
        for _ in lists:
            for c in KvCache.with_pool_many(layers, h, d, pool, n_tok + 1):
                c.close()

    def filled_caches():
        got = KvCache.with_pool_many(layers, h, d, pool, n_tok + 1)
        for c in got:
            c.advance_len(n_tok)
        return got, token_lists()[0]

    def publish(state):
        pool.publish(*state)
        for c in state[0]:
            c.close()

    best = best_of([("lookup", token_lists, reserve), ("plain", token_lists, reserve_plain),
                    ("publish", filled_caches, publish),
                    ("extend", lambda: None, _extend_layers(pool, layers, n_tok, ks, vs))],
                   reps * 2)
    lookup = max(best["lookup"] - best["plain"], 0.0) / loops
    cost = lookup + best["publish"]
    res.add(g, "8x128", "sharing.bookkeeping", f"lookup + publish of {n_tok} new tokens, "
            f"{layers} layers", cost * 1e6, "us", cost / best["extend"],
            f"extend {n_tok} into {layers} layers", layers=layers,
            lookup_us=lookup * 1e6, publish_us=best["publish"] * 1e6)
    assert pool.stats()["prefix_hits"] == 0
    pool.check()


def bench_chat(res, quick=False, log=print):
    """Prefill time of chat turns 2-4 with prefix reuse (the prompt's
    published history is reused, only the rest is computed) against the same
    FerroxCache path without a prefix cache, on the hf group's model."""
    import torch

    import ferrox_kv.hf  # noqa: F401
    from ferrox_kv import KvBlockPool
    from ferrox_kv.bench.llama import make_model
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


def run(r):
    log("sharing: forks, prefix reuse, bookkeeping")
    bench_sharing(r.res, r.quick, r.reps)
    if r.hf_ok:
        with Torch1():
            bench_chat(r.res, quick=r.quick, log=log)


TARGETS = [
    Target("blocks held by a parent + 8 forks vs the parent alone", "sharing.fork_blocks",
           "<=", 1.3),
    Target("blocks in use, 16 requests sharing a 1024-token prefix vs unshared",
           "sharing.prefix_blocks", "<=", 0.15),
    Target("with_pool_many on a full prefix hit vs extend of those rows",
           "sharing.hit_vs_extend", "<=", 0.05),
    Target("prefix bookkeeping (lookup + publish) at a 0% hit rate vs extend",
           "sharing.bookkeeping", "<=", 0.02),
    Target("prefill of chat turns 2-4 with prefix reuse vs without", "sharing.chat_prefill",
           "<=", 0.3),
]

GROUP = Group("sharing", "forks, prefix reuse and the prefix cache's bookkeeping", run,
              targets=lambda res: TARGETS,
              hf_rows="the chat-turn prefill row of the sharing group")
