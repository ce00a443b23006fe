"""Group attention: decode attention (one query position, 32 query heads over
8 KV heads x 128) read in place from a pooled cache, against torch SDPA on
contiguous tensors, a gather + SDPA, and the read floor; a causal chunk; a
batch of 8 sequences; and ``attend_many`` from 2 Python threads against the
read floor from 2 threads. The decode rows run calls back to back (a
context that fits the CPU's caches is read from there) and again from
memory (``attention.mem.*``: each call alone after the caches were
evicted, as a model's decode reads each layer's rows). Every row runs at 1
thread and at N (the bench's ``--threads``), with torch and the read floor
at the same count: a row's ``threads`` field says which."""
import numpy as np

import ferrox_kv
from ferrox_kv import KvBlockPool, KvCache, _core
from ferrox_kv.bench.common import (ATTN_DIM, ATTN_HEADS, ATTN_KV_HEADS, BLOCK_SIZE, Group,
                                    Threads, heads_first, log, thread_counts, thread_tag)
from ferrox_kv.bench.harness import best_from_memory, best_of, loops_for, scaling
from ferrox_kv.bench.targets import Figure, Target


def _causal_mask(torch, q_len, kv_len):
    """Bottom-right aligned: the q_len queries are the last positions."""
    qpos = torch.arange(kv_len - q_len, kv_len).view(-1, 1)
    return torch.arange(kv_len).view(1, -1) <= qpos


