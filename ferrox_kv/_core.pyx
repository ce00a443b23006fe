# cython: language_level=3
"""The ferrox_kv core: a paged KV block pool and per-sequence KV caches.

Shape (after explosion/preshed ``maps.pxd``): C structs (``Pool``,
``Prefix``, ``Cache``, declared in ``_core.pxd``) and ``noexcept nogil`` C
functions that do every hot piece of work on raw ``float*`` (copying rows,
gathering blocks, attention, moving block ids). The ``cdef class``es on top
only convert and validate arguments, call those functions and build Python
objects. The code is split by topic into includes of this one extension:

* ``_pool.pxi``: the pool: arenas, block ids and reference counts, the one
  all-or-nothing path that moves them (``pools_update``), fork handling, and
  ``KvBlockPool``;
* ``_prefix.pxi``: the prefix cache's index (hash chains, LRU eviction);
* ``_cache.pxi``: row copies, ``KvCache``;
* ``_batch.pxi``: calls over several caches at once (the write path,
  ``push_layers``, forks and reorders of a batch);
* ``_attend.pxi``: attention read in place (the kernel is ``_attn.h``);
* ``_testing.pxi``: test and benchmark hooks.

Locking rules (see the README's "Thread safety"):

* One pthread mutex per pool, held only while block ids move. Nothing inside
  the locked region makes a Python object, raises or can run the garbage
  collector; errors come back as codes and are raised after unlocking. An
  operation on caches of several pools locks those pools in address order.
* A pool's C struct is reference counted (atomically) by its ``KvBlockPool``
  object and by every cache that holds blocks of it, so a cache may outlive
  the Python pool object and still give its blocks back from
  ``__dealloc__``, touching only C state.
* Every ``KvCache`` method claims the cache with an atomic flag for its
  duration; a second thread that calls into the same cache meanwhile gets a
  ``RuntimeError`` instead of racing on its memory.
* Fork: ``pthread_atfork`` handlers take the registry lock and every pool lock
  (in address order) inside ``fork()`` itself, after every Python-level fork
  hook has run, and release them in the parent and the child. No Python code
  runs while they are held, so neither another hook nor the garbage collector
  (a ``__dealloc__`` giving blocks back) can wait on a lock its own thread
  holds, and a child never inherits a lock held by a thread it does not have.
"""

cimport cython
from libc.stdint cimport int32_t, int64_t, uint16_t, uint64_t, INT32_MAX
from libc.stdlib cimport malloc, calloc, realloc, free
from libc.string cimport memcmp, memcpy, memset

cimport numpy as cnp
import numpy as np
from numpy.lib.array_utils import byte_bounds as _byte_bounds
from numbers import Complex as _Complex, Real as _Real
from operator import index as _operator_index

cnp.import_array()


# ---------------------------------------------------------------------------
# Tunables
# ---------------------------------------------------------------------------

# Copies of at least this many bytes (K and V together, per call) run with the
# GIL released; smaller ones keep it, because a GIL release/re-acquire costs
# about as much as copying a few KB and threads convoy on the GIL when they
# release it around every small row. benchmarks/gil_threshold.py measures it.
cdef Py_ssize_t _gil_release_bytes = 131072

# The largest byte count any single allocation may have: beyond it ValueError.
cdef size_t _MAX_BYTES = <size_t>0x7fffffffffffffff


def build_info():
    """How this extension was built: ``{"build": ..., "compiler": ...,
    "kernel": ...}``: release or the AddressSanitizer debug build with its
    flags, the compiler, and the x86-64 levels the attention kernel was
    compiled for (``simd_path()`` says which one this CPU runs)."""
    return {"build": fx_build_flags.decode(), "compiler": fx_compiler.decode(),
            "kernel": fx_attend_levels().decode()}


def gil_release_threshold():
    """Bytes copied per call at or above which the copy runs without the GIL."""
    return _gil_release_bytes


def set_gil_release_threshold(Py_ssize_t nbytes):
    """Set the copy size (bytes per call, K and V together) from which the GIL
    is released. ``0`` releases it for every copy; returns the old value."""
    global _gil_release_bytes
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    old = _gil_release_bytes
    _gil_release_bytes = nbytes
    return old


cdef inline bint _release_pays(Py_ssize_t nbytes) noexcept:
    return nbytes >= _gil_release_bytes


