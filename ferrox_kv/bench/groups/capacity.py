"""Group capacity: more sequences per GiB (issue 26), no timings.

Rows (slug: what, ratio of):
  capacity.window_bytes        Gemma 3-like layers (5 of 6 with a 1,024 window, 8 KV
                               heads x 128 -- the llama8b KV geometry -- block 16):
                               bytes the pool holds for one sequence decoded to 8,192
                               positions, of the same sequence with every layer whole
  capacity.outlier.<case>      K with outlier channels, stored int4 with the Hadamard
                               rotation: relative RMS error of the scores q.k (from
                               ``.k``) against float64, of int4 without the rotation;
                               int8's beside. Cases: channels per head x factor,
                               scaled (a channel's values times it) or offset (plus it)
  capacity.logits.<dt>         (with transformers) the hf group's model (2 layers, 8 KV
                               heads x 128) with its q/k projections scaled by
                               LOGIT_QK_SCALE (attention scores of a trained model's spread,
                               where random weights give near-uniform attention), decoded
                               teacher-forced over 256 tokens (64 with --quick) through
                               FerroxCache and the
                               ferrox attention: largest logit error against a float32
                               cache, of bfloat16's
"""
import numpy as np

from ferrox_kv import KvBlockPool, KvCache
from ferrox_kv.bench.common import BLOCK_SIZE, Group, log
from ferrox_kv.bench.targets import Target

KVH, D, H = 8, 128, 32
WINDOW, LAYERS, SLIDING, POSITIONS, CHUNK = 1024, 6, 5, 8192, 512
# (channels per head, factor, how): the range, a couple of channels to four
OUTLIER_CASES = [(2, 10, "scaled"), (2, 50, "scaled"), (2, 100, "scaled"), (4, 50, "scaled"),
                 (2, 50, "offset")]


