"""A pool's prefix entries saved to a file and loaded back (pool.save_prefixes /
pool.load_prefixes): every hit verified row by row, every refusal leaves the
pool exactly as it was."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from support.pools import require_store

require_store()

import ferrox_kv  # noqa: E402
from support.pools import STORE_FP, lookup_rows, pool_counts, publish_seq, store_pool  # noqa: E402
from ferrox_kv.store import StoreCorrupt, StoreFormatError, StoreMismatch  # noqa: E402
from ferrox_kv.store._format import regions  # noqa: E402

BS = 4
SYSTEM = list(range(100, 112))                 # 3 blocks shared by both sequences
SEQ_A = SYSTEM + [1, 2, 3, 4, 5, 6, 7, 8, 9]   # 5 full blocks
SEQ_B = SYSTEM + [50, 51, 52, 53, 54]          # 4 full blocks


def _warm(dtype="float32", total=64, salt=None):
    pool = store_pool(total, dtype)
    rows_a = publish_seq(pool, SEQ_A, salt=salt, seed=1)
    rows_b = publish_seq(pool, SEQ_B, salt=salt, seed=1)   # its first 12 rows are A's
    return pool, rows_a, rows_b


def _hits(pool, tokens, want, salt=None):
    """A lookup of ``tokens`` reuses ``len(want[0][0])`` positions whose
    stored rows equal ``want`` in every layer, row by row."""
    n, got = lookup_rows(pool, tokens, salt=salt)
    assert n == len(want[0][0])
    for (gk, gv), (wk, wv) in zip(got, want):
        for t in range(n):
            assert np.array_equal(gk[t], wk[t]) and np.array_equal(gv[t], wv[t]), t
    return n


def test_export_holds_and_releases():
    pool, _, _ = _warm()
    before = pool.stats()
    layers, salts, parents, depths, toks, k, v = pool._export_prefixes()
    # 3 shared blocks + 2 of A + 1 of B, parents first
    assert layers == 2 and len(salts) == 6
    assert all(p < i for i, p in enumerate(parents))
    assert list(depths) == sorted(depths)
    after = pool.stats()
    assert after["cached_blocks"] == before["cached_blocks"] == 12
    assert after["free_blocks"] == before["free_blocks"]
    pool.check()
    assert k.shape == (6, 2, BS, pool.block_bytes // BS // 2)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8", "int4"])
def test_save_load_fresh_pool(tmp_path, dtype):
    pool, rows_a, rows_b = _warm(dtype)
    path = tmp_path / "prefixes.fxkv"
    saved = pool.save_prefixes(path, fingerprint=STORE_FP)
    assert saved["entries"] == 6 and saved["tokens"] == 24
    assert saved["bytes"] == os.path.getsize(path)
    fresh = store_pool(64, dtype)
    loaded = fresh.load_prefixes(path, fingerprint=STORE_FP)
    assert loaded == {"entries": 6, "tokens": 24, "present": 0, "left_out": 0}
    fresh.check()
    assert fresh.stats()["cached_blocks"] == 12
    assert _hits(fresh, SEQ_A + [0], rows_a) == 20
    assert _hits(fresh, SEQ_B + [0], rows_b) == 16
    fresh.check()


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_load_warm_pool_skips_present(tmp_path, dtype):
    pool, rows_a, rows_b = _warm(dtype)
    path = tmp_path / "p"
    pool.save_prefixes(path, fingerprint=STORE_FP)
    before = pool.stats()["cached_blocks"]
    assert pool.load_prefixes(path, fingerprint=STORE_FP) == {
        "entries": 0, "tokens": 0, "present": 6, "left_out": 0}
    assert pool.stats()["cached_blocks"] == before
    pool.check()
    # a pool that holds SEQ_B only gets A's two blocks added
    other = store_pool(64, dtype)
    publish_seq(other, SEQ_B, seed=1)
    got = other.load_prefixes(path, fingerprint=STORE_FP)
    assert got == {"entries": 2, "tokens": 8, "present": 3, "left_out": 1} or got == {
        "entries": 2, "tokens": 8, "present": 4, "left_out": 0}
    other.check()
    _hits(other, SEQ_A + [0], rows_a)
    _hits(other, SEQ_B + [0], rows_b)


def test_salts_round_trip(tmp_path):
    pool = store_pool(64)
    want = {}
    for salt in (None, "t", b"t", 7, -3):
        want[salt] = publish_seq(pool, SEQ_B, salt=salt, seed=3)
    pool.save_prefixes(tmp_path / "p", fingerprint=b"\x00fp")
    fresh = store_pool(64)
    assert fresh.load_prefixes(tmp_path / "p", fingerprint=b"\x00fp")["entries"] == 20
    for salt, rows in want.items():
        _hits(fresh, SEQ_B + [0], rows, salt=salt)
    assert lookup_rows(fresh, SEQ_B + [0], salt="other")[0] == 0


def test_pool_too_small_loads_shallowest_first(tmp_path):
    pool, rows_a, rows_b = _warm()
    pool.save_prefixes(tmp_path / "p", fingerprint=STORE_FP)
    small = store_pool(9)          # 4 entries of 2 layers fit: depths 0, 1, 2 and one at 3
    got = small.load_prefixes(tmp_path / "p", fingerprint=STORE_FP)
    assert got == {"entries": 4, "tokens": 16, "present": 0, "left_out": 2}
    small.check()
    caches = ferrox_kv.KvCache.with_pool_many(2, 2, 32, small, 16, tokens=SEQ_A + [0])
    assert caches[0].seq_len in (12, 16)
    for c in caches:
        c.close()
    ids = small.allocate(9)                      # every block: the cached ones are evicted
    before = pool_counts(small)
    assert small.load_prefixes(tmp_path / "p", fingerprint=STORE_FP) == {
        "entries": 0, "tokens": 0, "present": 0, "left_out": 6}
    assert pool_counts(small) == before
    small.check()
    small.free(ids)
    small.check()


def test_mixed_layer_counts(tmp_path):
    pool = store_pool(64)
    publish_seq(pool, SEQ_A, n_layers=2, seed=1)
    one = publish_seq(pool, SEQ_B, n_layers=1, seed=2)
    before = pool_counts(pool)
    with pytest.raises(ValueError, match="n_layers="):
        pool.save_prefixes(tmp_path / "p", fingerprint=STORE_FP)
    assert pool_counts(pool) == before and not (tmp_path / "p").exists()
    assert pool.save_prefixes(tmp_path / "p", fingerprint=STORE_FP, n_layers=1)["entries"] == 4
    fresh = store_pool(64)
    fresh.load_prefixes(tmp_path / "p", fingerprint=STORE_FP)
    n, got = lookup_rows(fresh, SEQ_B + [0], n_layers=1)
    assert n == 16 and np.array_equal(got[0][0], one[0][0])


def test_empty_pool_round_trip(tmp_path):
    store_pool(8).save_prefixes(tmp_path / "p", fingerprint=STORE_FP)
    fresh = store_pool(8)
    assert fresh.load_prefixes(tmp_path / "p", fingerprint=STORE_FP)["entries"] == 0
    fresh.check()


def test_no_prefix_cache_and_bad_fingerprint(tmp_path):
    plain = ferrox_kv.KvBlockPool(4, 8, 2, 32)
    with pytest.raises(ValueError, match="prefix_cache=True"):
        plain.save_prefixes(tmp_path / "p", fingerprint=STORE_FP)
    pool, _, _ = _warm()
    with pytest.raises(TypeError):
        pool.save_prefixes(tmp_path / "p", fingerprint=1.5)
    assert not (tmp_path / "p").exists()
    pool.save_prefixes(tmp_path / "p", fingerprint=STORE_FP)
    with pytest.raises(ValueError, match="prefix_cache=True"):
        plain.load_prefixes(tmp_path / "p", fingerprint=STORE_FP)


@pytest.mark.parametrize("make, field", [
    (lambda: store_pool(64, block_size=8), "block_size"),
    (lambda: ferrox_kv.KvBlockPool(4, 64, 1, 32, prefix_cache=True), "n_kv_heads"),
    (lambda: ferrox_kv.KvBlockPool(4, 64, 2, 16, prefix_cache=True), "head_dim"),
    (lambda: ferrox_kv.KvBlockPool(4, 64, 2, 32, v_head_dim=16, prefix_cache=True),
     "v_head_dim"),
    (lambda: store_pool(64, "int8"), "dtype"),
])
def test_load_refuses_other_geometry(tmp_path, make, field):
    pool, _, _ = _warm()
    pool.save_prefixes(tmp_path / "p", fingerprint=STORE_FP)
    target = make()
    publish_seq(target, SEQ_B, seed=1) if target.head_dim == 32 and target.n_kv_heads == 2 \
        and target.v_head_dim == 32 else None
    before = pool_counts(target)
    with pytest.raises(StoreMismatch) as e:
        target.load_prefixes(tmp_path / "p", fingerprint=STORE_FP)
    assert e.value.field == field
    assert pool_counts(target) == before
    target.check()


def _refused(pool, path, exc, field=None):
    before = pool_counts(pool)
    with pytest.raises(exc) as e:
        pool.load_prefixes(path, fingerprint=STORE_FP)
    if field is not None:
        assert e.value.field == field
    assert pool_counts(pool) == before
    pool.check()
    return e.value


def test_load_refuses_other_fingerprint(tmp_path):
    pool, _, rows_b = _warm()
    pool.save_prefixes(tmp_path / "p", fingerprint="model@2")
    target = store_pool(64)
    publish_seq(target, SEQ_B, seed=1)
    _refused(target, tmp_path / "p", StoreMismatch, "fingerprint")
    _hits(target, SEQ_B + [0], rows_b)


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_load_refuses_every_damaged_region(tmp_path, dtype):
    pool, _, _ = _warm(dtype)
    path = tmp_path / "p"
    pool.save_prefixes(path, fingerprint=STORE_FP)
    good = path.read_bytes()
    target = store_pool(64, dtype)
    publish_seq(target, SEQ_B, seed=1)
    bad = tmp_path / "bad"
    for name, lo, hi in regions(good):
        for at in sorted({lo, (lo + hi) // 2, hi - 1}):
            data = bytearray(good)
            data[at] ^= 0x40
            bad.write_bytes(bytes(data))
            _refused(target, bad, StoreFormatError)
        bad.write_bytes(good[:lo])                    # cut at every region boundary
        _refused(target, bad, StoreFormatError)
    bad.write_bytes(good + b"\0")
    _refused(target, bad, StoreCorrupt, "trailing bytes")
    assert target.load_prefixes(path, fingerprint=STORE_FP)["entries"] == 2


def test_restart_across_processes(tmp_path):
    """Save in one process, load in another: the second's hits equal the
    first's rows token by token."""
    here = os.path.dirname(os.path.abspath(__file__))
    common = textwrap.dedent(f"""
        import sys, numpy as np
        sys.path.insert(0, {here!r})
        from support.pools import store_pool, publish_seq, lookup_rows, STORE_FP
        SEQ = {SEQ_A!r}
    """)
    save = common + textwrap.dedent(f"""
        pool = store_pool(64, "int8")
        rows = publish_seq(pool, SEQ, seed=5)
        pool.save_prefixes({str(tmp_path / 'p')!r}, fingerprint=STORE_FP)
        np.save({str(tmp_path / 'want.npy')!r}, np.stack([np.concatenate(r, axis=1) for r in rows]))
    """)
    load = common + textwrap.dedent(f"""
        pool = store_pool(64, "int8")
        print(pool.load_prefixes({str(tmp_path / 'p')!r}, fingerprint=STORE_FP)["entries"])
        n, got = lookup_rows(pool, SEQ + [0])
        np.save({str(tmp_path / 'got.npy')!r}, np.stack([np.concatenate(r, axis=1) for r in got]))
        print(n)
        pool.check()
    """)
    # cwd: python -c puts the working directory first on sys.path, and the
    # repository root's ferrox_kv/ is the source tree, not the installed package
    subprocess.run([sys.executable, "-c", save], check=True, timeout=120, cwd=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", load], check=True, timeout=120,
                         capture_output=True, text=True, cwd=str(tmp_path)).stdout.split()
    assert out == ["5", "20"]
    want, got = np.load(tmp_path / "want.npy"), np.load(tmp_path / "got.npy")
    assert want.shape == got.shape == (2, 20, want.shape[2])
    for t in range(20):
        assert np.array_equal(want[:, t], got[:, t]), t


