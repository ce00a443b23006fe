"""int4 storage with and without the Hadamard rotation: the transform
against a float64 matrix, the storage contract, attend against a float64
reference over the stored values, the argument rules, and a prefix file's rotation against its reader's."""
import numpy as np
import pytest

from support.pools import STORE_FP, publish_seq, store_pool
from ferrox_kv import KvBlockPool, KvCache
from ferrox_kv.store import StoreMismatch


def hadamard(d):
    """The orthonormal block-diagonal Hadamard matrix of a head of d values
    (blocks: the largest power of two dividing d, at most 512), float64."""
    b = min(d & -d, 512)
    h = np.ones((1, 1))
    while h.shape[0] < b:
        h = np.block([[h, h], [h, -h]])
    return np.kron(np.eye(d // b), h / np.sqrt(b))


def q4(x, rotate):
    """The int4 contract over (..., d) float32 rows of one head, in float64:
    rotated when asked, groups of 32, scale amax/7 as float16 (one step up
    when |x|/s would pass 7), q = clip(rint(x/s), -7, 7); read back q * s,
    rotated back."""
    d = x.shape[-1]
    hm = hadamard(d)
    y = x.astype(np.float64) @ hm.T if rotate else x.astype(np.float64)
    g = y.reshape(y.shape[:-1] + (d // 32, 32))
    amax = np.abs(g).max(-1, keepdims=True).astype(np.float32)
    s = (amax / np.float32(7)).astype(np.float16)
    up = (s > 0) & (amax / np.maximum(s.astype(np.float32), 1e-30) > 7)
    s = np.where(up, np.nextafter(s, np.float16(np.inf)), s).astype(np.float32)
    with np.errstate(all="ignore"):
        q = np.where(s > 0, np.clip(np.rint(g / s), -7, 7), 0)
    back = (q * s).reshape(y.shape)
    return back @ hm if rotate else back


def reference(k, v, q):
    """Decode attention of q (n_heads, d) over k, v (T, h, d), float64."""
    nh, h = q.shape[0], k.shape[1]
    out = np.zeros((nh, v.shape[2]))
    for j in range(nh):
        s = k[:, j // (nh // h)].astype(np.float64) @ q[j] / np.sqrt(k.shape[2])
        w = np.exp(s - s.max())
        out[j] = w / w.sum() @ v[:, j // (nh // h)]
    return out


@pytest.mark.parametrize("d", [32, 64, 96, 128, 192, 256])
def test_the_rotation_is_the_orthonormal_hadamard_matrix(d):
    hm = hadamard(d)
    np.testing.assert_allclose(hm @ hm.T, np.eye(d), atol=1e-12)
    # a cache stores H k: unit vectors in, their rotated int4 images out of
    # the arena match the matrix's columns up to the quantisation
    pool = KvBlockPool(d, 1, 1, d, dtype="int4")
    c = KvCache.with_pool(1, d, pool, max_seq_len=d)
    eye = np.eye(d, dtype=np.float32)[:, None, :]
    c.extend(eye, eye)
    raw = np.asarray(pool.key_blocks[0, :, 0])                    # (d, d // 2) uint8
    sc = np.asarray(pool.key_scales[0, :, 0], np.float32)         # (d, d // 32)
    lo, hi = (raw & 15).astype(np.int8) - 8, (raw >> 4).astype(np.int8) - 8
    vals = np.concatenate([lo.reshape(d, -1, 16), hi.reshape(d, -1, 16)], -1).reshape(d, d)
    got = vals * np.repeat(sc, 32, -1)
    assert np.abs(got - hm.T).max() <= np.abs(hm).max() / 14 + 1e-6
    # .k reads back H^T (stored): the identity up to the quantisation
    np.testing.assert_allclose(c.k[:, 0], q4(np.eye(d, dtype=np.float32), True), atol=1e-5)
    pool.check()


@pytest.mark.parametrize("rotate", [True, False])
@pytest.mark.parametrize("h,d,bs", [(2, 64, 16), (1, 128, 7), (4, 96, 32), (2, 32, 1)])
def test_int4_rows_and_attend_follow_the_contract(rotate, h, d, bs):
    rng = np.random.default_rng(d + h)
    pool = KvBlockPool(bs, 64, h, d, dtype="int4", rotate=rotate)
    assert (pool.dtype, pool.rotate) == ("int4", rotate)
    c = KvCache.with_pool(h, d, pool, max_seq_len=50)
    assert (c.dtype, c.rotate) == ("int4", rotate)
    k = rng.standard_normal((50, h, d)).astype(np.float32)
    v = rng.standard_normal((50, h, d)).astype(np.float32)
    c.extend(k, v)
    for got, x in ((c.k, k), (c.v, v)):
        want = q4(x, rotate)
        if not rotate:
            np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
        else:   # float32 vs float64 rotation: a rare value lands on the next level
            far = np.abs(got - want) > 1e-4
            assert far.mean() < 0.01, far.mean()
            assert np.abs(got - want).max() <= 0.5, np.abs(got - want).max()
    q = rng.standard_normal((1, 2 * h, d)).astype(np.float32)
    # the kernel quantises each (rotated) query to int8; that costs < 1e-2 here
    out = c.attend(q)[0]
    np.testing.assert_allclose(out, reference(c.k, c.v, q[0]), atol=3e-2)
    pool.check()


def test_rotation_preserves_q_dot_k_before_quantisation():
    rng = np.random.default_rng(3)
    hm = hadamard(128).astype(np.float32)
    q, k = rng.standard_normal((2, 100, 128)).astype(np.float32)
    np.testing.assert_allclose(((q @ hm.T) * (k @ hm.T)).sum(-1), (q * k).sum(-1), rtol=1e-4, atol=1e-4)


def test_bad_int4_arguments_are_refused():
    with pytest.raises(ValueError, match="multiples of 32"):
        KvBlockPool(4, 4, 2, 40, dtype="int4")
    with pytest.raises(ValueError, match="multiples of 32"):
        KvCache(2, 64, v_head_dim=48, dtype="int4")
    with pytest.raises(ValueError, match="rotate=True applies to dtype='int4' only"):
        KvBlockPool(4, 4, 2, 64, dtype="int8", rotate=True)
    with pytest.raises(TypeError, match="rotate must be"):
        KvCache(2, 64, dtype="int4", rotate="yes")
    pool = KvBlockPool(4, 8, 2, 64, dtype="int4", rotate=False)
    with pytest.raises(ValueError, match="does not match the pool's dtype"):
        KvCache.with_pool(2, 64, pool, max_seq_len=8, dtype="int8")
    assert pool.free_blocks == 8
    c = KvCache.with_pool(2, 64, pool, max_seq_len=8, dtype="int4")
    assert c.rotate is False
    pool.check()


def test_a_prefix_file_loads_only_into_a_pool_of_its_rotation(tmp_path):
    pool = store_pool(64, "int4")
    publish_seq(pool, list(range(1, 10)))
    path = tmp_path / "p.fxkv"
    pool.save_prefixes(path, fingerprint=STORE_FP)
    plain = store_pool(64, "int4", rotate=False)
    with pytest.raises(StoreMismatch, match="dtype") as e:
        plain.load_prefixes(path, fingerprint=STORE_FP)
    assert e.value.field == "dtype"
    assert plain.free_blocks == 64
    plain.check()
    assert store_pool(64, "int4").load_prefixes(path, fingerprint=STORE_FP)["entries"] > 0
