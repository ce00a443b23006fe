"""Prefixes beyond one process: the prefix file (``--prefix-file``) and the
Redis store (``--redis``). The one module of the server that uses
``ferrox_kv.store``.

``PrefixFile``: loaded at start, before the first request, with
``load_prefixes`` (verified whole: a file of another model, geometry or
dtype, or a damaged one, is one log line naming the field, and the server
starts empty); saved atomically with ``save_prefixes`` (a temporary file
renamed over the old one: a save that fails leaves the previous file).

``RedisPrefixes``: a ``RedisPrefixStore`` as the server attaches it to its
pool. No Redis I/O ever runs on the engine's step loop:

* a publish (a finished request's prompt and output) writes through: the
  pool hands the entries (copies of the rows) to ``put_chain``, which queues
  them for a writer thread; the queue holds ``WRITE_QUEUE`` chains, and a
  publish that finds it full (Redis slow or unreachable) writes nothing,
  counted in ``writes_dropped``, so that memory stays bounded;
* a lookup at admission (on the engine's thread) reads nothing from Redis
  (``get_chain`` answers no entry there);
* the read-through runs before admission, in one of the engine's fetcher
  threads (``fetch``): the blocks of its prompt past the pool's local
  prefix are read from Redis, verified and published into the pool, and
  only then does the request join the engine's queue, where admission finds
  them locally. A request waiting for Redis thus waits alone, in a
  fetcher thread, while the step loop runs the others. A fetch runs only
  while the pool's free blocks that hold no cached prefix cover every block
  of the prompt in every layer: a read-through never evicts another
  request's (or tenant's) cached prefix, and a pool too full is a skip, not
  a Redis round trip.

Redis down, slow (each call is bounded by the store's ``timeout``) or wrong
(a value that fails verification) is a miss, counted, never an error to
the client. Tenants are the salts, as in the pool.
"""
from __future__ import annotations

import queue
import sys
import threading
import time

import numpy as np

from ferrox_kv.store import RedisPrefixStore, StoreFormatError, load_prefixes, save_prefixes

__all__ = ["WRITE_QUEUE", "PrefixFile", "RedisPrefixes", "redis_client"]

WRITE_QUEUE = 32        # chains waiting for the Redis writer; past it a publish writes nothing


def _log(message):
    print(f"ferrox-kv serve: {message}", file=sys.stderr, flush=True)


class PrefixFile:
    """``--prefix-file PATH`` of ``pool`` for the model whose identity is
    ``fingerprint`` (``ferrox_kv.hf.fingerprint``, computed once at start).
    ``loaded`` and ``saved`` count the entries moved."""

    def __init__(self, pool, path, fingerprint, n_layers):
        self.pool, self.path, self.fingerprint, self.n_layers = pool, path, fingerprint, n_layers
        self.loaded = 0
        self.saved = 0
        self._lock = threading.Lock()          # one save at a time (interval and shutdown)

    def load(self) -> bool:
        """Publish the file's prefixes into the pool; False (one log line,
        the pool untouched) when it is missing, foreign or damaged."""
        try:
            got = load_prefixes(self.pool, self.path, fingerprint=self.fingerprint)
        except FileNotFoundError:
            _log(f"--prefix-file {self.path}: no such file yet; starting empty")
            return False
        except StoreFormatError as e:
            _log(f"--prefix-file {self.path} not loaded, field {e.field!r}: {e}; starting empty")
            return False
        except (OSError, ValueError) as e:
            _log(f"--prefix-file {self.path} not loaded: {e}; starting empty")
            return False
        self.loaded += got["entries"]
        _log(f"--prefix-file {self.path}: loaded {got['entries']} prefix entries "
             f"({got['tokens']} tokens)")
        return True

    def save(self) -> bool:
        """Write the pool's published prefixes atomically; False (logged, the
        previous file intact) when the write fails."""
        with self._lock:
            try:
                got = save_prefixes(self.pool, self.path, fingerprint=self.fingerprint,
                                    n_layers=self.n_layers)
            except (OSError, ValueError) as e:
                _log(f"--prefix-file {self.path} not saved: {e}; the previous file is left as "
                     "it was")
                return False
        self.saved += got["entries"]
        _log(f"--prefix-file {self.path}: saved {got['entries']} prefix entries "
             f"({got['tokens']} tokens)")
        return True

    def save_every(self, seconds) -> _Saver:
        """A thread that saves every ``seconds`` until its ``stop()``. A save
        that raises is logged (its field, if the store names one) and the
        next one runs on time: the thread never ends on a failed save."""
        stop = threading.Event()

        def loop():
            while not stop.wait(seconds):
                try:
                    self.save()
                except Exception as e:         # noqa: BLE001  (logged; the next save retries)
                    field = getattr(e, "field", None)
                    _log(f"--prefix-file {self.path} not saved"
                         f"{f', field {field!r}' if field else ''}: {type(e).__name__}: {e}; "
                         f"trying again in {seconds:g} s")
        t = threading.Thread(target=loop, name="ferrox-serve-prefix-save", daemon=True)
        t.start()
        return _Saver(stop, t)


