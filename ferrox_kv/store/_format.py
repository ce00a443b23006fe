"""The prefix store's one encoder and decoder (file and Redis value); the
layout is specified in FORMAT.md at the repository root.

Every integer is little-endian and fixed-width; nothing is pickled. The bulk
bytes (token ids, K and V rows) move as memoryviews: encoding hands them to
the writer or to one ``b"".join``, decoding returns read-only numpy views of
the buffer it was given (they keep that buffer alive). Nothing is trusted
before the checksum that covers it has been verified.
"""
from __future__ import annotations

import hashlib
import struct
from typing import IO, Any, NamedTuple, Sequence

import numpy as np

try:
    import xxhash
except ModuleNotFoundError as _e:                       # pragma: no cover
    raise ImportError(
        "ferrox_kv.store needs the xxhash package: pip install '.[store]' from the "
        "ferrox_kv checkout (or '.[redis]', which includes it)") from _e

VERSION = 1
FILE_MAGIC = b"FXKVPFX\x00"
VALUE_MAGIC = b"FXKVVAL\x00"
ENTRY_MAGIC = b"FXKE"
TRAILER_MAGIC = b"FXKVEND\x00"
KIND_FILE = 1
KIND_VALUE = 2

# header: magic, version, kind, header_bytes, block_size, n_layers, n_kv_heads,
# head_dim, v_head_dim, k_row_bytes, v_row_bytes, dtype, n_entries,
# fingerprint_len, reserved; then the fingerprint (padded to 8), then a checksum
HEADER = struct.Struct("<8sHHIIIIIIII16sQII")
# entry: magic, flags, record_bytes, depth, n_tokens, salt_tag, 3 pad bytes,
# salt_len, key, parent; then the salt (padded to 8), token ids, K, V, checksum
ENTRY = struct.Struct("<4sIQII B3x I16s16s")
TRAILER = struct.Struct("<8sQ16s")
DIGEST = 16                          # XXH3-128 checksums and BLAKE2b-128 chain keys
NO_PARENT = bytes(DIGEST)
MAX_FINGERPRINT = 4096
MAX_SALT = 65536

ANY: Any = object()                  # decode_value: any salt

SALT_NONE, SALT_STR, SALT_BYTES, SALT_INT = 0, 1, 2, 3

# entry flags: the writer had no token ids and stored zeros (a parked
# conversation saved without tokens=); valid only where the reader allows it
FLAG_NO_TOKENS = 1


class StoreFormatError(ValueError):
    """Data that is not a valid ferrox_kv prefix file or store value; ``field``
    names the part of the layout that failed (see FORMAT.md)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class StoreCorrupt(StoreFormatError):
    """The bytes were damaged: a checksum, a length or a link disagrees."""


class StoreMismatch(StoreFormatError):
    """Intact, but written for something else: another version, geometry,
    dtype, fingerprint, salt or token ids than the reader's."""


def row_bytes(n_kv_heads: int, head_dim: int, dtype: str) -> int:
    """Bytes of one stored row of ``n_kv_heads * head_dim`` values: packed values,
    and for int8 one float16 scale per group of 32 dims of each head. The core
    owns the storage dtypes (``DTYPES``) and this size (``fx_row_bytes``); the
    store asks it (at call time: the store imports no core at module level)."""
    from ferrox_kv import _core
    if dtype != INT4_PLAIN and dtype not in _core.DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_core.DTYPES) + [INT4_PLAIN]}, got {dtype!r}")
    return _core._stored_row_bytes(n_kv_heads, head_dim, "int4" if dtype == INT4_PLAIN else dtype)


# The dtype name of int4 rows stored without the rotation (a pool with
# rotate=False): "int4" alone names rotated rows, so that a file's rotation
# must match the reader's (StoreMismatch on the field dtype).
INT4_PLAIN = "int4.norot"


def stored_dtype(obj: Any) -> str:
    """The dtype name a file gives the rows of ``obj`` (a pool or a cache):
    its dtype attribute's (float32 where it has none), ``INT4_PLAIN`` for
    int4 without the rotation."""
    dtype = str(getattr(obj, "dtype", "float32"))
    return INT4_PLAIN if dtype == "int4" and not getattr(obj, "rotate", True) else dtype


def as_cache_dtype(dtype: str) -> tuple[str, bool | None]:
    """The (dtype, rotate) arguments of a cache storing a file's rows of
    ``dtype`` (a name ``stored_dtype`` gives)."""
    return ("int4", False) if dtype == INT4_PLAIN else (dtype, None)


