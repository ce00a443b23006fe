"""ferrox_kv.store: prefix entries beyond one process.

A prefix entry is one block position of a published sequence in every layer:
its token ids, salt, chained hash and parent's hash, and the stored bytes of
its K and V rows (``Entry``). This package holds

- the format (FORMAT.md): ``write_file``/``decode_file`` for prefix files,
  ``encode_value``/``decode_value`` for one entry as a store value; every
  decode verifies checksums, geometry, dtype, fingerprint, salt, token ids and
  parent links and raises ``StoreCorrupt``/``StoreMismatch`` (both
  ``StoreFormatError``, a ``ValueError``) naming the failing field;
- ``save_file``/``load_file``: atomic writes (temporary file, fsync, rename,
  fsync of the directory) and whole, verified reads;
- ``RedisPrefixStore``: one Redis value per entry, pipelined, verified on
  fetch; Redis faults are counted misses, never exceptions.

The pool calls them (FORMAT.md, "How the pool uses it"): ``pool.save_prefixes``
/ ``pool.load_prefixes`` (``save_prefixes``/``load_prefixes`` here),
``KvCache.save``/``load`` and ``FerroxCache.save``/``load`` (``save_cache``,
``load_cache``, ``save_layers``), and ``pool.attach(store)``: publish writes
through, a lookup with ``tokens=`` reads the blocks missing locally through
the store, ``pool.stats()`` adds the store's counters under ``store_``.
"""
from ferrox_kv.store._files import atomic_write, load_file, save_file
from ferrox_kv.store._format import (
    NO_PARENT,
    VERSION,
    Decoded,
    Entry,
    Geometry,
    StoreCorrupt,
    StoreFormatError,
    StoreMismatch,
    chain_keys,
    check_run,
    decode_file,
    decode_value,
    encode_value,
    entries_from_rows,
    row_bytes,
    write_file,
)
from ferrox_kv.store._redis import RedisPrefixStore
from ferrox_kv.store._pool import load_prefixes, save_prefixes
from ferrox_kv.store._cache import load_cache, save_cache, save_layers

__all__ = [
    "NO_PARENT",
    "VERSION",
    "Decoded",
    "Entry",
    "Geometry",
    "RedisPrefixStore",
    "StoreCorrupt",
    "StoreFormatError",
    "StoreMismatch",
    "atomic_write",
    "chain_keys",
    "check_run",
    "decode_file",
    "decode_value",
    "encode_value",
    "entries_from_rows",
    "load_cache",
    "load_file",
    "load_prefixes",
    "row_bytes",
    "save_cache",
    "save_file",
    "save_layers",
    "save_prefixes",
    "write_file",
]
