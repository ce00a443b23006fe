"""One conversation parked in a file and resumed (``KvCache.save`` /
``KvCache.load``, ``FerroxCache.save`` / ``FerroxCache.load``).

A parked conversation is a prefix file (FORMAT.md) holding one entry whose
block is the whole conversation: ``block_size`` = its positions, ``n_layers``
= its layers, the token ids (zeros and the entry flag ``FLAG_NO_TOKENS`` when
the caller gave none), every layer's stored rows. It is written atomically
and verified whole before a row is written into a cache, like any prefix
file (its layout is checked against the file's size before any buffer is
sized by it); a load given the resumed conversation's ids checks them against the
saved ones first.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np

from ferrox_kv.store._files import open_regular, save_file
from ferrox_kv.store._format import (
    DIGEST,
    ENTRY,
    FLAG_NO_TOKENS,
    HEADER,
    INT4_PLAIN,
    KIND_FILE,
    MAX_FINGERPRINT,
    Geometry,
    StoreCorrupt,
    StoreMismatch,
    _header,
    _tokens_i32,
    _view,
    as_cache_dtype,
    entries_from_rows,
    fingerprint_bytes,
    read_entry,
    scan_file,
    stored_dtype,
)

UNNAMED = b"ferrox_kv:unnamed model"    # the fingerprint of a save that gives none


def _fp(fingerprint: Any) -> bytes:
    return UNNAMED if fingerprint is None else fingerprint_bytes(fingerprint)


def save_layers(caches: Sequence[Any], path: str | os.PathLike[str], *, fingerprint: Any = None,
                tokens: Any = None) -> int:
    """Write the layers of one conversation (caches of one geometry, dtype
    and length, at least one position) to ``path`` atomically; ``tokens``:
    its token ids (one per position, or one more: ``generate``'s output,
    whose last id has no K/V yet) or None. Returns the bytes written."""
    fp = _fp(fingerprint)
    if not caches:
        raise ValueError("no layers to save")
    c0 = caches[0]
    n = c0.seq_len
    for i, c in enumerate(caches):
        if (c.n_kv_heads, c.head_dim, c.v_head_dim, stored_dtype(c)) != (
                c0.n_kv_heads, c0.head_dim, c0.v_head_dim, stored_dtype(c0)):
            raise ValueError(f"layer {i} has another geometry or dtype than layer 0")
        if c.seq_len != n:
            raise ValueError(f"layer {i} holds {c.seq_len} positions, layer 0 {n}: one "
                             "conversation's layers have one length")
    if n == 0:
        raise ValueError("the cache holds no position: there is nothing to save")
    if tokens is None:
        toks = np.zeros(n, np.int32)
    else:
        toks = _tokens_i32(tokens)
        if len(toks) not in (n, n + 1):
            raise ValueError(f"tokens must hold one id per position ({n}; or {n + 1}, "
                             f"generate's output), got {len(toks)}")
        toks = toks[:n]
    g = Geometry(n, len(caches), c0.n_kv_heads, c0.head_dim, c0.v_head_dim,
                 stored_dtype(c0)).check()
    rows = [c._stored() for c in caches]
    entries = entries_from_rows(g, toks, [r[0] for r in rows], [r[1] for r in rows])
    return save_file(path, g, fp, entries, flags=FLAG_NO_TOKENS if tokens is None else 0)


def read_layers(path: str | os.PathLike[str], *, fingerprint: Any = None, tokens: Any = None):
    """(geometry, tokens or None, [k rows per layer], [v rows per layer]) of
    a parked conversation, verified whole (the format's exceptions
    otherwise). ``tokens``: the resumed conversation's ids (at least the
    saved positions; more are its new turn): the saved ids must be their
    start (``StoreMismatch``, field ``tokens``; also for a file saved without
    ids)."""
    fp = _fp(fingerprint)
    want = None if tokens is None else _tokens_i32(tokens)
    # the layout is scanned and checked against the file's size (header,
    # record headers, trailer, file checksum) before a buffer is sized by it
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(HEADER.size + MAX_FINGERPRINT + 8 + DIGEST)    # the longest header
        g = _header(_view(head), KIND_FILE, None, None)[0]
        scan = scan_file(f, size, geometry=g, fingerprint=fp)
        if len(scan.offsets) != 1:
            raise StoreMismatch("n_entries", f"a parked conversation is one entry; this file "
                                             f"holds {len(scan.offsets)} (load it with "
                                             "pool.load_prefixes)")
        buf = np.empty(scan.sizes[0], np.uint8)
        e = read_entry(f, scan, 0, buf, allowed_flags=FLAG_NO_TOKENS)
    if e.depth != 0:
        raise StoreCorrupt("depth", "a parked conversation's entry is at depth 0")
    saved = None if ENTRY.unpack_from(buf, 0)[1] & FLAG_NO_TOKENS else e.tokens
    if want is not None:
        n = g.block_size
        if saved is None:
            raise StoreMismatch("tokens", "the conversation was saved without token ids, so "
                                          "they cannot be checked: load it without tokens=, "
                                          "or save it with tokens=")
        if len(want) < n:
            raise StoreMismatch("tokens", f"the saved conversation holds {n} positions; the "
                                          f"ids given are {len(want)}")
        diff = np.flatnonzero(want[:n] != saved)
        if diff.size:
            raise StoreMismatch("tokens", f"the ids given differ from the saved conversation's "
                                          f"at position {int(diff[0])} (of {n}): this file "
                                          "holds another conversation")
    return g, saved, list(e.k), list(e.v)


def reserved(max_seq_len: int | None, n: int) -> int:
    """The positions a loaded conversation of ``n`` positions reserves:
    ``max_seq_len`` (None: ``n``), at least ``n``."""
    if max_seq_len is not None and (type(max_seq_len) is not int or max_seq_len < 1):
        raise ValueError("max_seq_len must be None or a positive int (the positions to "
                         f"reserve), got {max_seq_len!r}")
    return n if max_seq_len is None else max(max_seq_len, n)


def check_pool_dtype(g: Geometry, pool: Any) -> None:
    """``StoreMismatch`` (field ``dtype``) unless ``pool`` stores rows as the
    file does: its dtype, and for int4 its rotation."""
    if stored_dtype(pool) != g.dtype:
        raise StoreMismatch("dtype", f"the file's rows are {g.dtype}, the pool stores "
                                     f"{stored_dtype(pool)} ({INT4_PLAIN}: int4 without the "
                                     "rotation, a pool with rotate=False)")


def new_layer(g: Geometry, pool: Any, max_seq_len: int | None, k: np.ndarray, v: np.ndarray):
    """A cache holding one layer's rows: contiguous (the file's dtype and
    rotation), or on ``pool`` (its geometry must match: ``ValueError``; its
    dtype and rotation: ``StoreMismatch``, field ``dtype``), reserving
    max(max_seq_len, the rows)."""
    from ferrox_kv import KvCache
    cap = reserved(max_seq_len, g.block_size)
    dtype, rotate = as_cache_dtype(g.dtype)
    if pool is None:
        c = KvCache.with_capacity(g.n_kv_heads, g.head_dim, cap, v_head_dim=g.v_head_dim,
                                  dtype=dtype, rotate=rotate)
    else:
        check_pool_dtype(g, pool)
        c = KvCache.with_pool(g.n_kv_heads, g.head_dim, pool, cap, v_head_dim=g.v_head_dim,
                              dtype=dtype)
    try:
        c._extend_stored(k, v)
    except BaseException:
        c.close()
        raise
    return c


def save_cache(cache: Any, path: str | os.PathLike[str], *, fingerprint: Any = None,
               tokens: Any = None) -> int:
    """``KvCache.save``: park one cache (one layer) in ``path``, with its
    token ids when given (see ``save_layers``)."""
    return save_layers([cache], path, fingerprint=fingerprint, tokens=tokens)


def load_cache(path: str | os.PathLike[str], *, fingerprint: Any = None, pool: Any = None,
               max_seq_len: int | None = None, tokens: Any = None) -> Any:
    """``KvCache.load``: a cache holding the one layer parked in ``path``
    (contiguous, or on ``pool``); a file of several layers is refused
    (``StoreMismatch``, field ``n_layers``); ``tokens`` checked as by
    ``read_layers``."""
    g, _, ks, vs = read_layers(path, fingerprint=fingerprint, tokens=tokens)
    if g.n_layers != 1:
        raise StoreMismatch("n_layers", f"the file holds {g.n_layers} layers; KvCache.load "
                                        "reads one (FerroxCache.load reads a model's)")
    return new_layer(g, pool, max_seq_len, ks[0], vs[0])
