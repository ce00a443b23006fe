"""RedisPrefixStore: prefix entries shared by processes and machines through
one Redis, one value under one key per block position, verified on fetch."""
from __future__ import annotations

import hashlib
import threading
from typing import Any, Sequence

from ferrox_kv.store._format import (
    NO_PARENT,
    VERSION,
    Entry,
    Geometry,
    StoreFormatError,
    _tokens_i32,
    chain_keys,
    check_run,
    decode_value,
    encode_value,
    fingerprint_bytes,
    value_bytes,
)
from ferrox_kv.store._pool import read_through, write_through

# delete a key only while it still holds the value that was rejected (its SHA-1)
_DROP_IF_SAME = """
local v = redis.call('GET', KEYS[1])
if v and redis.sha1hex(v) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# delete a key only while it is still of another type than a string
_DROP_IF_NOT_STRING = """
local t = redis.call('TYPE', KEYS[1])['ok']
if t ~= 'string' and t ~= 'none' then return redis.call('DEL', KEYS[1]) end
return 0
"""

# delete a key only while it is still a string longer than any value can be
_DROP_IF_LONGER = """
if redis.call('TYPE', KEYS[1])['ok'] == 'string'
   and redis.call('STRLEN', KEYS[1]) > tonumber(ARGV[1]) then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

STAT_NAMES = ("lookups", "hits", "misses", "entries_fetched", "tokens_fetched",
              "bytes_fetched", "entries_written", "tokens_written", "bytes_written",
              "errors", "rejected")


def _redis() -> Any:
    try:
        import redis
    except ModuleNotFoundError as e:
        raise ImportError("RedisPrefixStore needs the redis client: "
                          "pip install '.[redis]' from the ferrox_kv checkout") from e
    return redis


