"""``FerroxCache``: a Hugging Face transformers ``Cache`` backed by ferrox_kv.

    from ferrox_kv import KvBlockPool
    from ferrox_kv.hf import FerroxCache

    cache = FerroxCache(model.config, pool=pool, max_seq_len=512)
    out = model.generate(**inputs, cache=cache, max_new_tokens=64)
    cache.close()                      # or `with FerroxCache(...) as cache:`

Needs ``torch`` and ``transformers`` (``pip install ferrox_kv[hf]``); the rest
of ferrox_kv never imports this module.

Layout. One ferrox_kv ``KvCache`` per layer and per sequence of the batch.
transformers hands each layer K/V shaped ``(batch, heads, T, head_dim)``; they
are stored as float32 rows (``(T, heads, head_dim)`` per sequence).

Copies, said plainly:

* in: the new K/V are converted to float32 on the CPU (a copy when the model
  runs in bf16/fp16 or on another device; none for a float32 CPU model
  decoding one token, whose rows are already laid out as ferrox stores them);
* out, contiguous caches (no pool) with batch 1 and a float32 CPU model: the
  K/V returned to attention are torch tensors over ferrox memory, no copy;
* out, batch > 1: the sequences are stacked (a copy);
* out, pooled caches: the rows are gathered from the blocks (a copy, GIL
  released when large); a paged attention kernel would read the blocks in
  place instead (``pool.key_blocks`` and ``KvCache.block_table``);
* out, bf16/fp16 or GPU models: converted back to the model's dtype/device.

Sliding-window layers are stored whole (the attention mask still applies the
window), so they cost full-length memory; models with non-attention layers
(linear attention, state-space) are refused with ``ValueError``.

Reservation. With a pool, the blocks for ``max_seq_len`` positions of every
layer of ``batch_size`` sequences are taken at construction in one
acquisition, all or none (``KvPoolExhausted``, pool untouched). A larger batch
later (beam search expands the prompt to ``batch * num_beams`` rows) reserves
the extra sequences the same way, or raises. Blocks go back at ``close()``,
at the end of a ``with`` block, or when the cache is garbage-collected.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ferrox_kv import KvBlockPool, KvCache

__all__ = ["FerroxCache", "FerroxLayer", "kv_geometry"]


def kv_geometry(config):
    """(num_layers, n_kv_heads, head_dim) of a transformers config."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    n_heads = cfg.num_attention_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    return cfg.num_hidden_layers, int(n_kv), int(head_dim)


class FerroxLayer(CacheLayerMixin):
    """One model layer: one ``KvCache`` per sequence of the batch."""

    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(self, owner: "FerroxCache", layer_idx: int):
        super().__init__()
        self._owner = owner
        self.layer_idx = layer_idx
        self.seqs: list[KvCache] = []
        self.dtype = None
        self.device = None

    def lazy_initialization(self, key_states, value_states):
        self.dtype = key_states.dtype
        self.device = key_states.device
        self.is_initialized = True

    # -- the hot path ---------------------------------------------------------

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        batch = key_states.shape[0]
        if batch < len(self.seqs):
            raise ValueError(f"update got a batch of {batch} for a cache holding {len(self.seqs)} "
                             "sequences; use batch_select_indices to shrink it first")
        if batch > len(self.seqs):
            self._owner._ensure_batch(batch)
        # (B, H, T, D) -> (B, T, H, D) float32 on the CPU; no copy for one
        # float32 CPU token, whose (H, 1, D) rows are already (1, H, D).
        k = key_states.detach().to("cpu", torch.float32).transpose(1, 2)
        v = value_states.detach().to("cpu", torch.float32).transpose(1, 2)
        kn = k.contiguous().numpy()
        vn = v.contiguous().numpy()
        t = kn.shape[1]
        for b, cache in enumerate(self.seqs):
            if t == 1:
                cache.push(kn[b, 0], vn[b, 0])
            else:
                cache.extend(kn[b], vn[b])
        return self._gather()

    def _gather(self):
        ks, vs = [], []
        for cache in self.seqs:
            kv, vv = cache._views()           # zero-copy (contiguous) or gathered (pooled)
            ks.append(torch.from_numpy(kv).permute(1, 0, 2))    # (H, S, D) view
            vs.append(torch.from_numpy(vv).permute(1, 0, 2))
        if len(ks) == 1:
            keys, values = ks[0].unsqueeze(0), vs[0].unsqueeze(0)
        else:
            keys, values = torch.stack(ks), torch.stack(vs)
        if self.dtype is not None and self.dtype != torch.float32:
            keys, values = keys.to(self.dtype), values.to(self.dtype)
        if self.device is not None and self.device.type != "cpu":
            keys, values = keys.to(self.device), values.to(self.device)
        return keys, values

    # -- what transformers asks of a layer -----------------------------------

    def get_seq_length(self) -> int:
        return self.seqs[0].seq_len if self.seqs else 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

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
        """Sequence b takes the rows of sequence beam_idx[b] (beam search).

        Every source is copied out before any sequence is rewritten; the
        rewritten ones stay within their reservation (no new blocks)."""
        order = [int(i) for i in (beam_idx.tolist() if hasattr(beam_idx, "tolist") else beam_idx)]
        if order == list(range(len(self.seqs))):
            return
        if len(order) != len(self.seqs):
            raise ValueError(f"beam_idx has {len(order)} entries for {len(self.seqs)} sequences")
        snap = {}
        for i in set(order):
            kv, vv = self.seqs[i]._views()   # pooled: already a copy
            snap[i] = (kv, vv) if self.seqs[i].is_pooled else (kv.copy(), vv.copy())
        for b, src in enumerate(order):
            if src == b:
                continue
            kv, vv = snap[src]
            cache = self.seqs[b]
            cache.clear()
            cache.extend(kv, vv)

    def offload(self):
        pass

    def prefetch(self):
        pass


