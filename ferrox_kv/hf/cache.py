"""``FerroxCache`` and its ``FerroxLayer``: a transformers ``Cache`` whose K/V
live in ferrox_kv caches, as transformers' ``cache_utils.py`` holds
DynamicCache (the package docstring says how it stores, reserves and
copies); ``kv_geometry`` and ``fingerprint`` of a model; ``_SeqsLayer``, the
layer base that ``ferrox_kv.hf.packed`` builds on too.
"""
from __future__ import annotations

import warnings
import weakref

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ferrox_kv import DTYPES, KvBlockPool, KvCache, KvPoolExhausted
from ferrox_kv._core import _assign, _dtype_name, _extend_each
from ferrox_kv.hf.attention import ATTENTION, _refuse_compile

__all__ = ["FerroxCache", "FerroxLayer", "fingerprint", "kv_geometry"]

_warned = False


def kv_geometry(config):
    """(num_layers, n_kv_heads, head_dim) of a transformers config."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    n_heads = cfg.num_attention_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    return cfg.num_hidden_layers, int(n_kv), int(head_dim)


def layer_windows(config, n_layers=None):
    """Each layer's sliding window, or None for a layer that attends to every
    position: ``sliding_window`` for the layers whose ``layer_types`` entry
    is ``"sliding_attention"`` (Gemma 2/3, gpt-oss, Qwen2 with
    ``use_sliding_window``), for every layer when the config has a
    ``sliding_window`` and no ``layer_types`` (Mistral), else None."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    n = cfg.num_hidden_layers if n_layers is None else n_layers
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if not window:
        return [None] * n
    if types is None:
        return [int(window)] * n
    return [int(window) if t == "sliding_attention" else None for t in types[:n]]


_STORAGE = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _storage_dtype(dtype) -> str:
    """A FerroxCache ``dtype=`` (not "auto") as a storage dtype name: a name
    ferrox_kv stores, or a torch dtype of one (``torch.int8`` included)."""
    try:
        return str(_dtype_name(dtype))          # the core's reading: one rule for every API
    except (TypeError, ValueError):
        raise ValueError(f"dtype={dtype!r}: FerroxCache stores 'auto' (the model's dtype), "
                         f"{', '.join(map(repr, DTYPES))} or the numpy / torch dtypes of "
                         "those") from None


def _model_storage(dtype) -> str:
    """What dtype="auto" stores for a model running in ``dtype``."""
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return _STORAGE.get(dtype, "float32")


def _rows(states):
    """(B, H, T, D) K or V states as (B, T, H, D) rows on the CPU the core
    reads in place: the tensor itself for float32 / float16 / bfloat16 (a
    float32 one as a numpy view), else converted to float32."""
    x = states.detach()
    if x.dtype not in _STORAGE:
        x = x.to(torch.float32)
    x = x.to("cpu").transpose(1, 2).contiguous()
    return x.numpy() if x.dtype == torch.float32 else x


def _ids(tokens):
    """Token ids as a 1-D numpy array (a torch tensor is read in place)."""
    if isinstance(tokens, torch.Tensor):
        return tokens.detach().cpu().reshape(-1).numpy()
    return np.asarray(tokens).reshape(-1)


def _check_states(key_states, value_states):
    """(batch, heads, positions, key head_dim, value head_dim) of K/V handed
    to ``update``, or ``ValueError`` naming what is wrong."""
    if key_states.dim() != 4 or value_states.dim() != 4:
        raise ValueError("update takes key_states and value_states shaped (batch, heads, "
                         f"T, head_dim); got {tuple(key_states.shape)} and "
                         f"{tuple(value_states.shape)}")
    kb, kh, kt, kd = key_states.shape
    vb, vh, vt, vd = value_states.shape
    if (kb, kh, kt) != (vb, vh, vt):
        raise ValueError(f"key_states {tuple(key_states.shape)} and value_states "
                         f"{tuple(value_states.shape)} differ in batch, heads or positions")
    return kb, kh, kt, kd, vd


def _order(beam_idx, n):
    order = [int(i) for i in (beam_idx.tolist() if hasattr(beam_idx, "tolist") else beam_idx)]
    if len(order) != n:
        raise ValueError(f"beam_idx has {len(order)} entries for {n} sequences")
    if any(i < 0 or i >= n for i in order):
        raise ValueError(f"beam_idx {order} out of range for {n} sequences")
    return order


