"""Load test of ``ferrox-kv serve`` on loopback (issue 15's table).

Starts the server (``python -m ferrox_kv.serve``) on the hf bench model
(hidden 1024, 2 layers, 32/8 heads x 128, random weights; written offline by
``ferrox_kv.serve.tiny --bench``), then drives it with an async httpx client
of its own: N concurrent clients, each sending ``--requests`` streaming
completions in turn, prompts of mixed lengths that share a system prompt,
``--max-tokens`` new tokens each (greedy). Bounded: every request has a
timeout, every run a request count.

Rows:

* at each N (``--clients 1 4 16 64``), in each of three server modes:
  ``batch`` (continuous batching), ``threads (DynamicCache)`` (``--mode
  threads --threads-cache dynamic``: one thread per request, transformers'
  DynamicCache and SDPA, the issue's baseline) and ``threads (ferrox)``
  (``--mode threads``: one thread per request on its own caches from the
  pool): output tokens/s, p50/p99 latency and time to first token, statuses;
* prefix cache off at 16 clients (p99 TTFT, cached vs not);
* 64 clients on a pool sized for 8 requests (``--max-queue 16``): the share
  of 200 and of 503 + Retry-After, anything else;
* resident memory of the server after 64 clients vs after 1;
* ``--soak N``: N requests on the tiny model (random short prompts and
  lengths, a fifth dropped by their client at a random point), bounded by
  ``--soak-seconds``; blocks lost, resident memory at start, middle and end;
* ``--generate-batch``: transformers' own continuous batching
  (``model.generate_batch``) on the 16-client row's requests, in process.

``--replicas 2 --redis`` and ``--restart`` run the rows of issue 25 instead
(prefixes shared by two replicas through Redis, and kept across a restart
by ``--prefix-file``; benchmarks/_serve_beyond.py says what each measures):

    python benchmarks/serve_load.py --replicas 2 --redis --restart --json beyond.json

Then the per-N table, the issue's table, and with ``--plot FILE.png``
tokens/s and p99 latency against N per mode. The issue's table comes from

    python benchmarks/serve_load.py --clients 1 4 16 64 --requests 2 --max-tokens 16 \
        --generate-batch --soak 10000 --plot serve.png --json serve.json

Figures on a busy machine are noisy; ratios within one run are what count.
The load test survives its own overload: a request that fails in transport
(a reset connection, a read error) or times out is counted in its row's
``errors`` and statuses, never raised; every server process it started is
stopped (SIGTERM, then SIGKILL, by its PID) whatever happens.
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


STARTED: list[ServerProcess] = []      # every server this run started, stopped at the end


def start(model_dir, *args):
    srv = ServerProcess(model_dir, *args, start_timeout=300)
    STARTED.append(srv)
    return srv


def stop(srv):
    """SIGTERM, then SIGKILL after 120 s; (exit status, the server's last line)."""
    rc = srv.stop(120)
    return rc, srv.log().strip().splitlines()[-1:]


def idle(srv):
    """``/health`` once the server is idle, or None when it does not answer
    (an overloaded server's health check may time out too)."""
    try:
        return srv.wait_idle()
    except Exception:
        return None


def stop_all():
    """Stop every server still running that this run started."""
    for srv in STARTED:
        if srv.proc.poll() is None:
            try:
                stop(srv)
            except Exception:
                srv.proc.kill()
                srv.proc.wait()


def is_error(status):
    """A request that got no HTTP answer at all: a transport error, a timeout."""
    return status == "timeout" or str(status).startswith("error")


def prompts(n, rng, system):
    tail = ("the pool", "a request reserves its worst case", "tenants never share blocks",
            "attention reads each sequence in place", "the queue is first in first out")
    return [system + " ".join(rng.choice(tail) for _ in range(rng.randrange(1, 12)))
            for _ in range(n)]


async def one(client, url, prompt, max_tokens, drop_after=None, timeout=120.0, headers=None):
    """(status, retry_after, ttft, latency, tokens, cached_tokens)."""
    t0 = time.perf_counter()
    ttft, n, cached = None, 0, None
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", url + "/v1/completions", json=body,
                                 timeout=timeout, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                return r.status_code, r.headers.get("retry-after"), None, None, 0, None
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                d = json.loads(line[6:])
                if d.get("usage"):
                    n = d["usage"]["completion_tokens"]
                    cached = (d["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
                elif ttft is None:
                    ttft = time.perf_counter() - t0
                if drop_after is not None:
                    drop_after -= 1
                    if drop_after <= 0:
                        return "dropped", None, None, None, 0, None
    except httpx.TimeoutException:
        return "timeout", None, None, None, 0, None
    except httpx.HTTPError as e:            # reset, read error, protocol error: counted
        return f"error:{type(e).__name__}", None, None, None, 0, None
    return 200, None, ttft, time.perf_counter() - t0, n, cached


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
            "statuses": statuses, "errors": sum(1 for r in results if is_error(r[0]))}


# the rows' server modes: label -> the server's arguments
MODES = {
    "batch": ("--mode", "batch"),
    "threads (DynamicCache)": ("--mode", "threads", "--threads-cache", "dynamic"),
    "threads (ferrox)": ("--mode", "threads", "--threads-cache", "ferrox"),
}
MODE_NAMES = {"batch": "batch", "threads-dynamic": "threads (DynamicCache)",
              "threads-ferrox": "threads (ferrox)"}
BASELINE = "threads (DynamicCache)"     # the issue's: thread-per-request generate, DynamicCache


def run_mode(model_dir, label, clients, args, system, extra=()):
    srv = start(model_dir, *MODES[label], "--kv-blocks", args.kv_blocks, "--max-batch",
                max(clients), "--max-queue", 256, "--queue-timeout", 300,
                "--torch-threads", args.torch_threads, *extra)
    rows, h = [], None
    try:
        for n in clients:
            rng = random.Random(n)
            row = asyncio.run(load(srv.url, n, args.requests, args.max_tokens, rng, system))
            idle(srv)
            row.update(mode=label + ("" if not extra else " " + " ".join(map(str, extra))),
                       rss_kib=srv.rss_kib())
            rows.append(row)
            print(fmt(row), flush=True)
        h = idle(srv)
    finally:
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
        h = idle(srv)
    finally:
        rc, tail = stop(srv)
    good = sum(v for k, v in row["statuses"].items() if k in ("200", "503+RA"))
    row.update(mode=f"pool for 8 ({blocks} blocks)", share_ok=good / row["requests"],
               used_blocks_after=None if h is None else h["used_blocks"], exit=rc,
               exit_line=tail)
    print(fmt(row), flush=True)
    return row


def soak(args):
    """``args.soak`` requests, 16 at a time, on the tiny model (the soak is
    about blocks and memory, not speed): random short prompts (a tenant's
    shared prefix or not), random ``max_tokens`` up to ``--soak-max-tokens``,
    streaming or not, a fifth dropped by their client at a random point
    (mid-stream, or by a timeout while queued or running). Bounded: no new
    request starts after ``--soak-seconds``. Resident memory at the start
    (after a warm-up), the middle and the end (idle); blocks lost."""
    from ferrox_kv.serve.tiny import SYSTEM, TEXT, make_model_dir

    model_dir = args.soak_model_dir or os.path.join(tempfile.gettempdir(),
                                                    "ferrox-serve-soak-model")
    if not os.path.exists(model_dir):
        make_model_dir(model_dir)
    srv = start(model_dir, "--kv-blocks", 256, "--max-batch", 16, "--max-queue", 64,
                "--queue-timeout", 30, "--prefill-chunk", 64,
                "--torch-threads", args.torch_threads)
    rng = random.Random(10)
    rss = {}

    def body():
        head = rng.choice(["", SYSTEM[:48]])
        b = {"prompt": head + TEXT[:rng.randrange(1, 48)],
             "max_tokens": rng.randrange(1, args.soak_max_tokens + 1),
             "temperature": rng.choice([0, 0.8]), "stream": rng.random() < 0.7,
             "user": rng.choice([None, "a", "b"])}
        return {k: v for k, v in b.items() if v is not None}

    async def request(client, b, drop):
        """(status, tokens); a dropped request: the client leaves mid-stream
        or times out."""
        url = srv.url + "/v1/completions"
        try:
            if not b["stream"]:
                r = await client.post(url, json=b, timeout=rng.uniform(0.02, 0.3) if drop else 120)
                return r.status_code, (r.json()["usage"]["completion_tokens"]
                                       if r.status_code == 200 else 0)
            async with client.stream("POST", url, json=b, timeout=120) as r:
                if r.status_code != 200:
                    await r.aread()
                    return r.status_code, 0
                n = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        n += 1
                        if drop and n >= drop:
                            return "dropped", 0
                return 200, n
        except httpx.TimeoutException:
            return ("dropped" if drop else "timeout"), 0
        except httpx.HTTPError as e:
            return f"error:{type(e).__name__}", 0

    async def run(n, deadline, mark=None):
        sem = asyncio.Semaphore(16)
        done = 0
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=32)) as client:
            async def go():
                nonlocal done
                async with sem:
                    if time.monotonic() > deadline:
                        return "not run", 0
                    drop = rng.randrange(1, 8) if rng.random() < 0.2 else 0
                    r = await request(client, body(), drop)
                    done += 1
                    if mark is not None and done == n // 2:
                        rss["middle"] = srv.rss_kib()
                    return r
            return await asyncio.gather(*[go() for _ in range(n)])

    try:
        asyncio.run(run(200, time.monotonic() + 600))          # warm-up: allocator, caches
        idle(srv)
        rss["start"] = srv.rss_kib()
        t0 = time.perf_counter()
        results = asyncio.run(run(args.soak, time.monotonic() + args.soak_seconds, mark=True))
        wall = time.perf_counter() - t0
        h = idle(srv) or {"used_blocks": None}
        rss["end"] = srv.rss_kib()
    finally:
        rc, tail = stop(srv)
    statuses = {}
    for st, _ in results:
        statuses[str(st)] = statuses.get(str(st), 0) + 1
    row = {"mode": "soak (tiny model)", "requests": args.soak, "wall_s": wall,
           "ran": args.soak - statuses.get("not run", 0),
           "tokens": sum(n for _, n in results), "statuses": statuses,
           "errors": sum(1 for st, _ in results if is_error(st)),
           "blocks_lost": h["used_blocks"], "rss_kib_start": rss["start"],
           "rss_kib_middle": rss.get("middle"), "rss_kib_end": rss["end"],
           "exit": rc, "exit_line": tail}
    print(json.dumps(row), flush=True)
    return row