class FerroxCache(Cache):
    """A transformers ``Cache`` whose K/V live in ferrox_kv caches.

    ``FerroxCache(config, pool=None, max_seq_len=None, batch_size=1)``

    * ``pool``: a ``KvBlockPool`` whose geometry matches the model's
      ``(num_key_value_heads, head_dim)``; every layer of every sequence then
      draws its blocks from it, reserving ``max_seq_len`` positions up front
      (``max_seq_len`` is required with a pool).
    * without a pool: contiguous caches, pre-allocated to ``max_seq_len`` when
      given (``KvCache.with_capacity``), else growing geometrically.

    Pass it to ``model.generate(..., cache=cache)`` (or the deprecated
    ``past_key_values=``). Call ``close()`` (or use ``with``) to give the
    blocks back as soon as the request is done.
    """

    # layers whose state is K/V rows; others (linear attention, recurrent,
    # compressed) keep state a KvCache cannot hold
    ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")

    def __init__(self, config, pool: KvBlockPool | None = None, max_seq_len: int | None = None,
                 batch_size: int = 1):
        n_layers, n_kv, head_dim = kv_geometry(config)
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        odd = sorted({t for t in (getattr(text, "layer_types", None) or [])
                      if t not in self.ATTENTION_LAYER_TYPES})
        if odd:
            raise ValueError(f"FerroxCache holds attention K/V only; this model has {odd} layers")
        if pool is not None:
            if max_seq_len is None:
                raise ValueError("max_seq_len is required with a pool: it is what gets reserved")
            if (pool.n_kv_heads, pool.head_dim, pool.v_head_dim) != (n_kv, head_dim, head_dim):
                raise ValueError(
                    f"pool geometry (n_kv_heads={pool.n_kv_heads}, head_dim={pool.head_dim}) "
                    f"does not match the model's (num_key_value_heads={n_kv}, head_dim={head_dim})")
        if max_seq_len is not None and max_seq_len < 0:
            raise ValueError(f"max_seq_len must be >= 0, got {max_seq_len}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.pool = pool
        self.max_seq_len = max_seq_len
        self.n_kv_heads = n_kv
        self.head_dim = head_dim
        super().__init__(layers=[FerroxLayer(self, i) for i in range(n_layers)])
        self._ensure_batch(batch_size)

    def _new_caches(self, count):
        if self.pool is not None:
            return KvCache.with_pool_many(count, self.n_kv_heads, self.head_dim, self.pool,
                                          self.max_seq_len)
        if self.max_seq_len is not None:
            return [KvCache.with_capacity(self.n_kv_heads, self.head_dim, self.max_seq_len)
                    for _ in range(count)]
        return [KvCache(self.n_kv_heads, self.head_dim) for _ in range(count)]

    def _ensure_batch(self, batch: int) -> None:
        """Grow every layer to ``batch`` sequences: all layers or none."""
        have = self.batch_size
        if batch <= have:
            return
        extra = batch - have
        fresh = self._new_caches(extra * len(self.layers))     # raises before any change
        seq_len = self.get_seq_length() if have else 0
        for i, layer in enumerate(self.layers):
            new = fresh[i * extra:(i + 1) * extra]
            if seq_len:
                # a batch that grows mid-sequence starts as copies of sequence 0
                kv, vv = layer.seqs[0]._views()
                for c in new:
                    c.extend(kv, vv)
            layer.seqs.extend(new)

    def _shrink_batch(self, batch: int) -> None:
        for layer in self.layers:
            for cache in layer.seqs[batch:]:
                cache.close()
            del layer.seqs[batch:]

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every sequence ``repeats`` times (sequence b -> b*repeats ..
        b*repeats + repeats - 1), reserving the new sequences in every layer at
        once first (or ``KvPoolExhausted`` with nothing changed)."""
        have = self.batch_size
        self._ensure_batch(have * repeats)
        order = [b // repeats for b in range(have * repeats)]
        for layer in self.layers:
            layer.reorder_cache(order)

    def batch_select_indices(self, indices) -> None:
        """Keep only the sequences ``indices`` (in that order); the blocks of
        the others go back to the pool."""
        keep = [int(i) for i in torch.as_tensor(indices).reshape(-1).tolist()]
        have = self.batch_size
        if any(i < 0 or i >= have for i in keep):
            raise IndexError(f"indices {keep} out of range for batch {have}")
        if len(keep) > have:
            raise ValueError(f"{len(keep)} indices for a batch of {have}")
        order = keep + list(range(len(keep), have))
        for layer in self.layers:
            layer.reorder_cache(order)
        self._shrink_batch(len(keep))

    @property
    def batch_size(self) -> int:
        return len(self.layers[0].seqs) if self.layers else 0

    @property
    def blocks_held(self) -> int:
        """Pool blocks held by all layers and sequences."""
        return sum(c.blocks_held for layer in self.layers for c in layer.seqs)

    def close(self) -> None:
        """Give every block back and drop the rows. Idempotent."""
        for layer in self.layers:
            for cache in layer.seqs:
                cache.close()
            layer.seqs = []
            layer.is_initialized = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
