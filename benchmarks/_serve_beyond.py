"""The rows of ``serve_load.py`` beyond one process (issue 25).

``--replicas 2 --redis``: a real redis-server on loopback (the suite's
``support.redis_server``) and two servers sharing it
(``--redis``). Replica A serves a request whose prompt starts with a shared
system prompt (``--system-tokens``) under one tenant; once its prefix is
written through, replica B's first request (the same system prompt, another
question) is timed to its first token, against the same request on a
replica started cold without Redis. Then the store's cost on a miss (a
prompt nobody published: the read-through's seconds, against one Redis
round trip), and ``--clients`` clients alternating between the replicas
while Redis runs, is stopped, and is back (statuses: only 200, or 503 +
Retry-After from admission; Redis hits resume).

``--restart``: a server with ``--prefix-file`` serves one request cold, is
stopped (SIGTERM: it drains and saves), started again, and serves the same
request: time to first token after the restart against before.

Every server's exit: status 0 and ``pool.check() passed, used_blocks=0``.
"""
from __future__ import annotations

import asyncio
import os
import re
import sys
import tempfile
import time

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def redis_server(folder):
    """A redis-server on a free loopback port, started by the test suite's
    manager (tests/support/redis_server.py), reused here."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from support.redis_server import RedisServer
    return RedisServer(folder).start()


def prompt_ids(model_dir, n_system):
    """(the shared system prompt's ids, ``question(i)`` -> ids of question i)."""
    from transformers import AutoTokenizer

    from ferrox_kv.serve.tiny import TEXT
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    ids = []
    while len(ids) < n_system:
        ids += tok(TEXT, add_special_tokens=False)["input_ids"]

    def question(i):
        return tok(f" Question {i}: what does the pool hold?",
                   add_special_tokens=False)["input_ids"]
    return ids[:n_system], question


def metric(url, name):
    """One sample of ``/metrics`` (0 when absent)."""
    body = httpx.get(url + "/metrics", timeout=30).text
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", body, re.M)
    return float(m.group(1)) if m else 0.0


def wait_metric(url, name, at_least, timeout=120.0):
    end = time.monotonic() + timeout
    while metric(url, name) < at_least and time.monotonic() < end:
        time.sleep(0.05)
    return metric(url, name)


def exit_row(rc, tail):
    return {"exit": rc, "clean": rc == 0 and any("used_blocks=0" in t for t in tail)}


class Beyond:
    """The two rows, over serve_load's ``start``/``stop``/``one``."""

    def __init__(self, args, model_dir, start, stop, one):
        self.args, self.model_dir = args, model_dir
        self.start, self.stop, self.one = start, stop, one
        self.system, self.question = prompt_ids(model_dir, args.system_tokens)
        self.common = ("--kv-blocks", args.kv_blocks, "--torch-threads", args.torch_threads,
                       "--max-batch", max(16, args.beyond_clients), "--max-queue", 256,
                       "--queue-timeout", 300)

    def first(self, url, ids, tenant="acme"):
        """(status, ttft, cached_tokens) of one streamed request."""
        async def go():
            async with httpx.AsyncClient() as client:
                return await self.one(client, url, ids, self.args.max_tokens,
                                      headers={"X-Tenant": tenant})
        r = asyncio.run(go())
        return r[0], r[2], r[5]

    # -- --replicas 2 --redis ---------------------------------------------------

    def replicas(self):
        store = redis_server(tempfile.mkdtemp(prefix="ferrox-redis-"))
        servers, exits = [], []
        try:
            cold = self.start(self.model_dir, *self.common)
            _, t_cold, _ = self.first(cold.url, self.system + self.question(1))
            exits.append(exit_row(*self.stop(cold)))
            for _ in range(2):
                servers.append(self.start(self.model_dir, *self.common, "--redis", store.url))
            a, b = servers
            self.first(a.url, self.system + self.question(0))       # A computes the prefix
            wait_metric(a.url, "ferrox:redis_entries_written_total", 1)
            status, t_b, cached_b = self.first(b.url, self.system + self.question(1))
            miss = self.miss_cost(b, store)
            phases = self.outage(servers, store)
        finally:
            for s in servers:
                if s.proc.poll() is None:
                    exits.append(exit_row(*self.stop(s)))
            store.stop()
        return {"mode": "replicas 2 --redis", "system_tokens": len(self.system),
                "clients": self.args.beyond_clients,
                "ttft_b_cold_s": t_cold, "ttft_b_redis_s": t_b, "status_b": status,
                "cached_tokens_b": cached_b,
                "ttft_ratio": t_b / t_cold if t_b and t_cold else float("nan"),
                **miss, "phases": phases, "exits": exits}

    def miss_cost(self, srv, store):
        """The read-through's seconds for a prompt nobody published, and one
        Redis round trip (a PING from here), both means."""
        import redis
        before = (metric(srv.url, "ferrox:redis_fetch_seconds_sum"),
                  metric(srv.url, "ferrox:redis_fetch_seconds_count"))
        for i in range(4):
            self.first(srv.url, self.question(1000 + i) * 8, tenant=f"miss-{i}")
        after = (metric(srv.url, "ferrox:redis_fetch_seconds_sum"),
                 metric(srv.url, "ferrox:redis_fetch_seconds_count"))
        n = after[1] - before[1]
        client = redis.Redis(port=store.port)
        t0 = time.perf_counter()
        for _ in range(100):
            client.ping()
        rtt = (time.perf_counter() - t0) / 100
        return {"miss_fetch_s": (after[0] - before[0]) / n if n else float("nan"),
                "miss_fetches": n, "redis_rtt_s": rtt}

    def outage(self, servers, store):
        """``--beyond-clients`` clients alternating between the replicas:
        Redis up, stopped, back. Each phase has a tenant of its own (a
        prefix neither pool holds yet): replica A serves its system prompt
        first, then the clients go to both. Statuses per phase, Redis errors,
        Redis hits (B reads A's prefix through, while Redis is there)."""
        phases = []
        for j, phase in enumerate(("redis up", "redis stopped", "redis back")):
            if phase == "redis stopped":
                store.stop()
            elif phase == "redis back":
                store.start()
            tenant = f"tenant-{j}"
            hits0 = sum(metric(s.url, "ferrox:redis_hits_total") for s in servers)
            errors0 = sum(metric(s.url, "ferrox:redis_errors_total") for s in servers)
            written = metric(servers[0].url, "ferrox:redis_entries_written_total")
            first = self.first(servers[0].url, self.system + self.question(10000 * (j + 1) - 1),
                               tenant=tenant)
            if phase != "redis stopped":
                wait_metric(servers[0].url, "ferrox:redis_entries_written_total", written + 1)
            statuses = asyncio.run(self.alternate(servers, 10000 * (j + 1), tenant))
            key = str(first[0])
            statuses[key] = statuses.get(key, 0) + 1
            phases.append({
                "phase": phase, "statuses": statuses,
                "redis_hits": sum(metric(s.url, "ferrox:redis_hits_total") for s in servers) - hits0,
                "redis_errors": sum(metric(s.url, "ferrox:redis_errors_total")
                                    for s in servers) - errors0})
        return phases

    async def alternate(self, servers, first_question, tenant):
        n, per = self.args.beyond_clients, self.args.requests
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=n + 4)) as client:
            async def worker(i):
                out = []
                for k in range(per):
                    url = servers[(i + k) % 2].url
                    ids = self.system + self.question(first_question + i * per + k)
                    out.append((await self.one(client, url, ids, self.args.max_tokens,
                                               headers={"X-Tenant": tenant}))[:2])
                return out
            results = [r for rs in await asyncio.gather(*[worker(i) for i in range(n)])
                       for r in rs]
        statuses = {}
        for status, retry_after in results:
            key = f"{status}" + ("+RA" if status == 503 and retry_after else "")
            statuses[key] = statuses.get(key, 0) + 1
        return statuses

    # -- --restart ----------------------------------------------------------------

    def restart(self):
        path = os.path.join(tempfile.mkdtemp(prefix="ferrox-prefixes-"), "prefixes.fxkv")
        ids = self.system + self.question(7)
        exits, runs = [], []
        for _ in range(2):
            srv = self.start(self.model_dir, *self.common, "--prefix-file", path)
            try:
                runs.append(self.first(srv.url, ids))
            finally:
                exits.append(exit_row(*self.stop(srv)))
        (s0, t0, c0), (s1, t1, c1) = runs
        return {"mode": "restart --prefix-file", "system_tokens": len(self.system),
                "ttft_cold_s": t0, "ttft_after_restart_s": t1, "statuses": [s0, s1],
                "cached_tokens_after": c1, "file_bytes": os.path.getsize(path),
                "ttft_ratio": t1 / t0 if t0 and t1 else float("nan"), "exits": exits}


