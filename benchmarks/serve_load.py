"""Load test of ``ferrox-kv serve`` on loopback (issue 15's table).

Starts the server (``python -m ferrox_kv.serve``) on the hf bench model
(hidden 1024, 2 layers, 32/8 heads x 128, random weights; written offline by
``ferrox_kv.serve.tiny --bench``), then drives it with an async httpx client
of its own: N concurrent clients, each sending ``--requests`` streaming
completions in turn, prompts of mixed lengths that share a system prompt,
``--max-tokens`` new tokens each (greedy). Bounded: every request has a
timeout, every run a request count.

Rows:

* ``batch`` and ``threads`` mode at each N (``--clients 1 4 16 64``): output
  tokens/s, p50/p99 latency and time to first token, statuses;
* prefix cache off at 16 clients (p99 TTFT, cached vs not);
* 64 clients on a pool sized for 8 requests (``--max-queue 16``): the share
  of 200 and of 503 + Retry-After, anything else;
* resident memory of the server after 64 clients vs after 1;
* ``--soak N``: N requests, a fifth of them dropped by their client at a
  random point; blocks lost afterwards;
* ``--generate-batch``: transformers' own continuous batching
  (``model.generate_batch``) on the same requests at 16, in process.

    python benchmarks/serve_load.py [--clients 1 4 16 64] [--requests 4] [--max-tokens 32]
        [--soak 10000] [--generate-batch] [--json FILE] [--plot FILE.png]

Figures on a busy machine are noisy; ratios within one run are what count.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time

import httpx

from ferrox_kv.serve._process import ServerProcess


def start(model_dir, *args):
    return ServerProcess(model_dir, *args, start_timeout=300)


def stop(srv):
    """SIGTERM; (exit status, the server's last line)."""
    rc = srv.stop(120)
    return rc, srv.log().strip().splitlines()[-1:]


def prompts(n, rng, system):
    tail = ("the pool", "a request reserves its worst case", "tenants never share blocks",
            "attention reads each sequence in place", "the queue is first in first out")
    return [system + " ".join(rng.choice(tail) for _ in range(rng.randrange(1, 12)))
            for _ in range(n)]


async def one(client, url, prompt, max_tokens, drop_after=None, timeout=120.0):
    """(status, retry_after, ttft, latency, tokens)."""
    t0 = time.perf_counter()
    ttft, n = None, 0
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", url + "/v1/completions", json=body,
                                 timeout=timeout) as r:
            if r.status_code != 200:
                await r.aread()
                return r.status_code, r.headers.get("retry-after"), None, None, 0
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                d = json.loads(line[6:])
                if d.get("usage"):
                    n = d["usage"]["completion_tokens"]
                elif ttft is None:
                    ttft = time.perf_counter() - t0
                if drop_after is not None:
                    drop_after -= 1
                    if drop_after <= 0:
                        return "dropped", None, None, None, 0
    except httpx.TimeoutException:
        return "timeout", None, None, None, 0
    return 200, None, ttft, time.perf_counter() - t0, n


def pct(xs, q):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


async def load(url, n_clients, per_client, max_tokens, rng, system):
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=n_clients + 4)) as client:
        async def worker():
            out = []
            for p in prompts(per_client, rng, system):
                out.append(await one(client, url, p, max_tokens))
            return out

        t0 = time.perf_counter()
        results = [r for rs in await asyncio.gather(*[worker() for _ in range(n_clients)])
                   for r in rs]
        wall = time.perf_counter() - t0
    ok = [r for r in results if r[0] == 200]
    statuses = {}
    for r in results:
        key = f"{r[0]}" + ("+RA" if r[0] == 503 and r[1] else "")
        statuses[key] = statuses.get(key, 0) + 1
    return {"clients": n_clients, "requests": len(results), "wall_s": wall,
            "tokens_per_s": sum(r[4] for r in ok) / wall,
            "p50_latency_s": pct([r[3] for r in ok], 50), "p99_latency_s": pct([r[3] for r in ok], 99),
            "p50_ttft_s": pct([r[2] for r in ok], 50), "p99_ttft_s": pct([r[2] for r in ok], 99),
            "statuses": statuses}


