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
from libc.stdint cimport int32_t, int64_t, uint64_t, INT32_MAX
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
    """How this extension was built: ``{"build": ..., "compiler": ...}``
    (release or the AddressSanitizer debug build, with its flags)."""
    return {"build": fx_build_flags.decode(), "compiler": fx_compiler.decode()}


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


cdef object _as_f32(object x, str name):
    """Convert an array-like to a C-contiguous float32 ndarray of the same
    shape (0-d stays 0-d), or TypeError naming the argument."""
    mod = type(x).__module__
    if mod == "torch" or mod.startswith("torch."):
        dt = str(getattr(x, "dtype", ""))
        dev = str(getattr(x, "device", "cpu"))
        if dt != "torch.float32" or not dev.startswith("cpu"):
            raise TypeError(
                f"{name} is a torch tensor of dtype {dt} on {dev}; ferrox_kv stores "
                f"float32 on the CPU: pass {name}.to('cpu', torch.float32)")
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


cdef inline cnp.ndarray _f32(object x, str name):
    """``x`` itself when it is a C-contiguous native float32 ndarray (the fast
    path: no conversion, no temporary), else a converted copy."""
    if (cnp.PyArray_Check(x)
            and cnp.PyArray_TYPE(<cnp.ndarray>x) == cnp.NPY_FLOAT32
            and cnp.PyArray_ISCARRAY_RO(<cnp.ndarray>x)
            and cnp.PyArray_ISNOTSWAPPED(<cnp.ndarray>x)):
        return <cnp.ndarray>x
    return _as_f32(x, name)


cdef str _shape(cnp.ndarray a):
    return str(tuple((<object>a).shape))


include "_pool.pxi"
include "_prefix.pxi"
include "_cache.pxi"
include "_batch.pxi"
include "_attend.pxi"
include "_testing.pxi"
