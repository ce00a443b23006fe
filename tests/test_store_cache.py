"""One conversation parked in a file and resumed: KvCache.save / KvCache.load,
FerroxCache.save / FerroxCache.load, ferrox_kv.hf.fingerprint."""
import os

import numpy as np
import pytest

from support.pools import require_store

require_store()

import ferrox_kv  # noqa: E402
from support.numerics import rows  # noqa: E402
from support.pools import STORE_DIM, STORE_HEADS, pool_counts, store_pool  # noqa: E402
from ferrox_kv.store import StoreCorrupt, StoreFormatError, StoreMismatch  # noqa: E402
from ferrox_kv.store._format import regions  # noqa: E402

W = STORE_HEADS * STORE_DIM


def _cache(dtype, n=21):
    c = ferrox_kv.KvCache(STORE_HEADS, STORE_DIM, dtype=dtype)
    c.extend(rows(n, W, 1), rows(n, W, 2))
    return c


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8", "int4"])
def test_cache_round_trip_contiguous_and_pooled(tmp_path, dtype):
    c = _cache(dtype)
    path = tmp_path / "slot"
    assert c.save(path, fingerprint="m") == os.path.getsize(path)
    back = ferrox_kv.KvCache.load(path, fingerprint="m")
    assert back.seq_len == 21 and back.dtype == dtype and not back.is_pooled
    for a, b in zip(c._stored(), back._stored()):
        assert np.array_equal(a, b)
    pool = store_pool(32, dtype)
    pooled = ferrox_kv.KvCache.load(path, fingerprint="m", pool=pool, max_seq_len=40)
    assert pooled.is_pooled and pooled.seq_len == 21 and pooled.blocks_held == 10
    for a, b in zip(c._stored(), pooled._stored()):
        assert np.array_equal(a, b)
    pooled.push(rows(1, W, 3)[0], rows(1, W, 4)[0])            # it goes on
    assert np.array_equal(pooled.k[:21], c.k)
    pooled.close()
    pool.check()
    assert pool.free_blocks == 32


@pytest.mark.parametrize("rotate", [None, False])
def test_an_int4_cache_keeps_its_rotation_and_loads_only_into_a_pool_of_it(tmp_path, rotate):
    c = ferrox_kv.KvCache(STORE_HEADS, STORE_DIM, dtype="int4", rotate=rotate)
    c.extend(rows(21, W, 1), rows(21, W, 2))
    path = tmp_path / "slot"
    c.save(path, fingerprint="m")
    back = ferrox_kv.KvCache.load(path, fingerprint="m")
    assert (back.dtype, back.rotate) == ("int4", rotate is not False)
    assert back.k.tobytes() == c.k.tobytes() and back.v.tobytes() == c.v.tobytes()
    same = store_pool(32, "int4", rotate=rotate)
    pooled = ferrox_kv.KvCache.load(path, fingerprint="m", pool=same)
    assert pooled.k.tobytes() == c.k.tobytes() and pooled.rotate == c.rotate
    other = store_pool(32, "int4", rotate=False if rotate is None else None)
    before = pool_counts(other)
    with pytest.raises(StoreMismatch, match="int4") as e:
        ferrox_kv.KvCache.load(path, fingerprint="m", pool=other)
    assert e.value.field == "dtype"
    assert pool_counts(other) == before
    other.check()


