"""``ferrox-kv serve`` beyond one process: the checkpoint's dtype by default,
prefixes that survive a restart (``--prefix-file``), and replicas that share
them through Redis (``--redis``). Real server processes and real
redis-servers on free loopback ports (``support.serve`` and
``support.redis_server`` start them)."""
from __future__ import annotations

import concurrent.futures
import os
import re

import pytest

from support.pools import STORE_DIM, STORE_FP, STORE_HEADS, pool_counts, publish_seq, store_pool
from support.redis_server import RedisServer, require_redis

redis = require_redis()

for _m in ("torch", "transformers", "fastapi", "uvicorn", "httpx", "prometheus_client"):
    if os.environ.get("CI") == "true":
        __import__(_m)                # in CI a missing serve dependency fails, never skips
    else:
        pytest.importorskip(_m)

import httpx  # noqa: E402
from support import serve as S  # noqa: E402

from ferrox_kv import KvBlockPool  # noqa: E402

BLOCK = 16
# about 130 tokens: eight whole blocks of a shared system prompt, then a question
PROMPT = S.SYSTEM * 3 + "Question: what does a pool of blocks hold?"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # the store tests' geometry (2 KV heads of 32), so that support.pools'
    # publish_seq can write a prefix file of another model for it
    return S.make_model_dir(tmp_path_factory.mktemp("model") / "tiny", hidden=128, heads=4,
                            kv_heads=STORE_HEADS, head_dim=STORE_DIM)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("work"))


def complete(server, prompt=PROMPT, tenant=None, max_tokens=8):
    """(greedy text, cached_tokens) of one completion; asserts a 200."""
    headers = {"X-Tenant": tenant} if tenant else {}
    r = httpx.post(server.url + "/v1/completions", headers=headers, timeout=120,
                   json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def metric(server, name):
    body = httpx.get(server.url + "/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", body, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def wait_metric(server, name, at_least, timeout=60.0):
    """The metric once it reaches ``at_least`` (a write-through runs in the
    background), or the assertion that it did not."""
    import time
    end = time.monotonic() + timeout
    while (v := metric(server, name)) < at_least and time.monotonic() < end:
        time.sleep(0.05)
    assert v >= at_least, f"{name} = {v} < {at_least} after {timeout} s"
    return v


def models_entry(server):
    return httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]


def stop_clean(server):
    rc = server.stop()
    log = server.log()
    assert rc == 0 and "pool.check() passed, used_blocks=0" in log, log
    return log


# -- --dtype auto ---------------------------------------------------------------

def test_a_bf16_checkpoint_runs_in_bf16_with_bf16_kv_by_default(tmp_path):
    bf16 = S.make_model_dir(tmp_path / "tiny-bf16", dtype="bfloat16")
    srv = S.Server(bf16, str(tmp_path))
    try:
        entry = models_entry(srv)
        assert (entry["dtype"], entry["kv_dtype"]) == ("bfloat16", "bfloat16"), entry
        text, _ = complete(srv, "The pool holds blocks.")
        assert isinstance(text, str)
        assert "bfloat16 weights, bfloat16 KV" in srv.log()
    finally:
        stop_clean(srv)


def test_kv_dtype_still_chooses_the_storage_and_dtype_the_weights(tmp_path, model_dir):
    srv = S.Server(model_dir, str(tmp_path), "--kv-dtype", "int8")
    try:
        entry = models_entry(srv)
        assert (entry["dtype"], entry["kv_dtype"]) == ("float32", "int8"), entry
    finally:
        stop_clean(srv)


# -- --prefix-file --------------------------------------------------------------

@pytest.mark.long
def test_prefixes_survive_a_restart_and_a_damaged_file_starts_empty(tmp_path, model_dir):
    path = tmp_path / "prefixes.fxkv"
    srv = S.Server(model_dir, str(tmp_path), "--prefix-file", path)
    try:
        assert "no such file yet" in srv.log()
        cold, cached = complete(srv)
        assert cached == 0
    finally:
        log = stop_clean(srv)
    assert path.exists() and "saved" in log, log
    # the same request on a restarted server reuses the saved prefix
    srv = S.Server(model_dir, str(tmp_path), "--prefix-file", path)
    try:
        assert metric(srv, "ferrox:prefix_entries_loaded_total") > 0
        warm, cached = complete(srv)
        assert cached > 0 and cached % BLOCK == 0
        assert warm == cold
    finally:
        stop_clean(srv)
    # one damaged byte: the start logs the field, serves correctly, from cold
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    srv = S.Server(model_dir, str(tmp_path), "--prefix-file", path)
    try:
        assert re.search(r"not loaded, field '[a-z_ ]+'", srv.log()), srv.log()
        again, cached = complete(srv)
        assert cached == 0 and again == cold
    finally:
        stop_clean(srv)


def test_a_file_of_another_model_is_refused_naming_the_field(tmp_path, model_dir):
    path = tmp_path / "other.fxkv"
    pool = KvBlockPool(BLOCK, 64, STORE_HEADS, STORE_DIM, prefix_cache=True)
    publish_seq(pool, list(range(3, 3 + 4 * BLOCK)))
    pool.save_prefixes(path, fingerprint=STORE_FP)          # another model's identity
    before = path.read_bytes()
    srv = S.Server(model_dir, str(tmp_path), "--prefix-file", path)
    try:
        assert "not loaded, field 'fingerprint'" in srv.log(), srv.log()
        _, cached = complete(srv)
        assert cached == 0
    finally:
        stop_clean(srv)
    assert path.read_bytes() != before          # replaced at shutdown by this model's own


def test_a_save_that_fails_is_logged_and_leaves_the_previous_file(tmp_path, model_dir):
    """The server may write no file past 64 KiB (RLIMIT_FSIZE, set on the
    running process: the disk is full for it); its prefixes take more."""
    import resource
    path = tmp_path / "prefixes.fxkv"
    path.write_bytes(b"the previous file")
    srv = S.Server(model_dir, str(tmp_path), "--prefix-file", path)
    try:
        assert "not loaded" in srv.log()        # not a prefix file: started empty
        complete(srv)
        resource.prlimit(srv.pid, resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))
    finally:
        log = stop_clean(srv)
    assert "not saved" in log and "previous file is left" in log, log
    assert path.read_bytes() == b"the previous file"
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