def generate_batch(model_dir, args, system):
    """transformers' continuous batching in process (``generate_batch``, its
    own paged cache) on the 16-client row's requests: the same prompts,
    ``--max-tokens`` new tokens each, greedy, one torch thread as the server.
    Run twice: the first call also warms it up; the second is the row."""
    import torch
    import transformers

    torch.set_num_threads(args.torch_threads)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    rng = random.Random(16)
    reqs = [tok(p)["input_ids"] for p in prompts(16 * args.requests, rng, system)]
    cfg = transformers.GenerationConfig(max_new_tokens=args.max_tokens, do_sample=False,
                                        eos_token_id=-1, pad_token_id=tok.pad_token_id)
    walls, n = [], 0
    for _ in range(2):
        t0 = time.perf_counter()
        out = model.generate_batch(inputs=reqs, generation_config=cfg, progress_bar=False)
        walls.append(time.perf_counter() - t0)
        n = sum(len(o.generated_tokens) for o in out.values())
    row = {"mode": "generate_batch (in process)", "clients": 16, "requests": len(reqs),
           "wall_s": walls[1], "first_call_wall_s": walls[0], "tokens": n,
           "tokens_per_s": n / walls[1]}
    print(fmt(row) + f"  (first call {walls[0]:.2f} s)", flush=True)
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
    if r.get("errors"):
        s += f"  errors {r['errors']}"
    return s


