"""The "ferrox" attention implementation and its mask function, as
transformers' ``integrations/sdpa_attention.py`` holds SDPA's.

``ferrox_attention`` reads a layer's ``KvCache`` rows in place with
``attend_many``; a layer that packs several sequences' positions in batch 1
(``PackedAttention``: ``ferrox_kv.hf.packed``) attends for itself. Every
other case runs torch's SDPA with exactly the mask "sdpa" would get (the
package docstring says when). Importing this module registers both under
``ATTENTION``.
"""
from __future__ import annotations

import abc

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import (
    causal_mask_function,
    sdpa_mask,
    sliding_window_causal_mask_function,
)

from ferrox_kv import attend_many
from ferrox_kv._core import _openmp_route, _openmp_routed, _torch_openmp

__all__ = ["ATTENTION", "COMPILE_REFUSED", "SDPA_PREFILL_MIN", "FerroxCompileError",
           "PackedAttention", "ferrox_attention"]

ATTENTION = "ferrox"          # model.set_attn_implementation(ATTENTION)

# A prefill of at least this many positions into an empty cache runs torch's
# SDPA on the incoming K/V: its matrix products beat the kernel from about
# 1024 positions, not before (benchmarks/NOTES.md, "Prefill: SDPA or attend").
SDPA_PREFILL_MIN = 1024

# The attention implementation
# ---------------------------------------------------------------------------


def _attend_on_torch_threads(seqs, q, **kwargs):
    """``attend_many(seqs, q, threads=torch.get_num_threads(), **kwargs)``,
    split on the calling thread's team of torch's OpenMP runtime where the
    core took it (``_torch_openmp``) rather than on ferrox_kv's worker pool:
    torch's OpenMP threads spin for a while after each of torch's operators,
    so pool threads would wait for their cores, while the team's threads
    take the units at once. The calling thread runs torch's operators, so
    its team exists already. The route is this call's alone: turned on
    here, it is turned off after (whatever happens). The core routes the
    main thread's calls itself; this serves the thread that runs the model
    wherever it is."""
    routed = _torch_openmp() is not None and not _openmp_routed()
    try:
        if routed:
            _openmp_route(True)
        return attend_many(seqs, q, threads=torch.get_num_threads(), **kwargs)
    finally:
        if routed:
            _openmp_route(False)


class _Mask:
    """What the "ferrox" mask function was given, for the attention: the 2D
    padding ``(batch, positions)`` the kernel reads; whether the mask is plain
    (causal, the ``local_size`` window and padding, nothing overlaid: only
    then may the kernel stand in for it); and the exact mask SDPA would get
    (``sdpa_mask`` on the same arguments), built on first use and shared by
    every layer the mask goes to."""

    __slots__ = ("padding", "plain", "local_size", "_args", "_sdpa")
    ndim = 4        # a prepared mask: generate's precomputed one is passed on, not re-read as 2D

    def __init__(self, args):
        self.padding = args.get("attention_mask")
        self.plain = bool(args.get("allow_is_causal_skip", False))
        self.local_size = args.get("local_size")
        # a static cache's offsets are tensors its update advances in place:
        # the mask is built later, at the first layer's attention, from a copy
        self._args = {k: v.clone() if isinstance(v, torch.Tensor) and k.endswith("_offset") else v
                      for k, v in args.items()}
        self._sdpa = None

    def sdpa(self):
        if self._args is not None:
            self._sdpa, self._args = sdpa_mask(**self._args), None
        return self._sdpa


def _ferrox_mask(**args):
    """The mask function registered for "ferrox" (transformers calls it with
    the arguments of ``sdpa_mask``): a ``_Mask`` holding them, or the
    ``_Mask`` it is given (``generate`` prepares it ahead for a static cache)."""
    prepared = args.get("attention_mask")
    return prepared if isinstance(prepared, _Mask) else _Mask(args)


def _direct_mask(padding, batch, q_len, kv_len, window, device, kv_offset=0):
    """A ``_Mask`` for a 2D padding mask handed to ``ferrox_attention``
    directly (not through the mask function): the queries are then the last
    ``q_len`` of the ``kv_len`` positions and the padding spans them; the
    keys start at ``kv_offset`` (a sliding layer's window)."""
    fn = sliding_window_causal_mask_function(window) if window else causal_mask_function
    return _Mask(dict(batch_size=batch, q_length=q_len, kv_length=kv_len - kv_offset,
                      q_offset=kv_len - q_len, kv_offset=kv_offset, mask_function=fn,
                      allow_is_causal_skip=True,
                      attention_mask=None if padding is None else
                      padding[:, -kv_len:].to(device=device, dtype=torch.bool),
                      local_size=window, device=device))