class KvPoolExhausted(Exception):
    """A pool had fewer free blocks than an operation needed.

    Nothing was changed when it is raised. ``requested`` is the number of
    blocks the operation needed from that pool, ``free`` the number the pool
    had free (its ``free_blocks``).
    """

    def __init__(self, requested, free):
        self.requested = requested
        self.free = free
        super().__init__(
            f"KV cache block pool exhausted: {requested} block(s) requested, "
            f"{free} free")

    def __reduce__(self):
        return (KvPoolExhausted, (self.requested, self.free))


# ---------------------------------------------------------------------------
# Argument helpers
# ---------------------------------------------------------------------------

cdef object _MISSING = object()    # a required argument that was not passed


cdef int _require(str what, tuple names, tuple values) except -1:
    """TypeError naming every required argument that was not passed."""
    missing = [name for name, value in zip(names, values) if value is _MISSING]
    if missing:
        raise TypeError(f"{what}() missing {len(missing)} required argument"
                        f"{'s' if len(missing) > 1 else ''}: "
                        + ", ".join(repr(m) for m in missing))
    return 0


cdef object _index(object value, str name):
    """``value`` as an exact Python int (``operator.index``: an ``__index__``
    that returns anything else is a TypeError), or TypeError naming the
    argument. Range checks then run on that int, and converting it to C gives
    the same number."""
    try:
        return _operator_index(value)
    except TypeError:
        raise TypeError(
            f"{name} must be an integer, got {type(value).__name__}") from None


cdef double _real(object value, str name) except? -1.0:
    """``value`` as a C double when it is a real number: its type defines
    ``__float__`` or ``__index__`` and it is not complex. A str, bytes or
    complex is a TypeError naming the argument (as in numpy's arithmetic:
    ``np.multiply(x, "0.5")`` is one); an int beyond the double range is a
    ValueError."""
    t = type(value)
    if (not (hasattr(t, "__float__") or hasattr(t, "__index__"))
            or (isinstance(value, _Complex) and not isinstance(value, _Real))):
        raise TypeError(f"{name} must be a real number, got {t.__name__}")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{name} is beyond the range of a float") from None
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name} must be a real number, got {t.__name__} ({e})") from None


cdef Py_ssize_t _count(object value, str name, Py_ssize_t minimum) except -1:
    """An integer argument >= minimum, or ValueError/TypeError naming it."""
    ivalue = _index(value, name)
    if ivalue < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {ivalue}")
    if ivalue > INT32_MAX * <Py_ssize_t>4096 * 4096:
        raise ValueError(f"{name} is too large: {ivalue}")
    return <Py_ssize_t>ivalue


cdef size_t _checked_bytes(str what, Py_ssize_t a, Py_ssize_t b,
                           Py_ssize_t c) except 0:
    """a * b * c * sizeof(float), or ValueError if it overflows.

    Returns at least 1 so that 0 can signal an exception.
    """
    cdef size_t out
    if (fx_mul(<size_t>a, <size_t>b, &out) or fx_mul(out, <size_t>c, &out)
            or fx_mul(out, sizeof(float), &out) or out > _MAX_BYTES):
        raise ValueError(f"{what}: {a} x {b} x {c} float32 overflows the byte count")
    return out if out > 0 else 1


cdef str _ACCEPTED_TORCH = ("ferrox_kv reads CPU tensors of dtype float32, float16 or "
                           "bfloat16")


cdef object _as_f32(object x, str name):
    """Convert an array-like to a C-contiguous float32 ndarray of the same
    shape (0-d stays 0-d), or TypeError naming the argument."""
    mod = type(x).__module__
    if mod == "torch" or mod.startswith("torch."):
        dt = str(getattr(x, "dtype", ""))
        dev = str(getattr(x, "device", "cpu"))
        if dt != "torch.float32" or not dev.startswith("cpu"):
            raise TypeError(
                f"{name} is a torch tensor of dtype {dt} on {dev}; {_ACCEPTED_TORCH} "
                f"(here: float32): pass {name}.to('cpu', torch.float32)")
    try:
        arr = np.asarray(x)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"{name} must be an array of numbers, got "
                        f"{type(x).__name__} ({e})") from None
    if arr.dtype.kind not in "biuf":
        raise TypeError(f"{name} must hold numbers, got dtype {arr.dtype}")
    _check_within_buffer(arr, name)
    if arr.dtype != np.float32 or not arr.flags.c_contiguous:
        arr = arr.astype(np.float32, order="C")
    return arr