def get(rows, mode, n):
    return next((r for r in rows if r["mode"] == mode and r.get("clients") == n), None)


def table(rows, kv_blocks):
    """The issue's table from this run's rows, as markdown lines."""
    from ferrox_kv.serve.tiny import BENCH

    out = ["| what | measured | target |", "| --- | --- | --- |"]
    b, t, f = get(rows, "batch", 16), get(rows, BASELINE, 16), get(rows, "threads (ferrox)", 16)
    if b and t:
        out.append(f"| tokens/s at 16, batch vs threads with DynamicCache | "
                   f"{b['tokens_per_s'] / t['tokens_per_s']:.2f}x ({b['tokens_per_s']:.0f} vs "
                   f"{t['tokens_per_s']:.0f}) | >= 4x |")
    if b and f:
        out.append(f"| (also) tokens/s at 16, batch vs threads on ferrox caches | "
                   f"{b['tokens_per_s'] / f['tokens_per_s']:.2f}x ({b['tokens_per_s']:.0f} vs "
                   f"{f['tokens_per_s']:.0f}) | - |")
    g = get(rows, "generate_batch (in process)", 16)
    if b and g:
        out.append(f"| tokens/s at 16 vs generate_batch | {b['tokens_per_s'] / g['tokens_per_s']:.2f}x "
                   f"({b['tokens_per_s']:.0f} vs {g['tokens_per_s']:.0f}) | >= 1.5x |")
    off = get(rows, "batch --no-prefix-cache", 16)
    if b and off:
        out.append(f"| p99 TTFT at 16, cached vs prefix cache off | "
                   f"{b['p99_ttft_s'] / off['p99_ttft_s']:.2f}x | <= 0.5x |")
    o = next((r for r in rows if r["mode"].startswith("pool for 8")), None)
    if o:
        out.append(f"| 64 on a pool for 8: 200 or 503+RA | {100 * o['share_ok']:.0f} % "
                   f"({o['statuses']}) | 100 % |")
    errs = sum(r.get("errors") or 0 for r in rows)
    out.append(f"| requests with no HTTP answer (transport errors, timeouts), all rows | "
               f"{errs} | 0 |")
    b1, b64 = get(rows, "batch", 1), get(rows, "batch", 64)
    if b1 and b64:
        pool_mib = kv_blocks * 16 * BENCH["kv_heads"] * BENCH["head_dim"] * 2 * 4 / 2 ** 20
        out.append(f"| RSS at 64 vs at 1 (batch) | {b64['rss_kib'] / 1024:.0f} vs "
                   f"{b1['rss_kib'] / 1024:.0f} MiB ({b64['rss_kib'] / b1['rss_kib']:.3f}x; the "
                   f"pool is {pool_mib:.0f} MiB, its pages resident as blocks are first used) | "
                   "<= 1.1x + the pool |")
    s = next((r for r in rows if r["mode"].startswith("soak")), None)
    if s:
        out.append(f"| blocks lost after the soak ({s['ran']} requests in {s['wall_s']:.0f} s; "
                   f"RSS start/middle/end {s['rss_kib_start'] / 1024:.0f}/"
                   f"{(s['rss_kib_middle'] or 0) / 1024:.0f}/{s['rss_kib_end'] / 1024:.0f} MiB) "
                   f"| {s['blocks_lost']} | 0 |")
    return out


