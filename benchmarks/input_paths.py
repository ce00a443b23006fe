"""What does it cost to get a float* out of the caller's array, per call?

Compiles (with Cython, at run time) four tiny functions that each take two
float32 rows and copy them into a buffer, differing only in how they reach
the data: a typed memoryview, the buffer protocol (PyObject_GetBuffer), the
numpy C API (the path KvCache.push uses), and np.ascontiguousarray first.
Ratios against the numpy C API path, from one run.

    python benchmarks/input_paths.py        # needs Cython and a C compiler
"""
import os
import sys
import tempfile
import timeit

import numpy as np

SRC = r'''
# cython: language_level=3, boundscheck=False, wraparound=False
cimport numpy as cnp
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_C_CONTIGUOUS, PyBUF_FORMAT
from libc.string cimport memcpy
import numpy as np
cnp.import_array()

cdef float out[65536]

def via_memoryview(const float[::1] k, const float[::1] v):
    memcpy(out, &k[0], k.shape[0] * 4)
    memcpy(out, &v[0], v.shape[0] * 4)

def via_buffer(k, v):
    cdef Py_buffer bk, bv
    PyObject_GetBuffer(k, &bk, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT)
    try:
        PyObject_GetBuffer(v, &bv, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT)
        try:
            if bk.itemsize != 4 or bv.itemsize != 4 or bk.format[0] != b'f' or bv.format[0] != b'f':
                raise ValueError("not float32")
            memcpy(out, bk.buf, bk.len)
            memcpy(out, bv.buf, bv.len)
        finally:
            PyBuffer_Release(&bv)
    finally:
        PyBuffer_Release(&bk)

cdef inline bint fast(object x):
    return (cnp.PyArray_Check(x) and cnp.PyArray_TYPE(<cnp.ndarray>x) == cnp.NPY_FLOAT32
            and cnp.PyArray_ISCARRAY_RO(<cnp.ndarray>x))

def via_numpy_c_api(k, v):
    if not fast(k) or not fast(v):
        raise ValueError("not float32")
    memcpy(out, cnp.PyArray_DATA(<cnp.ndarray>k), cnp.PyArray_NBYTES(<cnp.ndarray>k))
    memcpy(out, cnp.PyArray_DATA(<cnp.ndarray>v), cnp.PyArray_NBYTES(<cnp.ndarray>v))

def via_ascontiguousarray(k, v):
    cdef cnp.ndarray a = np.ascontiguousarray(k, dtype=np.float32)
    cdef cnp.ndarray b = np.ascontiguousarray(v, dtype=np.float32)
    memcpy(out, cnp.PyArray_DATA(a), cnp.PyArray_NBYTES(a))
    memcpy(out, cnp.PyArray_DATA(b), cnp.PyArray_NBYTES(b))
'''


def build():
    from Cython.Build import cythonize
    from setuptools import Distribution, Extension
    tmp = tempfile.mkdtemp(prefix="ferrox_input_paths_")
    with open(os.path.join(tmp, "_paths.pyx"), "w") as f:
        f.write(SRC)
    ext = Extension("_paths", [os.path.join(tmp, "_paths.pyx")], include_dirs=[np.get_include()],
                    extra_compile_args=["-O2"])
    dist = Distribution({"ext_modules": cythonize([ext], quiet=True)})
    cmd = dist.get_command_obj("build_ext")
    cmd.build_lib = tmp
    cmd.build_temp = tmp
    dist.run_command("build_ext")
    sys.path.insert(0, tmp)
    import _paths
    return _paths


def main():
    paths = build()
    import ferrox_kv
    rows = []
    for h, d in [(2, 64), (8, 128)]:
        k = np.ones(h * d, np.float32)
        v = np.ones(h * d, np.float32)
        cache = ferrox_kv.KvCache.with_capacity(h, d, 1)
        fns = {name: getattr(paths, name) for name in
               ["via_numpy_c_api", "via_buffer", "via_memoryview", "via_ascontiguousarray"]}

        def push_truncate():
            cache.push(k, v)
            cache.truncate(0)

        res = {}
        for _ in range(5):
            for name, fn in fns.items():
                t = min(timeit.repeat(lambda: fn(k, v), number=20000, repeat=3)) / 20000
                res[name] = min(res.get(name, 1), t)
            t = min(timeit.repeat(push_truncate, number=20000, repeat=3)) / 20000
            res["KvCache.push+truncate"] = min(res.get("KvCache.push+truncate", 1), t)
        base = res["via_numpy_c_api"]
        for name, t in res.items():
            rows.append((f"{h}x{d}", name, t * 1e9, t / base))
    print(f"{'geometry':<9} {'path':<24} {'ns/call':>8} {'ratio':>7}  (of via_numpy_c_api)")
    for g, name, ns, r in rows:
        print(f"{g:<9} {name:<24} {ns:>8.1f} {r:>7.2f}")


if __name__ == "__main__":
    main()