def bench_attention(res, contexts, reps, target_s, chunk, torch, threads=1):
    """Decode attention (one query position, 32 heads over 8 KV heads x 128)
    over a pooled KvCache, against torch SDPA on contiguous tensors of the
    same data, a gather + SDPA, and the read floor; a causal chunk; and
    attend_many from 2 threads against the read floor from 2 threads. On
    ``threads`` threads (torch and the floor too); the 2-Python-thread rows
    at 1 only."""
    H, KVH, D = ATTN_HEADS, ATTN_KV_HEADS, ATTN_DIM
    tag = thread_tag(threads)
    geo = "llama8b"
    g = "attention"
    F = torch.nn.functional if torch is not None else None
    row_bytes = 2 * KVH * D * 4
    rng = np.random.default_rng(20)
    for T in contexts:
        nb = -(-T // BLOCK_SIZE)
        pool = KvBlockPool(BLOCK_SIZE, 3 * nb, KVH, D)
        K = rng.standard_normal((T, KVH, D), dtype=np.float32)
        V = rng.standard_normal((T, KVH, D), dtype=np.float32)
        cache = KvCache.with_pool(KVH, D, pool, T)
        cache.extend(K, V)
        q = rng.standard_normal((H, D), dtype=np.float32)
        out = np.empty((H, D), np.float32)

        def attend_once(_):
            cache.attend(q, out=out)

        n = loops_for(attend_once, target_s)
        variants = [
            ("attend", lambda: None, lambda _: [cache.attend(q) for _ in range(n)]),
            ("floor", lambda: None, lambda _: _core._read_floor([cache], n, threads)),
        ]
        diff = None
        if torch is not None:
            # what DynamicCache hands attention: contiguous (1, KVH, T, D)
            kt = heads_first(torch, K)
            vt = heads_first(torch, V)
            qt = torch.from_numpy(q)[None, :, None, :]
            full = torch.ones(1, 1, 1, T, dtype=torch.bool)
            rep = H // KVH

            def sdpa(_):
                for _ in range(n):
                    F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

            def repeat_kv_sdpa(_):
                # transformers' path when a mask is present: repeat_kv, then a
                # masked SDPA over 32 heads
                for _ in range(n):
                    kr = kt[:, :, None].expand(1, KVH, rep, T, D).reshape(1, H, T, D)
                    vr = vt[:, :, None].expand(1, KVH, rep, T, D).reshape(1, H, T, D)
                    F.scaled_dot_product_attention(qt, kr, vr, attn_mask=full)

            def gather_sdpa(_):
                # what a paged cache without an in-place kernel does: gather
                # the blocks (cache.k / cache.v), then SDPA on the copies
                for _ in range(n):
                    kg = torch.from_numpy(cache.k).permute(1, 0, 2)[None]
                    vg = torch.from_numpy(cache.v).permute(1, 0, 2)[None]
                    F.scaled_dot_product_attention(qt, kg, vg, enable_gqa=True)

            variants += [("sdpa", lambda: None, sdpa),
                         ("repeat_kv_sdpa", lambda: None, repeat_kv_sdpa),
                         ("gather_sdpa", lambda: None, gather_sdpa)]
            ref = F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)[0, :, 0].numpy()
            diff = float(np.abs(cache.attend(q) - ref).max())
        best = best_of(variants, reps)
        us = {k: v / n * 1e6 for k, v in best.items()}
        ctx_bytes = T * row_bytes
        gbs = {k: ctx_bytes / (v * 1e-6) / 1e9 for k, v in us.items()}
        extra = dict(context=T, calls=n, threads=threads)
        res.add(g, geo, "attention.floor", tag + f"read floor: K+V read once, C @ {T}", us["floor"],
                "us/call", read_gbs=gbs["floor"], **extra)
        if torch is not None:
            res.add(g, geo, "attention.sdpa", tag + f"SDPA, contiguous (1,8,T,128), GQA @ {T}",
                    us["sdpa"], "us/call", us["sdpa"] / us["floor"], "read floor", **extra)
            res.add(g, geo, "attention.repeat_kv_sdpa", tag + f"repeat_kv + masked SDPA @ {T}",
                    us["repeat_kv_sdpa"], "us/call", us["repeat_kv_sdpa"] / us["sdpa"], "SDPA",
                    **extra)
            res.add(g, geo, "attention.gather_sdpa", tag + f"gather .k/.v + SDPA @ {T}",
                    us["gather_sdpa"], "us/call", us["gather_sdpa"] / us["sdpa"], "SDPA",
                    **extra)
            res.add(g, geo, "attention.attend.vs_sdpa", tag + f"attend, pooled, in place @ {T}",
                    us["attend"], "us/call", us["attend"] / us["sdpa"], "SDPA",
                    max_abs_diff=diff, read_gbs=gbs["attend"], **extra)
            res.add(g, geo, "attention.attend.vs_gather", tag + f"attend, pooled, in place @ {T}",
                    us["attend"], "us/call", us["gather_sdpa"] / us["attend"],
                    "speed-up over gather+SDPA", better="higher", **extra)
        res.add(g, geo, "attention.attend.vs_floor", tag + f"attend, pooled, in place @ {T}",
                us["attend"], "us/call", us["attend"] / us["floor"], "read floor",
                read_gbs=gbs["attend"], **extra)

        sdpa_once = (None if torch is None else
                     lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True))
        _from_memory(res, cache, q, out, threads, reps, sdpa_once, T)

        if threads > 1:
            one = res.find("attention.attend.vs_floor", context=T, threads=1)
            if one is not None:
                res.add(g, geo, "attention.attend.vs_1thread", tag + f"attend vs 1 thread @ {T}",
                        us["attend"], "us/call", us["attend"] / one["value"], "1 thread", **extra)
            cache.close()
            assert pool.free_blocks == pool.total_blocks
            continue

        # -- 2 threads, each attending its own cache on the shared pool --------
        tcaches = [KvCache.with_pool(KVH, D, pool, T) for _ in range(2)]
        for c in tcaches:
            c.extend(K, V)
        tq = [q[None, None].copy() for _ in range(2)]
        tout = [np.empty((1, 1, H, D), np.float32) for _ in range(2)]

        def many_once(i):
            ferrox_kv.attend_many([tcaches[i]], tq[i], out=tout[i])

        def floor_once(i):
            _core._read_floor([tcaches[i]], 1)

        loops = {"attend_many": loops_for(many_once, target_s),
                 "floor": loops_for(floor_once, target_s)}

        def looped(fn, m):
            def work(i):
                for _ in range(m):
                    fn(i)
            return work

        best2 = scaling([("attend_many", looped(many_once, loops["attend_many"])),
                          ("floor", looped(floor_once, loops["floor"]))], [1, 2], reps)
        scale = {}
        for name in ("attend_many", "floor"):
            scale[name] = 2 * best2[name, 1] / best2[name, 2]
            agg = 2 * loops[name] * ctx_bytes / best2[name, 2] / 1e9
            res.add(g, geo, f"attention.threads2.{name}",
                    f"[2 threads] {'attend_many' if name == 'attend_many' else 'read floor'}"
                    f" @ {T}", agg, "GB/s", scale[name], "1 thread", callers=2, **extra)
        res.add(g, geo, "attention.threads2.vs_floor", f"[2 threads] attend_many scaling @ {T}",
                scale["attend_many"], "x", scale["attend_many"] / scale["floor"],
                "floor's 2-thread scaling", callers=2, **extra)
        for c in tcaches + [cache]:
            c.close()
        assert pool.free_blocks == pool.total_blocks

    # -- a causal chunk (prefill of q_len positions over a longer context) ---
    q_len, T = chunk
    pool = KvBlockPool(BLOCK_SIZE, -(-T // BLOCK_SIZE), KVH, D)
    cache = KvCache.with_pool(KVH, D, pool, T)
    K = rng.standard_normal((T, KVH, D), dtype=np.float32)
    V = rng.standard_normal((T, KVH, D), dtype=np.float32)
    cache.extend(K, V)
    qc = rng.standard_normal((q_len, H, D), dtype=np.float32)
    variants = [("attend", lambda: None, lambda _: cache.attend(qc))]
    if torch is not None:
        kt = heads_first(torch, K)
        vt = heads_first(torch, V)
        qt = heads_first(torch, qc)
        mask = _causal_mask(torch, q_len, T)
        variants.append(("sdpa", lambda: None, lambda _: F.scaled_dot_product_attention(
            qt, kt, vt, attn_mask=mask, enable_gqa=True)))
    best = best_of(variants, reps)
    name = f"causal chunk: {q_len} queries over {T}"
    if torch is not None:
        res.add(g, geo, "attention.chunk.sdpa", tag + f"SDPA, {name}", best["sdpa"] * 1e6, "us/call",
                context=T, q_len=q_len, threads=threads)
        res.add(g, geo, "attention.chunk.attend", tag + f"attend, {name}", best["attend"] * 1e6,
                "us/call", best["attend"] / best["sdpa"], "SDPA, causal mask", context=T,
                q_len=q_len, threads=threads)
    else:
        res.add(g, geo, "attention.chunk.attend", tag + f"attend, {name}", best["attend"] * 1e6,
                "us/call", context=T, q_len=q_len, threads=threads)
    cache.close()

    # -- a batch: 8 sequences decoding, against SDPA over the padded batch ---
    B, T = 8, max(contexts) if max(contexts) <= 2048 else 2048
    pool = KvBlockPool(BLOCK_SIZE, B * -(-T // BLOCK_SIZE), KVH, D)
    lens = [T - 37 * b for b in range(B)]
    seqs = [KvCache.with_pool(KVH, D, pool, T) for _ in range(B)]
    Kb = rng.standard_normal((B, T, KVH, D), dtype=np.float32)
    Vb = rng.standard_normal((B, T, KVH, D), dtype=np.float32)
    for b, c in enumerate(seqs):
        c.extend(Kb[b, :lens[b]], Vb[b, :lens[b]])
    qb = rng.standard_normal((B, 1, H, D), dtype=np.float32)
    variants = [("attend_many", lambda: None, lambda _: ferrox_kv.attend_many(seqs, qb))]
    if torch is not None:
        kt = torch.from_numpy(np.ascontiguousarray(Kb.transpose(0, 2, 1, 3)))
        vt = torch.from_numpy(np.ascontiguousarray(Vb.transpose(0, 2, 1, 3)))
        qt = torch.from_numpy(np.ascontiguousarray(qb.transpose(0, 2, 1, 3)))
        pad = torch.arange(T)[None, :] < torch.tensor(lens)[:, None]
        pmask = pad[:, None, None, :]
        variants.append(("sdpa", lambda: None, lambda _: F.scaled_dot_product_attention(
            qt, kt, vt, attn_mask=pmask, enable_gqa=True)))
    best = best_of(variants, reps)
    name = f"batch of {B} x {T} (lengths {lens[-1]}..{T})"
    if torch is not None:
        res.add(g, geo, "attention.many.sdpa", tag + f"SDPA over the padded batch, {name}",
                best["sdpa"] * 1e6, "us/call", context=T, batch=B, threads=threads)
        res.add(g, geo, "attention.many.attend", tag + f"attend_many, {name}",
                best["attend_many"] * 1e6, "us/call", best["attend_many"] / best["sdpa"],
                "SDPA, padded batch", context=T, batch=B, threads=threads)
    else:
        res.add(g, geo, "attention.many.attend", tag + f"attend_many, {name}",
                best["attend_many"] * 1e6, "us/call", context=T, batch=B, threads=threads)
    for c in seqs:
        c.close()
    assert pool.free_blocks == pool.total_blocks


def _from_memory(res, cache, q, out, threads, reps, sdpa_once, T):
    """The decode rows again, each call timed alone after the caches were
    evicted (``best_from_memory``): attend, the read floor and SDPA
    (``sdpa_once``, None without torch) reading K/V from memory, as a
    model's decode reads each layer's rows (the rows above run calls back
    to back, so a context that fits the CPU's caches is read from there)."""
    tag = thread_tag(threads)
    calls = [("attend", lambda: cache.attend(q, out=out)),
             ("floor", lambda: _core._read_floor([cache], 1, threads))]
    if sdpa_once is not None:
        calls.append(("sdpa", sdpa_once))
    us = best_from_memory(calls, reps)
    geo, g = "llama8b", "attention"
    extra = dict(context=T, threads=threads, memory=True)
    res.add(g, geo, "attention.mem.floor", tag + f"read floor from memory @ {T}", us["floor"],
            "us/call", **extra)
    if sdpa_once is not None:
        res.add(g, geo, "attention.mem.sdpa", tag + f"SDPA from memory @ {T}", us["sdpa"],
                "us/call", us["sdpa"] / us["floor"], "read floor from memory", **extra)
        res.add(g, geo, "attention.mem.attend.vs_sdpa", tag + f"attend from memory @ {T}",
                us["attend"], "us/call", us["attend"] / us["sdpa"], "SDPA from memory",
                floor_vs_sdpa=us["floor"] / us["sdpa"], **extra)
    res.add(g, geo, "attention.mem.attend.vs_floor", tag + f"attend from memory @ {T}",
            us["attend"], "us/call", us["attend"] / us["floor"], "read floor from memory", **extra)
    one = res.find("attention.mem.attend.vs_floor", context=T, threads=1)
    if threads > 1 and one is not None:
        res.add(g, geo, "attention.mem.attend.vs_1thread", tag + f"attend from memory vs 1 thread @ {T}",
                us["attend"], "us/call", us["attend"] / one["value"], "1 thread, from memory", **extra)


def run(r):
    contexts = r.contexts or ([256, 1024] if r.quick else [512, 2048, 8192])
    chunk = (64, 512) if r.quick else (256, 2048)
    if r.contexts:     # a chunk no longer than the contexts asked for
        chunk = (min(chunk[0], max(r.contexts)), min(chunk[1], max(r.contexts)))
    for n in thread_counts(r.args):
        log(f"attention at {n} thread(s), contexts {contexts}, causal chunk {chunk[0]} over {chunk[1]}")
        with Threads(n) as torch:
            bench_attention(r.res, contexts, 3 if r.quick else 7, 0.02 if r.quick else 0.05,
                            chunk, torch if r.torch_ok else None, threads=n)


# the N-thread goals (the issue's): N threads over 1 at 8192, by N
SCALING_GOALS = {2: 0.6, 16: 0.15}


def targets(res):
    """Per context of this run: at 1 thread, goals from 512 (SDPA) or 2048
    (gather, the read floor) positions on, and the 2-thread scaling against
    the floor's; at N threads, against SDPA and the floor at N threads and
    N threads against 1."""
    out = []
    for r in res.rows:
        if r["group"] != "attention" or "context" not in r:
            continue
        T, n = r["context"], r.get("threads", 1)
        at = {"context": T, "threads": n}
        if n > 1:
            lead = thread_tag(n)
            # each decode goal twice: calls back to back, and from memory
            mem = ", from memory" if r["slug"].startswith("attention.mem.") else ""
            slug = r["slug"].replace("attention.mem.", "attention.")
            if slug == "attention.attend.vs_sdpa":
                # from memory, a miss where the read floor itself misses is the hardware's
                floor = Figure("the read floor vs SDPA", r["slug"], at, "floor_vs_sdpa") if mem else None
                out.append(Target(lead + f"attend vs SDPA at {n} threads{mem} @ {T}", r["slug"],
                                  "<=" if T >= 2048 else "info", 0.5 if T >= 2048 else None, at,
                                  bound_by=floor))
            elif slug == "attention.attend.vs_floor":
                out.append(Target(lead + f"attend vs the {n}-thread read floor{mem} @ {T}", r["slug"],
                                  "<=" if T >= 2048 else "info", 1.5 if T >= 2048 else None, at))
            elif slug == "attention.attend.vs_1thread":
                goal = SCALING_GOALS.get(n) if T >= 8192 else None   # the context
                out.append(Target(lead + f"attend at {n} threads vs 1{mem} @ {T}", r["slug"],
                                  "<=" if goal else "info", goal, at))
            elif r["slug"] == "attention.many.attend" and r.get("ratio") is not None:
                out.append(Target(lead + f"attend_many, 8 sequences, vs SDPA padded @ {T}", r["slug"],
                                  "<=", 0.5, at))
            elif r["slug"] == "attention.chunk.attend" and r.get("ratio") is not None:
                out.append(Target(lead + f"causal chunk vs SDPA causal @ {T}", r["slug"],
                                  "<=", 1.0, at))
            continue
        if r["slug"].startswith(("attention.chunk", "attention.many")):
            continue
        if r["slug"] == "attention.attend.vs_sdpa":
            out.append(Target(f"attend vs SDPA (contiguous) @ {T}", r["slug"],
                              "<=" if T >= 512 else "info", 1.0 if T >= 512 else None, at,
                              related=[Figure("attend read K/V at", "attention.attend.vs_floor",
                                              at, "read_gbs", " GB/s"),
                                       Figure("the read floor at", "attention.floor", at,
                                              "read_gbs", " GB/s")]))
        elif r["slug"] == "attention.attend.vs_gather":
            out.append(Target(f"attend speed-up over gather + SDPA @ {T}", r["slug"],
                              ">=" if T >= 2048 else "info", 3.0 if T >= 2048 else None, at))
        elif r["slug"] == "attention.attend.vs_floor":
            out.append(Target(f"attend vs read floor (stretch) @ {T}", r["slug"],
                              "<=" if T >= 2048 else "info", 1.3 if T >= 2048 else None, at))
        elif r["slug"] == "attention.threads2.vs_floor":
            out.append(Target(f"attend_many 2-thread scaling / floor's @ {T}", r["slug"],
                              ">=", 0.9, at,
                              related=[Figure("attend_many scaled", "attention.threads2."
                                              "attend_many", at, unit="x"),
                                       Figure("the read floor", "attention.threads2.floor",
                                              at, unit="x")]))
    return out


GROUP = Group("attention", "decode attention, 32 query / 8 KV heads x 128, at 1 and N threads",
              run, targets=targets, torch_rows="the attention rows against torch SDPA")