# ---------------------------------------------------------------------------
# The layers
# ---------------------------------------------------------------------------

class _SeqsLayer(CacheLayerMixin):
    """The base of ferrox_kv's cache layers: model layer ``layer_idx`` of
    several sequences, one ``KvCache`` each (``seqs``), whose K/V the
    "ferrox" attention reads in place. Not compileable; not sliding unless a
    ``FerroxLayer`` holds windowed caches."""

    is_compileable = False
    is_sliding = False
    sliding_window = None

    def __init__(self, layer_idx: int, seqs=()):
        super().__init__()
        self.layer_idx = layer_idx
        self.seqs: list[KvCache] = list(seqs)

    def _to_attention(self, kwargs, key_states):
        """Hand this layer to the "ferrox" attention (through the kwargs that
        transformers passes from ``update`` on to attention) and return the
        K/V placeholders ``update`` gives back: no positions, since the
        attention reads the caches instead."""
        kwargs["ferrox_layer"] = self
        b, h, _, d = key_states.shape
        empty = key_states.new_empty((b, h, 0, d))
        return empty, empty

    def get_seq_length(self) -> int:
        return self.seqs[0].seq_len if self.seqs else 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def offload(self):
        pass

    def prefetch(self):
        pass


class FerroxLayer(_SeqsLayer):
    """One model layer: one ``KvCache`` per sequence of the batch."""

    is_croppable = True

    def __init__(self, owner: "FerroxCache", layer_idx: int, window=None):
        super().__init__(layer_idx)
        self._owner_ref = weakref.ref(owner)     # no cycle: dropping the cache frees blocks
        self.dtype = None
        self.device = None
        # a sliding layer's caches keep only its window (KvCache window=); as
        # DynamicSlidingWindowLayer, it tells mask creation which positions
        # the K/V it hands over start at (_offset: those of the last update)
        self.sliding_window = window
        self.is_sliding = window is not None
        self._offset = 0

    def _window_start(self, length) -> int:
        """The first position a step at ``length`` positions reads (0 for a
        full layer): DynamicSlidingWindowLayer's ``kv_offset``."""
        return max(0, length - self.sliding_window + 1) if self.is_sliding else 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        length = self.get_seq_length()
        offset = self._window_start(length)
        return length + query_length - offset, offset

    @property
    def _owner(self) -> "FerroxCache":
        return self._owner_ref()

    @property
    def keys(self):
        """K as DynamicCache holds it: ``(batch, kv_heads, seq_len, head_dim)``
        in the model's dtype and device (a sliding layer: its last
        ``sliding_window - 1`` positions, as DynamicSlidingWindowLayer's);
        None before the first update. A
        zero-copy view of a contiguous CPU cache of batch 1 that stores the
        model's dtype, float32 or float16 (it shows
        the buffer at the time of access: rows written later into a new buffer
        do not show); otherwise a copy gathered at each access (pooled blocks,
        batch > 1, bfloat16 or int8 storage, another dtype or device). Read it, do not write it: writes
        into a view bypass the cache."""
        return (self._tensor(False, self._window_start(self.get_seq_length()))
                if self.is_initialized and self.seqs else None)

    @keys.setter
    def keys(self, value):
        if value is not None:
            raise AttributeError("FerroxLayer.keys is read from its caches; write through update()")

    @property
    def values(self):
        """V, as ``keys``."""
        return (self._tensor(True, self._window_start(self.get_seq_length()))
                if self.is_initialized and self.seqs else None)

    @values.setter
    def values(self, value):
        if value is not None:
            raise AttributeError("FerroxLayer.values is read from its caches; write through update()")

    def lazy_initialization(self, key_states, value_states):
        self.dtype = key_states.dtype
        self.device = key_states.device
        self.is_initialized = True

    # -- the hot path ---------------------------------------------------------

    def update(self, key_states, value_states, *args, kwargs=None, **extra):
        owner = self._owner
        owner._check_open()
        kb, kh, kt, kd, vd = _check_states(key_states, value_states)
        if (kh, kd, vd) != (owner.n_kv_heads, owner.head_dim, owner.head_dim):
            raise ValueError(f"key/value states have {kh} heads of {kd}/{vd}; this cache holds "
                             f"{owner.n_kv_heads} heads of {owner.head_dim}")
        if kb < len(self.seqs):
            raise ValueError(f"update got a batch of {kb} for a cache holding {len(self.seqs)} "
                             "sequences; use batch_select_indices to shrink it first")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        had = owner.batch_size
        was_empty = self.get_seq_length() == 0
        if kb > had:
            owner._ensure_batch(kb)
        if was_empty and self.layer_idx == 0:
            owner._settle_auto_dtype(key_states.dtype)
        # (B, H, T, D) -> (B, T, H, D) on the CPU, in the model's dtype; no
        # copy for one CPU token, whose (H, 1, D) rows are already (1, H, D).
        kn = _rows(key_states)
        vn = _rows(value_states)
        before = self.get_seq_length()
        self._offset = self._window_start(before)
        owner._warn_past_reservation(before + kt)
        try:
            _extend_each(self.seqs, kn, vn)        # every sequence or none
        except BaseException as e:
            if kb > had:
                owner._shrink_batch(had)
            owner._roll_back(self.layer_idx, before, kt)
            if isinstance(e, KvPoolExhausted) and owner._past_reservation(before + kt):
                raise owner._reservation_error(before + kt, e) from e
            raise
        # without a config the first step cannot tell which attention runs:
        # it hands back the incoming K/V, and "ferrox" adopts its module's config
        if kwargs is not None and (owner._reads_in_place() or (owner.config is None and was_empty)):
            placeholders = self._to_attention(kwargs, key_states)
            if was_empty:
                return key_states, value_states    # the whole K/V: SDPA may prefill on it
            return placeholders
        owner._warn_gathering()
        return self._gather()

    def _gather(self):
        """The K/V the last update's attention reads: every position, or a
        sliding layer's from its window (what ``get_mask_sizes`` said)."""
        return self._tensor(False, self._offset), self._tensor(True, self._offset)

    def _tensor(self, want_v, start=0):
        """K (or V) of every sequence from position ``start`` as ``(batch,
        heads, positions, head_dim)`` in the model's dtype and device:
        zero-copy for one contiguous CPU cache storing the model's dtype
        (float32 or float16), else a copy."""
        rows = []
        for cache in self.seqs:
            if cache.is_pooled or cache.dtype in ("bfloat16", "int8"):
                a = cache.v if want_v else cache.k     # a fresh copy: gathered, or float32 values
                a.setflags(write=True)                 # it owns its memory; torch wants it writable
            else:
                a = cache._views()[want_v]             # zero-copy (float32 or float16)
            a = a[start - cache.first_pos:]            # rows held start at first_pos
            rows.append(torch.from_numpy(a).permute(1, 0, 2))   # (H, S, D) view
        t = rows[0].unsqueeze(0) if len(rows) == 1 else torch.stack(rows)
        if self.dtype is not None and t.dtype != self.dtype:
            t = t.to(self.dtype)
        if self.device is not None and self.device.type != "cpu":
            t = t.to(self.device)
        return t

    # -- what transformers asks of a layer -----------------------------------

    def reset(self) -> None:
        for cache in self.seqs:
            cache.clear()                     # keeps capacity and reserved blocks

    def crop(self, tokens_to_remove: int) -> None:
        """``crop(-n)`` drops the last n positions (assisted / prompt-lookup
        decoding rejects drafts this way): ``KvCache.truncate``."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"Calling `crop` with a positive value (`{tokens_to_remove}`) is not supported. "
                "Please use a negative integer to remove that number of tokens from the cache instead.")
        if tokens_to_remove == 0:
            return
        new_len = max(0, self.get_seq_length() + tokens_to_remove)
        for cache in self.seqs:
            cache.truncate(new_len)

    def reorder_cache(self, beam_idx) -> None:
        """This layer's sequences reordered (beam search);
        ``FerroxCache.reorder_cache`` does every layer in one step."""
        self._owner._reorder_layers([self], _order(beam_idx, len(self.seqs)))


class FerroxCache(Cache):
    """A transformers ``Cache`` whose K/V live in ferrox_kv caches.

    ``FerroxCache(config=None, pool=None, max_seq_len=None, batch_size=1, *,
    tokens=None, salt=None, dtype="auto")``

    * ``dtype``: the storage. ``"auto"`` stores K/V in the dtype the model
      hands them in (bf16 model: bfloat16, fp16: float16, float32: float32;
      read from ``config.dtype`` and settled at the first ``update``), or a
      pool's dtype when a pool is given. ``"float32"``, ``"float16"``,
      ``"bfloat16"``, ``"int8"`` (or their torch dtypes) choose it whatever
      the model runs in; with a pool it must be the pool's (``ValueError``).

    * ``config``: the model's config (``model.config``, not the model).
      Without it (no pool then) the geometry and the layers come from the
      first ``update``, as for ``DynamicCache()``.

    * ``pool``: a ``KvBlockPool`` whose geometry matches the model's
      ``(num_key_value_heads, head_dim)``; every layer of every sequence then
      draws its blocks from it, reserving ``max_seq_len`` positions up front
      (``max_seq_len`` is required with a pool; ``generate`` asked for more
      warns, and past it the cache takes free blocks or raises
      ``KvPoolExhausted`` naming the reservation).
    * without a pool: contiguous caches, pre-allocated to ``max_seq_len`` when
      given (``KvCache.with_capacity``), else growing geometrically.
    * ``tokens`` (batch 1, a pool with ``prefix_cache=True``): the prompt's
      token ids. The cache starts holding the longest prefix of them that
      was published under ``salt`` (whole blocks, at most ``len(tokens) -
      1``), shared with whoever published it; pass the whole prompt to
      ``generate``, which feeds only the positions the cache lacks.
      ``publish(token_ids)`` after generating makes this conversation's
      blocks reusable by the next turn.

    Pass it to ``model.generate(..., cache=cache)`` (or the deprecated
    ``past_key_values=``), on a model with ``attn_implementation="ferrox"``
    to read the cache in place. ``cache.layers[i].keys`` / ``.values`` are
    DynamicCache's tensors (see ``FerroxLayer.keys`` for when they are
    copies). Call ``close()`` (or use ``with``) to give the
    blocks back as soon as the request is done; it is final.
    """

    # layers whose state is K/V rows; others (linear attention, recurrent,
    # compressed) keep state a KvCache cannot hold
    ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")

    def __init__(self, config=None, pool: KvBlockPool | None = None, max_seq_len: int | None = None,
                 batch_size: int = 1, *, tokens=None, salt=None, dtype="auto",
                 sliding_windows: bool = True):
        if isinstance(config, torch.nn.Module):
            raise TypeError("FerroxCache takes the model's config, not the model: "
                            "FerroxCache(model.config, ...)")
        if config is None:
            if pool is not None:
                raise ValueError("a pool reserves every layer's blocks at construction, which needs "
                                 "the model's geometry: FerroxCache(model.config, pool=pool, "
                                 "max_seq_len=...)")
            n_layers, n_kv, head_dim = 0, None, None      # taken from the first update
        else:
            try:
                n_layers, n_kv, head_dim = kv_geometry(config)
            except AttributeError as e:
                raise TypeError(f"FerroxCache takes a transformers config (model.config); this "
                                f"{type(config).__name__} has no {e.name!r}") from e
            text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
            odd = sorted({t for t in (getattr(text, "layer_types", None) or [])
                          if t not in self.ATTENTION_LAYER_TYPES})
            if odd:
                raise ValueError(f"FerroxCache holds attention K/V only; this model has {odd} layers")
        windows = layer_windows(config, n_layers) if sliding_windows and config is not None else []
        if pool is not None:
            if max_seq_len is None:
                raise ValueError("max_seq_len is required with a pool: it is what gets reserved")
            if (pool.n_kv_heads, pool.head_dim, pool.v_head_dim) != (n_kv, head_dim, head_dim):
                raise ValueError(
                    f"pool geometry (n_kv_heads={pool.n_kv_heads}, head_dim={pool.head_dim}) "
                    f"does not match the model's (num_key_value_heads={n_kv}, head_dim={head_dim})")
        self._auto = isinstance(dtype, str) and dtype == "auto"
        if self._auto:
            self.dtype = pool.dtype if pool is not None else _model_storage(
                getattr(config, "dtype", None) or getattr(config, "torch_dtype", None))
        else:
            self.dtype = _storage_dtype(dtype)
            if pool is not None and pool.dtype != self.dtype:
                raise ValueError(f"dtype={self.dtype!r} does not match the pool's dtype "
                                 f"{pool.dtype!r}: a pooled FerroxCache stores what its pool "
                                 "stores (leave dtype='auto' to take the pool's)")
        if max_seq_len is not None and max_seq_len < 0:
            raise ValueError(f"max_seq_len must be >= 0, got {max_seq_len}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if tokens is not None:
            if batch_size != 1:
                raise ValueError("tokens= (prefix reuse) is for a batch of 1; "
                                 f"got batch_size={batch_size}")
            if pool is None:
                raise ValueError("tokens= needs a pool with a prefix cache: "
                                 "KvBlockPool(..., prefix_cache=True)")
            if any(w is not None for w in windows):
                raise ValueError(
                    "tokens= (prefix reuse) needs every layer to hold its whole sequence; this "
                    "model has sliding-window layers, whose caches give their blocks back. "
                    "Pass sliding_windows=False to store them whole and reuse prefixes")
            tokens = _ids(tokens)
        self._tokens = tokens
        self.salt = salt
        self._closed = False
        self._lazy = config is None                   # layers appear as update reaches them
        self._batch0 = batch_size
        self._warned_reservation = False
        self.config = config
        self.pool = pool
        self.max_seq_len = max_seq_len
        self.n_kv_heads = n_kv
        self.head_dim = head_dim
        super().__init__(layers=[FerroxLayer(self, i, windows[i] if windows else None)
                                 for i in range(n_layers)])
        self._ensure_batch(batch_size)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """As ``Cache.update``; a cache made without a config first takes its
        geometry and layers from the K/V it is given (as ``DynamicCache()``).
        Under torch.compile it raises ``FerroxCompileError`` (see the README,
        "With transformers")."""
        _refuse_compile()
        added, geometry = [], self.n_kv_heads is None
        if self._lazy and layer_idx >= len(self.layers):
            self._check_open()
            if geometry:
                _, kh, _, kd, vd = _check_states(key_states, value_states)
                if kd != vd:
                    raise ValueError(f"FerroxCache holds K and V of one head_dim; got {kd} and {vd}")
                self.n_kv_heads, self.head_dim = int(kh), int(kd)
            try:
                while len(self.layers) <= layer_idx:
                    layer = FerroxLayer(self, len(self.layers))
                    layer.seqs = self._new_caches(self.batch_size if self.layers else self._batch0,
                                                  [layer])
                    self.layers.append(layer)
                    added.append(layer)
            except BaseException:
                self._drop_layers(added, geometry)
                raise
        try:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        except BaseException:
            self._drop_layers(added, geometry)
            raise

    def _drop_layers(self, added, geometry):
        """Undo what ``update`` added before it failed."""
        for layer in added:
            for cache in layer.seqs:
                cache.close()
            self.layers.remove(layer)
        if geometry and not self.layers:
            self.n_kv_heads = self.head_dim = None

    def _adopt_config(self, config):
        """A cache made without a config takes the model's from its attention
        module, so that the next steps know the attention reads in place."""
        if config is not None and self.config is None:
            self.config = config

    def _past_reservation(self, positions) -> bool:
        return self.pool is not None and self.max_seq_len is not None and positions > self.max_seq_len

    def _reservation_error(self, positions, e):
        err = KvPoolExhausted(e.requested, e.free)
        err.args = (f"FerroxCache grew past its reservation of {self.max_seq_len} positions per "
                    f"sequence (this step needs {positions}) and the pool has no free block for the "
                    f"rest ({e}); make max_seq_len at least the prompt plus max_new_tokens",)
        return err

    def _warn_past_reservation(self, positions) -> None:
        """A pooled cache whose step needs more positions than it reserved
        warns, once: transformers has no public API that tells a cache how
        many positions ``generate`` will ask for, so the warning comes at
        the first step past the reservation, before its blocks are taken."""
        if self._past_reservation(positions) and not self._warned_reservation:
            self._warned_reservation = True
            warnings.warn(
                f"a step needs {positions} positions per sequence of a FerroxCache that "
                f"reserved {self.max_seq_len} (max_seq_len); past that it takes free blocks of the "
                "pool if there are any and raises KvPoolExhausted if not: make max_seq_len at least "
                "the prompt plus max_new_tokens", stacklevel=4)

    def _reads_in_place(self) -> bool:
        """Whether the model runs the "ferrox" attention (read at each step:
        ``set_attn_implementation`` may switch it)."""
        return getattr(self.config, "_attn_implementation", None) == ATTENTION

    def _warn_gathering(self):
        global _warned
        if not _warned:
            _warned = True
            impl = getattr(self.config, "_attn_implementation", "unknown (no config)")
            warnings.warn(
                f"FerroxCache: the model's attention implementation is {impl!r}, so every step "
                "hands it the whole K/V (gathered from the pool's blocks when pooled); "
                f"model.set_attn_implementation({ATTENTION!r}) reads the cache in place",
                stacklevel=3)

    def _new_caches(self, count, layers, dtype=None):
        """``count`` caches for each of ``layers``, layer after layer: pooled
        (all reserved, or none: ``KvPoolExhausted``, pool untouched),
        pre-allocated to ``max_seq_len``, or growing; a sliding layer's keep
        its window (``KvCache`` ``window=``)."""
        dtype = self.dtype if dtype is None else dtype
        if self.pool is None:
            return [self._contiguous(layer.sliding_window, dtype)
                    for layer in layers for _ in range(count)]
        h, d, pool = self.n_kv_heads, self.head_dim, self.pool
        tokens, self._tokens = self._tokens, None          # the first sequence only
        windows = [layer.sliding_window for layer in layers for _ in range(count)]
        # one acquisition for every layer, whatever its window: all or none
        return KvCache.with_pool_many(count * len(layers), h, d, pool, self.max_seq_len,
                                      tokens=tokens, window=windows,
                                      salt=self.salt if tokens is not None else None)

    def _contiguous(self, window, dtype):
        if window is not None:
            return KvCache(self.n_kv_heads, self.head_dim, dtype=dtype, window=window)
        if self.max_seq_len is not None:
            return KvCache.with_capacity(self.n_kv_heads, self.head_dim, self.max_seq_len,
                                         dtype=dtype)
        return KvCache(self.n_kv_heads, self.head_dim, dtype=dtype)

    def _settle_auto_dtype(self, model_dtype) -> None:
        """dtype="auto" without a pool: the first update shows the dtype the
        model really runs in (its config may not say); the still-empty
        caches are remade in that storage dtype."""
        want = _model_storage(model_dtype)
        if not self._auto or self.pool is not None or want == self.dtype:
            return
        if any(c.seq_len for layer in self.layers for c in layer.seqs):
            return
        batch = self.batch_size
        fresh = self._new_caches(batch, self.layers, want)
        self.dtype = want
        for i, layer in enumerate(self.layers):
            for c in layer.seqs:
                c.close()
            layer.seqs = fresh[i * batch:(i + 1) * batch]

    def _check_open(self):
        if self._closed:
            raise ValueError("FerroxCache is closed")

    def _roll_back(self, failed_layer: int, length: int, added: int) -> None:
        """A forward step's update failed at ``failed_layer``: the layers it
        already extended (those before it, holding ``length + added``
        positions) go back to ``length``, so that every layer holds the same
        positions and the step can be retried."""
        for layer in self.layers[:failed_layer]:
            if layer.get_seq_length() == length + added:
                for cache in layer.seqs:
                    cache.truncate(length)

    def _reorder_layers(self, layers, order):
        """Sequence b of every given layer takes the rows of its sequence
        order[b] (b < len(order); the rest stay), all layers at once, all or
        nothing. Pooled: the full blocks are shared, not copied."""
        self._check_open()
        n = len(layers[0].seqs) if layers else 0
        flat = [c for layer in layers for c in layer.seqs]
        sources = [li * n + (order[b] if b < len(order) else b)
                   for li in range(len(layers)) for b in range(n)]
        _assign(flat, sources)

    def _ensure_batch(self, batch: int) -> None:
        """Grow every layer to ``batch`` sequences: all layers or none. A batch
        that grows mid-sequence starts as copies of sequence 0 (sharing its
        full blocks when pooled)."""
        self._check_open()
        have = self.batch_size
        if batch <= have:
            return
        if have == 0:
            fresh = self._new_caches(batch, self.layers)  # raises before any change
            for i, layer in enumerate(self.layers):
                layer.seqs = fresh[i * batch:(i + 1) * batch]
            return
        self._grow_from(lambda b: 0, batch)

    def _grow_from(self, source, batch):
        """Every layer grows to ``batch`` sequences, sequence b (old or new)
        taking the rows of old sequence ``source(b)``; all or nothing."""
        have = self.batch_size
        new = [layer.seqs[0]._blank(batch - have) for layer in self.layers]
        flat, sources = [], []
        for li, layer in enumerate(self.layers):
            base = len(flat)
            flat += layer.seqs + new[li]
            sources += [base + source(b) for b in range(batch)]
        try:
            _assign(flat, sources)
        except BaseException:
            for caches in new:
                for c in caches:
                    c.close()
            raise
        for li, layer in enumerate(self.layers):
            layer.seqs = layer.seqs + new[li]

    def _shrink_batch(self, batch: int) -> None:
        for layer in self.layers:
            for cache in layer.seqs[batch:]:
                cache.close()
            del layer.seqs[batch:]

    def reorder_cache(self, beam_idx) -> None:
        """Sequence b takes the rows of sequence beam_idx[b] (beam search), in
        every layer at once, all or nothing; pooled sequences share the full
        blocks instead of copying them."""
        self._check_open()
        self._reorder_layers(self.layers, _order(beam_idx, self.batch_size))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every sequence ``repeats`` times (sequence b -> b*repeats ..
        b*repeats + repeats - 1), in every layer at once; pooled copies share
        the full blocks and reserve their own plan (``KvPoolExhausted`` with
        nothing changed when the pool cannot)."""
        self._check_open()
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        if repeats > 1 and self.batch_size:
            self._grow_from(lambda b: b // repeats, self.batch_size * repeats)

    def batch_select_indices(self, indices) -> None:
        """Keep the sequences ``indices`` selects, in that order, in every
        layer at once, as DynamicCache does (torch indexing of the batch): an
        index tensor or list (negative indices count from the end; a repeated
        index copies that sequence, sharing its full blocks), a boolean mask
        of one entry per sequence (it selects, it is not indices), or a slice.
        The blocks of the dropped sequences go back to the pool; new copies
        reserve their plan, or ``KvPoolExhausted`` with nothing changed."""
        self._check_open()
        have = self.batch_size
        if not isinstance(indices, slice):
            indices = torch.as_tensor(indices, device="cpu")
            if indices.numel() == 0:
                indices = indices.to(torch.long)
            if indices.dtype != torch.bool and (indices.is_floating_point() or indices.is_complex()):
                raise TypeError(f"batch_select_indices takes integer indices or a boolean mask, "
                                f"got {indices.dtype}")
            if indices.dim() != 1:
                raise ValueError("batch_select_indices takes one dimension (indices, or a boolean "
                                 f"mask of one entry per sequence); got shape {tuple(indices.shape)}")
        try:
            keep = torch.arange(have)[indices].tolist()
        except IndexError as e:
            raise IndexError(f"batch_select_indices: indices out of range for a cache of {have} "
                             f"sequences ({e})") from e
        if not keep:
            raise ValueError("batch_select_indices would keep no sequence; close() the cache instead")
        if len(keep) <= have:
            self._reorder_layers(self.layers, keep)
            self._shrink_batch(len(keep))
        else:
            self._grow_from(lambda b: keep[b], len(keep))

    def publish(self, token_ids) -> int:
        """Publish what this cache computed (batch 1): ``token_ids`` are the
        ids of the positions it holds, prompt and generated; the output of
        ``generate`` (one id more, the last sampled token, which has no K/V
        yet) is accepted too. The next request whose prompt starts with them
        (same ``salt``) reuses the blocks. Returns the positions published."""
        self._check_open()
        if self.pool is None:
            raise ValueError("publish needs a pool with a prefix cache")
        if self.batch_size != 1:
            raise ValueError(f"publish is for a batch of 1; this cache holds {self.batch_size}")
        ids = _ids(token_ids)
        have = self.get_seq_length()
        if len(ids) not in (have, have + 1):
            raise ValueError(f"publish got {len(ids)} token ids for a cache holding {have} "
                             "positions (pass the ids of those positions, or generate's output)")
        return self.pool.publish([layer.seqs[0] for layer in self.layers], ids[:have],
                                 salt=self.salt)

    def save(self, path, *, fingerprint=None, tokens=None) -> int:
        """Park this conversation (batch 1) in the file ``path``: every layer's
        rows as stored, checksummed, written atomically (a prefix file of one
        entry, FORMAT.md). ``fingerprint``: the model's identity
        (``fingerprint(model)``), checked again by ``load``. ``tokens``: the
        ids of the positions held (or ``generate``'s output, one more), saved
        so that ``load(..., tokens=)`` can check a resumed conversation
        against them. A batch of several sequences is refused
        (``ValueError``): save each sequence's cache on its own. Returns the
        bytes written."""
        from ferrox_kv.store._cache import save_layers
        self._check_open()
        if self.batch_size != 1:
            raise ValueError(f"save is for a batch of 1; this cache holds {self.batch_size} "
                             "sequences (a parked conversation is one sequence)")
        return save_layers([layer.seqs[0] for layer in self.layers], path,
                           fingerprint=fingerprint,
                           tokens=None if tokens is None else _ids(tokens))

    @classmethod
    def load(cls, path, config, *, pool=None, max_seq_len=None, fingerprint=None, tokens=None):
        """A FerroxCache holding the conversation parked in ``path`` by
        ``save``, verified whole first: the file's layers, heads, head_dim
        and fingerprint must be ``config``'s and ``fingerprint``'s
        (``ferrox_kv.store.StoreMismatch`` naming the field, nothing made
        otherwise). ``tokens``: the resumed conversation's ids (the saved
        ones, then the new turn's); the saved ids must be their start
        (``StoreMismatch``, field ``tokens``, also for a file saved without
        them). It stores the file's dtype and int4 rotation (a pool's must
        match: ``StoreMismatch``, field ``dtype``);
        ``max_seq_len`` (at least the saved positions) is reserved as by the
        constructor. Pass it to ``generate`` with the whole conversation's
        ids: it feeds only the positions the cache lacks."""
        from ferrox_kv.store._cache import check_pool_dtype, read_layers, reserved
        from ferrox_kv.store._format import StoreMismatch, as_cache_dtype
        g, _, ks, vs = read_layers(path, fingerprint=fingerprint,
                                   tokens=None if tokens is None else _ids(tokens))
        n_layers, n_kv, head_dim = kv_geometry(config)
        for name, have, want in (("n_layers", g.n_layers, n_layers),
                                 ("n_kv_heads", g.n_kv_heads, n_kv),
                                 ("head_dim", g.head_dim, head_dim),
                                 ("v_head_dim", g.v_head_dim, head_dim)):
            if have != want:
                raise StoreMismatch(name, f"saved with {name}={have}, the model has {want}")
        cap = reserved(max_seq_len, g.block_size)
        dtype, rotate = as_cache_dtype(g.dtype)
        if pool is not None:
            check_pool_dtype(g, pool)
        elif rotate is False:
            raise StoreMismatch("dtype", "the file's rows are int4 without the rotation, and a "
                                         "FerroxCache without a pool stores int4 rotated: load "
                                         "it with pool=KvBlockPool(..., dtype='int4', "
                                         "rotate=False)")
        cache = cls(config, pool=pool, max_seq_len=cap, dtype=dtype)
        try:
            for layer, k, v in zip(cache.layers, ks, vs):
                layer.seqs[0]._extend_stored(k, v)
        except BaseException:
            cache.close()
            raise
        return cache

    @property
    def batch_size(self) -> int:
        return len(self.layers[0].seqs) if self.layers else 0

    @property
    def blocks_held(self) -> int:
        """Pool blocks held by all layers and sequences (a block shared by
        several sequences counts once for each)."""
        return sum(c.blocks_held for layer in self.layers for c in layer.seqs)

    def close(self) -> None:
        """Give every block back and drop the rows. Final, as for a file:
        afterwards ``update`` and the batch methods raise
        ``ValueError("FerroxCache is closed")``. Idempotent."""
        self._closed = True
        for layer in self.layers:
            for cache in layer.seqs:
                cache.close()
            layer.seqs = []
            layer.is_initialized = False

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self):
        self._check_open()
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def fingerprint(model) -> bytes:
    """An identity of ``model`` for ``save_prefixes``/``load_prefixes``,
    ``FerroxCache.save``/``load`` and ``RedisPrefixStore``: BLAKE2b-256 over
    its config (as JSON, sorted) and every parameter and buffer (name,
    dtype, shape and bytes), as hex. Computed once and kept on the model
    (``model._ferrox_kv_fingerprint``); a model whose weights change after
    that must drop the attribute."""
    import hashlib
    import json
    cached = getattr(model, "_ferrox_kv_fingerprint", None)
    if cached is not None:
        return cached
    h = hashlib.blake2b(digest_size=32, person=b"ferrox_kv.model")
    cfg = model.config.to_dict() if hasattr(model.config, "to_dict") else vars(model.config)
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            x = t.detach().to("cpu").contiguous()
            h.update(f"{name}:{x.dtype}:{tuple(x.shape)}".encode())
            h.update(x.reshape(-1).view(torch.uint8).numpy().tobytes())
    out = h.hexdigest().encode()
    model._ferrox_kv_fingerprint = out
    return out