class Geometry(NamedTuple):
    """What an entry's bytes mean: the pool's block size and head shapes, the
    layer count of one entry, the storage dtype's name and its row sizes."""
    block_size: int
    n_layers: int
    n_kv_heads: int
    head_dim: int
    v_head_dim: int
    dtype: str = "float32"

    @property
    def k_row_bytes(self) -> int:
        return row_bytes(self.n_kv_heads, self.head_dim, self.dtype)

    @property
    def v_row_bytes(self) -> int:
        return row_bytes(self.n_kv_heads, self.v_head_dim, self.dtype)

    @property
    def payload_bytes(self) -> int:
        """K and V bytes of one entry (every layer's block)."""
        return self.n_layers * self.block_size * (self.k_row_bytes + self.v_row_bytes)

    def tag(self) -> str:
        """The geometry and dtype as they appear in a store key."""
        return (f"bs{self.block_size}.L{self.n_layers}.h{self.n_kv_heads}"
                f".d{self.head_dim}.v{self.v_head_dim}.{self.dtype}")

    @classmethod
    def of_pool(cls, pool: Any, n_layers: int) -> "Geometry":
        """The geometry of ``n_layers``-layer entries of ``pool`` (its dtype
        attribute's name, float32 where it has none)."""
        return cls(pool.block_size, n_layers, pool.n_kv_heads, pool.head_dim,
                   pool.v_head_dim, stored_dtype(pool)).check()

    def check(self) -> "Geometry":
        for name in ("block_size", "n_layers", "n_kv_heads", "head_dim", "v_head_dim"):
            value = getattr(self, name)
            if type(value) is not int and not isinstance(value, np.integer):
                raise TypeError(f"geometry {name} must be an int, got {type(value).__name__}")
            if not 0 < value < 2**31:
                raise ValueError(f"geometry {name} must be in 1..2**31-1, got {value}")
        row_bytes(1, 1, self.dtype)                   # names the dtypes on a bad one
        if self.payload_bytes >= 2**48:
            raise ValueError(f"geometry: one entry would hold {self.payload_bytes} bytes")
        return Geometry(int(self.block_size), int(self.n_layers), int(self.n_kv_heads),
                        int(self.head_dim), int(self.v_head_dim), self.dtype)


class Entry(NamedTuple):
    """One block position of a published sequence in every layer.

    ``tokens``: int32 (block_size,); ``k``: uint8 (n_layers, block_size,
    k_row_bytes); ``v``: uint8 (n_layers, block_size, v_row_bytes) -- the rows'
    stored bytes; ``key``: this block's chained hash, ``parent``: the previous
    block's (``NO_PARENT`` at depth 0); ``depth``: the block's index in its
    sequence."""
    depth: int
    key: bytes
    parent: bytes
    salt: Any
    tokens: np.ndarray
    k: np.ndarray
    v: np.ndarray


# -- salts, fingerprints, chained keys ------------------------------------------

