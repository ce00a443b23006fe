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


def stored(x, dtype, head_dim):
    """The float32 values a cache of ``dtype`` gives back for float32 input
    ``x`` (last axis: heads of ``head_dim``, flat)."""
    x = np.asarray(x, np.float32)
    if dtype == "float32":
        return x
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        return bf16_round(x)
    return q8_round(x, head_dim)[0]


def values(a):
    """A cache's .k / .v as float32 (float16 views widened)."""
    return np.asarray(a, np.float32)