def test_cache_load_refusals_leave_the_pool_alone(tmp_path):
    c = _cache("float32")
    path = tmp_path / "slot"
    c.save(path, fingerprint="m")
    pool = store_pool(32)
    before = pool_counts(pool)
    with pytest.raises(StoreMismatch) as e:
        ferrox_kv.KvCache.load(path, fingerprint="other", pool=pool)
    assert e.value.field == "fingerprint"
    with pytest.raises(StoreMismatch):
        ferrox_kv.KvCache.load(path, pool=pool)            # saved with one: load needs it
    with pytest.raises(ValueError):
        ferrox_kv.KvCache.load(path, fingerprint="m", pool=store_pool(32, "int8"))
    with pytest.raises(ferrox_kv.KvPoolExhausted):
        ferrox_kv.KvCache.load(path, fingerprint="m", pool=store_pool(3))
    good = path.read_bytes()
    bad = tmp_path / "bad"
    for name, lo, hi in regions(good):
        data = bytearray(good)
        data[(lo + hi) // 2] ^= 1
        bad.write_bytes(bytes(data))
        with pytest.raises(StoreFormatError):
            ferrox_kv.KvCache.load(bad, fingerprint="m", pool=pool)
        bad.write_bytes(good[:lo])
        with pytest.raises(StoreFormatError):
            ferrox_kv.KvCache.load(bad, fingerprint="m", pool=pool)
    assert pool_counts(pool) == before
    pool.check()


def test_cache_save_refusals(tmp_path):
    empty = ferrox_kv.KvCache(STORE_HEADS, STORE_DIM)
    with pytest.raises(ValueError, match="nothing to save"):
        empty.save(tmp_path / "x")
    with pytest.raises(TypeError):
        _cache("float32").save(tmp_path / "x", fingerprint=3.5)
    assert not (tmp_path / "x").exists()


def test_prefix_file_is_not_a_slot(tmp_path):
    pool = store_pool(64)
    from support.pools import publish_seq
    publish_seq(pool, list(range(12)), seed=1)
    publish_seq(pool, list(range(50, 62)), seed=2)
    pool.save_prefixes(tmp_path / "p", fingerprint="m")
    with pytest.raises(StoreMismatch) as e:
        ferrox_kv.KvCache.load(tmp_path / "p", fingerprint="m")
    assert e.value.field == "n_entries"


def test_token_ids_saved_with_a_conversation_are_checked_on_load(tmp_path):
    c = _cache("float32")
    ids = np.arange(500, 521)
    path = tmp_path / "slot"
    c.save(path, fingerprint="m", tokens=ids)
    back = ferrox_kv.KvCache.load(path, fingerprint="m", tokens=list(ids) + [7, 8])  # next turn
    assert back.seq_len == 21 and np.array_equal(back.k, c.k)
    assert ferrox_kv.KvCache.load(path, fingerprint="m").seq_len == 21     # no check asked
    pool = store_pool(32)
    before = pool_counts(pool)
    for prompt, says in ((np.r_[ids[:5], 0, ids[6:]], "at position 5"),
                         (ids[:20], "holds 21 positions"),
                         (np.zeros(21, np.int64), "at position 0")):
        with pytest.raises(StoreMismatch, match=says) as e:
            ferrox_kv.KvCache.load(path, fingerprint="m", pool=pool, tokens=prompt)
        assert e.value.field == "tokens"
    assert pool_counts(pool) == before
    with pytest.raises(TypeError):
        ferrox_kv.KvCache.load(path, fingerprint="m", tokens=[0.5] * 21)
    # saved without ids: zeros are not taken for ids, the check is refused
    c.save(path, fingerprint="m")
    with pytest.raises(StoreMismatch, match="without token ids") as e:
        ferrox_kv.KvCache.load(path, fingerprint="m", pool=pool, tokens=np.zeros(21, int))
    assert e.value.field == "tokens" and pool_counts(pool) == before
    assert ferrox_kv.KvCache.load(path, fingerprint="m").seq_len == 21
    # one id more (generate's output) is accepted; other lengths are refused, nothing written
    c.save(path, fingerprint="m", tokens=np.arange(22))
    assert ferrox_kv.KvCache.load(path, fingerprint="m", tokens=np.arange(22)).seq_len == 21
    before_file = path.read_bytes()
    for bad in (np.arange(20), np.arange(23)):
        with pytest.raises(ValueError, match="one id per position"):
            c.save(path, fingerprint="m", tokens=bad)
    assert path.read_bytes() == before_file


def test_the_no_token_ids_flag_is_refused_outside_a_parked_conversation(tmp_path):
    from ferrox_kv.store import Geometry, decode_file, entries_from_rows
    from ferrox_kv.store._files import save_file
    from ferrox_kv.store._format import FLAG_NO_TOKENS
    g = Geometry(4, 1, STORE_HEADS, STORE_DIM, STORE_DIM)
    entries = entries_from_rows(g, np.arange(8), [rows(8, W, 1)], [rows(8, W, 2)])
    save_file(tmp_path / "p", g, "m", entries, flags=FLAG_NO_TOKENS)
    with pytest.raises(StoreCorrupt) as e:
        decode_file((tmp_path / "p").read_bytes(), fingerprint="m")
    assert e.value.field == "flags"
    pool = store_pool(32)
    with pytest.raises(StoreCorrupt) as e:
        pool.load_prefixes(tmp_path / "p", fingerprint="m")
    assert e.value.field == "flags" and pool.stats()["used_blocks"] == 0
    pool.check()
    with pytest.raises(ValueError, match="flags"):
        save_file(tmp_path / "q", g, "m", entries, flags=2)


# -- transformers ------------------------------------------------------------------

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import ferrox_kv.hf  # noqa: E402,F401  (registers the "ferrox" attention)


@pytest.fixture(scope="module")
def llama():
    from support.models import config
    cfg, cls = config("llama")
    torch.manual_seed(4321)
    m = cls(cfg).eval()
    m.generation_config.pad_token_id = 0
    m.set_attn_implementation("ferrox")
    return m


def _gen(model, ids, cache, n):
    with torch.no_grad():
        return model.generate(ids, cache=cache, max_new_tokens=n, do_sample=False)


@pytest.mark.parametrize("pooled", [False, True])
def test_loaded_ferrox_cache_continues_token_identically(tmp_path, llama, pooled):
    from ferrox_kv.hf import FerroxCache, fingerprint, kv_geometry
    ids = torch.randint(1, 256, (1, 13), generator=torch.Generator().manual_seed(3))
    whole = _gen(llama, ids, FerroxCache(llama.config, dtype="float32"), 24)
    first = _gen(llama, ids, cache := FerroxCache(llama.config, dtype="float32"), 11)
    fp = fingerprint(llama)
    cache.save(tmp_path / "conv", fingerprint=fp)
    cache.close()
    pool = None
    if pooled:
        _, h, d = kv_geometry(llama.config)
        pool = ferrox_kv.KvBlockPool(8, 64, h, d)
    resumed = FerroxCache.load(tmp_path / "conv", llama.config, pool=pool, max_seq_len=64,
                               fingerprint=fp)
    assert resumed.get_seq_length() == first.shape[1] - 1
    rest = _gen(llama, first, resumed, 13)
    assert torch.equal(rest, whole)
    resumed.close()
    if pool is not None:
        pool.check()
        assert pool.free_blocks == 64


def test_ferrox_cache_load_refuses_another_model(tmp_path, llama):
    from ferrox_kv.hf import FerroxCache, fingerprint
    ids = torch.randint(1, 256, (1, 9), generator=torch.Generator().manual_seed(5))
    _gen(llama, ids, cache := FerroxCache(llama.config, dtype="float32"), 3)
    cache.save(tmp_path / "conv", fingerprint=fingerprint(llama))
    other_cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    with pytest.raises(StoreMismatch) as e:
        FerroxCache.load(tmp_path / "conv", other_cfg, fingerprint=fingerprint(llama))
    assert e.value.field == "n_layers"
    torch.manual_seed(1)
    other = transformers.LlamaForCausalLM(llama.config)
    assert fingerprint(other) != fingerprint(llama)
    with pytest.raises(StoreMismatch) as e:
        FerroxCache.load(tmp_path / "conv", llama.config, fingerprint=fingerprint(other))
    assert e.value.field == "fingerprint"


def test_fingerprint_is_computed_once(llama, monkeypatch):
    from ferrox_kv.hf import fingerprint
    fp = fingerprint(llama)
    assert isinstance(fp, bytes) and len(fp) == 64
    monkeypatch.setattr(type(llama), "named_parameters",
                        lambda self: (_ for _ in ()).throw(AssertionError("hashed again")))
    assert fingerprint(llama) == fp


def test_a_ferrox_cache_saves_its_token_ids_and_refuses_another_prompt(tmp_path, llama):
    from ferrox_kv.hf import FerroxCache, fingerprint
    ids = torch.randint(1, 256, (1, 9), generator=torch.Generator().manual_seed(6))
    out = _gen(llama, ids, cache := FerroxCache(llama.config, dtype="float32"), 4)
    fp = fingerprint(llama)
    cache.save(tmp_path / "conv", fingerprint=fp, tokens=out)       # generate's output
    turn = torch.cat([out, torch.tensor([[5, 6]])], dim=1)
    resumed = FerroxCache.load(tmp_path / "conv", llama.config, fingerprint=fp, tokens=turn)
    assert resumed.get_seq_length() == out.shape[1] - 1
    resumed.close()
    other = turn.clone()
    other[0, 3] += 1
    with pytest.raises(StoreMismatch, match="at position 3") as e:
        FerroxCache.load(tmp_path / "conv", llama.config, fingerprint=fp, tokens=other)
    assert e.value.field == "tokens"


def test_a_ferrox_cache_of_several_sequences_is_refused_by_save(tmp_path, llama):
    from ferrox_kv.hf import FerroxCache
    ids = torch.randint(1, 256, (2, 6), generator=torch.Generator().manual_seed(7))
    _gen(llama, ids, cache := FerroxCache(llama.config, dtype="float32", batch_size=2), 2)
    with pytest.raises(ValueError, match="batch of 1; this cache holds 2 sequences"):
        cache.save(tmp_path / "conv")
    assert not (tmp_path / "conv").exists()
    cache.close()


@pytest.mark.parametrize("bad", [-1, 0, 2.5, True, "8"])
def test_a_bad_max_seq_len_is_refused_before_any_cache_is_made(tmp_path, bad):
    c = _cache("float32")
    path = tmp_path / "slot"
    c.save(path)
    pool = store_pool(32)
    before = pool_counts(pool)
    with pytest.raises(ValueError, match="max_seq_len must be None or a positive int"):
        ferrox_kv.KvCache.load(path, pool=pool, max_seq_len=bad)
    assert pool_counts(pool) == before
    assert ferrox_kv.KvCache.load(path, max_seq_len=64).seq_len == c.seq_len
    pool.check()


_SPARSE = """
import resource, sys
import ferrox_kv
from ferrox_kv.store import StoreCorrupt
resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
try:
    {load}
except StoreCorrupt as e:
    print("StoreCorrupt", e.field)
except MemoryError:
    print("MemoryError")
"""


@pytest.mark.skipif(os.environ.get("FERROX_KV_ASAN") == "1",
                    reason="an address-space cap (RLIMIT_AS) cannot hold ASan's shadow memory")
@pytest.mark.parametrize("which", ["KvCache", "FerroxCache"])
def test_a_huge_sparse_file_is_store_corrupt_before_a_buffer_is_sized_by_it(tmp_path, which):
    """A parked conversation extended to 16 GiB of holes: the layout is read
    against the file's size first, so the load refuses it (StoreCorrupt) in
    a process that could never allocate the file's size."""
    import subprocess
    import sys
    if which == "FerroxCache":
        pytest.importorskip("transformers")
    path = tmp_path / "slot"
    _cache("float32").save(path, fingerprint="m")
    os.truncate(path, 16 << 30)
    if which == "KvCache":
        load, limit = f"ferrox_kv.KvCache.load({str(path)!r}, fingerprint='m')", 2 << 30
    else:
        load = ("import transformers; from ferrox_kv.hf import FerroxCache; "
                "FerroxCache.load({!r}, transformers.LlamaConfig(num_hidden_layers=1, "
                "num_attention_heads={}, num_key_value_heads={}, head_dim={}, "
                "hidden_size={}), fingerprint='m')".format(
                    str(path), STORE_HEADS, STORE_HEADS, STORE_DIM, STORE_HEADS * STORE_DIM))
        limit = 8 << 30
    out = subprocess.run([sys.executable, "-c", _SPARSE.format(limit=limit, load=load)],
                         capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(ferrox_kv.__file__)))
    assert out.stdout.startswith("StoreCorrupt"), (out.stdout, out.stderr[-2000:])


