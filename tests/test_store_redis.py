"""RedisPrefixStore against a real redis-server (Debian's package), started by
the tests on a free loopback port with a temporary directory: round trips,
pipelining, verification of every fetched value, and faults (Redis stopped,
restarted, slow; corrupt, truncated, foreign and evicted values)."""
import contextlib
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from support.redis_server import require_redis

redis = require_redis()

from ferrox_kv import KvBlockPool, KvCache  # noqa: E402
from ferrox_kv.store import Geometry, RedisPrefixStore, encode_value, entries_from_rows  # noqa: E402

G = Geometry(16, 2, 2, 8, 8)
FP = b"model@1"


def _chain(n_tokens=512, salt=None, seed=0, geometry=G):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 32000, n_tokens)
    k = [rng.standard_normal((n_tokens, geometry.k_row_bytes // 4)).astype(np.float32)
         for _ in range(geometry.n_layers)]
    v = [rng.standard_normal((n_tokens, geometry.v_row_bytes // 4)).astype(np.float32)
         for _ in range(geometry.n_layers)]
    return tokens, entries_from_rows(geometry, tokens, k, v, salt=salt)


def _equal(got, want):
    return len(got) == len(want) and all(
        a.key == b.key and a.depth == b.depth and np.array_equal(a.tokens, b.tokens)
        and np.array_equal(a.k, b.k) and np.array_equal(a.v, b.v) for a, b in zip(got, want))


class CountingRedis(redis.Redis):
    """A client that counts round trips (pipeline executions)."""
    round_trips = 0

    def pipeline(self, *a, **kw):
        pipe = super().pipeline(*a, **kw)
        execute = pipe.execute

        def counted(*x, **y):
            CountingRedis.round_trips += 1
            return execute(*x, **y)

        pipe.execute = counted
        return pipe


def test_a_512_token_chain_round_trips_in_a_few_round_trips(server):
    client = CountingRedis(port=server.port, socket_timeout=5)
    store = RedisPrefixStore(client, namespace="t", fingerprint=FP)
    tokens, entries = _chain(512)
    CountingRedis.round_trips = 0
    assert store.put_chain(G, entries) == 32
    assert CountingRedis.round_trips == 2                      # EXISTS all, SET all
    CountingRedis.round_trips = 0
    got = store.get_chain(G, tokens)
    assert CountingRedis.round_trips == 1 and _equal(got, entries)
    assert not got[0].k.flags.writeable
    s = store.stats()
    value_bytes = sum(len(encode_value(G, FP, e)) for e in entries)
    assert s == dict(lookups=1, hits=1, misses=0, entries_fetched=32, tokens_fetched=512,
                     bytes_fetched=value_bytes, entries_written=32, tokens_written=512,
                     bytes_written=value_bytes, errors=0, rejected=0)
    # publishing it again writes nothing (asked first, one round trip)
    CountingRedis.round_trips = 0
    assert store.put_chain(G, entries) == 0 and CountingRedis.round_trips == 1
    assert server.client().dbsize() == 32


def test_a_repeated_publish_encodes_nothing_and_a_partial_one_only_the_missing(server,
                                                                               monkeypatch):
    import ferrox_kv.store._redis as r
    encoded = []
    real = r.encode_value
    monkeypatch.setattr(r, "encode_value", lambda g, fp, e: encoded.append(e.depth) or real(g, fp, e))
    store = _store(server)
    tokens, entries = _chain(128)
    assert store.put_chain(G, entries[:3]) == 3 and encoded == [0, 1, 2]
    encoded.clear()
    assert store.put_chain(G, entries) == 5 and encoded == [3, 4, 5, 6, 7]
    encoded.clear()
    assert store.put_chain(G, entries) == 0 and encoded == []
    assert _equal(store.get_chain(G, tokens), entries)


def test_batches_split_by_bytes_and_a_continuation_from_a_local_prefix(server):
    client = CountingRedis(port=server.port, socket_timeout=5)
    one = len(encode_value(G, FP, _chain(16)[1][0]))
    store = RedisPrefixStore(client, namespace="t", fingerprint=FP, batch_bytes=4 * one)
    tokens, entries = _chain(512)
    CountingRedis.round_trips = 0
    assert store.put_chain(G, entries) == 32 and CountingRedis.round_trips == 1 + 8
    CountingRedis.round_trips = 0
    got = store.get_chain(G, tokens, start=10, limit=5)      # blocks 10..14
    assert _equal(got, entries[10:15]) and CountingRedis.round_trips >= 2
    assert store.get_chain(G, tokens[:100], start=6) == []   # 6 full blocks: nothing after
    assert _equal(store.get_chain(G, list(tokens[:40])), entries[:2])   # full blocks only


def test_keys_carry_namespace_fingerprint_geometry_dtype_and_the_chained_hash(server):
    store = RedisPrefixStore(server.url, namespace="llama-8b", fingerprint=FP)
    tokens, entries = _chain(32)
    store.put_chain(G, entries)
    keys = sorted(server.client().keys("*"))
    want = sorted(store.key(G, e.key) for e in entries)
    assert keys == want
    ns, ver, fp, geom, h = keys[0].decode().split(":")
    assert (ns, ver, geom) == ("llama-8b", "fxkv1", "bs16.L2.h2.d8.v8.float32")
    assert len(fp) == 16 and h in (entries[0].key.hex(), entries[1].key.hex())
    other = RedisPrefixStore(server.url, namespace="llama-8b", fingerprint=b"model@2")
    assert other.key(G, entries[0].key) != store.key(G, entries[0].key)
    assert store.key(G._replace(dtype="float16"), entries[0].key) != store.key(G, entries[0].key)


def _store(server, **kw):
    return RedisPrefixStore(server.url, namespace="t", fingerprint=FP, **kw)


def _tamper(server, store, entry, change):
    c = server.client()
    key = store.key(G, entry.key)
    c.set(key, change(c.get(key)))


def test_a_flipped_byte_in_any_stored_value_is_rejected_and_the_run_stops_there(server):
    store = _store(server)
    tokens, entries = _chain(128)
    store.put_chain(G, entries)
    value = server.client().get(store.key(G, entries[3].key))
    for at in list(range(0, 200, 7)) + [len(value) // 2, len(value) - 1]:
        _tamper(server, store, entries[3], lambda v: v[:at] + bytes([v[at] ^ 0x10]) + v[at + 1:])
        assert _equal(store.get_chain(G, tokens), entries[:3])
        server.client().set(store.key(G, entries[3].key), value)
    s = store.stats()
    assert s["rejected"] == s["lookups"] and s["errors"] == 0
    assert _equal(store.get_chain(G, tokens), entries)


def test_a_truncated_value_is_rejected(server):
    store = _store(server)
    tokens, entries = _chain(64)
    store.put_chain(G, entries)
    _tamper(server, store, entries[2], lambda v: v[:-1])
    assert _equal(store.get_chain(G, tokens), entries[:2])
    _tamper(server, store, entries[0], lambda v: v[:100])
    assert store.get_chain(G, tokens) == []
    s = store.stats()
    assert (s["rejected"], s["hits"], s["misses"]) == (2, 1, 1)


def test_a_value_written_under_another_fingerprint_salt_geometry_or_dtype_is_rejected(server):
    store = _store(server)
    tokens, entries = _chain(64, salt="tenant-a")
    c = server.client()
    # another model's value under this model's key: its fingerprint differs
    other = RedisPrefixStore(server.url, namespace="t", fingerprint=b"model@2")
    other.put_chain(G, entries)
    assert store.get_chain(G, tokens, salt="tenant-a") == []          # other keys: a miss
    for e in entries:
        c.set(store.key(G, e.key), c.get(other.key(G, e.key)))
    assert store.get_chain(G, tokens, salt="tenant-a") == []
    assert store.stats()["rejected"] == 1
    assert c.dbsize() == 2 * 4 - 1                    # the rejected value was deleted
    c.flushall()
    # tenant a's values under tenant b's keys
    store.put_chain(G, entries)
    _, b_entries = _chain(64, salt="tenant-b")
    for a, b in zip(entries, b_entries):
        c.set(store.key(G, b.key), c.get(store.key(G, a.key)))
    assert store.get_chain(G, tokens, salt="tenant-b") == []
    assert _equal(store.get_chain(G, tokens, salt="tenant-a"), entries)
    # a float32 value under the float16 geometry's key (same row count, rows differ)
    g16 = G._replace(dtype="float16")
    c.set(store.key(g16, entries[0].key), c.get(store.key(G, entries[0].key)))
    assert store.get_chain(g16, tokens, salt="tenant-a") == []
    g3 = G._replace(n_layers=3)
    c.set(store.key(g3, entries[0].key), c.get(store.key(G, entries[0].key)))
    assert store.get_chain(g3, tokens, salt="tenant-a") == []
    assert store.stats()["rejected"] == 4 and store.stats()["errors"] == 0


def test_a_chain_whose_middle_entry_was_evicted_gives_the_longest_verified_prefix(server):
    store = _store(server)
    tokens, entries = _chain(256)
    store.put_chain(G, entries)
    server.client().delete(store.key(G, entries[5].key))
    assert _equal(store.get_chain(G, tokens), entries[:5])
    assert store.stats()["rejected"] == 0 and store.stats()["errors"] == 0
    assert store.put_chain(G, entries) == 1                    # only the evicted one
    assert _equal(store.get_chain(G, tokens), entries)


def test_ttl_expires_entries(server):
    store = _store(server, ttl=100)
    tokens, entries = _chain(32)
    store.put_chain(G, entries)
    assert 0 < server.client().ttl(store.key(G, entries[0].key)) <= 100


def test_redis_stopped_midrun_counts_errors_without_hanging_and_restarted_reuse_resumes(
        own_server):
    store = RedisPrefixStore(own_server.url, namespace="t", fingerprint=FP, timeout=0.5)
    tokens, entries = _chain(128)
    assert store.put_chain(G, entries) == 8
    assert _equal(store.get_chain(G, tokens), entries)
    own_server.stop()
    assert store.get_chain(G, tokens) == []
    assert store.put_chain(G, entries) == 0
    s = store.stats()
    assert (s["errors"], s["misses"], s["hits"]) == (2, 1, 1)
    own_server.start()                                  # the same port, empty
    assert store.get_chain(G, tokens) == []
    assert store.put_chain(G, entries) == 8
    assert _equal(store.get_chain(G, tokens), entries)
    assert store.stats()["errors"] == 2


@contextlib.contextmanager
def _asleep(server, seconds=4):
    """The server busy in ``DEBUG SLEEP`` (sent from another connection) for
    the block, which gets the sleeping thread: a call that returns while it
    is alive did not wait for the server. The server is awake after it."""
    sleeper = threading.Thread(target=lambda: server.client().execute_command(
        "DEBUG", "SLEEP", str(seconds)))
    sleeper.start()
    try:
        time.sleep(0.1)                                  # the server is asleep now
        yield sleeper
    finally:
        sleeper.join()


def test_a_slow_redis_is_bounded_by_the_timeout(server):
    store = _store(server, timeout=0.3)
    tokens, entries = _chain(64)
    store.put_chain(G, entries)
    with _asleep(server) as sleeper:
        assert store.get_chain(G, tokens) == []
        assert store.put_chain(G, entries) == 0
        assert sleeper.is_alive()                  # both gave up before the server woke
    assert store.stats()["errors"] == 2
    assert _equal(store.get_chain(G, tokens), entries)   # awake again: reuse resumes


def test_a_key_of_another_type_counts_as_an_error_and_keeps_the_run_before_it(server):
    store = _store(server)
    tokens, entries = _chain(64)
    store.put_chain(G, entries)
    c = server.client()
    c.delete(store.key(G, entries[2].key))
    c.rpush(store.key(G, entries[2].key), b"x")              # GET answers WRONGTYPE
    assert _equal(store.get_chain(G, tokens), entries[:2])
    assert store.stats()["errors"] == 1


def test_a_key_of_another_type_is_repaired_like_a_corrupt_value(server):
    """The fetch that meets it deletes it (still of that type), and the next
    publish writes the block; a publish also writes over one it meets."""
    store = _store(server)
    tokens, entries = _chain(64)
    store.put_chain(G, entries)
    c = server.client()
    key = store.key(G, entries[2].key)
    c.delete(key)
    c.rpush(key, b"x")
    assert _equal(store.get_chain(G, tokens), entries[:2])
    assert c.exists(key) == 0                                # dropped
    assert store.put_chain(G, entries) == 1                   # the next publish repairs it
    assert _equal(store.get_chain(G, tokens), entries)
    c.delete(key)
    c.hset(key, "f", b"x")                                   # met by a publish first
    assert store.put_chain(G, entries) == 1
    assert c.type(key) == b"string" and _equal(store.get_chain(G, tokens), entries)


def test_an_oversized_value_transfers_at_most_one_byte_past_a_value(server):
    """32 MiB of junk under a block's key: the fetch reads one byte more than a
    value can hold, rejects and drops it; the next publish repairs it."""
    store = _store(server)
    tokens, entries = _chain(64)
    store.put_chain(G, entries)
    c = server.client()
    key = store.key(G, entries[1].key)
    c.set(key, b"\0" * (32 << 20))
    size = len(encode_value(G, FP, entries[0]))              # every value of G, no salt
    before = store.stats()["bytes_fetched"]
    assert _equal(store.get_chain(G, tokens), entries[:1])
    s = store.stats()
    assert s["bytes_fetched"] - before == size + size + 1 and s["rejected"] == 1
    assert c.exists(key) == 0
    assert store.put_chain(G, entries) == 1
    assert _equal(store.get_chain(G, tokens), entries)
    c.set(key, b"")                                          # an empty string: a miss,
    assert store.put_chain(G, entries) == 1                   # and written over
    assert _equal(store.get_chain(G, tokens), entries)


def test_a_reservation_that_can_never_fit_reads_nothing_through_and_evicts_nothing(server):
    """The read-through comes after the never-fits check: no lookup, no
    import, the locally cached block kept."""
    from support.pools import lookup_rows, publish_seq
    from ferrox_kv import KvPoolExhausted
    writer = _attached(server)
    publish_seq(writer, SYS_PROMPT, seed=7)
    reader = _attached(server, total=12)
    publish_seq(reader, [7, 7, 7, 7, 8], seed=3)                # one cached block per layer
    before = reader.stats()
    assert before["cached_blocks"] == 2
    with pytest.raises(KvPoolExhausted):
        KvCache.with_pool_many(2, 2, 32, reader, 400, tokens=SYS_PROMPT + [0])
    s = reader.stats()
    assert s["store_lookups"] == 0 and s["cached_blocks"] == 2 and s["used_blocks"] == 0
    assert lookup_rows(reader, [7, 7, 7, 7, 8])[0] == 4          # the local block still there
    reader.check()


def test_bad_arguments_raise_before_any_io(server):
    c = server.client()
    with pytest.raises(ValueError, match="namespace"):
        RedisPrefixStore(server.url, namespace="a b", fingerprint=FP)
    with pytest.raises(ValueError, match="namespace"):
        RedisPrefixStore(server.url, namespace="", fingerprint=FP)
    with pytest.raises(TypeError, match="fingerprint"):
        RedisPrefixStore(server.url, namespace="t", fingerprint=None)
    with pytest.raises(ValueError, match="timeout"):
        RedisPrefixStore(server.url, namespace="t", fingerprint=FP, timeout=0)
    with pytest.raises(ValueError, match="ttl"):
        RedisPrefixStore(server.url, namespace="t", fingerprint=FP, ttl=-1)
    with pytest.raises(ValueError, match="decode"):
        RedisPrefixStore(server.client(decode_responses=True), namespace="t", fingerprint=FP)
    with pytest.raises(TypeError, match="url_or_client"):
        RedisPrefixStore(6379, namespace="t", fingerprint=FP)
    store = _store(server)
    tokens, entries = _chain(64)
    with pytest.raises(ValueError, match="child of entry"):
        store.put_chain(G, [entries[0], entries[2]])
    with pytest.raises(ValueError, match="chained hash"):
        store.put_chain(G, [entries[0]._replace(salt="x")])
    with pytest.raises(ValueError, match="start"):
        store.get_chain(G, tokens, start=-1)
    with pytest.raises(TypeError, match="salt"):
        store.get_chain(G, tokens, salt=1.5)
    with pytest.raises(ValueError, match="entry 1: k must be uint8"):
        store.put_chain(G, [entries[0], entries[1]._replace(k=entries[1].k[:1])])
    with pytest.raises(ValueError, match="entry 0: v must be uint8"):
        store.put_chain(G, [entries[0]._replace(v=entries[0].v.view(np.int8))])
    assert c.dbsize() == 0 and store.stats()["lookups"] == 0
    assert store.put_chain(G, entries[2:]) == 2                # a run from any depth
    assert store.get_chain(G, tokens, start=2) != []


def _run_role(script, server, tmp_path, role):
    """``python -c script URL ROLE OUT.npy`` in ``tmp_path`` (outside the
    repository root, whose unbuilt sources would be imported)."""
    return subprocess.run(
        [sys.executable, "-c", script, server.url, role, str(tmp_path / f"{role}.npy")],
        capture_output=True, text=True, timeout=120, cwd=str(tmp_path))


def test_two_processes_share_a_prefix_and_the_rows_are_exactly_the_writers(server, tmp_path):
    script = textwrap.dedent("""
        import sys
        import numpy as np
        from ferrox_kv import KvBlockPool, KvCache
        from ferrox_kv.store import Geometry, RedisPrefixStore, entries_from_rows
        url, role, out = sys.argv[1:]
        pool = KvBlockPool(16, 64, 2, 8, prefix_cache=True)
        g = Geometry.of_pool(pool, 2)
        store = RedisPrefixStore(url, namespace="t", fingerprint="model@1")
        tokens = np.arange(1000, 1000 + 200)
        if role == "writer":
            rng = np.random.default_rng()                 # rows only this process knows
            caches = KvCache.with_pool_many(2, 2, 8, pool, 200)
            for c in caches:
                c.extend(rng.standard_normal((200, 2, 8)).astype(np.float32),
                         rng.standard_normal((200, 2, 8)).astype(np.float32))
            pool.publish(caches, tokens, salt="sys")
            n = store.put_chain(g, entries_from_rows(g, tokens, [c.k for c in caches],
                                                     [c.v for c in caches], salt="sys"))
            np.save(out, np.stack([np.stack([c.k[:192] for c in caches]),
                                   np.stack([c.v[:192] for c in caches])]))
        else:
            got = store.get_chain(g, tokens, salt="sys")
            caches = KvCache.with_pool_many(2, 2, 8, pool, 200)
            for j, c in enumerate(caches):      # what the pool's read-through will do
                c.extend(np.concatenate([e.k[j] for e in got]).view(np.float32).reshape(-1, 2, 8),
                         np.concatenate([e.v[j] for e in got]).view(np.float32).reshape(-1, 2, 8))
            np.save(out, np.stack([np.stack([c.k for c in caches]),
                                   np.stack([c.v for c in caches])]))
            n = len(got)
        print(n, store.stats()["hits"], store.stats()["rejected"])
    """)
    run = lambda role: _run_role(script, server, tmp_path, role)  # noqa: E731
    w = run("writer")
    assert w.returncode == 0, w.stderr
    assert w.stdout.split() == ["12", "0", "0"]
    r = run("reader")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["12", "1", "0"]
    assert np.array_equal(np.load(tmp_path / "writer.npy"), np.load(tmp_path / "reader.npy"))


def test_eight_threads_publish_and_fetch_through_one_store(server):
    from support.threads import run_threads
    store = RedisPrefixStore(server.url, namespace="t", fingerprint=FP, timeout=5)
    prompts = [_chain(256, salt=s, seed=i) for i, s in enumerate([None, None, "x", 5])]
    prompts[1] = _chain(256, salt=None, seed=0)         # the same prompt as 0 (contention)
    seen = []

    def work(tid):
        for it in range(12):
            tokens, entries = prompts[(tid + it) % 4]
            got = store.get_chain(G, tokens, salt=entries[0].salt, start=it % 3)
            assert _equal(got, entries[it % 3:it % 3 + len(got)]), (tid, it)
            store.put_chain(G, entries)
            seen.append(len(got))
    assert run_threads(8, work) == [] and len(seen) == 96
    s = store.stats()
    assert s["lookups"] == 96 and s["errors"] == 0 and s["rejected"] == 0
    assert s["entries_fetched"] == sum(seen) and s["hits"] > 48
    assert server.client().dbsize() == 3 * 16        # three distinct prompts, each once
    assert s["entries_written"] >= 3 * 16           # racing publishers may both write one


def test_the_store_works_with_a_pool_shaped_geometry(server):
    pool = KvBlockPool(16, 8, 2, 8, v_head_dim=4)
    g = Geometry.of_pool(pool, 1)
    assert g.v_row_bytes == 2 * 4 * 4
    store = _store(server)
    c = KvCache.with_pool(2, 8, pool, 32, v_head_dim=4)
    rng = np.random.default_rng(0)
    c.extend(rng.standard_normal((32, 2, 8)).astype(np.float32),
             rng.standard_normal((32, 2, 4)).astype(np.float32))
    entries = entries_from_rows(g, np.arange(32), [c.k], [c.v])
    assert store.put_chain(g, entries) == 2
    got = store.get_chain(g, np.arange(32))
    assert np.array_equal(np.concatenate([e.v[0] for e in got]).view(np.float32).reshape(32, 2, 4),
                          c.v)


def test_a_redis_cluster_works_through_redis_pys_cluster_client(cluster):
    from redis.cluster import RedisCluster
    client = RedisCluster(host="127.0.0.1", port=cluster[0].port, socket_timeout=5)
    store = RedisPrefixStore(client, namespace="t", fingerprint=FP)
    tokens, entries = _chain(256)
    assert store.put_chain(G, entries) == 16
    assert _equal(store.get_chain(G, tokens), entries)
    per_node = [redis.Redis(port=n.port).dbsize() for n in cluster]
    assert sum(per_node) == 16 and sum(1 for n in per_node if n) >= 2   # spread over nodes
    key = store.key(G, entries[5].key)
    client.set(key, client.get(key)[:-1])                              # a truncated value
    assert _equal(store.get_chain(G, tokens), entries[:5])
    assert not client.exists(key)                                       # rejected, dropped
    assert store.put_chain(G, entries) == 1
    assert _equal(store.get_chain(G, tokens), entries)
    s = store.stats()
    assert (s["rejected"], s["errors"], s["hits"]) == (1, 0, 3)
    client.close()


def test_pools_publish_and_hit_across_the_nodes_of_a_redis_cluster(cluster):
    from redis.cluster import RedisCluster

    from support.pools import lookup_rows, publish_seq, store_pool
    prompt = list(range(500, 564))                              # 16 blocks of 4
    pools = []
    for _ in range(2):
        client = RedisCluster(host="127.0.0.1", port=cluster[0].port, socket_timeout=5)
        pool = store_pool(128)
        pool.attach(RedisPrefixStore(client, namespace="c", fingerprint=FP))
        pools.append((pool, client))
    (writer, _), (reader, _) = pools
    want = publish_seq(writer, prompt + [1], seed=5, salt="tenant")
    assert writer.stats()["store_entries_written"] == 16
    per_node = [redis.Redis(port=n.port).dbsize() for n in cluster]
    assert sum(per_node) == 16 and sum(1 for n in per_node if n) >= 2
    n, got = lookup_rows(reader, prompt + [2], salt="tenant")
    assert n == 64
    for (gk, gv), (wk, wv) in zip(got, want):
        assert np.array_equal(gk[:64], wk) and np.array_equal(gv[:64], wv)
    s = reader.stats()
    assert (s["store_hits"], s["store_entries_fetched"], s["store_errors"],
            s["store_rejected"]) == (1, 16, 0, 0)
    assert lookup_rows(reader, prompt + [2])[0] == 0           # another salt: no hit
    for pool, client in pools:
        pool.check()
        assert pool.stats()["used_blocks"] == 0
        client.close()


# -- a pool with the store attached: write-through, read-through ----------------------

def _attached(server, total=64, dtype="float32", rotate=None, **kw):
    from support.pools import store_pool
    pool = store_pool(total, dtype, rotate=rotate)
    pool.attach(RedisPrefixStore(server.url, namespace="pool", fingerprint=FP, **kw))
    return pool


SYS_PROMPT = list(range(300, 320))                  # 5 blocks of 4


@pytest.mark.parametrize("dtype", ["float32", "int8", "int4"])
def test_publish_writes_through_and_a_local_miss_reads_through(server, dtype):
    from support.pools import lookup_rows, publish_seq
    writer = _attached(server, dtype=dtype)
    want = publish_seq(writer, SYS_PROMPT + [1, 2, 3], seed=7)
    assert writer.stats()["store_entries_written"] == 5
    reader = _attached(server, dtype=dtype)
    n, got = lookup_rows(reader, SYS_PROMPT + [9, 9])
    assert n == 20
    for (gk, gv), (wk, wv) in zip(got, want):
        assert np.array_equal(gk[:20], wk[:20]) and np.array_equal(gv[:20], wv[:20])
    s = reader.stats()
    assert s["store_hits"] == 1 and s["store_entries_fetched"] == 5 and s["prefix_hits"] == 1
    assert s["used_blocks"] == 0 and s["cached_blocks"] == 10
    reader.check()
    # a local hit of 3 blocks and 2 more in Redis: the continuation is fetched
    part = _attached(server, dtype=dtype)
    publish_seq(part, SYS_PROMPT[:12], seed=7)
    assert lookup_rows(part, SYS_PROMPT + [0])[0] == 20
    part.check()


def test_int4_entries_reach_only_readers_of_their_rotation(server):
    """Rotated and plain int4 rows are two dtypes in the store's keys: a
    reader of the other rotation misses (and takes no block), one of the
    same rotation hits with the writer's rows."""
    from support.pools import lookup_rows, publish_seq
    for rotate, other, prompt in ((None, False, SYS_PROMPT), (False, None, SYS_PROMPT[::-1])):
        writer = _attached(server, dtype="int4", rotate=rotate)
        want = publish_seq(writer, prompt + [1, 2, 3], seed=7)
        miss = _attached(server, dtype="int4", rotate=other)
        assert lookup_rows(miss, prompt + [9, 9])[0] == 0
        s = miss.stats()
        assert s["store_hits"] == 0 and s["used_blocks"] == 0 and s["cached_blocks"] == 0
        miss.check()
        same = _attached(server, dtype="int4", rotate=rotate)
        n, got = lookup_rows(same, prompt + [9, 9])
        assert n == 20
        for (gk, gv), (wk, wv) in zip(got, want):
            assert np.array_equal(gk[:20], wk[:20]) and np.array_equal(gv[:20], wv[:20])
        same.check()


def test_attach_checks_its_arguments(server):
    from support.pools import store_pool
    with pytest.raises(TypeError, match="RedisPrefixStore"):
        store_pool(8).attach(object())
    plain = KvBlockPool(4, 8, 2, 32)
    with pytest.raises(ValueError, match="prefix_cache=True"):
        plain.attach(RedisPrefixStore(server.url, namespace="pool", fingerprint=FP))
    pool = _attached(server)
    assert pool.store is not None
    pool.attach(None)
    assert pool.store is None and "store_hits" not in pool.stats()


def test_redis_stopped_is_a_counted_miss_and_takes_no_block(own_server):
    from support.pools import lookup_rows, publish_seq
    writer = _attached(own_server, timeout=0.3)
    publish_seq(writer, SYS_PROMPT, seed=7)
    own_server.stop()
    reader = _attached(own_server, timeout=0.3)
    n, _ = lookup_rows(reader, SYS_PROMPT + [0])
    assert n == 0
    publish_seq(writer, SYS_PROMPT + [5, 6, 7, 8], seed=7)       # write-through fails quietly
    s = reader.stats()
    assert s["store_errors"] >= 1 and s["used_blocks"] == 0 and s["cached_blocks"] == 0
    assert writer.stats()["store_errors"] >= 1
    reader.check()
    writer.check()


def test_a_slow_redis_is_a_counted_miss_within_the_timeout_and_takes_no_block(server):
    from support.pools import lookup_rows, publish_seq
    writer = _attached(server, timeout=0.3)
    want = publish_seq(writer, SYS_PROMPT, seed=7)
    reader = _attached(server, timeout=0.3)
    with _asleep(server) as sleeper:
        n, _ = lookup_rows(reader, SYS_PROMPT + [0])
        assert n == 0 and sleeper.is_alive()       # gave up before the server woke
        s = reader.stats()
        assert (s["store_lookups"], s["store_misses"], s["store_errors"]) == (1, 1, 1)
        assert s["used_blocks"] == 0 and s["cached_blocks"] == 0
        reader.check()
    n, got = lookup_rows(reader, SYS_PROMPT + [0])        # awake again: the hit resumes
    assert n == 20 and reader.stats()["store_hits"] == 1
    for (gk, gv), (wk, wv) in zip(got, want):
        assert np.array_equal(gk[:20], wk) and np.array_equal(gv[:20], wv)
    reader.check()


def test_a_busy_pool_refuses_without_reading_through_and_leaks_nothing(server):
    """Refused for now (8 of 12 blocks held, 12 needed): nothing is read
    from Redis, nothing imported, the pool as it was; once the blocks are
    back the read-through fills the prefix."""
    from support.pools import lookup_rows, publish_seq
    writer = _attached(server)
    publish_seq(writer, SYS_PROMPT, seed=7)
    reader = _attached(server, total=12)
    held = KvCache.with_pool_many(2, 2, 32, reader, 4 * 4)        # 8 of 12 blocks
    from ferrox_kv import KvPoolExhausted
    with pytest.raises(KvPoolExhausted):
        lookup_rows(reader, SYS_PROMPT + [0])
    s = reader.stats()
    assert s["cached_blocks"] == 0 and s["store_lookups"] == 0 and s["used_blocks"] == 8
    reader.check()
    for c in held:
        c.close()
    assert reader.stats()["used_blocks"] == 0
    assert lookup_rows(reader, SYS_PROMPT + [0])[0] == 20
    reader.check()


def test_two_processes_share_a_system_prompt_through_one_redis(server, tmp_path):
    here = os.path.dirname(os.path.abspath(__file__))
    script = textwrap.dedent(f"""
        import sys
        import numpy as np
        sys.path.insert(0, {here!r})
        from support.pools import store_pool, publish_seq, lookup_rows
        from ferrox_kv.store import RedisPrefixStore
        url, role, out = sys.argv[1:]
        pool = store_pool(64)
        pool.attach(RedisPrefixStore(url, namespace="two", fingerprint="model@1"))
        prompt = {SYS_PROMPT!r}
        if role == "writer":
            rows = publish_seq(pool, prompt + [1, 2], seed=11, salt="sys")
            np.save(out, np.stack([np.concatenate(r, axis=1) for r in rows]))
            print(pool.stats()["store_entries_written"])
        else:
            n, got = lookup_rows(pool, prompt + [7, 8, 9], salt="sys")
            np.save(out, np.stack([np.concatenate(r, axis=1)[:n] for r in got]))
            print(n, pool.stats()["store_hits"], pool.stats()["prefix_hits"])
            pool.check()
    """)
    run = lambda role: _run_role(script, server, tmp_path, role)  # noqa: E731
    w = run("writer")
    assert w.returncode == 0, w.stderr
    assert w.stdout.split() == ["5"]
    r = run("reader")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["20", "1", "1"]        # the reader prefills only the tail
    want, got = np.load(tmp_path / "writer.npy"), np.load(tmp_path / "reader.npy")
    assert want.shape == got.shape
    for t in range(20):
        assert np.array_equal(want[:, t], got[:, t]), t


def test_the_two_servers_example_shares_the_system_prompt(server):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, os.path.join(root, "examples", "two_servers_one_redis.py"),
                        server.url], capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr
    first, second = p.stdout.splitlines()
    assert first.startswith("first server: reused 0 positions, prefilled 101;")
    assert "entries written 6" in first
    assert second.startswith("second server: reused 96 positions, prefilled 3; store hits 1")


def test_the_two_servers_example_answers_help_and_a_bad_url_at_once():
    """--help was taken as the Redis URL and the example blocked for 60 s."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, "examples", "two_servers_one_redis.py")
    p = subprocess.run([sys.executable, path, "--help"], capture_output=True, text=True,
                       timeout=20)
    assert p.returncode == 0 and "usage:" in p.stdout and "url" in p.stdout, p
    p = subprocess.run([sys.executable, path, "not-a-url"], capture_output=True, text=True,
                       timeout=20)
    assert p.returncode == 2 and "not a Redis URL" in p.stderr, p


@pytest.mark.long
def test_the_threaded_example_run_twice_shares_its_system_prompt_through_redis(server):
    pytest.importorskip("transformers")
    import re
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, os.path.join(root, "examples", "threaded_generate.py"),
           "--threads", "2", "--new-tokens", "2", "--redis", server.url]
    first, second = (subprocess.run(cmd, capture_output=True, text=True, timeout=300)
                     for _ in range(2))
    reused = []
    for p in (first, second):
        assert p.returncode == 0, p.stderr
        assert "every block is back in the pool" in p.stdout
        reused.append(re.findall(r"first request: time to first token [0-9.]+ ms, "
                                 r"(\d+) prompt positions reused", p.stdout)[-1])
    assert reused == ["0", "96"]                 # the second read the system prompt from Redis
    hits = re.search(r"store: (\d+) remote hits, \d+ positions fetched, \d+ written, "
                     r"(\d+) errors", second.stdout)
    assert hits and int(hits.group(1)) >= 1 and hits.group(2) == "0"


def test_eight_threads_read_and_write_through_one_pool_and_one_store(server):
    from support.numerics import rows
    from support.pools import STORE_DIM, STORE_HEADS
    from support.threads import run_threads
    writer = _attached(server, total=256)
    reader = _attached(server, total=256)
    w = STORE_HEADS * STORE_DIM

    def work(i):
        for r in range(4):
            pool = writer if (i + r) % 2 else reader
            toks = SYS_PROMPT + [i, r, i, r, 1]
            caches = KvCache.with_pool_many(2, STORE_HEADS, STORE_DIM, pool, len(toks),
                                            tokens=toks)
            todo = len(toks) - caches[0].seq_len
            for j, c in enumerate(caches):
                c.extend(rows(todo, w, 2 * j), rows(todo, w, 2 * j + 1))
            pool.publish(caches, toks)
            for c in caches:
                c.close()
    assert run_threads(8, work) == []
    for pool in (writer, reader):
        pool.check()
        assert pool.stats()["used_blocks"] == 0 and pool.stats()["store_rejected"] == 0


def test_a_salt_longer_than_the_format_holds_stays_local_and_nothing_raises(server):
    """The pool takes any salt; one beyond MAX_SALT bytes encoded is never
    written to nor read from the store (the format cannot hold it), and
    neither publish nor a lookup raises for it."""
    from support.pools import lookup_rows, publish_seq
    from ferrox_kv.store._format import MAX_SALT
    long = "x" * (MAX_SALT + 1)
    writer = _attached(server)
    want = publish_seq(writer, SYS_PROMPT, salt=long, seed=7)      # local publish, no write
    assert writer.stats()["store_entries_written"] == 0
    n, got = lookup_rows(writer, SYS_PROMPT + [0], salt=long)      # the local hit still works
    assert n == 20 and np.array_equal(got[0][0][:20], want[0][0])
    reader = _attached(server)
    assert lookup_rows(reader, SYS_PROMPT + [0], salt=long)[0] == 0
    s = reader.stats()
    assert s["store_lookups"] == 0 and s["used_blocks"] == 0 and s["cached_blocks"] == 0
    writer.check()
    reader.check()


def test_detaching_the_store_while_threads_look_up_and_publish_never_raises(server):
    """attach(None) from another thread between a pool's check for a store
    and its use of it: the lookup or the write-through just goes without."""
    from support.numerics import rows
    from support.pools import STORE_DIM, STORE_HEADS, store_pool
    from support.threads import run_threads
    store = RedisPrefixStore(server.url, namespace="detach", fingerprint=FP)
    pool = store_pool(64)
    pool.attach(store)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    stop = time.monotonic() + 2.0
    w = STORE_HEADS * STORE_DIM

    def work(i):
        n = 0
        while time.monotonic() < stop:
            if i == 0:
                pool.attach(None)
                pool.attach(store)
                continue
            n += 1
            toks = [i * 100000 + n] + list(range(15))
            cs = KvCache.with_pool_many(2, STORE_HEADS, STORE_DIM, pool, 17, tokens=toks + [1])
            have = cs[0].seq_len
            for c in cs:
                c.extend(rows(16 - have, w, n), rows(16 - have, w, n + 1))
            pool.publish(cs, toks)
            for c in cs:
                c.close()
    try:
        assert run_threads(3, work) == []
    finally:
        sys.setswitchinterval(old)
    pool.check()
    assert pool.stats()["used_blocks"] == 0