class _Saver:
    """The interval-save thread of ``PrefixFile.save_every``."""

    def __init__(self, stop, thread):
        self._stop, self.thread = stop, thread

    def stop(self):
        """No more saves; returns once a save under way has finished. A save
        holds references on published blocks while it exports them, so the
        exit's check of the pool (no block in use) runs only after this."""
        self._stop.set()
        self.thread.join()


def redis_client(url, timeout):
    """A client for ``--redis URL``: ``redis://`` (or ``rediss://``,
    ``unix://``) is one server, the store's own client; ``redis+cluster://HOST:PORT``
    is a Redis Cluster reached through any of its nodes."""
    if not url.startswith("redis+cluster://"):
        return url
    from redis.backoff import NoBackoff
    from redis.cluster import RedisCluster
    from redis.retry import Retry
    return RedisCluster.from_url("redis://" + url[len("redis+cluster://"):],
                                 socket_timeout=timeout, socket_connect_timeout=timeout,
                                 retry=Retry(NoBackoff(), 0))


class _ServerStore(RedisPrefixStore):
    """A ``RedisPrefixStore`` whose Redis I/O never runs on the engine's
    thread. The pool's hooks (``after_publish``, ``before_lookup``) are the
    store's own; underneath them, ``put_chain`` queues the entries (copies of
    the rows) for the writer thread, and ``get_chain`` reads Redis only in a
    thread that asked for it (``fetching``): elsewhere it answers no entry."""

    def __init__(self, *args, max_writes=WRITE_QUEUE, **kw):
        super().__init__(*args, **kw)
        self.local = threading.local()
        self.writes: queue.Queue = queue.Queue(max_writes)
        self.writes_dropped = 0          # chains not written: the queue was full, or closed
        self._drop_lock = threading.Lock()

    def _dropped(self, n):
        with self._drop_lock:
            self.writes_dropped += n

    def after_publish(self, pool, caches, tokens, salt):
        if self.writes.full():           # before the rows are copied
            self._dropped(1)
            return 0
        return super().after_publish(pool, caches, tokens, salt)

    def get_chain(self, geometry, tokens, *, salt=None, start=0, limit=None):
        calls = getattr(self.local, "calls", None)
        if calls is None:
            return []                 # a lookup on the engine's thread: never waits for Redis
        got = super().get_chain(geometry, tokens, salt=salt, start=start, limit=limit)
        calls.append((start, limit, len(got)))
        return got

    def put_chain(self, geometry, entries):
        try:
            self.writes.put_nowait((geometry, list(entries)))
        except queue.Full:
            self._dropped(1)
            return 0
        return len(entries)

    def drop_queued(self) -> int:
        """Empty the queue (each chain counted in ``writes_dropped``) and
        leave the writer its stop; returns the chains dropped."""
        n = 0
        while True:
            try:
                item = self.writes.get_nowait()
            except queue.Empty:
                break
            n += item is not None
        self._dropped(n)
        self.writes.put_nowait(None)
        return n

    def write_queued(self):
        """The writer thread: each queued chain to Redis, until None."""
        while (item := self.writes.get()) is not None:
            try:
                super().put_chain(*item)
            except Exception:              # noqa: BLE001  (counted by the store; never fatal)
                pass