def encode_salt(salt: Any) -> tuple[int, bytes]:
    """A salt (None, str, bytes or int, as the pool takes) as (tag, bytes)."""
    t = type(salt)
    if salt is None:
        tag, data = SALT_NONE, b""
    elif t is str:
        tag, data = SALT_STR, salt.encode("utf-8", "surrogatepass")
    elif t is bytes:
        tag, data = SALT_BYTES, salt
    elif t is int:
        tag, data = SALT_INT, salt.to_bytes(max(1, (salt.bit_length() + 8) // 8), "little",
                                            signed=True)
    else:
        raise TypeError(f"salt must be None, str, bytes or int, got {t.__name__}")
    if len(data) > MAX_SALT:
        raise ValueError(f"salt is {len(data)} bytes encoded; at most {MAX_SALT}")
    return tag, data


def salt_fits(salt: Any) -> bool:
    """Whether the format can hold ``salt``: at most ``MAX_SALT`` bytes
    encoded. The pool takes any salt; sequences under a longer one stay
    local (never saved to a file nor written to or read from a store)."""
    try:
        encode_salt(salt)
    except ValueError:
        return False
    return True


def _decode_salt(tag: int, data: bytes) -> Any:
    if tag == SALT_NONE and not data:
        return None
    if tag == SALT_STR:
        try:
            return data.decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            pass
    elif tag == SALT_BYTES:
        return data
    elif tag == SALT_INT and data:
        return int.from_bytes(data, "little", signed=True)
    raise StoreCorrupt("salt", f"tag {tag} with {len(data)} bytes is not a salt")


def fingerprint_bytes(fingerprint: Any) -> bytes:
    """The caller's model identity (bytes, or str as UTF-8)."""
    if type(fingerprint) is str:
        fingerprint = fingerprint.encode("utf-8")
    elif isinstance(fingerprint, (bytearray, memoryview)):
        fingerprint = bytes(fingerprint)
    if type(fingerprint) is not bytes:
        raise TypeError(f"fingerprint must be bytes or str, got {type(fingerprint).__name__}")
    if not 0 < len(fingerprint) <= MAX_FINGERPRINT:
        raise ValueError(f"fingerprint must be 1..{MAX_FINGERPRINT} bytes, got {len(fingerprint)}")
    return fingerprint


def _tokens_i32(tokens: Any) -> np.ndarray:
    arr = np.asarray(tokens)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise TypeError(f"tokens must be a 1-d sequence of ints, got {arr.dtype} "
                        f"with shape {arr.shape}")
    if arr.size and (arr.min() < -2**31 or arr.max() >= 2**31):
        raise ValueError("tokens must fit in int32")
    return np.ascontiguousarray(arr, dtype="<i4")


def chain_keys(tokens: Any, block_size: int, salt: Any = None) -> list[bytes]:
    """The chained hash of every full block of ``tokens``: BLAKE2b-128 over the
    parent's key, the salt and the block's int32 token ids. Process-independent
    (unlike the pool's in-memory key, which uses a per-process salt id)."""
    if type(block_size) is not int or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    arr = _tokens_i32(tokens)
    tag, sdata = encode_salt(salt)
    salted = struct.pack("<BI", tag, len(sdata)) + sdata
    keys, parent = [], NO_PARENT
    for i in range(len(arr) // block_size):
        h = hashlib.blake2b(parent, digest_size=DIGEST, person=b"ferrox_kv.chain")
        h.update(salted)
        h.update(arr[i * block_size:(i + 1) * block_size].data.cast("B"))
        parent = h.digest()
        keys.append(parent)
    return keys


def entries_from_rows(geometry: Geometry, tokens: Any, k: Sequence[Any], v: Sequence[Any],
                      *, salt: Any = None) -> list[Entry]:
    """The entries of every full block of one sequence, from each layer's stored
    rows: ``k[j]`` holds layer j's K rows as bytes -- uint8 ``(T, k_row_bytes)``, or,
    for float32 storage, float32 ``(T, n_kv_heads, head_dim)`` or ``(T, width)``
    (a ``KvCache.k``). The entries are views of the arrays given (no copy)."""
    geometry = geometry.check()
    bs, n = geometry.block_size, geometry.n_layers
    arr = _tokens_i32(tokens).copy()              # the entries own their token ids
    if len(k) != n or len(v) != n:
        raise ValueError(f"k and v need one array per layer ({n}), got {len(k)} and {len(v)}")
    nb = len(arr) // bs

    def as_rows(a: Any, row: int, what: str) -> np.ndarray:
        a = np.asarray(a)
        if a.dtype == np.float32 and geometry.dtype == "float32":
            a = a.reshape(a.shape[0], -1) if a.ndim >= 2 else a
            a = np.ascontiguousarray(a).view(np.uint8)
        if a.dtype != np.uint8 or a.ndim != 2 or a.shape[1] != row or a.shape[0] < nb * bs:
            raise ValueError(f"{what} must be uint8 rows of {row} bytes (or float32 rows for "
                             f"float32 storage), at least {nb * bs} of them; got {a.dtype} "
                             f"{a.shape}")
        return np.ascontiguousarray(a[:nb * bs]).reshape(nb, bs, row)

    ks = [as_rows(a, geometry.k_row_bytes, f"k[{j}]") for j, a in enumerate(k)]
    vs = [as_rows(a, geometry.v_row_bytes, f"v[{j}]") for j, a in enumerate(v)]
    ks_all = np.stack(ks, axis=1)                 # (nb, n_layers, bs, row): one copy
    vs_all = np.stack(vs, axis=1)
    keys = chain_keys(arr, bs, salt)
    return [Entry(i, keys[i], keys[i - 1] if i else NO_PARENT, salt,
                  arr[i * bs:(i + 1) * bs], ks_all[i], vs_all[i]) for i in range(nb)]


# -- encoding -------------------------------------------------------------------

def _pad8(n: int) -> int:
    return -n % 8


def _header_size(fp_len: int) -> int:
    """The header's bytes: fixed fields, fingerprint, zeros to a multiple of 8,
    checksum (so entries start 8-aligned)."""
    return HEADER.size + fp_len + _pad8(HEADER.size + fp_len) + DIGEST


def _encode_header(geometry: Geometry, fingerprint: bytes, kind: int,
                   n_entries: int) -> bytes:
    fp_len = len(fingerprint)
    size = _header_size(fp_len)
    head = HEADER.pack(FILE_MAGIC if kind == KIND_FILE else VALUE_MAGIC, VERSION, kind, size,
                       geometry.block_size, geometry.n_layers, geometry.n_kv_heads,
                       geometry.head_dim, geometry.v_head_dim, geometry.k_row_bytes,
                       geometry.v_row_bytes, geometry.dtype.encode("ascii"), n_entries,
                       fp_len, 0) + fingerprint + bytes(_pad8(HEADER.size + fp_len))
    return head + xxhash.xxh3_128_digest(head)


def _entry_parts(geometry: Geometry, e: Entry, flags: int = 0) -> list[Any]:
    """The pieces of one entry record, its checksum last; the bulk pieces are
    memoryviews of the entry's arrays."""
    bs = geometry.block_size
    tag, sdata = encode_salt(e.salt)
    tokens = np.asarray(e.tokens)
    if tokens.dtype != np.dtype("<i4") or tokens.shape != (bs,):
        raise ValueError(f"entry tokens must be int32 of shape ({bs},), got {tokens.dtype} "
                         f"{tokens.shape}")
    k, v = np.asarray(e.k), np.asarray(e.v)
    for name, a, row in (("k", k, geometry.k_row_bytes), ("v", v, geometry.v_row_bytes)):
        if a.dtype != np.uint8 or a.shape != (geometry.n_layers, bs, row):
            raise ValueError(f"entry {name} must be uint8 of shape "
                             f"{(geometry.n_layers, bs, row)}, got {a.dtype} {a.shape}")
    if len(e.key) != DIGEST or len(e.parent) != DIGEST:
        raise ValueError(f"entry key and parent must be {DIGEST} bytes")
    if type(e.depth) is not int or not 0 <= e.depth < 2**32:
        raise ValueError(f"entry depth must be an int in 0..2**32-1, got {e.depth!r}")
    size = ENTRY.size + len(sdata) + _pad8(len(sdata)) + 4 * bs + geometry.payload_bytes + DIGEST
    head = ENTRY.pack(ENTRY_MAGIC, flags, size, e.depth, bs, tag, len(sdata), bytes(e.key),
                      bytes(e.parent)) + sdata + bytes(_pad8(len(sdata)))
    parts: list[Any] = [head, np.ascontiguousarray(tokens).data.cast("B"),
                        np.ascontiguousarray(k).data.cast("B"),
                        np.ascontiguousarray(v).data.cast("B")]
    h = xxhash.xxh3_128()
    for part in parts:
        h.update(part)
    parts.append(h.digest())
    return parts


def value_bytes(geometry: Geometry, fingerprint: Any, salt: Any = None) -> int:
    """The exact size of a store value (``encode_value``) of ``geometry`` for
    ``fingerprint`` under ``salt``: a value of any other size is corrupt."""
    g = geometry.check()
    _, sdata = encode_salt(salt)
    return (_header_size(len(fingerprint_bytes(fingerprint))) + ENTRY.size + len(sdata)
            + _pad8(len(sdata)) + 4 * g.block_size + g.payload_bytes + DIGEST)


def encode_value(geometry: Geometry, fingerprint: Any, entry: Entry) -> bytes:
    """One store value: a header (kind "value", one entry) and the entry, whole."""
    geometry = geometry.check()
    fp = fingerprint_bytes(fingerprint)
    return b"".join([_encode_header(geometry, fp, KIND_VALUE, 1),
                     *_entry_parts(geometry, entry)])


def write_file(f: IO[bytes], geometry: Geometry, fingerprint: Any,
               entries: Sequence[Entry], *, flags: int = 0) -> int:
    """Write a prefix file of ``entries`` (parents before their children) to the
    binary file ``f``; returns the bytes written. Use ``atomic_write`` for a path.
    Every entry is validated before the first byte is written. ``flags``:
    every record's (``FLAG_NO_TOKENS`` or 0)."""
    if flags not in (0, FLAG_NO_TOKENS):
        raise ValueError(f"flags must be 0 or FLAG_NO_TOKENS, got {flags!r}")
    geometry = geometry.check()
    fp = fingerprint_bytes(fingerprint)
    entries = list(entries)
    _check_links(geometry, entries)
    records = [_entry_parts(geometry, e, flags) for e in entries]
    head = _encode_header(geometry, fp, KIND_FILE, len(entries))
    total = f.write(head)
    whole = xxhash.xxh3_128(head[-DIGEST:])
    for parts in records:
        for part in parts:
            total += f.write(part)
        whole.update(parts[-1])
    tail = TRAILER_MAGIC + struct.pack("<Q", len(entries))
    whole.update(tail)
    total += f.write(tail + whole.digest())
    return total


def _check_entry(geometry: Geometry, i: int, e: Entry) -> None:
    """Entry ``i``'s shapes, and its key is the chained hash of its parent, salt
    and tokens, with a parent exactly when its depth is not 0."""
    tokens = np.asarray(e.tokens)
    if tokens.shape != (geometry.block_size,) or tokens.dtype.kind not in "iu":
        raise ValueError(f"entry {i}: tokens must be ints of shape ({geometry.block_size},), "
                         f"got {tokens.dtype} {tokens.shape}")
    if type(e.depth) is not int or not 0 <= e.depth < 2**32:
        raise ValueError(f"entry {i}: depth must be an int in 0..2**32-1, got {e.depth!r}")
    for name, a, row in (("k", e.k, geometry.k_row_bytes), ("v", e.v, geometry.v_row_bytes)):
        a = np.asarray(a)
        if a.dtype != np.uint8 or a.shape != (geometry.n_layers, geometry.block_size, row):
            raise ValueError(f"entry {i}: {name} must be uint8 of shape "
                             f"{(geometry.n_layers, geometry.block_size, row)}, got {a.dtype} "
                             f"{a.shape}")
    if len(e.key) != DIGEST or len(e.parent) != DIGEST:
        raise ValueError(f"entry {i}: key and parent must be {DIGEST} bytes")
    if (e.depth == 0) != (bytes(e.parent) == NO_PARENT):
        raise ValueError(f"entry {i}: depth {e.depth} needs "
                         f"{'no parent' if e.depth == 0 else 'a parent'}")
    if _key_of(bytes(e.parent), e.salt, tokens) != e.key:
        raise ValueError(f"entry {i}: key is not the chained hash of its parent, salt "
                         "and tokens (make entries with entries_from_rows or chain_keys)")


def _check_links(geometry: Geometry, entries: Sequence[Entry]) -> None:
    """A forest (a file): each entry valid, no key twice, each parent earlier
    in the list with the same salt and depth one less."""
    seen: dict[bytes, tuple[int, Any]] = {}
    for i, e in enumerate(entries):
        _check_entry(geometry, i, e)
        if e.key in seen:
            raise ValueError(f"entry {i}: its key appears twice")
        if e.depth and seen.get(e.parent) != (e.depth - 1, e.salt):
            raise ValueError(f"entry {i}: its parent (same salt, depth {e.depth - 1}) must "
                             "come earlier in the list")
        seen[e.key] = (e.depth, e.salt)


def check_run(geometry: Geometry, entries: Sequence[Entry]) -> None:
    """A run (a store write): each entry valid and the parent of the next."""
    for i, e in enumerate(entries):
        _check_entry(geometry, i, e)
        if i and (e.parent != entries[i - 1].key or e.depth != entries[i - 1].depth + 1
                  or type(e.salt) is not type(entries[i - 1].salt)
                  or e.salt != entries[i - 1].salt):
            raise ValueError(f"entry {i}: not the child of entry {i - 1} (parent, depth "
                             "and salt must follow on)")


def _key_of(parent: bytes, salt: Any, tokens: np.ndarray) -> bytes:
    tag, sdata = encode_salt(salt)
    h = hashlib.blake2b(parent, digest_size=DIGEST, person=b"ferrox_kv.chain")
    h.update(struct.pack("<BI", tag, len(sdata)) + sdata)
    h.update(np.ascontiguousarray(tokens, dtype="<i4").data.cast("B"))
    return h.digest()


# -- decoding -------------------------------------------------------------------

def _header(buf: memoryview, kind: int, geometry: Geometry | None,
            fingerprint: bytes | None) -> tuple[Geometry, bytes, int, int]:
    """Parse and verify a header; returns (geometry, fingerprint, n_entries, size)."""
    magic = FILE_MAGIC if kind == KIND_FILE else VALUE_MAGIC
    what = "prefix file" if kind == KIND_FILE else "store value"
    if len(buf) < 8 and magic.startswith(bytes(buf)):
        raise StoreCorrupt("truncated", f"{len(buf)} bytes end inside the magic number")
    if bytes(buf[:8]) != magic:
        raise StoreFormatError("magic", f"not a ferrox_kv {what} (the first 8 bytes are not "
                                        f"{magic!r})")
    if len(buf) < HEADER.size:
        raise StoreCorrupt("truncated", f"{len(buf)} bytes end inside the header")
    (_, version, got_kind, size, bs, nl, nh, hd, vhd, krb, vrb, dtype_raw, n_entries,
     fp_len, reserved) = HEADER.unpack_from(buf, 0)
    if version != VERSION:
        raise StoreMismatch("version", f"format version {version}; this ferrox_kv reads "
                                       f"version {VERSION} only: write it again")
    if got_kind != kind:
        raise StoreCorrupt("kind", f"kind {got_kind}, expected {kind} ({what})")
    if fp_len == 0 or fp_len > MAX_FINGERPRINT or size != _header_size(fp_len):
        raise StoreCorrupt("header_bytes", f"header of {size} bytes with a fingerprint of "
                                           f"{fp_len} bytes does not add up")
    if len(buf) < size:
        raise StoreCorrupt("truncated", f"{len(buf)} bytes end inside the header")
    if xxhash.xxh3_128_digest(buf[:size - DIGEST]) != bytes(buf[size - DIGEST:size]):
        raise StoreCorrupt("header checksum", "the header's bytes do not match its checksum")
    if reserved != 0:
        raise StoreCorrupt("reserved", "reserved header field is not zero")
    if any(bytes(buf[HEADER.size + fp_len:size - DIGEST])):
        raise StoreCorrupt("padding", "the header's padding is not zero")
    try:
        dtype = dtype_raw.rstrip(b"\x00").decode("ascii")
        got = Geometry(bs, nl, nh, hd, vhd, dtype).check()
    except (UnicodeDecodeError, ValueError, TypeError) as e:
        raise StoreCorrupt("geometry", f"the header's geometry is not valid: {e}") from None
    if (krb, vrb) != (got.k_row_bytes, got.v_row_bytes):
        raise StoreCorrupt("row bytes", f"rows of {krb}/{vrb} bytes do not fit {got}")
    fp = bytes(buf[HEADER.size:HEADER.size + fp_len])
    if geometry is not None:
        geometry = geometry.check()
        for name in Geometry._fields:
            if getattr(got, name) != getattr(geometry, name):
                raise StoreMismatch(name, f"written with {name}={getattr(got, name)!r}, the "
                                          f"reader has {getattr(geometry, name)!r}")
    if fingerprint is not None and fp != fingerprint:
        raise StoreMismatch("fingerprint", "written for another model (fingerprint "
                                           f"{fp[:32]!r}, the reader's is {fingerprint[:32]!r})")
    return got, fp, n_entries, size


def _entry(buf: memoryview, at: int, g: Geometry, origin: int = 0,
           allowed_flags: int = 0) -> tuple[Entry, bytes, int]:
    """Parse and verify the entry record at ``at``; returns (entry, its
    checksum, the offset after it). The arrays are views of ``buf``.
    Messages name byte ``origin + at`` (``buf`` may hold one record of a file);
    flags outside ``allowed_flags`` are refused."""
    pos = origin + at
    if len(buf) - at < ENTRY.size:
        raise StoreCorrupt("truncated", f"ends inside an entry header at byte {pos}")
    magic, flags, size, depth, n_tokens, tag, salt_len, key, parent = ENTRY.unpack_from(buf, at)
    if magic != ENTRY_MAGIC:
        raise StoreCorrupt("entry magic", f"no entry starts at byte {pos}")
    if salt_len > MAX_SALT:
        raise StoreCorrupt("salt_len", f"salt of {salt_len} bytes at byte {pos}")
    start = at + ENTRY.size + salt_len + _pad8(salt_len)
    expect = start - at + 4 * g.block_size + g.payload_bytes + DIGEST
    if size != expect:
        raise StoreCorrupt("record_bytes", f"entry at byte {pos} claims {size} bytes; its "
                                           f"geometry and salt make {expect}")
    end = at + size
    if len(buf) < end:
        raise StoreCorrupt("truncated", f"ends inside the entry at byte {pos}")
    checksum = bytes(buf[end - DIGEST:end])
    if xxhash.xxh3_128_digest(buf[at:end - DIGEST]) != checksum:
        raise StoreCorrupt("entry checksum", f"the entry at byte {pos} does not match its "
                                             "checksum")
    if flags & ~allowed_flags:
        raise StoreCorrupt("flags", f"entry at byte {pos} has unknown flags {flags:#x}")
    if any(bytes(buf[at + 25:at + 28])) or any(
            bytes(buf[at + ENTRY.size + salt_len:start])):
        raise StoreCorrupt("padding", f"entry at byte {pos}: its padding is not zero")
    if n_tokens != g.block_size:
        raise StoreCorrupt("n_tokens", f"entry at byte {pos} holds {n_tokens} tokens, "
                                       f"not a block of {g.block_size}")
    salt = _decode_salt(tag, bytes(buf[at + ENTRY.size:at + ENTRY.size + salt_len]))
    bs, nl = g.block_size, g.n_layers
    tokens = np.frombuffer(buf, "<i4", bs, start)
    kb = nl * bs * g.k_row_bytes
    k = np.frombuffer(buf, np.uint8, kb, start + 4 * bs).reshape(nl, bs, g.k_row_bytes)
    v = np.frombuffer(buf, np.uint8, nl * bs * g.v_row_bytes,
                      start + 4 * bs + kb).reshape(nl, bs, g.v_row_bytes)
    if (depth == 0) != (parent == NO_PARENT):
        raise StoreCorrupt("parent", f"entry at byte {pos}: depth {depth} with "
                                     f"{'no ' if parent == NO_PARENT else 'a '}parent")
    if _key_of(parent, salt, tokens) != key:
        raise StoreCorrupt("key", f"entry at byte {pos}: its key is not the chained hash of "
                                  "its parent, salt and tokens")
    return Entry(depth, key, parent, salt, tokens, k, v), checksum, end


def _view(data: Any) -> memoryview:
    m = memoryview(data)
    if m.ndim != 1 or m.itemsize != 1 or not m.c_contiguous:
        m = m.cast("B") if m.c_contiguous else memoryview(bytes(m))
    return m.toreadonly()


def decode_value(data: Any, *, geometry: Geometry, fingerprint: Any,
                 key: bytes | None = None, parent: bytes | None = None,
                 depth: int | None = None, salt: Any = ANY,
                 tokens: Any = None) -> Entry:
    """The one entry of a store value, verified: header checksum, geometry,
    fingerprint, entry checksum, its chained key; and, where given, that its key,
    parent, depth, salt and token ids are the ones asked for. Raises
    StoreCorrupt or StoreMismatch naming the field otherwise."""
    buf = _view(data)
    g, _, n, size = _header(buf, KIND_VALUE, geometry, fingerprint_bytes(fingerprint))
    if n != 1:
        raise StoreCorrupt("n_entries", f"a store value holds one entry, this says {n}")
    e, _, end = _entry(buf, size, g)
    if end != len(buf):
        raise StoreCorrupt("trailing bytes", f"{len(buf) - end} bytes after the entry")
    if key is not None and e.key != key:
        raise StoreMismatch("key", "the value stores another block than its key names")
    if parent is not None and e.parent != parent:
        raise StoreMismatch("parent", "the value's parent is not the block before it")
    if depth is not None and e.depth != depth:
        raise StoreMismatch("depth", f"the value is block {e.depth}, expected {depth}")
    if salt is not ANY:
        if type(e.salt) is not type(salt) or e.salt != salt:
            raise StoreMismatch("salt", "the value was written under another salt")
    if tokens is not None and not np.array_equal(e.tokens, _tokens_i32(tokens)):
        raise StoreMismatch("tokens", "the value's token ids are not the ones asked for")
    return e


def read_into(f: Any, at: int, view: memoryview) -> int:
    """Read the binary file ``f`` from byte ``at`` into ``view`` until it is
    full or the file ends; returns the bytes read."""
    f.seek(at)
    got = 0
    while got < len(view):
        k = f.readinto(view[got:])
        if not k:
            break
        got += k
    return got


class Scanned(NamedTuple):
    """A prefix file's layout, read record header by record header
    (``scan_file``): each entry's offset and bytes, depth, key, parent,
    salt, token ids and stored checksum. Only the header and the trailer
    are verified; each record is verified when it is read whole."""
    geometry: Geometry
    offsets: list[int]
    sizes: list[int]
    depths: list[int]
    keys: list[bytes]
    parents: list[bytes]
    salts: list[Any]
    tokens: np.ndarray                 # int32 (n, block_size)
    checksums: list[bytes]


class _FileChecks:
    """The checks of a prefix file's records and trailer, shared by both ways
    of reading one (``decode_file``: the whole file in memory;
    ``scan_file`` + ``read_entry``: streamed): the entry count the bytes can
    hold, each key once, each parent earlier in the file with the same salt
    and depth one less, the whole-file checksum over the header's digest and
    the records' checksums, the trailer's magic and count, nothing after
    it."""

    def __init__(self, g: Geometry, n: int, at: int, size: int, head_digest: bytes) -> None:
        if n > (size - at) // (ENTRY.size + 4 * g.block_size + g.payload_bytes + DIGEST):
            raise StoreCorrupt("truncated", f"the header promises {n} entries; the "
                                            f"{size} bytes cannot hold them")
        self.n = n
        self.size = size
        self.whole = xxhash.xxh3_128(head_digest)
        self.seen: dict[bytes, tuple[int, Any]] = {}

    def record(self, at: int, key: bytes, parent: bytes, depth: int, salt: Any,
               checksum: bytes) -> None:
        """The record at byte ``at``, after its own fields were read."""
        if key in self.seen:
            raise StoreCorrupt("key", f"the entry at byte {at} appears twice")
        if depth and self.seen.get(parent) != (depth - 1, salt):
            raise StoreCorrupt("parent", f"the entry at byte {at} has no parent before it "
                                         "(same salt, depth one less)")
        self.seen[key] = (depth, salt)
        self.whole.update(checksum)

    def trailer(self, at: int, read: Any) -> None:
        """The trailer at byte ``at``; ``read()`` gives its bytes."""
        if self.size - at < TRAILER.size:
            raise StoreCorrupt("truncated", f"ends at byte {self.size}, inside the trailer")
        magic, count, checksum = TRAILER.unpack(read())
        if magic != TRAILER_MAGIC:
            raise StoreCorrupt("trailer magic", f"no trailer at byte {at}")
        self.whole.update(struct.pack("<8sQ", magic, count))
        if self.whole.digest() != checksum:
            raise StoreCorrupt("file checksum", "the file's entries and trailer do not match "
                                                "its checksum")
        if count != self.n:                      # unreachable unless the checksum collides
            raise StoreCorrupt("n_entries", f"the trailer counts {count}, the header {self.n}")
        if at + TRAILER.size != self.size:
            raise StoreCorrupt("trailing bytes", f"{self.size - at - TRAILER.size} bytes after "
                                                 "the trailer")


def scan_file(f: Any, size: int, *, geometry: Geometry, fingerprint: Any) -> Scanned:
    """The layout of the prefix file open as ``f`` (a binary file of ``size``
    bytes; read with seek/readinto), without reading the rows: the header
    (verified, as by ``decode_file``), every record's fixed fields, salt,
    token ids and checksum, and the trailer, whose whole-file checksum over
    the records' checksums is verified here. Raises what ``decode_file``
    raises for the same damage, except inside a record's rows, which only
    reading the record finds (``read_entry``)."""
    fp = fingerprint_bytes(fingerprint)
    g = geometry.check()
    bs = g.block_size
    small = bytearray(ENTRY.size + MAX_SALT + 8 + 4 * bs)

    def read_at(at: int, n: int) -> memoryview:
        view = memoryview(small)[:n]
        return view[:read_into(f, at, view)]

    head = bytearray(min(size, HEADER.size + MAX_FINGERPRINT + 8 + DIGEST))
    got = read_into(f, 0, memoryview(head))
    _, _, n, at = _header(_view(head[:got]), KIND_FILE, g, fp)
    checks = _FileChecks(g, n, at, size, bytes(head[at - DIGEST:at]))
    out = Scanned(g, [], [], [], [], [], [], np.empty((n, bs), np.int32), [])
    for i in range(n):
        fixed = read_at(at, ENTRY.size)
        if len(fixed) < ENTRY.size:
            raise StoreCorrupt("truncated", f"ends inside an entry header at byte {at}")
        magic, _, rec, depth, _, tag, salt_len, key, parent = ENTRY.unpack_from(fixed, 0)
        if magic != ENTRY_MAGIC:
            raise StoreCorrupt("entry magic", f"no entry starts at byte {at}")
        if salt_len > MAX_SALT:
            raise StoreCorrupt("salt_len", f"salt of {salt_len} bytes at byte {at}")
        start = ENTRY.size + salt_len + _pad8(salt_len)
        if rec != start + 4 * bs + g.payload_bytes + DIGEST:
            raise StoreCorrupt("record_bytes", f"entry at byte {at} claims {rec} bytes; its "
                                               f"geometry and salt make "
                                               f"{start + 4 * bs + g.payload_bytes + DIGEST}")
        if size < at + rec:
            raise StoreCorrupt("truncated", f"ends inside the entry at byte {at}")
        front = read_at(at, start + 4 * bs)
        salt = _decode_salt(tag, bytes(front[ENTRY.size:ENTRY.size + salt_len]))
        out.tokens[i] = np.frombuffer(front, "<i4", bs, start)
        checksum = bytes(read_at(at + rec - DIGEST, DIGEST))
        checks.record(at, key, parent, depth, salt, checksum)
        for lst, x in zip(out[1:7], (at, rec, depth, key, parent, salt)):
            lst.append(x)
        out.checksums.append(checksum)
        at += rec
    checks.trailer(at, lambda: read_at(at, TRAILER.size))
    return out


def read_entry(f: Any, scan: Scanned, i: int, buf: np.ndarray,
               allowed_flags: int = 0) -> Entry:
    """Entry ``i`` of a scanned file, read whole into ``buf`` (uint8, at least
    the record's bytes; the entry's arrays are views of it) and verified: its
    checksum, chained key, and that it is the record ``scan`` saw (depth, key,
    parent, salt, token ids, checksum), or StoreCorrupt naming the field."""
    at, n = scan.offsets[i], scan.sizes[i]
    view = memoryview(buf)[:n]
    if read_into(f, at, view) < n:
        raise StoreCorrupt("truncated", f"ends inside the entry at byte {at} (the file "
                                        "shrank while it was read)")
    e, checksum, _ = _entry(view.toreadonly(), 0, scan.geometry, origin=at,
                            allowed_flags=allowed_flags)
    if (checksum != scan.checksums[i] or e.depth != scan.depths[i] or e.key != scan.keys[i]
            or e.parent != scan.parents[i] or type(e.salt) is not type(scan.salts[i])
            or e.salt != scan.salts[i] or not np.array_equal(e.tokens, scan.tokens[i])):
        raise StoreCorrupt("changed", f"the entry at byte {at} changed while the file was "
                                      "read")
    return e


class Decoded(NamedTuple):
    geometry: Geometry
    fingerprint: bytes
    entries: list[Entry]


def decode_file(data: Any, *, geometry: Geometry | None = None,
                fingerprint: Any = None, allowed_flags: int = 0) -> Decoded:
    """Every entry of a prefix file held in ``data`` (bytes-like), verified before
    any is returned: header, each entry (checksum, chained key, parent earlier in
    the file with the same salt and depth one less), the trailer's count and
    whole-file checksum, nothing after it. With ``geometry``/``fingerprint`` a
    file written for another one raises StoreMismatch. Entry flags outside
    ``allowed_flags`` are refused (``flags``)."""
    buf = _view(data)
    fp = None if fingerprint is None else fingerprint_bytes(fingerprint)
    g, got_fp, n, at = _header(buf, KIND_FILE, geometry, fp)
    checks = _FileChecks(g, n, at, len(buf), bytes(buf[at - DIGEST:at]))
    entries: list[Entry] = []
    for _ in range(n):
        e, checksum, nxt = _entry(buf, at, g, allowed_flags=allowed_flags)
        checks.record(at, e.key, e.parent, e.depth, e.salt, checksum)
        entries.append(e)
        at = nxt
    checks.trailer(at, lambda: buf[at:at + TRAILER.size])
    return Decoded(g, got_fp, entries)


def regions(data: Any) -> list[tuple[str, int, int]]:
    """The named byte ranges of a valid prefix file, in order (FORMAT.md's
    names): the fault tests flip a byte in each."""
    buf = _view(data)
    g, fp, n, at = _header(buf, KIND_FILE, None, None)
    out = [("magic", 0, 8), ("version", 8, 10), ("kind", 10, 12), ("header_bytes", 12, 16),
           ("geometry", 16, 44), ("dtype", 44, 60), ("n_entries", 60, 68),
           ("fingerprint_len", 68, 72), ("reserved", 72, 76),
           ("fingerprint", 76, 76 + len(fp))]
    if 76 + len(fp) < at - DIGEST:
        out.append(("header padding", 76 + len(fp), at - DIGEST))
    out.append(("header checksum", at - DIGEST, at))
    for i in range(n):
        _, _, size, _, _, _, salt_len, _, _ = ENTRY.unpack_from(buf, at)
        s = at + ENTRY.size + salt_len + _pad8(salt_len)
        kb = g.n_layers * g.block_size * g.k_row_bytes
        out += [(f"entry {i} magic", at, at + 4), (f"entry {i} flags", at + 4, at + 8),
                (f"entry {i} record_bytes", at + 8, at + 16), (f"entry {i} depth", at + 16, at + 20),
                (f"entry {i} n_tokens", at + 20, at + 24), (f"entry {i} salt_tag", at + 24, at + 25),
                (f"entry {i} padding", at + 25, at + 28), (f"entry {i} salt_len", at + 28, at + 32),
                (f"entry {i} key", at + 32, at + 48), (f"entry {i} parent", at + 48, at + 64)]
        if salt_len:
            out.append((f"entry {i} salt", at + ENTRY.size, at + ENTRY.size + salt_len))
        if at + ENTRY.size + salt_len < s:
            out.append((f"entry {i} salt padding", at + ENTRY.size + salt_len, s))
        out += [(f"entry {i} tokens", s, s + 4 * g.block_size),
                (f"entry {i} k", s + 4 * g.block_size, s + 4 * g.block_size + kb),
                (f"entry {i} v", s + 4 * g.block_size + kb, at + size - DIGEST),
                (f"entry {i} checksum", at + size - DIGEST, at + size)]
        at += size
    out += [("trailer magic", at, at + 8), ("trailer n_entries", at + 8, at + 16),
            ("file checksum", at + 16, at + 32)]
    return out
