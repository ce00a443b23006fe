"""``FerroxCache``: a Hugging Face transformers ``Cache`` backed by ferrox_kv,
and ``"ferrox"``: an attention implementation that reads it in place.

    import ferrox_kv.hf                       # registers the "ferrox" attention
    from ferrox_kv.hf import FerroxCache

    model.set_attn_implementation("ferrox")   # the one line: attend in place
    with FerroxCache(model.config, pool=pool, max_seq_len=512) as cache:
        out = model.generate(**inputs, cache=cache, max_new_tokens=64)

Needs ``torch`` and ``transformers`` 5 (``pip install '.[hf]'``); the
rest of ferrox_kv never imports this package (``ferrox_kv.serve`` aside,
which uses its public names only).

Modules, as transformers splits ``integrations/sdpa_attention.py`` from
``cache_utils.py``: ``attention`` (the "ferrox" attention, its masks, and
``PackedAttention``: the hook of a layer that attends packed sequences
itself), ``cache`` (``FerroxLayer``, ``FerroxCache``, ``kv_geometry``,
``fingerprint``), ``packed`` (``PackedCache``: the sequences of one
continuous-batching step packed in batch 1, on the same layer base).

Layout. One ferrox_kv ``KvCache`` per layer and per sequence of the batch.
transformers hands each layer K/V shaped ``(batch, heads, T, head_dim)``; they
are stored as rows (``(T, heads, head_dim)`` per sequence) of the cache's
``dtype``: by default (``dtype="auto"``) the dtype the model runs in, so a
bf16 model's cache holds bfloat16 (the bytes of DynamicCache), or an explicit
``"float32"`` / ``"float16"`` / ``"bfloat16"`` / ``"int8"`` (or torch dtype).

Attention. With ``attn_implementation="ferrox"`` a layer's ``update`` stores
the new rows and hands the layer to the attention function (through the
kwargs dict that transformers passes from ``update`` on to attention); the
function runs ``attend_many`` over the layer's caches, reading contiguous
buffers or the pool's blocks in place: no gather, no ``torch.cat``, no
``repeat_kv``. The mask function registered under the same name hands each
layer what mask creation was given: the 2D padding the kernel reads
(positions before a sequence's first real token are never attended) and the
arguments of ``sdpa_mask``. A sliding window (Mistral) is applied by the
kernel. The function runs torch's SDPA instead, with exactly the mask "sdpa"
would get (so it is "sdpa" there, for every cache transformers ships), when
the layer's cache is not a FerroxCache (``use_cache=False``, DynamicCache,
StaticCache, QuantizedCache), for a custom 4D mask (as given), for a mask
that is not plain causal plus left padding and the window (overlaid masks,
chunked or bidirectional attention), for a prefill of at least
``SDPA_PREFILL_MIN`` positions into an empty cache (SDPA's matrix products
are faster there), and with dropout.

Copies, said plainly:

* in: bf16 / fp16 / fp32 K/V are read in place on the CPU (after moving them
  there and making them ``(T, heads, head_dim)``-contiguous, which is a copy
  unless T is 1) and converted to the storage dtype inside the copy loop: no
  float32 detour; other dtypes are converted to float32 first;
* attention "ferrox": only the queries (to float32) and the output (back to
  the model's dtype and device) are copied;
* any other attention implementation: every step hands the whole K/V to
  attention: zero-copy views of a contiguous cache with batch 1, else
  stacked or gathered from the blocks (a copy), converted to the model's
  dtype and device. FerroxCache warns about it once per process.
* ``cache.layers[i].keys`` / ``.values`` (as DynamicCache's: ``(batch,
  kv_heads, seq_len, head_dim)``, the model's dtype) are made the same way
  at each access: zero-copy for a contiguous float32 CPU cache of batch 1,
  else a copy.

Sliding-window layers (``layer_types`` entries ``"sliding_attention"``, or
every layer of a config with ``sliding_window`` and no ``layer_types``) get
windowed caches (``KvCache`` ``window=``): they keep what the window still
reads and give the rest back, so a Gemma 3 sequence holds its five sliding
layers' windows and only its full layers' whole length.
``FerroxCache(..., sliding_windows=False)`` stores them whole (prefix reuse,
``tokens=``, needs that). Models with non-attention layers (linear
attention, state-space) are refused with ``ValueError``.

Reservation. With a pool, the blocks for ``max_seq_len`` positions of every
layer of ``batch_size`` sequences are taken at construction in one
acquisition, all or none (``KvPoolExhausted``, pool untouched). A larger batch
later (beam search, ``num_return_sequences``) shares the full blocks of the
sequence it copies and reserves the rest for each new sequence, or raises.
Blocks go back at ``close()``, at the end of a ``with`` block, or when the
cache is garbage-collected. A step that needs more positions than a pooled
cache reserved warns once (at that step: transformers has no public API
that tells a cache ahead how many positions ``generate`` will ask for);
growing past the reservation takes free blocks of the pool, and when there
are none ``KvPoolExhausted`` says so.

No config. ``FerroxCache()`` (contiguous caches only) takes the geometry and
the layers from the K/V of the first step, as ``DynamicCache()`` does; that
step hands the incoming K/V to whichever attention runs, and "ferrox" reads in
place from the next one.
"""
from __future__ import annotations

try:
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from transformers.cache_utils import Cache, CacheLayerMixin  # noqa: F401
except ImportError as e:
    raise ImportError(
        "ferrox_kv.hf needs torch and transformers 5: pip install '.[hf]' from the ferrox_kv "
        f"checkout (on Linux take torch's CPU build from PyTorch's CPU wheel index first); {e}") from e

from ferrox_kv.hf.attention import (
    ATTENTION,
    COMPILE_REFUSED,
    SDPA_PREFILL_MIN,
    FerroxCompileError,
    PackedAttention,
    ferrox_attention,
)
from ferrox_kv.hf.cache import FerroxCache, FerroxLayer, fingerprint, kv_geometry, layer_windows
from ferrox_kv.hf.packed import PackedCache, PackedLayer

__all__ = ["ATTENTION", "COMPILE_REFUSED", "SDPA_PREFILL_MIN", "FerroxCache",
           "FerroxCompileError", "FerroxLayer", "PackedAttention", "PackedCache", "PackedLayer",
           "ferrox_attention", "fingerprint", "kv_geometry", "layer_windows"]
