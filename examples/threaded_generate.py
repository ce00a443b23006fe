"""Many request threads, one bounded KV pool, a shared system prompt.

A server-shaped example: one ``KvBlockPool`` sized for only a few requests at
once, and N request threads, each generating for its own prompt (a system
prompt every request shares, then its own text) with its own
``FerroxCache``. A request reserves its worst case (prompt + max_new_tokens,
every layer) when it is admitted, so it can never fail mid-decode; a request
that does not fit waits for blocks to come back and retries, and is refused
after a timeout. The model reads the cache in place (``attn_implementation=
"ferrox"``).

It runs twice: without and with the pool's prefix cache. With it, a request
publishes what it computed when it is done, and later requests reuse the
system prompt's blocks (and skip computing them): the hit rate, the blocks
saved and the time to first token say what that buys. At the end every block
is back in the pool.

    python examples/threaded_generate.py [--threads 8] [--new-tokens 32] [--redis URL]

With ``--redis redis://host:port/db`` the prefix-cache run's pool has a
``RedisPrefixStore`` attached (``pip install '.[redis]'``): what a
request publishes is written through to Redis, and a prompt whose prefix is
missing locally is read through from there. Run it twice, as two processes:
the second one's first request finds the system prompt in Redis instead of
computing it (compare the ``first request`` lines). The store's fingerprint
is ``ferrox_kv.hf.fingerprint(model)``: the same seeded weights in both.

The model is a tiny randomly initialised Llama (no download), so the tokens
are meaningless; the point is the admission control and the accounting.
"""
import argparse
import statistics
import threading
import time

import torch
import transformers
from transformers.generation.streamers import BaseStreamer

import ferrox_kv.hf  # noqa: F401  (registers the "ferrox" attention)
from ferrox_kv import KvBlockPool, KvPoolExhausted
from ferrox_kv.hf import FerroxCache, kv_geometry


class Admission:
    """Admit a request when the pool can reserve its worst case; else wait."""

    def __init__(self, pool):
        self.pool = pool
        self.returned = threading.Condition()
        self.waits = 0
        self.refused = 0

    def open(self, config, max_seq_len, timeout, tokens):
        deadline = time.monotonic() + timeout
        while True:
            try:
                return FerroxCache(config, pool=self.pool, max_seq_len=max_seq_len,
                                   tokens=tokens if self.pool.prefix_cache else None)
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


class FirstToken(BaseStreamer):
    """Records when generate produces its first token."""

    def __init__(self):
        self.calls = 0
        self.at = None

    def put(self, value):
        self.calls += 1
        if self.calls == 2 and self.at is None:        # the first call is the prompt
            self.at = time.perf_counter()

    def end(self):
        pass


def serve(model, config, args, prefix_cache, store=None):
    layers, n_kv, head_dim = kv_geometry(config)
    block_size = 16
    prompt_len = args.system_len + args.user_len
    max_seq_len = prompt_len + args.new_tokens
    per_request = layers * -(-max_seq_len // block_size)
    pool = KvBlockPool(block_size, per_request * args.fits, n_kv, head_dim,
                       prefix_cache=prefix_cache)
    if store is not None:
        pool.attach(store)
    admission = Admission(pool)
    system = torch.randint(1, config.vocab_size, (1, args.system_len),
                           generator=torch.Generator().manual_seed(0))
    done_tokens, ttft, errors = [], [], []
    first_request = {}

    def request(i):
        try:
            user = torch.randint(1, config.vocab_size, (1, args.user_len),
                                 generator=torch.Generator().manual_seed(i + 1))
            prompt = torch.cat([system, user], dim=1)
            t0 = time.perf_counter()
            cache = admission.open(config, max_seq_len, args.timeout, prompt[0])
            if cache is None:
                print(f"  request {i}: refused after {args.timeout:.1f} s")
                return
            reused = cache.get_seq_length()
            try:
                first = FirstToken()
                with torch.no_grad():
                    out = model.generate(prompt, cache=cache, max_new_tokens=args.new_tokens,
                                         do_sample=False, streamer=first)
                ttft.append(first.at - t0)
                if i == 0:
                    first_request.update(ttft=first.at - t0, reused=reused)
                done_tokens.append(out.shape[1] - prompt_len)
                if prefix_cache:
                    cache.publish(out[0])           # the next requests reuse these blocks
            finally:
                admission.close(cache)
        except BaseException as e:
            errors.append(e)

    t0 = time.perf_counter()
    # the first request goes alone, so that the others can find its prefix
    first = threading.Thread(target=request, args=(0,))
    first.start()
    first.join()
    threads = [threading.Thread(target=request, args=(i,)) for i in range(1, args.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]

    s = pool.stats()
    label = "with the prefix cache" if prefix_cache else "without a prefix cache"
    print(f"{label}: pool of {pool.total_blocks} blocks x {block_size} positions "
          f"({pool.total_blocks * pool.block_bytes / 2**20:.2f} MiB), {per_request} blocks "
          f"reserved per request, so {args.fits} fit at once")
    print(f"  requests: {len(done_tokens)} served, {admission.refused} refused, "
          f"{admission.waits} waits for blocks")
    print(f"  tokens: {sum(done_tokens)} in {elapsed:.2f} s = {sum(done_tokens) / elapsed:.1f} "
          f"tokens/s; time to first token: median {statistics.median(ttft) * 1e3:.1f} ms")
    if prefix_cache:
        lookups = s["prefix_hits"] + s["prefix_misses"]
        print(f"  prefix cache: {s['prefix_hits']} of {lookups} requests hit "
              f"({s['prefix_hits'] / max(lookups, 1):.0%}), {s['hit_tokens']} positions reused "
              f"= {s['hit_tokens'] // block_size * layers} blocks shared instead of computed "
              f"and stored anew; {s['cached_blocks']} blocks cached, {s['evictions']} evicted")
    if first_request:
        print(f"  first request: time to first token {first_request['ttft'] * 1e3:.1f} ms, "
              f"{first_request['reused']} prompt positions reused")
    if store is not None:
        print(f"  store: {s['store_hits']} remote hits, {s['store_tokens_fetched']} positions "
              f"fetched, {s['store_tokens_written']} written, {s['store_errors']} errors")
    print(f"  pool: high-water {s['high_water']} of {s['total_blocks']} blocks, "
          f"refusals {s['refused']}")
    pool.check()
    assert s["used_blocks"] == 0, "blocks leaked"
    return statistics.median(ttft)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--system-len", type=int, default=96, help="shared system prompt tokens")
    ap.add_argument("--user-len", type=int, default=16, help="each request's own tokens")
    ap.add_argument("--fits", type=int, default=2, help="requests the pool can hold at once")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds a request may wait")
    ap.add_argument("--redis", metavar="URL", default=None,
                    help="share the prefix cache through this Redis (redis://host:port/db)")
    args = ap.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(1)                 # one core per request thread
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
    model = transformers.LlamaForCausalLM(config).eval()
    model.generation_config.pad_token_id = 0
    model.set_attn_implementation("ferrox")  # read the cache in place

    without = serve(model, config, args, prefix_cache=False)
    store = None
    if args.redis is not None:
        from ferrox_kv.hf import fingerprint
        from ferrox_kv.store import RedisPrefixStore
        store = RedisPrefixStore(args.redis, namespace="threaded_generate",
                                 fingerprint=fingerprint(model))
    with_ = serve(model, config, args, prefix_cache=True, store=store)
    print(f"time to first token with the prefix cache: {with_ / without:.2f}x of without")
    print("every block is back in the pool")


if __name__ == "__main__":
    main()
