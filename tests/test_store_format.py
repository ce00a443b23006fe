"""The prefix file and store value format (FORMAT.md): round trips, and a
decoder that refuses whatever does not fit with the failing field named."""
import io
import struct

import numpy as np
import pytest

from support.pools import require_store

require_store()

from ferrox_kv import KvBlockPool, KvCache  # noqa: E402
from ferrox_kv.store import (  # noqa: E402
    NO_PARENT,
    Entry,
    Geometry,
    StoreCorrupt,
    StoreFormatError,
    StoreMismatch,
    chain_keys,
    decode_file,
    decode_value,
    encode_value,
    entries_from_rows,
    row_bytes,
    write_file,
)
from ferrox_kv.store._format import regions  # noqa: E402

G = Geometry(block_size=4, n_layers=3, n_kv_heads=2, head_dim=8, v_head_dim=6)
FP = b"model-a@rev1"


def _rows(geometry, n_tokens, seed):
    rng = np.random.default_rng(seed)
    k = [rng.integers(0, 256, (n_tokens, geometry.k_row_bytes), dtype=np.uint8)
         for _ in range(geometry.n_layers)]
    v = [rng.integers(0, 256, (n_tokens, geometry.v_row_bytes), dtype=np.uint8)
         for _ in range(geometry.n_layers)]
    return k, v


def _chain(geometry=G, n_tokens=10, salt=None, seed=0):
    tokens = np.random.default_rng(seed + 100).integers(0, 50000, n_tokens)
    k, v = _rows(geometry, n_tokens, seed)
    return tokens, k, v, entries_from_rows(geometry, tokens, k, v, salt=salt)


def _file(entries, geometry=G, fingerprint=FP):
    f = io.BytesIO()
    n = write_file(f, geometry, fingerprint, entries)
    data = f.getvalue()
    assert n == len(data)
    return data


def _forest():
    """Two sequences sharing their first block, under one salt, and a third
    under another salt."""
    tokens, k, v, a = _chain(n_tokens=12, salt="t1")
    tokens2 = tokens.copy()
    tokens2[4:] += 1
    k2, v2 = _rows(G, 12, seed=5)
    for j in range(G.n_layers):
        k2[j][:4], v2[j][:4] = k[j][:4], v[j][:4]
    b = entries_from_rows(G, tokens2, k2, v2, salt="t1")
    assert b[0].key == a[0].key and b[1].key != a[1].key
    _, _, _, c = _chain(n_tokens=8, salt=7, seed=9)
    return a + b[1:] + c


def test_file_round_trip_gives_every_entry_with_its_rows_tokens_salt_and_links():
    entries = _forest()
    d = decode_file(_file(entries), geometry=G, fingerprint=FP)
    assert d.geometry == G and d.fingerprint == FP and len(d.entries) == len(entries)
    for got, want in zip(d.entries, entries):
        assert (got.depth, got.key, got.parent) == (want.depth, want.key, want.parent)
        assert type(got.salt) is type(want.salt) and got.salt == want.salt
        assert np.array_equal(got.tokens, want.tokens)
        assert np.array_equal(got.k, want.k) and np.array_equal(got.v, want.v)


def test_decoded_arrays_are_read_only_views_of_the_buffer_not_copies():
    _, _, _, entries = _chain()
    data = bytearray(_file(entries))
    e = decode_file(data).entries[1]
    buf = np.frombuffer(data, np.uint8)
    assert np.shares_memory(e.k, buf) and np.shares_memory(e.v, buf)
    assert not e.k.flags.writeable and not e.tokens.flags.writeable


def test_entries_from_float32_cache_rows_hold_the_caches_bytes():
    pool = KvBlockPool(4, 16, 2, 8)
    g = Geometry.of_pool(pool, 2)
    assert g == Geometry(4, 2, 2, 8, 8, "float32")
    rng = np.random.default_rng(1)
    caches = [KvCache.with_pool(2, 8, pool, 12) for _ in range(2)]
    for c in caches:
        c.extend(rng.standard_normal((9, 2, 8)).astype(np.float32),
                 rng.standard_normal((9, 2, 8)).astype(np.float32))
    entries = entries_from_rows(g, list(range(9)), [c.k for c in caches], [c.v for c in caches])
    assert len(entries) == 2                                   # full blocks only
    back = decode_file(_file(entries, g)).entries[1]
    for j, c in enumerate(caches):
        assert np.array_equal(back.k[j].view(np.float32).reshape(4, 2, 8), c.k[4:8])
        assert np.array_equal(back.v[j].view(np.float32).reshape(4, 2, 8), c.v[4:8])