def test_import_refuses_all_or_nothing():
    pool, _, _ = _warm()
    layers, salts, parents, depths, toks, k, v = pool._export_prefixes()
    small = store_pool(5)
    before = pool_counts(small)
    with pytest.raises(ferrox_kv.KvPoolExhausted):
        small._import_prefixes(layers, toks, salts, parents, list(k), list(v))
    assert pool_counts(small) == before
    small.check()
    with pytest.raises(ValueError, match="parent comes before"):
        small._import_prefixes(layers, toks, salts, parents[::-1].copy(), list(k), list(v))
    with pytest.raises(ValueError, match="C-contiguous uint8"):
        small._import_prefixes(layers, toks, salts, parents, list(k[:, :1]), list(v))
    assert pool_counts(small) == before


# -- the one-pass load: records read into one buffer, verified, copied into reserved blocks


def test_a_fresh_pool_loads_record_by_record_without_reading_the_file_whole(tmp_path,
                                                                           monkeypatch):
    from ferrox_kv.store import _pool
    pool, rows_a, rows_b = _warm()
    path = tmp_path / "p"
    pool.save_prefixes(path, fingerprint=STORE_FP)
    whole = []
    real = _pool.read_whole
    monkeypatch.setattr(_pool, "read_whole", lambda p: whole.append(p) or real(p))
    fresh = store_pool(64)
    assert fresh.load_prefixes(path, fingerprint=STORE_FP)["entries"] == 6
    assert whole == []                       # one pass, one record at a time
    _hits(fresh, SEQ_A + [0], rows_a)
    _hits(fresh, SEQ_B + [0], rows_b)
    fresh.check()
    # a warm pool that holds some of the entries reads the file whole first
    assert fresh.load_prefixes(path, fingerprint=STORE_FP) == {
        "entries": 0, "tokens": 0, "present": 6, "left_out": 0}
    assert whole == [path]
    fresh.check()


