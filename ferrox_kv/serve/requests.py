"""One generation as the engine sees it: ``Request`` (what it asks for, what
the engine reports back through ``emit``, its text and usage) and
``Sampling`` (how the next token is chosen). No HTTP here: the app builds a
``Request`` from a body (``protocol``), the engine runs it."""
from __future__ import annotations

import time

import torch

from ferrox_kv import KvCache
from ferrox_kv.serve.text import TextStream

__all__ = ["Request", "Sampling"]


class Sampling:
    """How the next token is chosen: greedy at ``temperature == 0``, else
    softmax at ``temperature`` restricted to the ``top_p`` nucleus, from a
    generator seeded with ``seed`` (reproducible) or at random."""

    def __init__(self, temperature=1.0, top_p=1.0, seed=None):
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.generator = None
        if self.temperature > 0:
            self.generator = torch.Generator()
            if seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(int(seed))

    def pick(self, logits):
        """The next token id from a (vocab,) float tensor."""
        if self.temperature == 0:
            return int(torch.argmax(logits))
        # the max is taken out before the division, in float64: any positive
        # temperature, however small, then gives scores <= 0 (-inf at worst),
        # never inf - inf
        x = logits.double()
        probs = torch.softmax((x - x.max()) / self.temperature, dim=-1)
        if self.top_p < 1.0:
            sorted_p, idx = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, 0) - sorted_p < self.top_p
            keep[0] = True
            probs = torch.zeros_like(probs).scatter(0, idx[keep], sorted_p[keep])
        return int(torch.multinomial(probs, 1, generator=self.generator))


class Request:
    """One generation: what it asks for, and what the engine reports back
    through ``emit(kind, payload)`` (called from the engine's threads;
    ``"token"`` with the new text, then ``"done"`` with the finish reason, or
    ``"error"`` with an exception). A request has at least one prompt id
    (``ValueError`` otherwise): with none it could never make progress."""

    def __init__(self, prompt_ids, max_tokens, sampling, stop=(), tenant=None, emit=None):
        self.prompt_ids = [int(t) for t in prompt_ids]
        if not self.prompt_ids:
            raise ValueError("a request needs at least one prompt token")
        self.max_tokens = int(max_tokens)
        self.sampling = sampling
        self.stop = tuple(s for s in stop if s)
        self.tenant = tenant
        self.emit = emit or (lambda kind, payload: None)
        self.cancelled = False
        self.caches: list[KvCache] | None = None
        self.cached_tokens = 0
        self.output_ids: list[int] = []
        self.stream: TextStream | None = None   # made by the engine at the first token
        self.finish_reason = None
        self.arrived = time.monotonic()
        self.admitted_at = None
        self.first_token_at = None
        self.last_token_at = None

    @property
    def text(self) -> str:
        """The whole text so far (cut at a stop string): what the chunks
        emitted join to once the request is done."""
        return "" if self.stream is None else self.stream.text

    @property
    def reserve(self) -> int:
        return len(self.prompt_ids) + self.max_tokens

    @property
    def remaining(self) -> int:
        return self.max_tokens - len(self.output_ids)

    def cancel(self):
        """The client went away: the engine stops the sequence at its next
        step and gives its blocks back. Safe from any thread."""
        self.cancelled = True

    def usage(self):
        return {"prompt_tokens": len(self.prompt_ids),
                "completion_tokens": len(self.output_ids),
                "total_tokens": len(self.prompt_ids) + len(self.output_ids),
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}
