"""``PackedCache``: the caches of the sequences that run in one forward of a
continuous-batching step, packed in batch 1, as a transformers ``Cache``.

Sequence b's next ``counts[b]`` positions are the packed positions
``[offsets[b], offsets[b + 1])`` of the forward (the caller builds the ids
and per-sequence ``position_ids`` in that order, those with one position
first); its rows go to its own ``KvCache`` of each layer, and its queries
attend those rows at its own length (``attend_many``: one call for the
single-position sequences, one for each other sequence). Lengths may differ.
The layers are ``PackedAttention`` layers: the "ferrox" attention hands them
the queries whatever the mask. A forward that fails part way leaves some
caches extended: the caller truncates them back (``KvCache.truncate``).
"""
from __future__ import annotations

import numpy as np
import torch
from transformers.cache_utils import Cache

from ferrox_kv import KvCache
from ferrox_kv._core import _extend_each
from ferrox_kv.hf.attention import PackedAttention, _attend_on_torch_threads
from ferrox_kv.hf.cache import _rows, _SeqsLayer

__all__ = ["PackedCache", "PackedLayer"]


class PackedLayer(_SeqsLayer, PackedAttention):
    """Layer ``layer_idx`` of the sequences in this step, packed in batch 1:
    positions ``[offsets[b], offsets[b + 1])`` of the forward are sequence
    b's next ``counts[b]`` positions, in its ``KvCache`` of that layer
    (``seqs[b]``); the first ``n_single`` sequences have one position each."""

    def __init__(self, layer_idx, seqs, counts):
        super().__init__(layer_idx, seqs)
        self.counts = counts
        self.offsets = np.concatenate([[0], np.cumsum(counts)]).tolist()
        self.n_single = next((i for i, n in enumerate(counts) if n != 1), len(counts))
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states):
        pass

    def update(self, key_states, value_states, *args, kwargs=None, **extra):
        """Store the step's rows, each sequence's in its own cache, and hand
        the layer to the "ferrox" attention, which calls ``attend_packed``."""
        if kwargs is None:
            raise RuntimeError("the model did not pass its attention kwargs to the cache; "
                               "a PackedCache needs a transformers 5 model")
        kn, vn = _rows(key_states)[0], _rows(value_states)[0]      # (positions, heads, dim)
        self._by_sequence(lambda seqs, a, b: _extend_each(seqs, kn[a:b].reshape(
            len(seqs), (b - a) // len(seqs), *kn.shape[1:]), vn[a:b].reshape(
            len(seqs), (b - a) // len(seqs), *vn.shape[1:])))
        return self._to_attention(kwargs, key_states)

    def _by_sequence(self, fn):
        """``fn(seqs, start, end)`` for the single-position sequences at once,
        then for each other sequence: the packed positions ``[start, end)``."""
        k = self.n_single
        if k:
            fn(self.seqs[:k], 0, k)
        for b in range(k, len(self.seqs)):
            fn(self.seqs[b:b + 1], self.offsets[b], self.offsets[b + 1])

    def attend_packed(self, query, scale, window):
        """query ``(1, heads, positions, dim)`` -> ``(1, positions, heads,
        dim)`` float32, each sequence's queries against its own cache (its
        last positions)."""
        q = query.detach()[0].to("cpu", torch.float32).transpose(0, 1).contiguous().numpy()
        out = np.empty(q.shape[:2] + (self.seqs[0].v_head_dim,), dtype=np.float32)

        def one(seqs, a, b):
            n = len(seqs)
            shape = (n, (b - a) // n)
            _attend_on_torch_threads(seqs, q[a:b].reshape(shape + q.shape[1:]), scale=scale,
                                     window=window, out=out[a:b].reshape(shape + out.shape[1:]))

        self._by_sequence(one)
        return torch.from_numpy(out)[None]

    def reset(self):
        pass


class PackedCache(Cache):
    """``PackedCache(caches, counts)``: ``caches[b]`` is sequence b's list of
    ``KvCache``, one per model layer; ``counts[b]`` its new positions in this
    forward (packed in batch 1, in this order, the single positions first).
    Pass it as ``cache=`` to one forward of a model running the "ferrox"
    attention, with the packed ``input_ids`` and each sequence's own
    ``position_ids``."""

    def __init__(self, caches: list[list[KvCache]], counts: list[int]):
        if len(caches) != len(counts) or not caches:
            raise ValueError(f"PackedCache takes one count per sequence and at least one "
                             f"sequence; got {len(caches)} sequences and {len(counts)} counts")
        super().__init__(layers=[PackedLayer(i, [seq[i] for seq in caches], counts)
                                 for i in range(len(caches[0]))])
