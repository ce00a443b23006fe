"""Many request threads, one bounded KV pool.

A server-shaped example: one ``KvBlockPool`` sized for only a few requests at
once, and N request threads, each generating for its own prompt with its own
``FerroxCache``. A request reserves its worst case (prompt + max_new_tokens,
every layer) when it is admitted, so it can never fail mid-decode; a request
that does not fit waits for blocks to come back and retries, and is refused
after a timeout. At the end every block is back in the pool.

    python examples/threaded_generate.py [--threads 8] [--new-tokens 32]

The model is a tiny randomly initialised Llama (no download), so the tokens
are meaningless; the point is the admission control and the accounting.
"""
import argparse
import threading
import time

import torch
import transformers

from ferrox_kv import KvBlockPool, KvPoolExhausted
from ferrox_kv.hf import FerroxCache, kv_geometry


class Admission:
    """Admit a request when the pool can reserve its worst case; else wait."""

    def __init__(self, pool):
        self.pool = pool
        self.returned = threading.Condition()
        self.waits = 0
        self.refused = 0

    def open(self, config, max_seq_len, timeout):
        deadline = time.monotonic() + timeout
        while True:
            try:
                return FerroxCache(config, pool=self.pool, max_seq_len=max_seq_len)
            except KvPoolExhausted:
                with self.returned:
                    self.waits += 1
                    left = deadline - time.monotonic()
                    if left <= 0:
                        self.refused += 1
                        return None
                    self.returned.wait(min(left, 0.05))

    def close(self, cache):
        cache.close()
        with self.returned:
            self.returned.notify_all()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--fits", type=int, default=2, help="requests the pool can hold at once")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds a request may wait")
    args = ap.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(1)                 # one core per request thread
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
    model = transformers.LlamaForCausalLM(config).eval()
    model.generation_config.pad_token_id = 0

    layers, n_kv, head_dim = kv_geometry(config)
    block_size = 16
    max_seq_len = args.prompt_len + args.new_tokens
    per_request = layers * -(-max_seq_len // block_size)
    pool = KvBlockPool(block_size, per_request * args.fits, n_kv, head_dim)
    admission = Admission(pool)
    print(f"pool: {pool.total_blocks} blocks of {block_size} positions "
          f"({pool.total_blocks * pool.block_bytes / 2**20:.2f} MiB); "
          f"{per_request} blocks per request, so {args.fits} fit at once")

    done_tokens = []
    errors = []

    def request(i):
        try:
            prompt = torch.randint(1, config.vocab_size, (1, args.prompt_len),
                                   generator=torch.Generator().manual_seed(i))
            cache = admission.open(config, max_seq_len, args.timeout)
            if cache is None:
                print(f"request {i}: refused after {args.timeout:.1f} s")
                return
            try:
                with torch.no_grad():
                    out = model.generate(prompt, cache=cache, max_new_tokens=args.new_tokens,
                                         do_sample=False)
                done_tokens.append(out.shape[1] - args.prompt_len)
            finally:
                admission.close(cache)
        except BaseException as e:
            errors.append(e)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=request, args=(i,)) for i in range(args.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]

    s = pool.stats()
    print(f"requests: {len(done_tokens)} served, {admission.refused} refused, "
          f"{admission.waits} waits for blocks")
    print(f"tokens: {sum(done_tokens)} in {elapsed:.2f} s = {sum(done_tokens) / elapsed:.1f} tokens/s")
    print(f"pool: high-water {s['high_water']} of {s['total_blocks']} blocks, "
          f"acquired {s['acquired']}, released {s['released']}, refusals {s['refused']}")
    assert s["free_blocks"] == s["total_blocks"], "blocks leaked"
    assert s["high_water"] <= s["total_blocks"]
    print("every block is back in the pool")


if __name__ == "__main__":
    main()