def _held_bytes(windowed):
    """Bytes the pool holds for one sequence at POSITIONS: the prompt
    prefilled in CHUNK-row extends, then decoded a position at a time over
    the last block (the caches' steady state)."""
    blocks = LAYERS * (POSITIONS // BLOCK_SIZE) + 64
    pool = KvBlockPool(BLOCK_SIZE, blocks, KVH, D)
    row = np.zeros((1, KVH, D), np.float32)
    chunk = np.zeros((CHUNK, KVH, D), np.float32)
    caches = [KvCache.with_pool(KVH, D, pool, POSITIONS,
                                window=WINDOW if windowed and layer < SLIDING else None)
              for layer in range(LAYERS)]
    prompt = POSITIONS - BLOCK_SIZE
    for c in caches:
        while c.seq_len + CHUNK <= prompt:
            c.extend(chunk, chunk)
        while c.seq_len < POSITIONS:
            c.extend(row, row)
    held = pool.used_blocks * pool.block_bytes
    pool.check()
    for c in caches:
        c.close()
    return held


def window_rows(res):
    whole, windowed = _held_bytes(False), _held_bytes(True)
    res.add("capacity", "gemma3-like", "capacity.window_bytes",
            f"bytes held per sequence at {POSITIONS}, {SLIDING} of {LAYERS} layers with a "
            f"{WINDOW} window", windowed, "B", windowed / whole, "every layer whole",
            whole_bytes=whole, positions=POSITIONS)


def _score_error(q, ex, cache):
    s = np.einsum("hgd,thd->hgt", q, cache.k.astype(np.float64))
    return float(np.sqrt(((s - ex) ** 2).mean() / (ex ** 2).mean()))


def outlier_rows(res, seeds=3):
    T = 2048
    for n, factor, how in OUTLIER_CASES:
        err = {"int8": [], "int4 rotated": [], "int4": []}
        for seed in range(seeds):
            rng = np.random.default_rng(seed)
            K = rng.standard_normal((T, KVH, D), dtype=np.float32)
            for h in range(KVH):
                ch = rng.choice(D, n, replace=False)
                if how == "scaled":
                    K[:, h, ch] *= factor
                else:
                    K[:, h, ch] += factor * np.sign(rng.standard_normal(n)).astype(np.float32)
            q = rng.standard_normal((KVH, H // KVH, D)).astype(np.float32).astype(np.float64)
            ex = np.einsum("hgd,thd->hgt", q, K.astype(np.float64))
            for name, kw in (("int8", {"dtype": "int8"}), ("int4 rotated", {"dtype": "int4", "rotate": True}),
                             ("int4", {"dtype": "int4", "rotate": False})):
                c = KvCache(KVH, D, **kw)
                c.extend(K, K)
                err[name].append(_score_error(q, ex, c))
        m = {k: float(np.mean(v)) for k, v in err.items()}
        case = f"{n}x{factor}.{how}"
        res.add("capacity", "llama8b", f"capacity.outlier.{case}",
                f"score error, {n} channels per head {how} by {factor}: int4 rotated vs int4",
                m["int4 rotated"], "rel err", m["int4 rotated"] / m["int4"], "int4 without rotation",
                better="lower", int4_err=m["int4"], int8_err=m["int8"], case=case)


LOGIT_TOKENS, LOGIT_PROMPT, LOGIT_QK_SCALE = 256, 16, 3.0


def _teacher_forced(model, ids, cache):
    """float32 logits of every step: ids' first LOGIT_PROMPT tokens as one
    prefill, then the rest one token at a time through ``cache``."""
    import torch
    out = []
    with torch.no_grad():
        r = model(ids[:, :LOGIT_PROMPT], cache=cache, use_cache=True)
        out.append(r.logits[0, -1].float())
        for t in range(LOGIT_PROMPT, ids.shape[1]):
            r = model(ids[:, t:t + 1], cache=cache, use_cache=True)
            out.append(r.logits[0, -1].float())
    return torch.stack(out)


def logit_rows(res, tokens=LOGIT_TOKENS):
    """Each storage dtype's largest logit error, teacher-forced over
    ``tokens`` tokens, against a float32 cache on the same model."""
    import torch

    from ferrox_kv.bench.llama import make_model
    from ferrox_kv.hf import ATTENTION, FerroxCache, kv_geometry

    cfg, model = make_model(tokens)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(LOGIT_QK_SCALE)
            layer.self_attn.k_proj.weight.mul_(LOGIT_QK_SCALE)
    model.set_attn_implementation(ATTENTION)
    layers, h, d = kv_geometry(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(26))
    blocks = layers * (-(-tokens // BLOCK_SIZE))
    logits = {}
    for dt, kw in (("float32", {}), ("bfloat16", {}), ("int8", {}), ("int4", {"rotate": True}),
                   ("int4 unrotated", {"rotate": False})):
        pool = KvBlockPool(BLOCK_SIZE, blocks, h, d, dtype=dt.split()[0], **kw)
        cache = FerroxCache(cfg, pool=pool, max_seq_len=tokens)
        logits[dt] = _teacher_forced(model, ids, cache)
        cache.close()
        pool.check()
    spread = float(logits["float32"].std())
    err = {dt: float((x - logits["float32"]).abs().max()) for dt, x in logits.items() if dt != "float32"}
    log(f"capacity logits, largest error vs float32 over {tokens} tokens: "
        + ", ".join(f"{k} {v:.4f}" for k, v in err.items()) + f" (logits' std {spread:.3f})")
    for dt, e in err.items():
        res.add("capacity", f"llama-{layers}L", f"capacity.logits.{dt.replace(' ', '_')}",
                f"largest logit error vs a float32 cache, {dt}, teacher-forced over {tokens}",
                e, "abs err", e / max(err["bfloat16"], 1e-12), "bfloat16's", better="lower",
                dtype=dt, logit_std=spread, tokens=tokens, qk_scale=LOGIT_QK_SCALE)


def run(r):
    log("capacity: bytes held with sliding windows, int4 score error with outliers")
    window_rows(r.res)
    outlier_rows(r.res, seeds=1 if r.quick else 3)
    if r.hf_ok:
        logit_rows(r.res, 64 if r.quick else LOGIT_TOKENS)


def targets(res):
    out = [Target("Gemma 3-like, 8192 positions: bytes held with windows vs whole",
                  "capacity.window_bytes", "<=", 0.3)]
    for n, factor, how in OUTLIER_CASES:
        case = f"{n}x{factor}.{how}"
        out.append(Target(f"score error with outliers ({case}): int4 rotated vs not",
                          f"capacity.outlier.{case}", "<=", 0.7, where={"case": case}))
    return out


GROUP = Group("capacity", "more sequences per GiB: sliding windows and int4", run, targets,
              hf_rows="the logit rows of the capacity group")