def _left_padding(padding, kv_len):
    """Each row's first visible position when ``padding`` (batch, kv_len) is
    left padding (False then True), else None."""
    if padding is None:
        return None
    pad = padding[:, -kv_len:].to(torch.bool)
    first = torch.where(pad.any(-1), pad.to(torch.int8).argmax(-1),
                        torch.full((pad.shape[0],), kv_len))
    if not bool((pad.sum(-1) == kv_len - first).all()):
        return None
    return first.cpu().numpy()


COMPILE_REFUSED = (
    "FerroxCache does not run under torch.compile: its K/V live in ferrox_kv's C caches, "
    "which torch.compile cannot trace (they are not registered as torch custom ops). Run the "
    "model eagerly with FerroxCache (attn_implementation='ferrox' reads it in place), or "
    "compile with transformers' own StaticCache or DynamicCache.")


class FerroxCompileError(RuntimeError):
    """A FerroxCache (or a "ferrox" attention over one) met torch.compile."""


def _refuse_compile():
    """Raises ``FerroxCompileError`` while torch.compile traces the caller:
    a clear error at the first cache call, not a failed trace deep in dynamo."""
    if torch.compiler.is_compiling():
        raise FerroxCompileError(COMPILE_REFUSED)


class PackedAttention(abc.ABC):
    """The packed-step hook: a cache layer that holds several sequences'
    positions packed in batch 1 (a continuous-batching step:
    ``ferrox_kv.hf.packed.PackedLayer``) and attends them itself.
    ``ferrox_attention`` hands such a layer the queries whatever the mask,
    since a mask cannot describe sequences of different lengths packed side
    by side. Subclass it (an ABC, so a layer is one by declaration, never by
    an attribute's name)."""

    @abc.abstractmethod
    def attend_packed(self, query, scale, window):
        """query ``(1, heads, positions, head_dim)`` -> ``(1, positions,
        heads, v_head_dim)``: each sequence's queries against its own rows,
        as the causal mask of that sequence alone would have it."""


def ferrox_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                     sliding_window=None, ferrox_layer=None, **kwargs):
    """Attention for ``attn_implementation="ferrox"``: reads a FerroxCache's
    rows in place with ``attend_many``; otherwise torch's SDPA with exactly
    the mask SDPA would get (see the package docstring). query (B, H, q_len, D)
    -> (B, q_len, H, D). A ``PackedAttention`` layer (several sequences'
    positions packed in batch 1: ``PackedCache``'s) attends for itself, by
    the same kernel, whatever the mask. The
    kernel uses at most ``torch.get_num_threads()`` threads (and at most
    ``ferrox_kv.get_num_threads()``), so ``torch.set_num_threads(k)`` limits
    both, and splits on torch's OpenMP team (``_attend_on_torch_threads``)."""
    batch, _, q_len, _ = query.shape
    layer = ferrox_layer
    if layer is not None:
        _refuse_compile()
    if isinstance(layer, PackedAttention):
        return layer.attend_packed(query, scaling, sliding_window).to(device=query.device,
                                                                      dtype=query.dtype), None
    if layer is not None and layer._owner.config is None:
        layer._owner._adopt_config(getattr(module, "config", None))
    if isinstance(attention_mask, _Mask):
        mask = attention_mask
    elif isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
        mask = None                                       # a custom mask: SDPA, as given
    else:                                                 # 2D padding or None, handed directly
        kv = layer.get_seq_length() if layer is not None else key.shape[2]
        mask = _direct_mask(attention_mask, batch, q_len, kv, sliding_window, query.device,
                            getattr(layer, "_offset", 0) if layer is not None else 0)
    if layer is not None:
        kv_len = layer.get_seq_length()
        fresh = key.shape[2] == kv_len == q_len           # update handed back the incoming K/V
        if (mask is not None and mask.plain and mask.local_size == sliding_window
                and dropout == 0.0 and len(layer.seqs) == batch
                and not (fresh and q_len >= SDPA_PREFILL_MIN)):
            starts = _left_padding(mask.padding, kv_len)
            if starts is not None or mask.padding is None:
                q = query.detach().to("cpu", torch.float32).transpose(1, 2).contiguous().numpy()
                out = torch.from_numpy(_attend_on_torch_threads(layer.seqs, q, scale=scaling,
                                                               window=sliding_window, start=starts))
                return out.to(device=query.device, dtype=query.dtype), None
        if not fresh:                                     # update handed back placeholders
            key, value = layer._gather()
    dense = attention_mask if mask is None else mask.sdpa()
    return sdpa_attention_forward(module, query, key, value, dense, dropout=dropout,
                                  scaling=scaling, **kwargs)


AttentionInterface.register(ATTENTION, ferrox_attention)
AttentionMaskInterface.register(ATTENTION, _ferrox_mask)
