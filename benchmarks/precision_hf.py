"""Accuracy of reduced storage on the hf bench model (ferrox_kv/bench/llama.py:
a 2-layer Llama with Llama-3-8B's attention geometry), float32 weights
scaled by --weight-scale so that greedy output is not a repeated pair of
tokens. A float32 FerroxCache generates --tokens greedy tokens (the
reference); each storage dtype then decodes teacher-forced on those tokens
(so one flipped token does not make the rest incomparable) with the
"ferrox" attention. Reports, per dtype: the steps whose argmax agrees with
the reference, the largest logit difference, and free-running greedy: the
tokens identical before the first divergence.

    python benchmarks/precision_hf.py [--tokens 512] [--weight-scale 2]
"""
import argparse
import sys

import torch

import ferrox_kv.hf  # noqa: F401  (registers "ferrox")
from ferrox_kv.bench.llama import make_model
from ferrox_kv.hf import FerroxCache


def _teacher_forced(model, seq, prompt_len, cache):
    out = []
    with torch.no_grad():
        r = model(seq[:, :prompt_len], cache=cache, use_cache=True)
        out.append(r.logits[0, -1])
        for t in range(prompt_len, seq.shape[1] - 1):
            r = model(seq[:, t:t + 1], cache=cache, use_cache=True)
            out.append(r.logits[0, -1])
    return torch.stack(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--weight-scale", type=float, default=2.0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    _, model = make_model(args.prompt + args.tokens + 8)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(args.weight_scale)
    model.set_attn_implementation("ferrox")
    model.generation_config.pad_token_id = 0
    ids = torch.randint(1, model.config.vocab_size, (1, args.prompt),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model.generate(ids, cache=FerroxCache(model.config, dtype="float32"),
                             max_new_tokens=args.tokens, min_new_tokens=args.tokens,
                             do_sample=False)
    gen = ref[0, args.prompt:]
    print(f"reference: {args.tokens} greedy tokens, {len(set(gen.tolist()))} distinct "
          f"(weights x {args.weight_scale})")
    truth = _teacher_forced(model, ref, args.prompt, FerroxCache(model.config, dtype="float32"))
    for dt in ("float16", "bfloat16", "int8"):
        got = _teacher_forced(model, ref, args.prompt, FerroxCache(model.config, dtype=dt))
        agree = int((got.argmax(-1) == truth.argmax(-1)).sum())
        diff = float((got - truth).abs().max())
        with torch.no_grad():
            free = model.generate(ids, cache=FerroxCache(model.config, dtype=dt),
                                  max_new_tokens=args.tokens, min_new_tokens=args.tokens,
                                  do_sample=False)[0, args.prompt:]
        same = (free == gen).int()
        first = int(same.argmin()) if not bool(same.all()) else len(gen)
        print(f"{dt:>9}: teacher-forced argmax agrees at {agree}/{len(truth)} steps, largest "
              f"logit difference {diff:.4g}; free-running: identical for the first {first} "
              f"of {len(gen)} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