cdef int _check_within_buffer(object arr, str name) except -1:
    """An array numpy built over another object's buffer (through
    ``__array_interface__``) must lie inside that buffer: numpy trusts the
    interface's shape. (A raw pointer in the interface cannot be checked;
    numpy trusts it as ctypes does.)"""
    base = arr.base
    while isinstance(base, np.ndarray):
        base = base.base
    if base is None or arr.size == 0:
        return 0
    try:
        buf = np.frombuffer(base, np.uint8)
    except (TypeError, ValueError, BufferError):
        return 0                       # not a buffer exporter
    low, high = _byte_bounds(arr)
    lo = buf.__array_interface__["data"][0]
    if low < lo or high > lo + buf.nbytes:
        raise TypeError(f"{name} describes {high - low} bytes that its buffer of "
                        f"{buf.nbytes} bytes does not hold (a lying __array_interface__)")
    return 0


cdef inline bint _is_f32(object x) noexcept:
    """Whether ``x`` is a C-contiguous native float32 ndarray (the fast path:
    no conversion, no temporary)."""
    return (cnp.PyArray_Check(x)
            and cnp.PyArray_TYPE(<cnp.ndarray>x) == cnp.NPY_FLOAT32
            and cnp.PyArray_ISCARRAY_RO(<cnp.ndarray>x)
            and cnp.PyArray_ISNOTSWAPPED(<cnp.ndarray>x))


cdef inline cnp.ndarray _f32(object x, str name):
    """``x`` itself when it is a C-contiguous native float32 ndarray, else a
    converted copy."""
    if _is_f32(x):
        return <cnp.ndarray>x
    return _as_f32(x, name)


# -- storage dtypes ------------------------------------------------------------

DTYPES = ("float32", "float16", "bfloat16", "int8")   # by FX_* code


cdef int _dtype_code(object dtype, str name) except -1:
    """The FX_* code of a dtype given as a name ("float32", "float16",
    "bfloat16", "int8"), a numpy dtype or scalar type (np.float32,
    np.float16, np.int8), or a torch dtype (torch.bfloat16, matched by name:
    the core does not import torch). Unknown: ValueError; not a dtype at
    all: TypeError."""
    if isinstance(dtype, str):
        key = dtype
    else:
        mod = type(dtype).__module__
        if mod == "torch" or mod.startswith("torch."):
            key = str(dtype)[6:] if str(dtype).startswith("torch.") else str(dtype)
        else:
            # numpy dtypes and scalar types only: np.dtype() would also take
            # bytes and type codes ('f2', b'e'), which the names here do not
            key = None
            if isinstance(dtype, (np.dtype, type)):
                try:
                    key = np.dtype(dtype).name
                except Exception:      # numpy's own errors for what is no dtype
                    pass
            if key is None:
                raise TypeError(f"{name} must be one of {', '.join(map(repr, DTYPES))} (or a "
                                f"numpy / torch dtype of those), got {type(dtype).__name__}")
    try:
        return DTYPES.index(key)
    except ValueError:
        raise ValueError(f"{name}={dtype!r} is not a storage dtype ferrox_kv has; accepted: "
                         f"{', '.join(map(repr, DTYPES))} (numpy's float32 / float16 / int8, "
                         "torch's float32 / float16 / bfloat16 / int8 alike)") from None


def _dtype_name(dtype, name="dtype"):
    """The storage dtype name of ``dtype`` as the pools and caches read it
    (for integrations that take a ``dtype=`` of their own)."""
    return DTYPES[_dtype_code(dtype, name)]


cdef inline size_t _row_bytes(Py_ssize_t h, Py_ssize_t d, int dtype) noexcept nogil:
    """Bytes of one stored row of h heads of d values (h, d < 2**31): the
    storage contract's fx_row_bytes (int8 rows carry one float16 scale per
    32 values of each head after the values)."""
    return fx_row_bytes(<int>h, <int>d, dtype)


cdef inline int _src_size(int src) noexcept:
    """Bytes per value of an FX_F32 / FX_F16 / FX_BF16 source."""
    return 4 if src == FX_F32 else 2


