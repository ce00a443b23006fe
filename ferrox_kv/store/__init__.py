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

The interface the pool is to call (``pool.attach(store)``, read-through
lookups, ``pool.save_prefixes``/``load_prefixes``; not wired yet):

- ``Geometry(block_size, n_layers, n_kv_heads, head_dim, v_head_dim, dtype)``
  names what an entry's bytes mean; ``Geometry.of_pool(pool, n_layers)``.
- entries out of the pool: ``entries_from_rows(geometry, tokens, k_rows,
  v_rows, salt=...)`` from each layer's stored row bytes (uint8 ``(T,
  row_bytes)``; float32 rows for float32 storage), or ``Entry`` tuples built
  directly with keys from ``chain_keys(tokens, block_size, salt)``;
- ``store.put_chain(geometry, entries) -> int`` after a publish;
- ``store.get_chain(geometry, tokens, salt=, start=, limit=) -> [Entry]`` on a
  local miss of blocks ``start..``; each entry's ``k``/``v`` are uint8
  ``(n_layers, block_size, row_bytes)`` to copy into the reserved blocks;
- ``store.stats() -> dict`` for ``pool.stats()``.
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
    "load_file",
    "row_bytes",
    "save_file",
    "write_file",
]
