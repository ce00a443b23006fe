"""ferrox_kv: the key/value cache of transformer inference, for Python.

One ``KvCache`` per sequence and layer, and one bounded ``KvBlockPool`` per
process that request threads share (paged, PagedAttention-style allocation
with admission control). The core is Cython over raw ``float*``; copies run
without the GIL where that pays.
"""
from ferrox_kv._core import (
    KvBlockPool,
    KvCache,
    KvPoolExhausted,
    attend_gil_release_threshold,
    attend_many,
    gil_release_threshold,
    push_layers,
    set_attend_gil_release_threshold,
    set_gil_release_threshold,
    simd_path,
)

__version__ = "0.1.0"

__all__ = [
    "KvBlockPool",
    "KvCache",
    "KvPoolExhausted",
    "attend_gil_release_threshold",
    "attend_many",
    "gil_release_threshold",
    "push_layers",
    "set_attend_gil_release_threshold",
    "set_gil_release_threshold",
    "simd_path",
    "__version__",
]