@pytest.mark.parametrize("salt", [None, "", "tenant-é", b"\x00raw", 0, -1, 2**70, -(2**70)])
def test_every_kind_of_salt_round_trips_and_keys_differ_by_salt(salt):
    _, _, _, entries = _chain(salt=salt)
    value = encode_value(G, FP, entries[1])
    e = decode_value(value, geometry=G, fingerprint=FP, key=entries[1].key, salt=salt)
    assert type(e.salt) is type(salt) and e.salt == salt
    others = {None, "x", b"x", 1} - {salt}
    mine = chain_keys(entries[0].tokens, 4, salt)[0]
    assert all(chain_keys(entries[0].tokens, 4, s)[0] != mine for s in others)


def test_entries_own_their_token_ids():
    tokens = np.arange(8, dtype=np.int32)
    k, v = _rows(G, 8, 0)
    entries = entries_from_rows(G, tokens, k, v)
    tokens[:] = 7                                     # the caller reuses its array
    assert np.array_equal(entries[1].tokens, np.arange(4, 8))
    assert len(decode_file(_file(entries)).entries) == 2


def test_str_and_bytes_salts_with_the_same_bytes_are_different_tenants():
    t = np.arange(8)
    assert chain_keys(t, 4, "a") != chain_keys(t, 4, b"a")


def test_chain_keys_depend_on_every_earlier_block():
    t = np.arange(12)
    t2 = t.copy()
    t2[1] = 99
    a, b = chain_keys(t, 4), chain_keys(t2, 4)
    assert all(x != y for x, y in zip(a, b))
    assert chain_keys(t[:9], 4) == a[:2]                      # partial block: no key


def test_regions_tile_the_whole_file():
    data = _file(_forest())
    r = regions(data)
    assert r[0][1] == 0 and r[-1][2] == len(data)
    assert all(a[2] == b[1] for a, b in zip(r, r[1:])), r