def per_n(rows, modes):
    """p50/p99 latency and time to first token per N and mode, markdown."""
    out = ["| mode | N | tokens/s | latency p50 / p99 (s) | TTFT p50 / p99 (s) | errors |",
           "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if r["mode"] in modes or r["mode"].endswith("--no-prefix-cache"):
            out.append(f"| {r['mode']} | {r['clients']} | {r['tokens_per_s']:.1f} | "
                       f"{r['p50_latency_s']:.3f} / {r['p99_latency_s']:.3f} | "
                       f"{r['p50_ttft_s']:.3f} / {r['p99_ttft_s']:.3f} | "
                       f"{r.get('errors', 0)} |")
    return out


def plot(rows, path, modes):
    """Output tokens/s and p99 latency against N, one series per mode, to
    ``path`` (matplotlib, the [plot] extra). Returns the series drawn:
    ``{mode: (clients, tokens_per_s, p99_latency_s)}``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    series = {}
    for mode in modes:
        pts = sorted((r["clients"], r["tokens_per_s"], r["p99_latency_s"]) for r in rows
                     if r["mode"] == mode)
        if not pts:
            continue
        series[mode] = tuple(list(x) for x in zip(*pts))
        a1.plot(series[mode][0], series[mode][1], "o-", label=mode)
        a2.plot(series[mode][0], series[mode][2], "o-", label=mode)
    for a, y in ((a1, "output tokens/s"), (a2, "p99 latency (s)")):
        a.set_xscale("log", base=2)
        a.set_xlabel("concurrent clients")
        a.set_ylabel(y)
        a.legend()
    fig.suptitle("ferrox-kv serve on loopback (benchmarks/serve_load.py)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return series


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--requests", type=int, default=4, help="requests per client (4)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--kv-blocks", type=int, default=4096)
    ap.add_argument("--torch-threads", type=int, default=1)
    ap.add_argument("--modes", nargs="+", choices=list(MODE_NAMES),
                    default=list(MODE_NAMES), help="server modes for the rows at each N "
                    "(threads-dynamic: the baseline, DynamicCache and SDPA)")
    ap.add_argument("--soak", type=int, default=0, help="requests in the soak (0: none)")
    ap.add_argument("--soak-max-tokens", type=int, default=8)
    ap.add_argument("--soak-seconds", type=float, default=1800,
                    help="no soak request starts after this many seconds (1800)")
    ap.add_argument("--soak-model-dir", default=None,
                    help="default: the tiny model (ferrox_kv.serve.tiny), made in /tmp")
    ap.add_argument("--generate-batch", action="store_true")
    ap.add_argument("--no-overload", action="store_true", help="skip the pool-for-8 row")
    ap.add_argument("--model-dir", default=None, help="default: the bench model, made in /tmp")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    beyond = ap.add_argument_group("beyond one process (issue 25; these rows only)")
    beyond.add_argument("--replicas", type=int, choices=(2,), default=None,
                        help="with --redis: two replicas sharing one redis-server")
    beyond.add_argument("--redis", action="store_true",
                        help="with --replicas 2: a real redis-server on loopback")
    beyond.add_argument("--restart", action="store_true",
                        help="a server with --prefix-file, stopped and started again")
    beyond.add_argument("--system-tokens", type=int, default=1024,
                        help="the shared system prompt's tokens (1024)")
    beyond.add_argument("--beyond-clients", type=int, default=16,
                        help="clients alternating between the replicas, Redis up, stopped, "
                             "back (16)")
    args = ap.parse_args(argv)
    if (args.replicas is None) != (not args.redis):
        ap.error("--replicas 2 and --redis go together")
    from ferrox_kv.serve.tiny import BENCH, SYSTEM, make_model_dir

    model_dir = args.model_dir or os.path.join(tempfile.gettempdir(), "ferrox-serve-bench-model")
    if not os.path.exists(model_dir):
        make_model_dir(model_dir, **BENCH)
    system = SYSTEM * 2
    modes = [MODE_NAMES[m] for m in args.modes]
    try:
        if args.redis or args.restart:
            return _beyond(args, model_dir)
        return _main(args, model_dir, system, modes)
    finally:
        stop_all()


def _beyond(args, model_dir):
    """The rows of issue 25 (benchmarks/_serve_beyond.py)."""
    import _serve_beyond as beyond
    b = beyond.Beyond(args, model_dir, start, stop, one)
    rows = []
    if args.redis:
        rows.append(b.replicas())
        print(json.dumps(rows[-1]), flush=True)
    if args.restart:
        rows.append(b.restart())
        print(json.dumps(rows[-1]), flush=True)
    print("\n" + "\n".join(beyond.table(rows)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def _main(args, model_dir, system, modes):
    rows = []
    for label in modes:
        r, h, rc, tail = run_mode(model_dir, label, args.clients, args, system)
        rows += r
        print(f"  {label}: used_blocks after "
              f"{'(no answer)' if h is None else h['used_blocks']}, exit {rc} {tail}")
    if 16 in args.clients and "batch" in modes:
        r, h, rc, tail = run_mode(model_dir, "batch", [16], args, system,
                                  extra=("--no-prefix-cache",))
        rows += r
    if not args.no_overload:
        rows.append(overload(model_dir, args, system))
    if args.soak:
        rows.append(soak(args))
    if args.generate_batch:
        rows.append(generate_batch(model_dir, args, system))
    print("\n" + "\n".join(per_n(rows, modes)))
    print("\n" + "\n".join(table(rows, args.kv_blocks)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.plot:
        plot(rows, args.plot, modes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