def run_mode(model_dir, mode, clients, args, system, extra=()):
    srv = start(model_dir, "--mode", mode, "--kv-blocks", args.kv_blocks, "--max-batch",
                 max(clients), "--max-queue", 256, "--queue-timeout", 300,
                 "--torch-threads", args.torch_threads, *extra)
    rows = []
    try:
        rss = {}
        for n in clients:
            rng = random.Random(n)
            row = asyncio.run(load(srv.url, n, args.requests, args.max_tokens, rng, system))
            srv.wait_idle()
            rss[n] = srv.rss_kib()
            row.update(mode=mode + ("" if not extra else " " + " ".join(map(str, extra))),
                       rss_kib=rss[n])
            rows.append(row)
            print(fmt(row), flush=True)
    finally:
        h = srv.wait_idle()
        rc, tail = stop(srv)
    return rows, h, rc, tail


def overload(model_dir, args, system):
    """64 clients, one request each, on a pool for 8 requests."""
    per_req = args.max_tokens + 160                      # the longest prompt + max_tokens
    blocks = 8 * 2 * -(-per_req // 16)
    srv = start(model_dir, "--kv-blocks", blocks, "--max-batch", 16, "--max-queue", 16,
                 "--queue-timeout", 5, "--torch-threads", args.torch_threads)
    try:
        rng = random.Random(64)
        row = asyncio.run(load(srv.url, 64, 1, args.max_tokens, rng, system))
        h = srv.wait_idle()
    finally:
        rc, tail = stop(srv)
    good = sum(v for k, v in row["statuses"].items() if k in ("200", "503+RA"))
    row.update(mode=f"pool for 8 ({blocks} blocks)", share_ok=good / row["requests"],
               used_blocks_after=h["used_blocks"], exit=rc, exit_line=tail)
    print(fmt(row), flush=True)
    return row


def soak(model_dir, args, system):
    srv = start(model_dir, "--kv-blocks", args.kv_blocks, "--max-batch", 16, "--max-queue", 64,
                 "--queue-timeout", 30, "--torch-threads", args.torch_threads)
    rng = random.Random(10)
    try:
        rss0 = None

        async def main():
            nonlocal rss0
            sem = asyncio.Semaphore(16)
            done = 0
            async with httpx.AsyncClient(limits=httpx.Limits(max_connections=32)) as client:
                async def go():
                    nonlocal done, rss0
                    async with sem:
                        drop = rng.randrange(1, 8) if rng.random() < 0.2 else None
                        r = await one(client, srv.url, prompts(1, rng, system)[0],
                                      rng.randrange(1, args.max_tokens + 1), drop_after=drop)
                        done += 1
                        if done == min(200, args.soak // 2):
                            rss0 = srv.rss_kib()
                        return r[0]
                return await asyncio.gather(*[go() for _ in range(args.soak)])

        t0 = time.perf_counter()
        statuses = asyncio.run(main())
        wall = time.perf_counter() - t0
        h = srv.wait_idle()
        rss1 = srv.rss_kib()
    finally:
        rc, tail = stop(srv)
    row = {"mode": "soak", "requests": args.soak, "wall_s": wall,
           "statuses": {str(s): statuses.count(s) for s in set(statuses)},
           "blocks_lost": h["used_blocks"], "rss_kib_early": rss0, "rss_kib_end": rss1,
           "exit": rc, "exit_line": tail}
    print(json.dumps(row), flush=True)
    return row


def generate_batch(model_dir, args, system):
    """transformers' continuous batching in process on 16 clients' requests."""
    import torch
    import transformers

    torch.set_num_threads(args.torch_threads)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    rng = random.Random(16)
    reqs = [tok(p)["input_ids"] for p in prompts(16 * args.requests, rng, system)]
    cfg = transformers.GenerationConfig(max_new_tokens=args.max_tokens, do_sample=False,
                                        eos_token_id=-1, pad_token_id=tok.pad_token_id)
    t0 = time.perf_counter()
    out = model.generate_batch(inputs=reqs, generation_config=cfg, progress_bar=False)
    wall = time.perf_counter() - t0
    n = sum(len(o.generated_tokens) for o in out.values())
    row = {"mode": "generate_batch (in process)", "clients": 16, "requests": len(reqs),
           "wall_s": wall, "tokens_per_s": n / wall}
    print(fmt(row), flush=True)
    return row


def fmt(r):
    s = f"{r['mode']:<28} N={r.get('clients', '-'):<3} req={r['requests']:<4} "
    if "tokens_per_s" in r:
        s += f"{r['tokens_per_s']:8.1f} tok/s  "
    if "p50_latency_s" in r:
        s += (f"lat p50 {r['p50_latency_s']:.3f} p99 {r['p99_latency_s']:.3f} s  "
              f"ttft p50 {r['p50_ttft_s']:.3f} p99 {r['p99_ttft_s']:.3f} s  ")
    if "statuses" in r:
        s += f"{r['statuses']}"
    return s


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--requests", type=int, default=4, help="requests per client (4)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--kv-blocks", type=int, default=4096)
    ap.add_argument("--torch-threads", type=int, default=1)
    ap.add_argument("--modes", nargs="+", default=["batch", "threads"])
    ap.add_argument("--soak", type=int, default=0, help="requests in the soak (0: none)")
    ap.add_argument("--generate-batch", action="store_true")
    ap.add_argument("--model-dir", default=None, help="default: the bench model, made in /tmp")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args(argv)
    from ferrox_kv.serve.tiny import BENCH, SYSTEM, make_model_dir

    model_dir = args.model_dir or os.path.join(tempfile.gettempdir(), "ferrox-serve-bench-model")
    if not os.path.exists(model_dir):
        make_model_dir(model_dir, **BENCH)
    system = SYSTEM * 2
    rows = []
    for mode in args.modes:
        r, h, rc, tail = run_mode(model_dir, mode, args.clients, args, system)
        rows += r
        print(f"  {mode}: used_blocks after {h['used_blocks']}, exit {rc} {tail}")
    if 16 in args.clients:
        r, h, rc, tail = run_mode(model_dir, "batch", [16], args, system,
                                  extra=("--no-prefix-cache",))
        rows += r
    rows.append(overload(model_dir, args, system))
    if args.soak:
        rows.append(soak(model_dir, args, system))
    if args.generate_batch:
        rows.append(generate_batch(model_dir, args, system))

    def get(mode, n):
        return next((r for r in rows if r["mode"] == mode and r.get("clients") == n), None)

    print("\n| what | measured | target |\n| --- | --- | --- |")
    b, t = get("batch", 16), get("threads", 16)
    if b and t:
        print(f"| tokens/s at 16, batch vs threads | {b['tokens_per_s'] / t['tokens_per_s']:.2f}x "
              "| >= 4x |")
    g = get("generate_batch (in process)", 16)
    if b and g:
        print(f"| tokens/s at 16 vs generate_batch | {b['tokens_per_s'] / g['tokens_per_s']:.2f}x "
              "| >= 1.5x |")
    off = get("batch --no-prefix-cache", 16)
    if b and off:
        print(f"| p99 TTFT at 16, cached vs prefix cache off | "
              f"{b['p99_ttft_s'] / off['p99_ttft_s']:.2f}x | <= 0.5x |")
    o = rows[-1] if rows[-1]["mode"].startswith("pool for 8") else next(
        r for r in rows if r["mode"].startswith("pool for 8"))
    print(f"| 64 on a pool for 8: 200 or 503+RA | {100 * o['share_ok']:.0f} % | 100 % |")
    b1, b64 = get("batch", 1), get("batch", 64)
    if b1 and b64:
        pool_mib = args.kv_blocks * 16 * BENCH["kv_heads"] * BENCH["head_dim"] * 2 * 4 / 2 ** 20
        print(f"| RSS at 64 vs at 1 (batch) | {b64['rss_kib'] / 1024:.0f} vs "
              f"{b1['rss_kib'] / 1024:.0f} MiB ({b64['rss_kib'] / b1['rss_kib']:.3f}x; the pool "
              f"is {pool_mib:.0f} MiB, its pages resident as blocks are first used) | "
              "<= 1.1x + the pool |")
    s = next((r for r in rows if r["mode"] == "soak"), None)
    if s:
        print(f"| blocks lost after the soak ({s['requests']}) | {s['blocks_lost']} | 0 |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        for mode in args.modes:
            pts = [(r["clients"], r["tokens_per_s"], r["p99_latency_s"]) for r in rows
                   if r["mode"] == mode]
            a1.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=mode)
            a2.plot([p[0] for p in pts], [p[2] for p in pts], "o-", label=mode)
        for a, y in ((a1, "output tokens/s"), (a2, "p99 latency (s)")):
            a.set_xscale("log", base=2)
            a.set_xlabel("concurrent clients")
            a.set_ylabel(y)
            a.legend()
        fig.tight_layout()
        fig.savefig(args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