@pytest.mark.parametrize("where", ["entry 0 k", "entry 3 v", "entry 5 tokens",
                                   "entry 4 checksum"])
def test_a_record_damaged_after_the_layout_gives_the_reservation_back_exactly(tmp_path,
                                                                             where):
    pool, _, _ = _warm()
    path = tmp_path / "p"
    pool.save_prefixes(path, fingerprint=STORE_FP)
    data = bytearray(path.read_bytes())
    lo, hi = next((lo, hi) for name, lo, hi in regions(bytes(data)) if name == where)
    data[(lo + hi) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    fresh = store_pool(64)
    c = ferrox_kv.KvCache.with_pool(2, 32, fresh, 8)          # a high-water mark of 2
    c.close()
    before = fresh.stats()
    with pytest.raises(StoreFormatError):
        fresh.load_prefixes(path, fingerprint=STORE_FP)
    assert fresh.stats() == before                            # every counter, high-water too
    fresh.check()
    assert lookup_rows(fresh, SEQ_A + [0])[0] == 0


def test_a_record_that_changed_after_the_layout_scan_is_refused(tmp_path, monkeypatch):
    from ferrox_kv.store import _format, _pool
    pool, _, _ = _warm()
    path = tmp_path / "p"
    pool.save_prefixes(path, fingerprint=STORE_FP)
    real = _format.scan_file

    def stale(*a, **kw):                     # the layout as it was before a rewrite
        s = real(*a, **kw)
        s.tokens[2, 0] += 1
        return s
    monkeypatch.setattr(_pool, "scan_file", stale)
    fresh = store_pool(64)
    before = fresh.stats()
    with pytest.raises(StoreCorrupt) as e:
        fresh.load_prefixes(path, fingerprint=STORE_FP)
    assert e.value.field == "changed" and fresh.stats() == before
    fresh.check()


def test_import_with_a_reading_callable_gives_back_on_error_and_refuses_a_warm_pool():
    pool, _, _ = _warm()
    layers, salts, parents, depths, toks, k, v = pool._export_prefixes()
    fresh = store_pool(64)
    before = fresh.stats()
    calls = []

    def failing(i):
        calls.append(i)
        if i == 4:
            raise OSError("the disk went away")
        return k[i], v[i]
    with pytest.raises(OSError, match="disk"):
        fresh._import_prefixes_streamed(layers, toks, salts, parents, failing, fit=True)
    assert calls == [0, 1, 2, 3, 4] and fresh.stats() == before
    fresh.check()
    for bad, exc in (((k[0],), TypeError), ((k[0][:1], v[0]), ValueError),
                     ((k[0].astype(np.int8), v[0]), ValueError)):
        with pytest.raises(exc):
            fresh._import_prefixes_streamed(layers, toks, salts, parents, lambda i: bad,
                                            fit=True)
        assert fresh.stats() == before
    assert fresh._import_prefixes_streamed(layers, toks, salts, parents,
                                           lambda i: (k[i], v[i]), fit=True) == (6, 0, 0)
    fresh.check()
    # entries already published: a reading callable is not used, nothing changes
    after = fresh.stats()
    assert fresh._import_prefixes_streamed(layers, toks, salts, parents, failing,
                                           fit=True) is None
    assert fresh.stats() == after and calls == [0, 1, 2, 3, 4]
    # a pool whose free list is short (cached blocks would be evicted): the same
    full = store_pool(14)
    publish_seq(full, [9, 9, 9, 9, 8, 8, 8, 8], seed=3)      # 4 of 14 blocks cached
    after = full.stats()
    assert full._import_prefixes_streamed(layers, toks, salts, parents, failing,
                                          fit=True) is None
    assert full.stats() == after


def test_entries_under_a_salt_the_format_cannot_hold_are_skipped_and_counted(tmp_path):
    """One tenant's salt beyond MAX_SALT bytes must not make the whole pool
    unsavable: its chain is left out, counted in ``skipped``."""
    from support.pools import lookup_rows, publish_seq, store_pool
    from ferrox_kv.store._format import MAX_SALT
    pool = store_pool(64)
    want = publish_seq(pool, list(range(12)), salt="short", seed=1)
    publish_seq(pool, list(range(12)), salt="x" * (MAX_SALT + 1), seed=2)
    path = tmp_path / "p.fxkv"
    got = pool.save_prefixes(path, fingerprint="m")
    assert (got["entries"], got["skipped"]) == (3, 3)
    fresh = store_pool(64)
    assert fresh.load_prefixes(path, fingerprint="m")["entries"] == 3
    n, rows_ = lookup_rows(fresh, list(range(12)) + [0], salt="short")
    assert n == 12 and np.array_equal(rows_[0][0][:12], want[0][0])
    assert lookup_rows(fresh, list(range(12)) + [0], salt="x" * (MAX_SALT + 1))[0] == 0
    fresh.check()
