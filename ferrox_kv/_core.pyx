# cython: language_level=3
"""The ferrox_kv core: a paged KV block pool and per-sequence KV caches.

Shape (after explosion/preshed ``maps.pxd``): C structs (``Pool``,
``Prefix``, ``Cache``) and ``noexcept nogil`` C functions that do every hot
piece of work on raw ``float*`` (copying rows, gathering blocks, attention,
moving block ids); ``_core.pxd`` declares every one of them, by file, with
its lock rule. The ``cdef class``es on top only convert and validate
arguments, call those functions and build Python objects. This file is the
index (as msgpack's ``_cmsgpack.pyx``): directives, imports, tunables and
the includes, by topic:

* ``_args.pxi``: argument conversion and validation, storage dtypes;
* ``_pool.pxi``: the C pool: arenas, block ids and reference counts, the
  one check/apply pair that moves them (``_req_check``/``_req_apply``;
  ``pools_update``), fork handling;
* ``_check.pxi``: the invariant checker behind ``KvBlockPool.check()``;
* ``_prefix.pxi``: the prefix cache's index (hash chains, LRU eviction);
* ``_prefix_io.pxi``: entries out of and into a pool, for ``ferrox_kv.store``
  (which the core never imports);
* ``_pool_class.pxi``: ``KvBlockPool`` and ``KvPoolExhausted``;
* ``_cache.pxi``: the C rows of a cache (where rows live, copies, claiming
  a cache for one call) and the reservation of pooled caches;
* ``_window.pxi``: sliding-window caches (the blocks a window gave back);
* ``_cache_class.pxi``: ``KvCache``;
* ``_batch.pxi``: calls over several caches at once (the write path,
  ``push_layers``, forks and reorders of a batch);
* ``_attend.pxi``: attention read in place (the kernel is ``_attn.h``);
* ``_testing.pxi``: test and benchmark hooks.

Locking rules (see docs/usage.md, "Thread safety"):

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
from libc.stdint cimport int32_t, uint16_t, uint64_t, INT32_MAX
from libc.stdlib cimport malloc, calloc, realloc, free
from libc.string cimport memcmp, memcpy, memmove, memset
from posix.unistd cimport usleep

cimport numpy as cnp
import os
import sys
import threading
import types

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


include "_args.pxi"
include "_pool.pxi"
include "_check.pxi"
include "_prefix.pxi"
include "_prefix_io.pxi"
include "_pool_class.pxi"
include "_cache.pxi"
include "_window.pxi"
include "_cache_class.pxi"
include "_batch.pxi"
include "_attend.pxi"
include "_testing.pxi"
