"""A pool's prefix entries out to files and stores, and back in.

The core exports and imports entries (``KvBlockPool._export_prefixes`` /
``_import_prefixes``: blocks held or reserved under the pool lock, bytes
copied without the GIL outside it); everything here is file and store I/O,
verification and bookkeeping, and never runs under the pool lock.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from ferrox_kv.store._files import open_regular, read_whole, save_file
from ferrox_kv.store._format import (
    DIGEST,
    HEADER,
    KIND_FILE,
    MAX_FINGERPRINT,
    NO_PARENT,
    Entry,
    Geometry,
    Scanned,
    StoreMismatch,
    _header,
    _key_of,
    _view,
    decode_file,
    entries_from_rows,
    fingerprint_bytes,
    read_entry,
    salt_fits,
    scan_file,
)


def export_entries(pool: Any, n_layers: int | None = None
                   ) -> tuple[Geometry, list[Entry], int]:
    """Every published prefix entry of ``pool`` (of ``n_layers`` layers; None:
    the one layer count its entries have), parents first, with the store's
    chained keys; the rows are private copies. Also the count of entries
    left out because their salt is longer than the format holds
    (``salt_fits``)."""
    layers, salts, parents, depths, toks, k, v = pool._export_prefixes(
        0 if n_layers is None else n_layers)
    g = Geometry.of_pool(pool, layers)
    keys: list[bytes | None] = []
    entries: list[Entry] = []
    for i, salt in enumerate(salts):
        # a salt beyond the format's MAX_SALT is left out, with its whole
        # chain (every entry of a chain has its root's salt)
        parent = NO_PARENT if parents[i] < 0 else keys[parents[i]]
        if parent is None or not salt_fits(salt):
            keys.append(None)
            continue
        keys.append(_key_of(parent, salt, toks[i]))
        entries.append(Entry(int(depths[i]), keys[i], parent, salt, toks[i], k[i], v[i]))
    return g, entries, len(salts) - len(entries)


def save_prefixes(pool: Any, path: str | os.PathLike[str], *, fingerprint: Any,
                  n_layers: int | None = None) -> dict[str, int]:
    """Write every published prefix entry of ``pool`` to the prefix file
    ``path`` atomically (FORMAT.md). ``fingerprint`` names the model (bytes or
    str). A pool whose entries were published with several layer counts
    needs ``n_layers=`` (``ValueError`` otherwise). Entries published under a
    salt longer than the format holds (64 KiB encoded) are not written.
    Returns ``entries``, ``tokens`` and ``bytes`` written, and ``skipped``
    (entries left out for their salt)."""
    fingerprint_bytes(fingerprint)             # a bad one raises before anything is held
    g, entries, skipped = export_entries(pool, n_layers)
    size = save_file(path, g, fingerprint, entries)
    return {"entries": len(entries), "tokens": len(entries) * g.block_size, "bytes": size,
            "skipped": skipped}


def load_prefixes(pool: Any, path: str | os.PathLike[str], *,
                  fingerprint: Any) -> dict[str, int]:
    """Publish the entries of the prefix file ``path`` into ``pool``.

    The whole file is read and verified first (header, geometry and dtype
    against the pool's, ``fingerprint``, every entry's checksum, key and
    parent, the file checksum): any mismatch raises the format's
    ``StoreMismatch``/``StoreCorrupt`` naming the field, and the pool is
    untouched. Entries already published are kept, not duplicated. When the
    pool cannot take them all, the entries go in by depth (every sequence's
    first block, then every second block, ...) while the pool's free blocks
    last (cached blocks count as free: the least recently used are evicted
    for them), so each chain keeps its longest prefix that fits; the rest are
    counted in ``left_out``. Returns ``entries`` (added), ``tokens`` (their
    positions), ``present`` (already published) and ``left_out``.

    Into a pool whose free list takes every entry, none of them published
    yet (a restart), the file is read once, record by record into one
    buffer of one record, each verified there and copied into its reserved
    blocks; a record that fails gives the reservation back exactly. Else the
    file is read whole and verified before any block is reserved."""
    fp = fingerprint_bytes(fingerprint)
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(HEADER.size + MAX_FINGERPRINT + 8 + DIGEST)    # the longest header
        got = _header(_view(head), KIND_FILE, None, None)[0]
        want = Geometry.of_pool(pool, got.n_layers)
        for name in Geometry._fields:
            if getattr(got, name) != getattr(want, name):
                raise StoreMismatch(name, f"written with {name}={getattr(got, name)!r}, the "
                                          f"pool has {getattr(want, name)!r}")
        scan = scan_file(f, size, geometry=want, fingerprint=fp)
        done = _import_streamed(pool, scan, f)
    if done is not None:
        return done
    dec = decode_file(read_whole(path), geometry=want, fingerprint=fp)
    return import_entries(pool, want, dec.entries, fit=True)


def _import_streamed(pool: Any, scan: Scanned, f: Any) -> dict[str, int] | None:
    """Publish a scanned file's entries, each record read and verified into one
    reused buffer as its reserved blocks are filled; None (nothing changed)
    where the pool would have to share or evict for them."""
    n = len(scan.offsets)
    order = sorted(range(n), key=lambda i: scan.depths[i])
    at = {scan.keys[i]: j for j, i in enumerate(order)}
    parents = np.array([-1 if scan.depths[i] == 0 else at[scan.parents[i]] for i in order],
                       np.int32)
    buf = np.empty(max(scan.sizes, default=0), np.uint8)

    def rows(j: int) -> tuple[np.ndarray, np.ndarray]:
        e = read_entry(f, scan, order[j], buf)
        return e.k, e.v
    got = pool._import_prefixes_streamed(scan.geometry.n_layers, scan.tokens[order],
                                         [scan.salts[i] for i in order], parents, rows,
                                         fit=True)
    if got is None:
        return None
    added, present, left_out = got
    return {"entries": added, "tokens": added * scan.geometry.block_size, "present": present,
            "left_out": left_out}


def import_entries(pool: Any, geometry: Geometry, entries: list[Entry], *,
                   fit: bool) -> dict[str, int]:
    """Publish verified entries, each one's parent among those before it
    (or, at depth 0, none): shallowest first; ``fit`` as in
    ``_import_prefixes``."""
    order = sorted(range(len(entries)), key=lambda i: entries[i].depth)
    at: dict[bytes, int] = {}
    parents = np.empty(len(order), np.int32)
    tokens = np.empty((len(order), geometry.block_size), np.int32)
    salts, ks, vs = [], [], []
    for j, i in enumerate(order):
        e = entries[i]
        parents[j] = -1 if e.depth == 0 else at[e.parent]
        at[e.key] = j
        tokens[j] = e.tokens
        salts.append(e.salt)
        ks.append(e.k)
        vs.append(e.v)
    added, present, left_out = pool._import_prefixes(geometry.n_layers, tokens, salts,
                                                     parents, ks, vs, fit=fit)
    return {"entries": added, "tokens": added * geometry.block_size, "present": present,
            "left_out": left_out}


# -- an attached store ---------------------------------------------------------------

def write_through(store: Any, pool: Any, caches: Any, tokens: np.ndarray, salt: Any) -> int:
    """After ``pool.publish``: the published blocks of one sequence
    (``caches``: its layers; ``tokens``: the published positions) to
    ``store`` (``put_chain``). Store faults are counted there, never raised; a
    salt longer than the format holds writes nothing."""
    if not salt_fits(salt):
        return 0
    g = Geometry.of_pool(pool, len(caches))
    n = len(tokens)
    ks, vs = [], []
    for c in caches:
        k, v = c._stored()
        ks.append(k[:n])
        vs.append(v[:n])
    entries = entries_from_rows(g, tokens, ks, vs, salt=salt)
    return store.put_chain(g, entries)


def read_through(store: Any, pool: Any, tokens: np.ndarray, salt: Any, n_layers: int) -> int:
    """Before a lookup of ``tokens`` (whole blocks): the blocks past the local
    prefix, fetched from ``store`` (``get_chain``, verified there), imported
    and published, so that the lookup that follows shares them. A store
    fault or a pool too full to take them is a miss here: nothing is raised
    and no block stays taken; so is a salt longer than the format holds.
    Returns the blocks added."""
    if not salt_fits(salt):
        return 0
    bs = pool.block_size
    nb = len(tokens) // bs
    local = pool._prefix_match(tokens, salt, n_layers)
    if local >= nb:
        return 0
    g = Geometry.of_pool(pool, n_layers)
    tail = store.get_chain(g, tokens, salt=salt, start=local, limit=nb - local)
    if not tail:
        return 0
    # the import publishes whole chains from their first block: the local
    # blocks' rows come too, so that an entry evicted meanwhile is filled
    # with verified rows, never with placeholders
    head = store.get_chain(g, tokens, salt=salt, start=0, limit=local) if local else []
    if len(head) != local:
        return 0
    done = import_entries(pool, g, list(head) + list(tail), fit=True)
    return done["entries"]