def _expected_field(region):
    name = region.split(" ", 2)[-1] if region.startswith("entry ") else region
    return {
        "magic": {"magic"}, "version": {"version"}, "kind": {"kind"},
        "header_bytes": {"header_bytes"}, "fingerprint_len": {"header_bytes"},
        "trailer magic": {"trailer magic"}, "trailer n_entries": {"file checksum"},
        "file checksum": {"file checksum"},
    }.get(region) or {
        "magic": {"entry magic"}, "record_bytes": {"record_bytes"},
        "salt_len": {"salt_len", "record_bytes"},
    }.get(name if region.startswith("entry ") else "", None) or (
        {"entry checksum"} if region.startswith("entry ") else {"header checksum"})


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_flipped_byte_in_any_region_is_refused_naming_the_field(where):
    data = _file(_forest())
    for name, start, end in regions(data):
        at = {"first": start, "middle": (start + end - 1) // 2, "last": end - 1}[where]
        bad = bytearray(data)
        bad[at] ^= 0xFF
        with pytest.raises(StoreFormatError) as e:
            decode_file(bytes(bad), geometry=G, fingerprint=FP)
        assert e.value.field in _expected_field(name), (name, at, e.value)
        assert isinstance(e.value, ValueError)


def test_a_flipped_byte_in_any_region_of_a_store_value_is_refused():
    _, _, _, entries = _chain(salt="s")
    value = encode_value(G, FP, entries[1])
    for at in range(len(value)):
        bad = bytearray(value)
        bad[at] ^= 0x01
        with pytest.raises(StoreFormatError):
            decode_value(bytes(bad), geometry=G, fingerprint=FP, key=entries[1].key, salt="s")


def test_a_truncated_file_is_refused_at_every_length():
    data = _file(_forest())
    cuts = sorted({a for _, a, _ in regions(data)} | {b - 1 for _, _, b in regions(data)})
    for n in cuts:
        with pytest.raises(StoreCorrupt) as e:
            decode_file(data[:n], geometry=G, fingerprint=FP)
        assert e.value.field == "truncated", (n, e.value)
    with pytest.raises(StoreCorrupt, match="truncated"):
        decode_file(b"", geometry=G)


def test_bytes_after_the_trailer_are_refused():
    data = _file(_forest())
    with pytest.raises(StoreCorrupt, match="trailing bytes"):
        decode_file(data + b"\x00")


def test_a_truncated_store_value_is_refused():
    _, _, _, entries = _chain()
    value = encode_value(G, FP, entries[0])
    for n in (0, 7, 40, 100, len(value) - 17, len(value) - 1):
        with pytest.raises(StoreFormatError):
            decode_value(value[:n], geometry=G, fingerprint=FP)


def test_another_version_is_refused_naming_the_version():
    data = bytearray(_file(_forest()))
    struct.pack_into("<H", data, 8, 2)
    with pytest.raises(StoreMismatch, match="version 2") as e:
        decode_file(bytes(data))
    assert e.value.field == "version"


def test_a_store_value_is_not_a_file_and_a_file_is_not_a_store_value():
    _, _, _, entries = _chain()
    with pytest.raises(StoreFormatError) as e:
        decode_file(encode_value(G, FP, entries[0]))
    assert e.value.field == "magic"
    with pytest.raises(StoreFormatError) as e:
        decode_value(_file(entries), geometry=G, fingerprint=FP)
    assert e.value.field == "magic"


@pytest.mark.parametrize("field,value", [("block_size", 8), ("n_layers", 2), ("n_kv_heads", 1),
                                         ("head_dim", 4), ("v_head_dim", 8),
                                         ("dtype", "float16"), ("dtype", "int8")])
def test_another_geometry_or_dtype_is_refused_naming_the_field(field, value):
    data = _file(_forest())
    other = G._replace(**{field: value})
    with pytest.raises(StoreMismatch) as e:
        decode_file(data, geometry=other, fingerprint=FP)
    assert e.value.field == field
    _, _, _, entries = _chain()
    with pytest.raises(StoreMismatch) as e:
        decode_value(encode_value(G, FP, entries[0]), geometry=other, fingerprint=FP)
    assert e.value.field == field


def test_another_fingerprint_is_refused():
    data = _file(_forest())
    with pytest.raises(StoreMismatch) as e:
        decode_file(data, geometry=G, fingerprint=b"model-a@rev2")
    assert e.value.field == "fingerprint"
    assert decode_file(data, geometry=G, fingerprint="model-a@rev1").fingerprint == FP


def test_a_store_value_for_another_block_salt_or_tokens_is_refused():
    tokens, _, _, entries = _chain(salt="a")
    value = encode_value(G, FP, entries[1])
    ok = dict(geometry=G, fingerprint=FP, key=entries[1].key, parent=entries[0].key, depth=1,
              salt="a", tokens=tokens[4:8])
    assert decode_value(value, **ok).depth == 1
    for change, field in [({"key": entries[0].key}, "key"), ({"parent": NO_PARENT}, "parent"),
                          ({"depth": 2}, "depth"), ({"salt": "b"}, "salt"),
                          ({"salt": b"a"}, "salt"), ({"tokens": tokens[:4]}, "tokens")]:
        with pytest.raises(StoreMismatch) as e:
            decode_value(value, **{**ok, **change})
        assert e.value.field == field


def test_an_entry_whose_parent_is_missing_from_the_file_is_refused():
    _, _, _, entries = _chain()
    data = _file(entries)
    # a file of the second entry alone: written by hand, its parent is absent
    with pytest.raises(ValueError, match="parent"):
        _file(entries[1:])
    with pytest.raises(ValueError, match="parent"):
        _file(entries[::-1])
    assert len(decode_file(data).entries) == 2


def test_row_bytes_follow_the_storage_contract():
    assert row_bytes(8, 128, "float32") == 8 * 128 * 4
    assert row_bytes(8, 128, "float16") == row_bytes(8, 128, "bfloat16") == 8 * 128 * 2
    assert row_bytes(8, 128, "int8") == 8 * 128 + 2 * 8 * 4              # 1.0625 B/value
    assert row_bytes(2, 40, "int8") == 2 * 40 + 2 * 2 * 2                # a short last group
    g = Geometry(16, 2, 8, 128, 128, "int8")
    _, _, _, entries = _chain(g, 32)
    assert entries[0].k.shape == (2, 16, 1088)
    assert len(decode_file(_file(entries, g), geometry=g).entries) == 2


def test_bad_geometry_fingerprint_salt_and_entries_raise_before_writing():
    _, _, _, entries = _chain()
    f = io.BytesIO()
    for geometry, exc in [(G._replace(block_size=0), ValueError),
                          (G._replace(dtype="float64"), ValueError),
                          (G._replace(head_dim=2.0), TypeError)]:
        with pytest.raises(exc):
            write_file(f, geometry, FP, entries)
    for fp, exc in [(b"", ValueError), (None, TypeError), (1, TypeError),
                    (b"x" * 5000, ValueError)]:
        with pytest.raises(exc, match="fingerprint"):
            write_file(f, G, fp, entries)
    for salt in (True, 1.5, ["a"]):
        with pytest.raises(TypeError, match="salt"):
            chain_keys(np.arange(8), 4, salt)
    bad = [entries[0]._replace(tokens=entries[0].tokens + 1), entries[1]]
    with pytest.raises(ValueError, match="chained hash"):
        write_file(f, G, FP, bad)
    with pytest.raises(ValueError, match="entry 0: k must be uint8"):
        write_file(f, G, FP, [entries[0]._replace(k=entries[0].k[:, :2])])
    with pytest.raises(ValueError, match="depth 0"):
        write_file(f, G, FP, [entries[0]._replace(parent=entries[1].key)])
    assert f.getvalue() == b""                                 # nothing written
    with pytest.raises(ValueError, match="one array per layer"):
        entries_from_rows(G, np.arange(8), [np.zeros((8, G.k_row_bytes), np.uint8)], [])


def test_an_empty_file_of_no_entries_round_trips():
    d = decode_file(_file([]), geometry=G, fingerprint=FP)
    assert d.entries == [] and d.geometry == G


def test_entry_is_a_plain_tuple_with_the_documented_fields():
    assert Entry._fields == ("depth", "key", "parent", "salt", "tokens", "k", "v")


def test_random_damage_to_a_value_or_a_file_raises_only_store_format_errors():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    _, _, _, entries = _chain(salt=b"s")
    value = encode_value(G, FP, entries[1])
    data = _file(entries)

    @settings(max_examples=300, deadline=None, derandomize=True)
    @given(st.sampled_from(["value", "file"]), st.integers(0, 4000), st.integers(0, 64),
           st.binary(max_size=64))
    def damage(which, at, cut, insert):
        good = value if which == "value" else data
        at %= len(good) + 1
        bad = good[:at] + insert + good[at + cut:]
        try:
            if which == "value":
                e = decode_value(bad, geometry=G, fingerprint=FP)
                assert np.array_equal(e.k, entries[1].k) and np.array_equal(e.v, entries[1].v)
            else:
                d = decode_file(bad, geometry=G, fingerprint=FP)
                assert all(np.array_equal(a.k, b.k) for a, b in zip(d.entries, entries))
            assert bad == good
        except StoreFormatError:
            assert bad != good

    damage()


def _reseal_value(data, at, byte):
    """A store value with ``data[at] = byte`` and both checksums recomputed:
    damage no checksum sees (a writer that left junk in a pad byte)."""
    import xxhash

    from ferrox_kv.store._format import DIGEST, HEADER
    buf = bytearray(data)
    buf[at] = byte
    size = struct.unpack_from("<I", buf, 12)[0]             # header_bytes
    buf[size - DIGEST:size] = xxhash.xxh3_128_digest(bytes(buf[:size - DIGEST]))
    buf[-DIGEST:] = xxhash.xxh3_128_digest(bytes(buf[size:-DIGEST]))
    assert HEADER.size < size
    return bytes(buf)


def test_pad_bytes_that_are_not_zero_are_refused_naming_padding():
    """FORMAT.md's pad bytes are zeros: in the header after the fingerprint,
    after an entry's salt tag and after its salt, even with checksums that
    match."""
    from ferrox_kv.store._format import ENTRY, HEADER
    fp = b"model@1"                                        # 76 + 7 bytes: 5 pad bytes
    _, _, _, entries = _chain(n_tokens=4, salt="abc")      # 3 salt bytes: 5 pad bytes
    value = encode_value(G, fp, entries[0])
    decode_value(value, geometry=G, fingerprint=fp)
    size = struct.unpack_from("<I", value, 12)[0]
    for at in (HEADER.size + len(fp), size - 17, size + 25, size + 27,
               size + ENTRY.size + 3, size + ENTRY.size + 7):
        bad = _reseal_value(value, at, 0x5A)
        with pytest.raises(StoreCorrupt) as e:
            decode_value(bad, geometry=G, fingerprint=fp)
        assert e.value.field == "padding", (at, e.value)
