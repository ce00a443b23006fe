"""What refusing prefix hits on sliding-window layers costs (issue 26).

FerroxCache refuses ``tokens=`` (prefix reuse) on a model with sliding
layers unless ``sliding_windows=False`` stores those layers whole. This
script measures both sides of that choice on a Gemma 3-like text model (6
layers, 5 of them sliding, 8 KV heads x 128 as the bench's model, random
weights), one thread, the ferrox attention:

- time to first token of a request whose prompt is a published system prompt
  of SYSTEM tokens plus QUESTION tokens of its own: windows on (the whole
  prompt prefilled) against windows off with the prefix reused (only the
  question prefilled);
- blocks the pool holds for N such requests at once, each decoded to
  SYSTEM + QUESTION + ANSWER positions: windows on (every sequence's own
  window) against windows off with the system prompt's blocks shared.

  python benchmarks/window_prefix.py [--system 1024] [--window 512] [--requests 16]
"""
import argparse
import time

import torch
import transformers

from ferrox_kv import KvBlockPool
from ferrox_kv.hf import ATTENTION, FerroxCache, kv_geometry

BS = 16


def model_for(window, positions):
    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=1024, hidden_size=1024, intermediate_size=1024, num_hidden_layers=6,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, sliding_window=window,
        max_position_embeddings=max(2048, positions))
    m = transformers.Gemma3ForCausalLM(cfg).eval()
    m.set_attn_implementation(ATTENTION)
    return cfg, m


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--system", type=int, default=1024)
    ap.add_argument("--question", type=int, default=64)
    ap.add_argument("--answer", type=int, default=32)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    total = args.system + args.question + args.answer
    cfg, model = model_for(args.window, total)
    layers, h, d = kv_geometry(cfg)
    gen = torch.Generator().manual_seed(1)
    system = torch.randint(0, cfg.vocab_size, (1, args.system), generator=gen)
    questions = [torch.randint(0, cfg.vocab_size, (1, args.question), generator=gen)
                 for _ in range(args.requests)]
    per_seq = layers * (-(-total // BS) + 2)
    out = {}
    for windows in (True, False):
        pool = KvBlockPool(BS, args.requests * per_seq + per_seq, h, d, prefix_cache=not windows)
        with torch.no_grad():
            if not windows:                        # publish the system prompt once
                c = FerroxCache(cfg, pool=pool, max_seq_len=args.system, sliding_windows=False)
                model(input_ids=system, cache=c, use_cache=True)
                c.publish(system[0])
                c.close()
            ttft, caches = float("inf"), []
            for r, q in enumerate(questions):
                prompt = torch.cat([system, q], 1)
                kw = {} if windows else {"tokens": prompt[0], "sliding_windows": False}
                c = FerroxCache(cfg, pool=pool, max_seq_len=total, **kw)
                have = c.get_seq_length()
                t0 = time.perf_counter()
                o = model(input_ids=prompt[:, have:], cache=c, use_cache=True)
                nxt = o.logits[:, -1:].argmax(-1)
                if r < args.reps:
                    ttft = min(ttft, time.perf_counter() - t0)
                for _ in range(args.answer):
                    nxt = model(input_ids=nxt, cache=c, use_cache=True).logits[:, -1:].argmax(-1)
                caches.append(c)
            used = pool.used_blocks
            for c in caches:
                c.close()
            pool.check()
        out[windows] = (ttft, used)
        print(f"windows {'on ' if windows else 'off'}: TTFT {ttft * 1e3:8.1f} ms, "
              f"{args.requests} requests hold {used} blocks", flush=True)
    (t_on, b_on), (t_off, b_off) = out[True], out[False]
    print(f"\nGemma 3-like, 5 of 6 layers with a {args.window} window; system {args.system}, "
          f"question {args.question}, answer {args.answer}, {args.requests} requests")
    print("| what | windows on, no prefix hits | windows off, prefix reused | on / off |")
    print("| --- | --- | --- | --- |")
    print(f"| time to first token (ms) | {t_on * 1e3:.1f} | {t_off * 1e3:.1f} | {t_on / t_off:.2f} |")
    print(f"| blocks held, {args.requests} requests | {b_on} | {b_off} | {b_on / b_off:.2f} |")


if __name__ == "__main__":
    main()