def test_ferrox_cache_load_keeps_an_int4_files_rotation(tmp_path):
    """A FerroxCache of an int4 pool without the rotation saves rows marked
    so; they load only where rows are stored so (a pool with
    rotate=False), never as rotated ones."""
    from ferrox_kv.hf import FerroxCache
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=STORE_HEADS * STORE_DIM, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=STORE_HEADS, num_key_value_heads=STORE_HEADS)
    plain = store_pool(32, "int4", rotate=False)
    cache = FerroxCache(cfg, pool=plain, max_seq_len=8)
    k = torch.from_numpy(rows(5, W, 1).reshape(1, 5, STORE_HEADS, STORE_DIM)).transpose(1, 2)
    for i in range(2):
        cache.update(k * (i + 1), -k, i)
    want = [(layer.seqs[0].k.tobytes(), layer.seqs[0].v.tobytes()) for layer in cache.layers]
    cache.save(tmp_path / "conv")
    cache.close()
    for pool in (None, store_pool(32, "int4")):
        with pytest.raises(StoreMismatch, match="without the rotation|int4.norot") as e:
            FerroxCache.load(tmp_path / "conv", cfg, pool=pool)
        assert e.value.field == "dtype"
    back = FerroxCache.load(tmp_path / "conv", cfg, pool=plain)
    assert [(layer.seqs[0].k.tobytes(), layer.seqs[0].v.tobytes())
            for layer in back.layers] == want
    back.close()
    plain.check()
    assert plain.free_blocks == 32
