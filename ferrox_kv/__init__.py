"""ferrox_kv: the key/value cache of transformer inference, for Python.

One ``KvCache`` per sequence and layer, and one bounded ``KvBlockPool`` per
process that request threads share (paged, PagedAttention-style allocation
with admission control), storing K/V as float32, float16, bfloat16 or int8
with scales (``dtype=``). The core is Cython over raw rows; copies (and the
conversions into the storage dtype) run without the GIL where that pays.
"""
import os as _os

try:
    import ferrox_kv._core  # noqa: F401  (the compiled core)
except ModuleNotFoundError as _e:
    if _e.name != "ferrox_kv._core":
        raise
    raise ImportError(
        f"ferrox_kv is being imported from {_os.path.dirname(_os.path.abspath(__file__))}, "
        "a source tree whose compiled core (ferrox_kv._core) is not built. python -m and "
        "python -m pytest put the current directory first on sys.path: run them from "
        "outside the checkout, use the installed `ferrox-kv` command or plain `pytest`, or "
        "build in place with `python setup.py build_ext --inplace`.") from None

from ferrox_kv._core import (
    DTYPES,
    KvBlockPool,
    KvCache,
    KvPoolExhausted,
    attend_gil_release_threshold,
    attend_many,
    build_info,
    get_num_threads,
    gil_release_threshold,
    push_layers,
    set_attend_gil_release_threshold,
    set_gil_release_threshold,
    set_num_threads,
    simd_path,
)



class _StoreFiles:
    """What ``KvBlockPool.save_prefixes`` / ``load_prefixes`` and
    ``KvCache.save`` / ``load`` forward to: ``ferrox_kv.store``, imported when
    first used (it needs xxhash). The core never imports the store; the
    package connects the two here."""

    @staticmethod
    def save_prefixes(pool, path, **kw):
        from ferrox_kv.store import save_prefixes
        return save_prefixes(pool, path, **kw)

    @staticmethod
    def load_prefixes(pool, path, **kw):
        from ferrox_kv.store import load_prefixes
        return load_prefixes(pool, path, **kw)

    @staticmethod
    def save_cache(cache, path, **kw):
        from ferrox_kv.store import save_cache
        return save_cache(cache, path, **kw)

    @staticmethod
    def load_cache(path, **kw):
        from ferrox_kv.store import load_cache
        return load_cache(path, **kw)


ferrox_kv._core._set_store_files(_StoreFiles)

__version__ = "0.1.0"

__all__ = [
    "DTYPES",
    "KvBlockPool",
    "KvCache",
    "KvPoolExhausted",
    "attend_gil_release_threshold",
    "attend_many",
    "build_info",
    "get_num_threads",
    "gil_release_threshold",
    "push_layers",
    "set_attend_gil_release_threshold",
    "set_gil_release_threshold",
    "set_num_threads",
    "simd_path",
    "__version__",
]

from ferrox_kv import _threadpoolctl  # noqa: E402  (after the core's check above)

_threadpoolctl.install()  # threadpoolctl sees the worker pool (no import of it here)