# -- --redis ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def replicas(tmp_path_factory, model_dir, workdir):
    """One redis-server and two servers sharing it: (redis, A, B)."""
    store = RedisServer(tmp_path_factory.mktemp("redis")).start()
    servers = []
    try:
        for _ in range(2):
            servers.append(S.Server(model_dir, workdir, "--redis", store.url,
                                    "--redis-timeout", "0.3"))
        yield store, servers[0], servers[1]
    finally:
        for s in servers:
            stop_clean(s)
        store.stop()


def test_replica_b_reuses_what_a_computed_and_another_tenant_does_not(replicas):
    _, a, b = replicas
    text_a, cached = complete(a, tenant="acme")
    assert cached == 0
    wait_metric(a, "ferrox:redis_entries_written_total", 1)
    text_b, cached = complete(b, tenant="acme")
    assert cached > 0 and cached % BLOCK == 0
    assert text_b == text_a
    assert metric(b, "ferrox:redis_hits_total") >= cached
    _, cached = complete(b, tenant="globex")          # another tenant: another salt
    assert cached == 0
    assert metric(b, "ferrox:redis_misses_total") > 0
    assert metric(a, "ferrox:redis_writes_dropped_total") == 0


def test_redis_stopped_mid_load_gives_no_5xx_and_hits_resume(replicas):
    store, a, b = replicas
    store.stop()
    prompts = [PROMPT + f" Load {i}." for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda i: complete(a if i % 2 else b, prompts[i], tenant="acme"),
                            range(8)))
    assert len(got) == 8                        # every answer a 200 (complete asserts it)
    assert metric(a, "ferrox:redis_errors_total") + metric(b, "ferrox:redis_errors_total") > 0
    store.start()                               # back, empty, on the same port
    prompt = S.SYSTEM * 2 + "After the outage: what comes back?"
    written = metric(a, "ferrox:redis_entries_written_total")
    text_a, _ = complete(a, prompt, tenant="initech")
    wait_metric(a, "ferrox:redis_entries_written_total", written + 1)
    text_b, cached = complete(b, prompt, tenant="initech")
    assert cached > 0 and text_b == text_a
    for s in (a, b):
        h = s.wait_idle()
        assert h["used_blocks"] == 0, h