class RedisPrefixStore:
    """A prefix store on Redis (or Valkey).

    ``RedisPrefixStore(url_or_client, *, namespace, fingerprint, timeout=0.5,
    ttl=None, batch_bytes=64 MiB)``. A URL (``redis://host:port/db``) makes a
    client whose connect and socket timeouts are ``timeout`` seconds, with no
    retries; a client you pass in keeps its own timeouts (it must not decode
    responses). ``namespace`` and ``fingerprint`` (the model's identity, bytes
    or str) are part of every key, with the geometry, the dtype and the block's
    chained hash: ``{namespace}:fxkv1:{fingerprint digest}:{geometry}:{hash}``.
    ``ttl`` (seconds) expires entries; otherwise Redis's ``maxmemory-policy``
    (``allkeys-lru``) evicts them.

    Redis faults never raise: a connection error, a timeout or a value that
    fails verification counts (``errors``, ``rejected``) and the call returns
    what it had (a miss). A rejected value is deleted (if it is still the same
    value), and so is a key of another type than a string under the store's
    keys (if it still is), so that the next publish of that block repairs it;
    a publish also overwrites any key that is not a string of a value's exact
    size. A fetch reads at most one byte more than a value's exact size
    (``GETRANGE``), so one round trip receives at most ``batch_bytes`` plus
    one byte per value, whatever junk a key holds. Each call stops at its
    first fault, so it returns within its round trips (at most 2 + one per
    ``batch_bytes`` of values) times ``timeout``. Wrong arguments (a bad geometry, entries that do not
    chain) raise ``ValueError``/``TypeError`` before any I/O.

    Thread-safe: one store may serve many threads (the client's connection
    pool hands each call its own connection).
    """

    def __init__(self, url_or_client: Any, *, namespace: str, fingerprint: Any,
                 timeout: float = 0.5, ttl: int | None = None,
                 batch_bytes: int = 64 << 20) -> None:
        if type(namespace) is not str or not 0 < len(namespace) <= 128 or any(
                c.isspace() or not c.isprintable() for c in namespace):
            raise ValueError("namespace must be 1..128 printable characters without spaces, "
                             f"got {namespace!r}")
        self._fp = fingerprint_bytes(fingerprint)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (
                0 < timeout <= 3600):
            raise ValueError(f"timeout must be seconds in (0, 3600], got {timeout!r}")
        if ttl is not None and (type(ttl) is not int or ttl <= 0):
            raise ValueError(f"ttl must be None or a positive number of seconds, got {ttl!r}")
        if type(batch_bytes) is not int or batch_bytes <= 0:
            raise ValueError(f"batch_bytes must be a positive int, got {batch_bytes!r}")
        if isinstance(url_or_client, str):
            redis = _redis()
            from redis.backoff import NoBackoff
            from redis.retry import Retry
            client = redis.Redis.from_url(url_or_client, socket_timeout=timeout,
                                          socket_connect_timeout=timeout,
                                          retry=Retry(NoBackoff(), 0), health_check_interval=0)
        elif callable(getattr(url_or_client, "pipeline", None)):
            client = url_or_client
            kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", {})
            if kwargs.get("decode_responses"):
                raise ValueError("the Redis client decodes responses to str; the store needs "
                                 "bytes: make it with decode_responses=False")
        else:
            raise TypeError("url_or_client must be a redis:// URL or a redis client, got "
                            f"{type(url_or_client).__name__}")
        self._client = client
        self._owns_client = isinstance(url_or_client, str)
        self._errors = _redis().exceptions.RedisError, OSError
        self.namespace, self.timeout, self.ttl, self.batch_bytes = (namespace, timeout, ttl,
                                                                     batch_bytes)
        self._fp_tag = hashlib.blake2b(self._fp, digest_size=8).hexdigest()
        self._lock = threading.Lock()
        self._stats = dict.fromkeys(STAT_NAMES, 0)

    @property
    def fingerprint(self) -> bytes:
        return self._fp

    @property
    def client(self) -> Any:
        return self._client

    def key(self, geometry: Geometry, chain_key: bytes) -> bytes:
        """The Redis key of the block whose chained hash is ``chain_key``."""
        return (f"{self.namespace}:fxkv{VERSION}:{self._fp_tag}:{geometry.tag()}:"
                f"{bytes(chain_key).hex()}").encode()

    # -- the pool's hooks (KvBlockPool.attach): write through, read through ----

    def after_publish(self, pool: Any, caches: Any, tokens: Any, salt: Any) -> int:
        """Called by ``pool.publish``: the published blocks of one sequence
        (``caches``: its layers; ``tokens``: the published positions) written
        here; see ``ferrox_kv.store._pool.write_through``."""
        return write_through(self, pool, caches, tokens, salt)

    def before_lookup(self, pool: Any, tokens: Any, salt: Any, n_layers: int) -> int:
        """Called by a lookup with ``tokens=``: the blocks past the pool's local
        prefix fetched from here and published in the pool; see
        ``ferrox_kv.store._pool.read_through``."""
        return read_through(self, pool, tokens, salt, n_layers)

    def stats(self) -> dict[str, int]:
        """Counts since the store was made: ``lookups`` (get_chain calls),
        ``hits`` (lookups that returned an entry) and ``misses``;
        ``entries_fetched``/``tokens_fetched`` (verified), ``bytes_fetched``
        (value bytes received); ``entries_written``, ``tokens_written``,
        ``bytes_written``; ``errors`` (connection errors, timeouts, keys of
        another type, which are deleted); ``rejected`` (values that failed
        verification, or longer than a value can be; deleted)."""
        with self._lock:
            return dict(self._stats)

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, d in deltas.items():
                self._stats[name] += d

    def put_chain(self, geometry: Geometry, entries: Sequence[Entry]) -> int:
        """Write consecutive entries of one sequence (the first at any depth,
        each the parent of the next) that Redis does not hold yet: one round
        trip to ask which keys hold a string of the value's exact size
        (``STRLEN``; a key of another type or size is written over), then one
        per ``batch_bytes`` of values to set (each one ``SET``, so a reader
        sees a value whole or not at all). Returns how many were written; a
        fault stops the call (counted)."""
        geometry = geometry.check()
        entries = list(entries)
        check_run(geometry, entries)
        keys = [self.key(geometry, e.key) for e in entries]
        sizes = [value_bytes(geometry, self._fp, e.salt) for e in entries]
        written = tokens = nbytes = 0
        try:
            pipe = self._client.pipeline(transaction=False)
            for k in keys:
                pipe.strlen(k)
            lengths = pipe.execute(raise_on_error=False)
            present = [n == size for n, size in zip(lengths, sizes)]   # WRONGTYPE: not
            todo = [i for i, p in enumerate(present) if not p]
            if self.ttl is not None and len(todo) < len(keys):
                pipe = self._client.pipeline(transaction=False)
                for i, p in enumerate(present):
                    if p:
                        pipe.expire(keys[i], self.ttl)
                pipe.execute()
            # values are encoded batch by batch, only for the missing keys
            todo.reverse()
            value = encode_value(geometry, self._fp, entries[todo[-1]]) if todo else b""
            while todo:
                pipe = self._client.pipeline(transaction=False)
                n = size = 0
                while todo and (not n or size + len(value) <= self.batch_bytes):
                    pipe.set(keys[todo.pop()], value, ex=self.ttl)
                    size += len(value)
                    n += 1
                    value = encode_value(geometry, self._fp, entries[todo[-1]]) if todo else b""
                pipe.execute()
                written += n
                tokens += n * geometry.block_size
                nbytes += size
        except self._errors:
            self._count(errors=1)
        self._count(entries_written=written, tokens_written=tokens, bytes_written=nbytes)
        return written

    def get_chain(self, geometry: Geometry, tokens: Any, *, salt: Any = None, start: int = 0,
                  limit: int | None = None) -> list[Entry]:
        """The longest run of verified entries for the full blocks of ``tokens``
        from block ``start`` on (at most ``limit``): pipelined ``GET``s, one
        round trip per ``batch_bytes`` of values. Each value is verified
        (geometry, dtype, fingerprint, checksum, salt, token ids, depth, parent
        link); the run stops at the first missing, failing or unreachable one.
        Each ``GETRANGE`` reads at most one byte past a value's exact size.
        The entries' arrays are read-only views of the fetched values."""
        geometry = geometry.check()
        if type(start) is not int or start < 0:
            raise ValueError(f"start must be a non-negative int, got {start!r}")
        if limit is not None and (type(limit) is not int or limit < 0):
            raise ValueError(f"limit must be None or a non-negative int, got {limit!r}")
        bs = geometry.block_size
        tokens = _tokens_i32(tokens).copy()           # a private copy: checked against values
        chain = chain_keys(tokens, bs, salt)
        stop = len(chain) if limit is None else min(len(chain), start + limit)
        size = value_bytes(geometry, self._fp, salt)
        per_batch = max(1, self.batch_bytes // (size + 1))
        got: list[Entry] = []
        received = rejected = errors = 0
        at = start
        try:
            while at < stop:
                upto = min(stop, at + per_batch)
                pipe = self._client.pipeline(transaction=False)
                for i in range(at, upto):               # one byte past a value's size
                    pipe.getrange(self.key(geometry, chain[i]), 0, size)
                values = pipe.execute(raise_on_error=False)
                ok = 0
                for i, value in zip(range(at, upto), values):
                    if isinstance(value, Exception):
                        errors += 1
                        if "WRONGTYPE" in str(value):
                            self._client.eval(_DROP_IF_NOT_STRING, 1,
                                              self.key(geometry, chain[i]))
                        break
                    if not value:                        # no key (or an empty string)
                        break
                    received += len(value)
                    if len(value) > size:
                        rejected += 1
                        self._client.eval(_DROP_IF_LONGER, 1, self.key(geometry, chain[i]),
                                          size)
                        break
                    try:
                        got.append(decode_value(
                            value, geometry=geometry, fingerprint=self._fp, key=chain[i],
                            parent=chain[i - 1] if i else NO_PARENT, depth=i, salt=salt,
                            tokens=tokens[i * bs:(i + 1) * bs]))
                    except StoreFormatError:
                        rejected += 1
                        self._client.eval(_DROP_IF_SAME, 1, self.key(geometry, chain[i]),
                                          hashlib.sha1(value).hexdigest())
                        break
                    ok += 1
                at += ok
                if at < upto:
                    break
        except self._errors:
            errors += 1
        self._count(lookups=1, hits=int(bool(got)), misses=int(not got),
                    entries_fetched=len(got), tokens_fetched=len(got) * bs,
                    bytes_fetched=received, rejected=rejected, errors=errors)
        return got

    def close(self) -> None:
        """Close the connections of the client the store made from a URL; a
        client passed in is the caller's to close."""
        if self._owns_client:
            try:
                self._client.close()
            except self._errors:
                pass
