"""Rows the tests write, and what a cache of each storage dtype stores."""
import numpy as np

DTYPES = ("float32", "float16", "bfloat16", "int8")
REDUCED = ("float16", "bfloat16", "int8")


def rows(n, width, seed=0, scale=1.0):
    """Deterministic, distinct float32 rows (never zeros)."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, width)) * scale + 0.5).astype(np.float32)


class ArrayHook:
    """An array-like whose conversion runs ``effect`` first (hostile-input
    tests: conversion is user code that may close caches or empty lists)."""

    def __init__(self, value, effect):
        self.value, self.effect = value, effect

    def __array__(self, dtype=None, copy=None):
        self.effect()
        return np.asarray(self.value, dtype=dtype)


def bf16_round(x):
    """float32 -> bfloat16 (as float32 values): round to nearest even on the
    top 16 bits; NaN stays NaN (quiet)."""
    x = np.ascontiguousarray(x, np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint32)
    nan = np.isnan(x)
    r[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint32)
    return (r << 16).astype(np.uint32).view(np.float32).reshape(x.shape)


def q8_round(x, head_dim):
    """The int8 storage contract over rows of float32 values (last axis:
    heads of ``head_dim``): groups of 32 dims per head, scale amax/127 as
    float16 (rounded up when rounding down would push |x|/s past 127),
    q = clamp(rint(x/s), -127, 127), dequantised q * s. Returns
    (dequantised float32 values, int8 values, float16 scales)."""
    x = np.ascontiguousarray(x, np.float32)
    lead, w = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, w // head_dim, head_dim)
    n_groups = -(-head_dim // 32)
    q = np.zeros(rows.shape, np.int8)
    scales = np.zeros(rows.shape[:2] + (n_groups,), np.float16)
    out = np.zeros(rows.shape, np.float32)
    with np.errstate(all="ignore"):
        for j in range(n_groups):
            g = rows[:, :, j * 32:(j + 1) * 32]
            a = np.abs(g)
            amax = np.where(np.isnan(a).any(-1), np.float32(np.nan), np.nanmax(a, -1, initial=0))
            amax = amax.astype(np.float32)
            s = (amax / np.float32(127)).astype(np.float16)
            s = np.where(np.isfinite(amax) & (amax != 0)
                         & (amax / s.astype(np.float32) > np.float32(127)),
                         np.nextafter(s, np.float16(np.inf)), s)
            sf = s.astype(np.float32)[..., None]
            v = np.where((sf != 0) & ~np.isnan(sf), np.rint(g / sf), 0)
            v = np.clip(np.nan_to_num(v, nan=0.0), -127, 127).astype(np.int8)
            q[:, :, j * 32:(j + 1) * 32] = v
            scales[:, :, j] = s
            out[:, :, j * 32:(j + 1) * 32] = v.astype(np.float32) * sf
    return (out.reshape(x.shape), q.reshape(x.shape),
            scales.reshape(lead + ((w // head_dim) * n_groups,)))


def hadamard_block(head_dim):
    """The Hadamard block of an int4 head: the largest power of two dividing
    head_dim, at most 512 (fx_hadamard_block)."""
    return min(head_dim & -head_dim, 512)


def fwht(x, head_dim):
    """fx_fwht over every head of float32 rows ``x`` (last axis: heads of
    ``head_dim``), in float32 with the core's order of additions: a fast
    Walsh-Hadamard transform per block, then the factor 1/sqrt(b). The
    orthonormal block-diagonal Hadamard matrix, its own inverse."""
    x = np.ascontiguousarray(x, np.float32)
    b = hadamard_block(head_dim)
    k = b.bit_length() - 1
    f = np.float32(0.5) ** (k // 2)
    if k & 1:
        f = np.float32(f * np.float32(0.70710678118654752))
    y = x.reshape(-1, b)
    h = 1
    with np.errstate(all="ignore"):
        while h < b:
            z = y.reshape(-1, b // (2 * h), 2, h)
            u, w = z[:, :, 0], z[:, :, 1]
            y = np.stack([u + w, u - w], 2).reshape(-1, b)
            h *= 2
        y = y * f
    return y.reshape(x.shape)


def q4_round(x, head_dim, rotate=True):
    """The int4 storage contract over rows of float32 values (last axis:
    heads of ``head_dim``, a multiple of 32), bit for bit: each head rotated
    first when ``rotate`` (fwht), then groups of 32 with scale amax/7 as
    float16 (one float16 step up when |x|/s would pass 7, capped at 65504),
    q = clip(rint(x/s), -7, 7); an all-zero, NaN or inf group stores q = 0
    with scale 0, NaN or inf. Returns (the float32 values ``.k``/``.v``
    read back: q * s, rotated back, int8 q values of the rotated rows,
    float16 scales)."""
    x = np.ascontiguousarray(x, np.float32)
    y = fwht(x, head_dim) if rotate else x
    g = y.reshape(-1, 32)
    q = np.zeros(g.shape, np.int8)
    s = np.zeros(len(g), np.float16)
    with np.errstate(all="ignore"):
        a = np.abs(g)
        nan = np.isnan(a).any(-1)
        amax = np.where(nan, np.float32(np.nan), np.max(np.where(np.isnan(a), 0, a), -1))
        amax = amax.astype(np.float32)
        ok = np.isfinite(amax) & (amax != 0)
        h = (amax / np.float32(7)).astype(np.float16)
        h = np.where(ok & np.isinf(h), np.float16(65504), h)
        up = ok & (h < np.float16(65504)) & ~(amax / h.astype(np.float32) <= np.float32(7))
        h = np.where(up, np.nextafter(h, np.float16(np.inf)), h)
        s = np.where(ok, h, np.where(nan, np.float16(np.nan),
                                     np.where(amax == 0, np.float16(0), np.float16(np.inf))))
        sf = s.astype(np.float32)[:, None]
        v = np.where(ok[:, None], np.rint(g / np.where(ok[:, None], sf, 1)), 0)
        q = np.clip(v, -7, 7).astype(np.int8)
        back = (q.astype(np.float32) * sf).reshape(x.shape)
    if rotate:
        back = fwht(back, head_dim)
    lead = x.shape[:-1]
    return back, q.reshape(x.shape), s.reshape(lead + (x.shape[-1] // 32,))


def stored(x, dtype, head_dim, rotate=None):
    """The float32 values a cache of ``dtype`` gives back for float32 input
    ``x`` (last axis: heads of ``head_dim``, flat). ``rotate`` applies to
    int4 (None: rotated, the pool's default)."""
    x = np.asarray(x, np.float32)
    if dtype == "float32":
        return x
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        return bf16_round(x)
    if dtype == "int4":
        return q4_round(x, head_dim, rotate is not False)[0]
    return q8_round(x, head_dim)[0]


def values(a):
    """A cache's .k / .v as float32 (float16 views widened)."""
    return np.asarray(a, np.float32)