def test_two_replicas_share_prefixes_through_a_redis_cluster(cluster, model_dir, workdir):
    url = f"redis+cluster://127.0.0.1:{cluster[0].port}"
    servers = []
    try:
        for _ in range(2):
            servers.append(S.Server(model_dir, workdir, "--redis", url))
        a, b = servers
        text_a, cached = complete(a, tenant="acme")
        assert cached == 0
        wait_metric(a, "ferrox:redis_entries_written_total", 1)
        text_b, cached = complete(b, tenant="acme")
        assert cached > 0 and text_b == text_a
        assert sum(redis.Redis(port=n.port).dbsize() for n in cluster) > 0
    finally:
        for s in servers:
            stop_clean(s)


def test_a_request_waiting_for_its_read_through_waits_alone(model_dir):
    """The engine runs the read-through (Redis) in a fetcher thread of the
    request's own: while one request's fetch hangs, another is admitted,
    runs and finishes; the first runs once its fetch returns."""
    import threading

    import transformers

    import ferrox_kv.hf  # noqa: F401
    from ferrox_kv.serve.engine import Engine, Request, Sampling

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir,
                                                              attn_implementation="ferrox")
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    release, fetched = threading.Event(), []

    def fetch(ids, salt):
        fetched.append(salt)
        if salt == "slow":
            assert release.wait(60)

    pool = KvBlockPool(BLOCK, 256, STORE_HEADS, STORE_DIM, prefix_cache=True)
    engine = Engine(model, tok, pool, fetch=fetch)
    engine.start()
    done = {name: threading.Event() for name in ("slow", "fast")}
    reqs = {name: Request([5, 6, 7], 4, Sampling(0), tenant=name,
                          emit=lambda kind, p, name=name: kind == "done" and done[name].set())
            for name in done}
    try:
        engine.submit(reqs["slow"])
        engine.submit(reqs["fast"])
        assert done["fast"].wait(60)
        assert not done["slow"].is_set() and reqs["slow"].caches is None   # not admitted
        assert engine.stats() == {"running": 0, "waiting": 1}         # in its fetch
        release.set()
        assert done["slow"].wait(60)
        assert reqs["slow"].finish_reason == reqs["fast"].finish_reason == "length"
        assert sorted(fetched) == ["fast", "slow"]
    finally:
        release.set()
        engine.close()
    assert pool.stats()["used_blocks"] == 0
    pool.check()


