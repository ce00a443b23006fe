# Argument conversion and validation for the classes and functions of the
# core: required arguments, integers, reals, byte counts, arrays (numpy,
# torch, anything array-like) into rows of a source dtype, and the storage
# dtypes. Everything here holds the GIL and raises on bad input; nothing
# here touches a pool or a cache.


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


cdef Py_ssize_t _positions(object value, str name) except -1:
    """A number of positions >= 1 (a sliding window, a chunk), or
    ValueError/TypeError naming it. A bool is a TypeError: ``window=True``
    is a request for a window, not for a window of one position."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer number of positions, got bool "
                        f"({value!r}); pass the size itself")
    return _count(value, name, 1)


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

DTYPES = ("float32", "float16", "bfloat16", "int8", "int4")   # the names dtype= takes
# The name of each FX_* code: FX_I4 (int4, values as given) and FX_I4H
# (int4 of Hadamard-rotated values) are both "int4"; rotate= tells them apart.
_DTYPE_OF_CODE = DTYPES + ("int4",)


cdef int _dtype_code(object dtype, str name) except -1:
    """The FX_* code of a dtype given as a name ("float32", "float16",
    "bfloat16", "int8", "int4": rotated, FX_I4H, see _storage_code), a numpy
    dtype or scalar type (np.float32, np.float16, np.int8), or a torch dtype
    (torch.bfloat16, matched by name: the core does not import torch).
    Unknown: ValueError; not a dtype at all: TypeError."""
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
        code = DTYPES.index(key)
        return FX_I4H if code == FX_I4 else code
    except ValueError:
        raise ValueError(f"{name}={dtype!r} is not a storage dtype ferrox_kv has; accepted: "
                         f"{', '.join(map(repr, DTYPES))} (numpy's float32 / float16 / int8, "
                         "torch's float32 / float16 / bfloat16 / int8 alike)") from None


def _dtype_name(dtype, name="dtype"):
    """The storage dtype name of ``dtype`` as the pools and caches read it
    (for integrations that take a ``dtype=`` of their own)."""
    return _DTYPE_OF_CODE[_dtype_code(dtype, name)]


def _dtype_label(int code):
    """A dtype code's name for messages: int4 says whether it rotates."""
    return ("int4 (rotate=False)" if code == FX_I4 else "int4 (rotate=True)" if code == FX_I4H
            else _DTYPE_OF_CODE[code])


cdef int _storage_code(object dtype, object rotate, Py_ssize_t head_dim,
                       Py_ssize_t v_head_dim) except -1:
    """The FX_* code of ``dtype=`` with ``rotate=`` (None: int4 rotates,
    nothing else does), checked against the head dims: int4 stores groups of
    32 values along a head, so both must be multiples of 32. rotate=True
    with another dtype is a ValueError (only int4 rows are rotated)."""
    cdef int code = _dtype_code(dtype, "dtype")
    if rotate is not None and not isinstance(rotate, (bool, np.bool_)):
        raise TypeError(f"rotate must be True, False or None, got {type(rotate).__name__}")
    if code == FX_I4H:
        if rotate is not None and not rotate:
            code = FX_I4
        if head_dim % 32 or v_head_dim % 32:
            raise ValueError(f"dtype='int4' needs head_dim and v_head_dim to be multiples of 32 "
                             f"(int4 stores groups of 32 values along the head dim, one scale "
                             f"each), got head_dim={head_dim}, v_head_dim={v_head_dim}")
    elif rotate:
        raise ValueError(f"rotate=True applies to dtype='int4' only (its rows are stored "
                         f"Hadamard-rotated); dtype={_DTYPE_OF_CODE[code]!r} stores rows as given")
    return code


cdef inline size_t _row_bytes(Py_ssize_t h, Py_ssize_t d, int dtype) noexcept nogil:
    """Bytes of one stored row of h heads of d values (h, d < 2**31): the
    storage contract's fx_row_bytes (int8 rows carry one float16 scale per
    32 values of each head after the values)."""
    return fx_row_bytes(<int>h, <int>d, dtype)


def _stored_row_bytes(n_kv_heads, head_dim, dtype):
    """Bytes of one stored row of ``n_kv_heads`` heads of ``head_dim`` values
    in the storage dtype ``dtype`` (``fx_row_bytes``, for ferrox_kv.store's
    format: the one definition of the row layout)."""
    cdef Py_ssize_t h = _count(n_kv_heads, "n_kv_heads", 1)
    cdef Py_ssize_t d = _count(head_dim, "head_dim", 1)
    if h > INT32_MAX or d > INT32_MAX:
        raise ValueError("n_kv_heads and head_dim must be < 2**31")
    return _row_bytes(h, d, _dtype_code(dtype, "dtype"))


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


cdef Py_ssize_t _check_rows(cnp.ndarray a, int lead, Py_ssize_t h, Py_ssize_t d,
                            str name, str lead_s) except -1:
    """Check that ``a`` is ``lead`` leading axes (named ``lead_s``, e.g.
    "T, ") followed by (h, d) or (h*d,); returns the product of the leading
    axes (1 when lead is 0)."""
    cdef int nd = cnp.PyArray_NDIM(a), i
    cdef cnp.npy_intp* shp = cnp.PyArray_DIMS(a)
    cdef Py_ssize_t n = 1
    if (nd == lead + 1 and shp[lead] == h * d) or (
            nd == lead + 2 and shp[lead] == h and shp[lead + 1] == d):
        for i in range(lead):
            n *= shp[i]
        return n
    if lead == 0:
        raise ValueError(f"{name} must have {h * d} values, flat or shaped ({h}, {d}); "
                         f"got shape {_shape(a)}")
    raise ValueError(f"{name} must be shaped ({lead_s}{h}, {d}) or ({lead_s}{h * d}); "
                     f"got shape {_shape(a)}")


cdef object _token_ids(object tokens, str name):
    """Token ids as a private 1-D int32 array (ValueError / TypeError)."""
    try:
        arr = np.asarray(tokens)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name} must be a sequence of integer token ids ({e})") from None
    if arr.dtype.kind not in "iu" and not (arr.dtype.kind == "f" and arr.size == 0):
        raise TypeError(f"{name} must be integer token ids, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be one sequence of token ids, got shape {arr.shape}")
    if arr.size and (arr.min() < -2**31 or arr.max() > 2**31 - 1):
        raise ValueError(f"{name} holds ids outside the int32 range")
    return np.array(arr, dtype=np.int32, copy=True)