cdef object _torch_half(object x, str name):
    """A torch CPU tensor of dtype float16 / bfloat16 as a uint16 ndarray
    over its own memory (read in place: numpy has no bfloat16); the array
    keeps the tensor alive. float32 CPU tensors go through ``__array__``;
    anything else is a TypeError that says what is accepted."""
    dt = str(getattr(x, "dtype", ""))
    dev = str(getattr(x, "device", "cpu"))
    if dt not in ("torch.float16", "torch.bfloat16") or not dev.startswith("cpu"):
        raise TypeError(f"{name} is a torch tensor of dtype {dt} on {dev}; {_ACCEPTED_TORCH}: "
                        f"pass {name}.to('cpu', torch.float32) (or float16 / bfloat16)")
    if str(x.layout) != "torch.strided":
        raise TypeError(f"{name} is a torch tensor of layout {x.layout}; pass a dense one "
                        f"({name}.to_dense())")
    x = x.resolve_neg()                # a lazily negated view: its values, not its memory
    if not x.is_contiguous():
        x = x.contiguous()
    cdef int nd = x.dim(), i
    cdef cnp.npy_intp dims[32]
    if nd > 32:
        raise ValueError(f"{name} has {nd} dimensions")
    for i in range(nd):
        dims[i] = <cnp.npy_intp>x.shape[i]
    cdef size_t ptr = 0
    cdef Py_ssize_t n = x.numel()
    if n:
        # the memory read must be the tensor's own: a fake or meta-like tensor
        # has none (data_ptr 0), a resized storage less than its shape says
        try:
            held = x.untyped_storage().nbytes()
            ptr = <size_t>x.data_ptr()
        except Exception:
            held = -1
        if ptr == 0 or held < (x.storage_offset() + n) * 2:
            raise TypeError(f"{name} is a torch tensor without memory for its {n} values (a "
                            "fake tensor, or one whose storage was resized); pass a tensor "
                            "that holds its data")
    cdef cnp.ndarray arr = cnp.PyArray_SimpleNewFromData(nd, dims, cnp.NPY_UINT16, <void*>ptr)
    cnp.set_array_base(arr, x)
    cnp.PyArray_CLEARFLAGS(arr, cnp.NPY_ARRAY_WRITEABLE)
    return arr


cdef tuple _rows_in(object x, str name):
    """(array, source code) of row input: a C-contiguous float32 ndarray as
    it is (FX_F32, the fast path), a float16 ndarray as it is (FX_F16), a
    torch float16 / bfloat16 CPU tensor read in place (FX_F16 / FX_BF16),
    anything else converted to float32."""
    if cnp.PyArray_Check(x):
        if _is_f32(x):
            return x, FX_F32
        if (cnp.PyArray_TYPE(<cnp.ndarray>x) == cnp.NPY_FLOAT16 and cnp.PyArray_NDIM(x) > 0
                and cnp.PyArray_ISNOTSWAPPED(<cnp.ndarray>x)):
            _check_within_buffer(x, name)
            return np.ascontiguousarray(x), FX_F16
        return _as_f32(x, name), FX_F32
    mod = type(x).__module__
    if mod == "torch" or mod.startswith("torch."):
        dt = str(getattr(x, "dtype", ""))
        if dt == "torch.float16":
            return _torch_half(x, name), FX_F16
        if dt == "torch.bfloat16":
            return _torch_half(x, name), FX_BF16
    return _as_f32(x, name), FX_F32


cdef tuple _rows_pair(object k, object v, str kname, str vname):
    """k and v as ``_rows_in`` gives them, with one source code for both
    (float32 when they differ)."""
    ka, ks = _rows_in(k, kname)
    va, vs = _rows_in(v, vname)
    if ks != vs:
        ka = _half_to_f32(ka, ks)
        va = _half_to_f32(va, vs)
        ks = FX_F32
    return ka, va, ks


cdef object _half_to_f32(cnp.ndarray a, int src):
    """A half source of ``_rows_in`` (float16 values, or uint16 bits of
    float16 / bfloat16) as float32 values (exact); float32 as it is."""
    if src == FX_F32:
        return a
    if src == FX_BF16:
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.view(np.float16).astype(np.float32)


cdef str _shape(cnp.ndarray a):
    return str(tuple((<object>a).shape))


include "_pool.pxi"
include "_prefix.pxi"
include "_cache.pxi"
include "_batch.pxi"
include "_attend.pxi"
include "_testing.pxi"