@pytest.mark.long
def test_the_load_test_of_replicas_and_restart_runs_end_to_end(tmp_path, model_dir):
    """benchmarks/serve_load.py --replicas 2 --redis --restart, small
    settings on the tiny model: every row and its table; no figure is
    checked, only what the rows must hold whatever the machine."""
    import json
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "serve_load.py"
    out = subprocess.run(
        [sys.executable, str(script), "--model-dir", model_dir, "--replicas", "2", "--redis",
         "--restart", "--system-tokens", "64", "--beyond-clients", "4", "--requests", "1",
         "--max-tokens", "3", "--kv-blocks", "1024", "--json", str(tmp_path / "rows.json")],
        cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    rep, res = json.loads((tmp_path / "rows.json").read_text())
    assert rep["status_b"] == 200 and rep["cached_tokens_b"] >= 64 - BLOCK
    for phase in rep["phases"]:
        assert set(phase["statuses"]) <= {"200", "503+RA"}, phase
    phases = {p["phase"]: p for p in rep["phases"]}
    assert phases["redis stopped"]["redis_errors"] > 0
    assert phases["redis back"]["redis_hits"] > 0
    assert res["statuses"] == [200, 200] and res["cached_tokens_after"] > 0
    assert all(e["clean"] for r in (rep, res) for e in r["exits"]), (rep, res)
    for what in ("replica B's first request", "after a restart", "Redis stopped",
                 "cost on a miss", "blocks lost"):
        assert what in out.stdout, what


def test_a_given_model_fingerprint_names_the_model_instead_of_its_hash(tmp_path, model_dir):
    """--model-fingerprint ID: the file saved for ID loads (here one written
    by the library under that identity, of the same geometry and dtype)."""
    path = tmp_path / "named.fxkv"
    pool = KvBlockPool(BLOCK, 64, STORE_HEADS, STORE_DIM, prefix_cache=True)
    publish_seq(pool, list(range(3, 3 + 4 * BLOCK)))
    saved = pool.save_prefixes(path, fingerprint=STORE_FP)
    srv = S.Server(model_dir, str(tmp_path), "--prefix-file", path,
                   "--model-fingerprint", STORE_FP)
    try:
        assert metric(srv, "ferrox:prefix_entries_loaded_total") == saved["entries"] > 0
    finally:
        stop_clean(srv)


def test_the_save_interval_saves_while_serving(tmp_path, model_dir):
    path = tmp_path / "prefixes.fxkv"
    srv = S.Server(model_dir, str(tmp_path), "--prefix-file", path,
                   "--prefix-save-interval", "0.2")
    try:
        complete(srv)
        wait_metric(srv, "ferrox:prefix_entries_saved_total", 1)
        assert path.exists()
    finally:
        stop_clean(srv)


def test_a_second_signal_exits_at_once_without_saving(tmp_path, model_dir):
    """SIGTERM while a long request runs starts the drain; a second one
    exits at once: the prefix file is not written."""
    import signal
    import threading
    import time

    path = tmp_path / "prefixes.fxkv"
    srv = S.Server(model_dir, str(tmp_path), "--prefix-file", path)
    first, status = threading.Event(), []

    def long_request():                           # greedy: 600 tokens, no end of sequence
        try:
            with httpx.stream("POST", srv.url + "/v1/completions", timeout=120,
                              json={"prompt": PROMPT, "max_tokens": 600, "temperature": 0,
                                    "stream": True}) as r:
                status.append(r.status_code)
                for _ in r.iter_lines():
                    first.set()
        except httpx.HTTPError:
            pass                                  # the server went away: expected
        first.set()

    t = threading.Thread(target=long_request)
    t.start()
    try:
        assert first.wait(60) and status == [200]
        srv.proc.send_signal(signal.SIGTERM)
        end = time.monotonic() + 30                     # until the first signal is handled
        while srv.health()["status"] != "draining" and time.monotonic() < end:
            time.sleep(0.01)
        assert srv.health()["status"] == "draining"
        assert t.is_alive()                             # the long request still runs
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(60)
    finally:
        srv.stop()
        t.join(60)
    assert not path.exists() and "saved" not in srv.log(), srv.log()


# -- prefixes.py in process: the write queue, the read-through's rule, the saver --

def test_the_redis_write_queue_is_bounded_and_what_it_drops_is_counted(tmp_path, capsys):
    """With Redis not taking writes (here: the writer stopped), a publish
    past the queue's bound queues nothing and counts a drop; close() gives
    up on what is still queued, counts it and says so."""
    from ferrox_kv.serve.prefixes import RedisPrefixes

    store = RedisServer(tmp_path).start()
    pool = store_pool()
    rp = RedisPrefixes(pool, store.url, fingerprint=STORE_FP, n_layers=2, max_writes=3)
    try:
        rp.store.writes.put(None)                 # the writer ends: nothing is written
        rp._writer.join(60)
        assert not rp._writer.is_alive()
        for i in range(5):
            publish_seq(pool, [10 * i + j for j in range(8)], seed=i)
        assert rp.store.writes.qsize() == 3
        assert rp.writes_dropped == 2
        rp.close(timeout=0)
        assert rp.writes_dropped == 5             # the three still queued, dropped at close
        assert "3 queued prefix writes dropped" in capsys.readouterr().err
        assert rp.stats()["entries_written"] == 0
        assert store.client().dbsize() == 0
        assert pool.stats()["used_blocks"] == 0
        pool.check()
    finally:
        store.stop()


def test_a_read_through_into_a_pool_without_free_blocks_evicts_nothing(tmp_path):
    """A pool whose free blocks are all another tenant's cached prefixes
    fetches nothing (Redis not even asked) and evicts nothing; the same
    fetch into a pool with free blocks reads the whole prefix."""
    from ferrox_kv.serve.prefixes import RedisPrefixes

    store = RedisServer(tmp_path).start()
    prompt = list(range(3, 3 + 4 * 4 + 1))          # four whole blocks of 4, one token more
    try:
        src = store_pool()
        a = RedisPrefixes(src, store.url, fingerprint=STORE_FP, n_layers=2)
        publish_seq(src, prompt[:16], salt="acme")
        a.close()                                   # waits for the writer
        assert a.stats()["entries_written"] == 4
        full = store_pool(total=16)
        for i in range(2):                          # 2 x 4 blocks x 2 layers: all cached
            publish_seq(full, [100 * (i + 1) + j for j in range(16)], salt="globex", seed=i)
        before = pool_counts(full)
        assert before["cached_blocks"] == before["free_blocks"] == 16
        b = RedisPrefixes(full, store.url, fingerprint=STORE_FP, n_layers=2)
        try:
            assert b.fetch(prompt, "acme") == 0
            assert b.stats()["lookups"] == 0         # no Redis round trip
        finally:
            b.close()
        assert pool_counts(full) == before
        full.check()
        roomy = store_pool(total=16)
        c = RedisPrefixes(roomy, store.url, fingerprint=STORE_FP, n_layers=2)
        try:
            assert c.fetch(prompt, "acme") == 16
        finally:
            c.close()
        assert roomy.stats()["cached_blocks"] == 8 and roomy.stats()["evictions"] == 0
    finally:
        store.stop()


def _prefix_file(tmp_path):
    from ferrox_kv.serve.prefixes import PrefixFile

    pool = KvBlockPool(BLOCK, 64, STORE_HEADS, STORE_DIM, prefix_cache=True)
    publish_seq(pool, list(range(3, 3 + 2 * BLOCK)))
    return pool, PrefixFile(pool, str(tmp_path / "prefixes.fxkv"), STORE_FP, 2)


def test_an_interval_save_that_raises_is_logged_and_the_saves_go_on(tmp_path, monkeypatch,
                                                                     capsys):
    import threading

    from ferrox_kv.serve import prefixes
    from ferrox_kv.store import load_prefixes

    pool, files = _prefix_file(tmp_path)
    real, calls, saved = prefixes.save_prefixes, [], threading.Event()

    def flaky(*a, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the disk is on fire")
        got = real(*a, **kw)
        saved.set()
        return got

    monkeypatch.setattr(prefixes, "save_prefixes", flaky)
    saver = files.save_every(0.01)
    try:
        assert saved.wait(60)
        assert saver.thread.is_alive()
    finally:
        saver.stop()
    assert "not saved: RuntimeError: the disk is on fire" in capsys.readouterr().err
    assert files.saved >= 2 and files.saved % 2 == 0
    fresh = KvBlockPool(BLOCK, 64, STORE_HEADS, STORE_DIM, prefix_cache=True)
    assert load_prefixes(fresh, files.path, fingerprint=STORE_FP)["entries"] == 2


def test_stopping_the_interval_save_waits_for_a_save_under_way(tmp_path, monkeypatch):
    """The exit (forced or not) checks that no block is in use: it stops the
    saver first, and stop() returns only once the save under way (which
    holds published blocks while it exports them) has finished."""
    import threading

    from ferrox_kv.serve import prefixes

    pool, files = _prefix_file(tmp_path)
    real, entered, go, finished = prefixes.save_prefixes, *(threading.Event() for _ in "123")

    def slow(*a, **kw):
        entered.set()
        assert go.wait(60)
        got = real(*a, **kw)
        finished.set()
        return got

    monkeypatch.setattr(prefixes, "save_prefixes", slow)
    saver = files.save_every(0.01)
    assert entered.wait(60)
    seen = []
    stopper = threading.Thread(target=lambda: (saver.stop(), seen.append(finished.is_set())))
    stopper.start()
    go.set()
    stopper.join(60)
    assert seen == [True] and not saver.thread.is_alive()
    assert pool.stats()["used_blocks"] == 0
    pool.check()