class RedisPrefixes:
    """``--redis URL`` of ``pool``: attaches a ``_ServerStore`` (see the
    module docstring). ``RedisPrefixes(pool, url, *, fingerprint, n_layers,
    namespace, timeout, max_writes)``; ``fetch(prompt_ids, salt)`` from a
    fetcher thread; ``close()`` writes what is queued, stops the writer,
    detaches."""

    def __init__(self, pool, url, *, fingerprint, n_layers, namespace="ferrox", timeout=0.5,
                 max_writes=WRITE_QUEUE):
        self.store = _ServerStore(redis_client(url, timeout), namespace=namespace,
                                  fingerprint=fingerprint, timeout=timeout,
                                  max_writes=max_writes)
        self.pool, self.n_layers = pool, n_layers
        self._lock = threading.Lock()
        self.hit_tokens = 0
        self.miss_tokens = 0
        self.on_fetch = None                     # on_fetch(seconds): the metrics' histogram
        self._writer = threading.Thread(target=self.store.write_queued,
                                        name="ferrox-serve-redis-write", daemon=True)
        self._writer.start()
        pool.attach(self.store)

    def stats(self):
        return self.store.stats()

    @property
    def writes_dropped(self) -> int:
        """Chains (one per publish) not written to Redis: the write queue
        was full, or still held them when ``close`` gave up waiting."""
        return self.store.writes_dropped

    def fetch(self, prompt_ids, salt) -> int:
        """Read the blocks of ``prompt_ids`` past the pool's local prefix
        through Redis into the pool (in the calling thread; at most the
        store's round trips, each bounded by its timeout). Returns the
        tokens it added; a fault is a miss. Nothing is read while the
        pool's free blocks that hold no cached prefix are fewer than the
        prompt's blocks in every layer: the import then never evicts."""
        bs = self.pool.block_size
        whole = (max(len(prompt_ids) - 1, 0) // bs) * bs   # a lookup reuses at most len - 1
        if whole == 0:
            return 0
        s = self.pool.stats()
        if s["free_blocks"] - s["cached_blocks"] < (whole // bs) * self.n_layers:
            return 0
        tokens = np.asarray(prompt_ids[:whole], dtype=np.int64)
        self.store.local.calls = calls = []
        t0 = time.perf_counter()
        try:
            added = self.store.before_lookup(self.pool, tokens, salt, self.n_layers)
        except Exception:                  # noqa: BLE001  (a fault of the store is a miss)
            added = 0
        finally:
            self.store.local.calls = None
        if not calls:                      # all local: Redis was not asked
            return 0
        asked = calls[0][1] if calls[0][1] is not None else whole // bs - calls[0][0]
        hit = min(added, asked)
        with self._lock:
            self.hit_tokens += hit * bs
            self.miss_tokens += (asked - hit) * bs
        if self.on_fetch is not None:
            self.on_fetch(time.perf_counter() - t0)
        return hit * bs

    def close(self, timeout=60.0):
        """Detach, write what is queued (for at most ``timeout`` seconds),
        stop the writer, close the client. Chains still queued then are
        dropped: counted in ``writes_dropped`` and logged."""
        self.pool.attach(None)                   # nothing more is queued
        end = time.monotonic() + timeout
        try:
            self.store.writes.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._writer.join(max(end - time.monotonic(), 0.0))
        dropped = self.store.drop_queued()
        if dropped:
            _log(f"--redis: {dropped} queued prefix writes dropped at shutdown (Redis did not "
                 f"take them within {timeout:g} s); {self.writes_dropped} dropped in all")
        self.store.close()