def table(rows):
    """The issue's targets with this run's figures."""
    out = ["| what | target | this run |", "| --- | --- | --- |"]
    rep = next((r for r in rows if r["mode"].startswith("replicas")), None)
    res = next((r for r in rows if r["mode"].startswith("restart")), None)
    if rep:
        out.append(f"| replica B's first request, shared system prompt of {rep['system_tokens']} "
                   f"tokens computed by A, TTFT vs B cold without Redis | <= 0.3x | "
                   f"{rep['ttft_ratio']:.2f}x ({rep['ttft_b_redis_s'] * 1e3:.0f} vs "
                   f"{rep['ttft_b_cold_s'] * 1e3:.0f} ms; cached_tokens "
                   f"{rep['cached_tokens_b']}) |")
    if res:
        out.append(f"| first request after a restart with --prefix-file, TTFT vs the same "
                   f"request on a cold server | <= 0.3x | {res['ttft_ratio']:.2f}x "
                   f"({res['ttft_after_restart_s'] * 1e3:.0f} vs {res['ttft_cold_s'] * 1e3:.0f} "
                   f"ms; cached_tokens {res['cached_tokens_after']}) |")
    if rep:
        ph = {p["phase"]: p for p in rep["phases"]}
        down = ph["redis stopped"]
        out.append(f"| Redis stopped under {rep.get('clients', '')} clients: answers | only 200 "
                   f"(or 503 + Retry-After), no 5xx; hits resume | stopped: {down['statuses']}, "
                   f"{down['redis_errors']:.0f} Redis errors; back: "
                   f"{ph['redis back']['statuses']}, {ph['redis back']['redis_hits']:.0f} hit "
                   "tokens |")
        out.append(f"| the store's cost on a miss, per request | <= one Redis round trip | "
                   f"{rep['miss_fetch_s'] * 1e3:.2f} ms per read-through vs "
                   f"{rep['redis_rtt_s'] * 1e3:.2f} ms per PING |")
    exits = [e for r in (rep, res) if r for e in r["exits"]]
    if exits:
        out.append(f"| blocks lost after the load test, in every server | 0 | "
                   f"{sum(not e['clean'] for e in exits)} of {len(exits)} servers not clean "
                   f"(exit statuses {[e['exit'] for e in exits]}) |")
    return out
