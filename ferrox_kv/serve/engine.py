"""The engine: one scheduler thread owns the model, the pool and the step loop.

Admission is the pool. A request reserves ``prompt + max_tokens`` positions of
every layer at once (``KvCache.with_pool_many``, all or nothing) when it
leaves the FIFO queue; a sliding-window layer (``layer_windows(config)``:
Gemma 2/3, gpt-oss, Mistral, Qwen2 with ``use_sliding_window``) reserves only
what its window needs (``ceil((W + prefill_chunk - 1) / block_size) + 1``
blocks, at most the whole length's), and gives back the blocks that leave its
window as the request runs (``sliding_windows=False`` stores them whole). A
reserved request can never fail mid-decode, so there is no preemption. A
request that does not fit waits at the head of the queue (no one overtakes
it) until blocks come back; past ``max_queue`` waiting
requests, or ``queue_timeout`` seconds of waiting, it is refused with
``Overloaded`` (HTTP 503 + Retry-After). A request that could never fit (its
reservation beyond the whole pool or the model's context) is refused at once
with ``NeverFits`` (HTTP 400).

Continuous batching (``mode="batch"``). Each step of the loop:

1. admits from the head of the queue while the pool can reserve and fewer than
   ``max_batch`` sequences run;
2. runs one model forward over the running sequences, packed in batch 1:
   the next token of every decoding sequence, then the next prompt chunk of
   admitted requests in FIFO order, at most ``prefill_chunk`` prompt
   positions in all (a long prompt takes several steps, so running sequences
   keep decoding between its chunks). Position ids are per sequence; each
   sequence's rows go to its own caches and its queries attend them at their
   own length (``attend_many``: one call for the decoding sequences, one per
   prompt chunk). A request starts from the longest prefix of its prompt
   published under its tenant's salt;
3. samples, streams each new token to its request, and retires the finished
   and the cancelled, whose blocks go back (after publishing what a finished
   request computed, for the next request with the same prefix and tenant).

``mode="threads"`` is the fallback and the baseline: the same admission, but
each admitted request runs its own prefill and decode (batch 1) in a thread of
its own. ``threads_cache="ferrox"`` keeps its K/V in its reservation (and the
prefix cache serves it); ``threads_cache="dynamic"`` is transformers' own
path, the issue's baseline: the K/V in a ``DynamicCache`` and attention by
SDPA (what the "ferrox" attention runs for any other cache), one forward per
token as ``generate`` does; its reservation is held as the admission ticket
only, so admission, the queue and the 503s are the same, and the prefix
cache is neither read nor published.

Read-through (``fetch=``, the Redis store: ``serve.prefixes``). A request
is first handed to one of ``fetch_threads`` fetcher threads, which reads
the blocks of its prompt that the pool lacks into the pool, then queues it:
the step loop never waits for the store, and a request whose fetch is slow
waits alone (counted as waiting, and against ``max_queue``); each fetch is
bounded by the store's timeout. Once a drain or ``close()`` begins, a request
still waiting for its fetcher skips the fetch and is refused from the queue.

The server never calls ``fork()``: one process, these threads, uvicorn's event
loop.
"""
from __future__ import annotations

import collections
import concurrent.futures
import math
import threading
import time

import numpy as np
import torch
from transformers.cache_utils import DynamicCache

from ferrox_kv import KvBlockPool, KvCache, KvPoolExhausted
from ferrox_kv.hf import ATTENTION, PackedCache, kv_geometry, layer_windows
from ferrox_kv.serve.protocol import NeverFits, Overloaded
from ferrox_kv.serve.requests import Request, Sampling
from ferrox_kv.serve.text import TextStream

__all__ = ["Engine", "NeverFits", "Overloaded", "Request", "Sampling", "check_options"]


def _spell(name, value, cli):
    """An option as its user writes it: ``--max-batch 0`` on the command
    line, ``max_batch=0`` to the constructor."""
    return f"--{name.replace('_', '-')} {value}" if cli else f"{name}={value!r}"


def check_options(*, mode="batch", max_batch=16, max_queue=64, queue_timeout=30.0,
                  prefill_chunk=256, threads_cache="ferrox", cli=False):
    """``ValueError`` naming the first option out of range, spelled as the
    command line writes it when ``cli``: the one place the engine's options
    are checked (``Engine`` and ``ferrox-kv serve`` both call it)."""
    if mode not in ("batch", "threads"):
        raise ValueError(f"{_spell('mode', mode, cli)}: the mode must be 'batch' or 'threads'")
    if threads_cache not in ("ferrox", "dynamic"):
        raise ValueError(f"{_spell('threads_cache', threads_cache, cli)}: threads_cache must be "
                         "'ferrox' or 'dynamic'")
    if threads_cache == "dynamic" and mode != "threads":
        raise ValueError(f"{_spell('threads_cache', 'dynamic', cli)} is the threads mode's "
                         f"baseline; pass {_spell('mode', 'threads', cli)} with it")
    for name, v in (("max_batch", max_batch), ("prefill_chunk", prefill_chunk)):
        if v < 1:
            raise ValueError(f"{_spell(name, v, cli)}: {name} must be >= 1")
    for name, v in (("max_queue", max_queue), ("queue_timeout", queue_timeout)):
        if v < 0:
            raise ValueError(f"{_spell(name, v, cli)}: {name} must be >= 0")


def _roll_back(requests, lengths):
    """A forward failed part-way: every layer of every sequence goes back to
    the length it had before it."""
    for r, n in zip(requests, lengths):
        for c in r.caches:
            if c.seq_len > n:
                c.truncate(n)


# ---------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------

class Engine:
    """The model, its tokenizer, one ``KvBlockPool`` and the step loop.

    ``Engine(model, tokenizer, pool, *, mode="batch", max_batch=16,
    max_queue=64, queue_timeout=30.0, prefill_chunk=256,
    threads_cache="ferrox", metrics=None, fetch=None, fetch_threads=4,
    sliding_windows=True)``
    (``threads_cache``: ``"ferrox"`` or ``"dynamic"``, threads mode only;
    ``fetch(prompt_ids, salt)``: a read-through run before a request is
    queued, in one of ``fetch_threads`` threads; ``sliding_windows``: the
    model's sliding layers keep only their windows, as ``FerroxCache``'s,
    and then, as there, a model that has such layers takes no part in the
    prefix cache: no hit, no publish; False stores them whole). ``start()``
    launches the scheduler thread; ``submit(request)`` queues a request (or
    raises ``Overloaded`` / ``NeverFits``); ``drain(deadline)`` stops
    admitting and waits for the running requests; ``close()`` cancels what is
    left, stops the threads and gives every block back.
    """

    def __init__(self, model, tokenizer, pool: KvBlockPool, *, mode="batch", max_batch=16,
                 max_queue=64, queue_timeout=30.0, prefill_chunk=256, threads_cache="ferrox",
                 metrics=None, fetch=None, fetch_threads=4, sliding_windows=True):
        check_options(mode=mode, max_batch=max_batch, max_queue=max_queue,
                      queue_timeout=queue_timeout, prefill_chunk=prefill_chunk,
                      threads_cache=threads_cache)
        if getattr(model.config, "_attn_implementation", None) != ATTENTION:
            raise ValueError(f"the model must run attn_implementation={ATTENTION!r}")
        self.n_layers, n_kv, head_dim = kv_geometry(model.config)
        if (pool.n_kv_heads, pool.head_dim) != (n_kv, head_dim):
            raise ValueError(f"pool geometry ({pool.n_kv_heads} heads of {pool.head_dim}) does "
                             f"not match the model's ({n_kv} heads of {head_dim})")
        self.model = model
        self.tokenizer = tokenizer
        self.pool = pool
        self.mode = mode
        self.threads_cache = threads_cache
        self.max_batch = int(max_batch)
        self.max_queue = int(max_queue)
        self.queue_timeout = float(queue_timeout)
        self.prefill_chunk = int(prefill_chunk)
        self.metrics = metrics
        self.n_kv, self.head_dim = n_kv, head_dim
        # each layer's window (None: full attention); a windowed layer's
        # caches reserve what an append of up to prefill_chunk rows needs
        self.windows = (layer_windows(model.config, self.n_layers) if sliding_windows
                        else [None] * self.n_layers)
        self.sliding = any(w is not None for w in self.windows)
        # a sliding layer gives back the blocks a prefix hit would share
        # (FerroxCache refuses tokens= then too): its model reuses no prefix
        self.reuse_prefixes = (pool.prefix_cache and threads_cache == "ferrox"
                               and not self.sliding)
        text = model.config.get_text_config(decoder=True)
        self.context = int(getattr(text, "max_position_embeddings", 0) or 0) or None
        eos = model.generation_config.eos_token_id
        if eos is None:
            eos = tokenizer.eos_token_id
        self.eos = set([eos] if isinstance(eos, int) else (eos or []))
        self._cv = threading.Condition()
        self._queue: collections.deque[Request] = collections.deque()
        self._running: list[Request] = []       # admitted (prefilling or decoding)
        self._threads: list[threading.Thread] = []
        self._draining = False
        self._stopping = False
        # fetch(prompt_ids, salt): a read-through before admission (the Redis
        # store), run in a fetcher thread of the request's own; the request
        # joins the queue once it returns, so that no step waits for it
        self._fetch = fetch
        self._fetching = 0
        self._fetchers = (concurrent.futures.ThreadPoolExecutor(
            fetch_threads, thread_name_prefix="ferrox-serve-fetch") if fetch is not None else None)
        self._step_ema = None                   # seconds per decode step (per token in threads)
        self._loop = None

    # -- sizes --------------------------------------------------------------

    def _layer_blocks(self, positions: int, window) -> int:
        """What one layer of a reservation of ``positions`` takes (the pool's
        rule for ``KvCache.with_pool``, appends of up to ``prefill_chunk``)."""
        return self.pool.reservation_blocks(
            positions, window=window, max_chunk=self.prefill_chunk if window else None)

    def blocks_for(self, positions: int) -> int:
        """Blocks a reservation of ``positions`` takes, summed over the
        layers: a full layer's ``ceil(positions / block_size)`` (at least
        1), a sliding layer's at most what its window needs."""
        return sum(self._layer_blocks(positions, w) for w in self.windows)

    @property
    def max_positions(self) -> int:
        """The longest reservation this pool and model can ever grant (a
        model whose every layer is sliding: the context, or 2**31 without
        one, once the windows fit the pool)."""
        total, bs = self.pool.total_blocks, self.pool.block_size
        if all(w is not None for w in self.windows) and self.blocks_for(1 << 31) <= total:
            return self.context or 1 << 31
        lo, hi = 0, total                # the most blocks per full layer that fit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.blocks_for(mid * bs) <= total:
                lo = mid
            else:
                hi = mid - 1
        by_pool = lo * bs
        return min(by_pool, self.context) if self.context else by_pool

    def stats(self):
        """``running``: admitted; ``waiting``: queued, or in their read-through."""
        with self._cv:
            return {"running": len(self._running), "waiting": len(self._queue) + self._fetching}

    def health(self):
        """``/health``'s figures in one snapshot: the engine takes and gives
        back blocks under its lock, so the counts and the pool's figures
        agree (a request retired between two separate reads would look idle
        with its blocks still held)."""
        with self._cv:
            s = self.pool.stats()
            return {"status": "draining" if self._draining else "ok",
                    "running": len(self._running), "waiting": len(self._queue) + self._fetching,
                    "free_blocks": s["free_blocks"], "used_blocks": s["used_blocks"],
                    "cached_blocks": s["cached_blocks"], "total_blocks": s["total_blocks"],
                    "reserved_blocks": sum(self.blocks_for(r.reserve) for r in self._running),
                    "head_needs_blocks": (self.blocks_for(self._queue[0].reserve)
                                          if self._queue else 0),
                    "window_freed_blocks": s["window_freed"]}

    # -- the client side -------------------------------------------------------

    def check_fits(self, request: Request):
        """``NeverFits`` when the request's reservation exceeds what the pool
        or the model's context can ever hold."""
        n = len(request.prompt_ids)
        if self.context and request.reserve > self.context:
            raise NeverFits(
                f"prompt ({n} tokens) + max_tokens ({request.max_tokens}) = {request.reserve} "
                f"exceeds the model's context of {self.context} tokens; shorten the prompt or "
                "lower max_tokens", "max_tokens" if n < self.context else "prompt")
        if request.reserve > self.max_positions:
            sliding = sum(w is not None for w in self.windows)
            layers = (f" over {self.n_layers} layers ({sliding} sliding, reserving at most "
                      "their windows)" if sliding else f" over {self.n_layers} layers")
            raise NeverFits(
                f"prompt ({n} tokens) + max_tokens ({request.max_tokens}) = {request.reserve} "
                f"positions need {self.blocks_for(request.reserve)} blocks{layers}; the whole "
                f"pool holds {self.pool.total_blocks} ({self.max_positions} positions per "
                "request at most); lower max_tokens or start the server with a larger "
                "--kv-blocks", "max_tokens")

    def submit(self, request: Request):
        """Queue ``request`` (FIFO). Raises ``NeverFits`` or ``Overloaded``
        (queue full or shutting down), with nothing queued."""
        self.check_fits(request)
        with self._cv:
            if self._draining or self._stopping:
                raise Overloaded("the server is shutting down; retry on another instance",
                                 self.retry_after(request), "shutting_down")
            if (len(self._queue) + self._fetching >= self.max_queue
                    and not self._can_start_now(request)):
                raise Overloaded(
                    f"the queue is full ({self.max_queue} requests wait for KV blocks); "
                    "retry after the time in Retry-After", self.retry_after(request), "queue_full")
            if self._fetchers is not None and self.threads_cache == "ferrox":
                self._fetching += 1
                self._fetchers.submit(self._fetch_main, request)
                return
            self._queue.append(request)
            self._cv.notify_all()

    def _fetch_main(self, request):
        """In a fetcher thread: the request's read-through, then the queue
        (a fault is a miss: the request is queued all the same). A request
        cancelled, or whose fetch starts once a drain or close began, skips
        its read-through: the queue refuses it without a Redis round trip."""
        try:
            skip = request.cancelled or self._draining or self._stopping
            if not skip and self.reuse_prefixes:
                self._fetch(request.prompt_ids, request.tenant)
        except Exception:                # noqa: BLE001  (a miss; the store counts it)
            pass
        finally:
            with self._cv:
                self._fetching -= 1
                self._queue.append(request)     # _expire_queue refuses it if draining
                self._cv.notify_all()

    def _can_start_now(self, request):
        return (not self._queue and len(self._running) < self.max_batch
                and self.blocks_for(request.reserve) <= self.pool.free_blocks)

    def retry_after(self, request=None) -> int:
        """Seconds until the blocks ``request`` needs are likely back: the
        running requests finish in order of their remaining tokens, each
        freeing its reservation; the estimate is the remaining tokens of the
        one whose end frees enough, times the measured seconds per step
        (queued requests ahead count as needing their blocks first)."""
        need = self.blocks_for(request.reserve) if request is not None else 1
        need += sum(self.blocks_for(r.reserve) for r in self._queue)
        free = self.pool.free_blocks
        step = self._step_ema if self._step_ema is not None else 0.05
        steps = 0
        for r in sorted(self._running, key=lambda r: r.remaining):
            if free >= need:
                break
            free += self.blocks_for(r.reserve)
            steps = r.remaining + (len(r.prompt_ids) // self.prefill_chunk if
                                   r.first_token_at is None else 0)
        if free < need:                 # the queue ahead outlasts every running request
            steps += sum(r.max_tokens for r in self._queue)
        return max(1, math.ceil(steps * step))

    # -- lifecycle -----------------------------------------------------------

    def start(self):
        t = threading.Thread(target=self._loop_main, name="ferrox-serve-engine", daemon=True)
        self._loop = t
        t.start()

    def drain(self, deadline: float):
        """Stop admitting (new and queued requests get ``Overloaded``) and
        wait up to ``deadline`` seconds for the running requests to finish.
        Returns whether they did."""
        with self._cv:
            self._draining = True
            self._cv.notify_all()
            end = time.monotonic() + deadline
            while self._running or self._queue or self._fetching:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(min(left, 0.1))
        return True

    def close(self):
        """Cancel whatever is left, stop the threads, give every block back."""
        with self._cv:
            self._stopping = True
            for r in list(self._queue) + list(self._running):
                r.cancel()
            self._cv.notify_all()
        if self._fetchers is not None:
            # a fetch under way ends (bounded by the store); the requests
            # still waiting for a fetcher skip theirs (_stopping) and queue,
            # to be refused below
            self._fetchers.shutdown(wait=True)
        if self._loop is not None:
            self._loop.join(timeout=30)
        for t in list(self._threads):
            t.join(timeout=30)
        with self._cv:
            for r in list(self._queue):
                self._refuse(r, "shutting_down", "the server shut down before the request ran")
            self._queue.clear()
            for r in list(self._running):
                self._retire(r, publish=False)

    # -- the scheduler ---------------------------------------------------------

    def _loop_main(self):
        with torch.inference_mode():
            while True:
                with self._cv:
                    self._expire_queue()
                    self._admit()
                    if self._stopping:
                        return
                    if not self._running or self.mode == "threads":
                        self._cv.wait(0.05 if self._queue else 0.5)
                        continue
                    batch = list(self._running)
                try:
                    self._step(batch)
                except Exception as e:          # a broken model: fail its requests, go on
                    with self._cv:
                        for r in batch:
                            self._fail(r, e)

    def _expire_queue(self):
        """Queued requests past the timeout, cancelled, or refused by a drain
        leave the queue."""
        now = time.monotonic()
        keep = collections.deque()
        for r in self._queue:
            if r.cancelled:
                r.emit("done", "cancelled")
                self._count("cancelled_queued")
            elif self._draining or self._stopping:
                self._refuse(r, "shutting_down", "the server is shutting down; the request was "
                             "not started")
            elif now - r.arrived > self.queue_timeout:
                self._refuse(r, "queue_timeout",
                             f"no KV blocks came free within the queue timeout "
                             f"({self.queue_timeout:g} s); retry after the time in Retry-After")
            else:
                keep.append(r)
        if len(keep) != len(self._queue):
            self._queue = keep
            self._cv.notify_all()

    def _refuse(self, r, reason, message):
        r.emit("error", Overloaded(message, self.retry_after(r), reason))
        if self.metrics is not None:
            self.metrics.refused(reason)

    def _count(self, what):
        if self.metrics is not None:
            self.metrics.event(what)

    def _admit(self):
        """From the head of the queue while the pool can reserve (all layers,
        all or nothing) and there is room in the batch."""
        while self._queue and not (self._draining or self._stopping):
            if len(self._running) >= self.max_batch:
                return
            r = self._queue[0]
            reuse = self.reuse_prefixes
            try:
                r.caches = KvCache.with_pool_many(
                    self.n_layers, self.n_kv, self.head_dim, self.pool, r.reserve,
                    tokens=np.asarray(r.prompt_ids, dtype=np.int64) if reuse else None,
                    salt=r.tenant if reuse else None,
                    window=self.windows if self.sliding else None,
                    max_chunk=self.prefill_chunk if self.sliding else None)
            except KvPoolExhausted:
                return                          # the head waits; nobody overtakes it
            self._queue.popleft()
            r.cached_tokens = r.caches[0].seq_len
            r.admitted_at = time.monotonic()
            self._running.append(r)
            if self.metrics is not None:
                self.metrics.admitted(r, looked_up=reuse)
            if self.mode == "threads":
                t = threading.Thread(target=self._thread_main, args=(r,), daemon=True,
                                     name="ferrox-serve-request")
                self._threads.append(t)
                t.start()

    def _step(self, batch):
        """One iteration, one forward: the next token of every decoding
        sequence, then prompt chunks of the admitted requests in FIFO order,
        ``prefill_chunk`` prompt positions in all."""
        decoding, prefilling, chunks = [], [], []
        budget = self.prefill_chunk
        for r in batch:
            if r.cancelled:
                continue
            have = r.caches[0].seq_len
            if have < len(r.prompt_ids):
                if budget > 0:
                    chunks.append(r.prompt_ids[have:have + budget])
                    budget -= len(chunks[-1])
                    prefilling.append(r)
            elif r.output_ids:
                decoding.append(r)
        # every running request prefills or decodes: one that can do neither
        # would hold its reservation and a batch slot for good
        stuck = [r for r in batch if not (r.cancelled or r.finish_reason is not None
                                          or r in decoding)
                 and r.caches[0].seq_len >= len(r.prompt_ids)]
        if stuck:
            with self._cv:
                for r in stuck:
                    self._fail(r, RuntimeError(
                        "ferrox_kv.serve: a request could make no progress (its prompt is in "
                        "and it has no token); it was failed and its blocks given back"))
            batch = [r for r in batch if r not in stuck]
        seqs = decoding + prefilling
        if seqs:
            t0 = time.perf_counter()
            logits = self._forward(seqs, [[r.output_ids[-1]] for r in decoding] + chunks)
            dt = time.perf_counter() - t0
            if decoding:
                self._step_ema = dt if self._step_ema is None else 0.9 * self._step_ema + 0.1 * dt
                if self.metrics is not None:
                    self.metrics.decode_batch(len(decoding))
            for r, row in zip(seqs, logits):
                if r.caches[0].seq_len >= len(r.prompt_ids):    # decoding, or its prompt is in
                    self._accept(r, r.sampling.pick(row))
        with self._cv:
            for r in batch:
                if r.cancelled or r.finish_reason is not None:
                    self._retire(r, publish=r.finish_reason is not None)
                    if r.finish_reason is None:
                        r.emit("done", "cancelled")
                        self._count("cancelled_running")

    def _forward(self, requests, tokens):
        """One model forward over ``requests`` packed in batch 1:
        ``tokens[b]`` are sequence b's next positions (any count; those with
        one position first). Returns each sequence's last position's logits,
        (B, vocab)."""
        lengths = [r.caches[0].seq_len for r in requests]
        counts = [len(t) for t in tokens]
        ids = torch.tensor([[t for ts in tokens for t in ts]], dtype=torch.long)
        pos = torch.tensor([[L + i for L, n in zip(lengths, counts) for i in range(n)]],
                           dtype=torch.long)
        last = torch.tensor(np.cumsum(counts) - 1, dtype=torch.long)
        try:
            out = self.model(input_ids=ids, position_ids=pos,
                             cache=PackedCache([r.caches for r in requests], counts),
                             use_cache=True, logits_to_keep=last)
        except BaseException:
            _roll_back(requests, lengths)
            raise
        return out.logits[0]

    def _accept(self, r, token):
        """A new token for ``r``: stream its text, decide whether it ends."""
        now = time.monotonic()
        if r.first_token_at is None:
            r.first_token_at = now
            if self.metrics is not None:
                self.metrics.first_token(r, now - r.arrived)
        elif self.metrics is not None:
            self.metrics.inter_token(now - r.last_token_at)
        r.last_token_at = now
        if r.stream is None:
            r.stream = TextStream(self._decode, r.stop)
        if token in self.eos:                    # not part of the text, nor of the usage
            self._end(r, *r.stream.finish(), "stop")
            return
        r.output_ids.append(token)
        delta, stopped = r.stream.push(token)
        if delta:
            r.emit("token", delta)
        if stopped:
            self._finish(r, "stop")
        elif len(r.output_ids) >= r.max_tokens:
            self._end(r, *r.stream.finish(), "length")

    def _decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _end(self, r, delta, stopped, reason):
        """The request ends (``reason``, or "stop" when the text's last part
        held a stop string): the held text goes out first."""
        if delta:
            r.emit("token", delta)
        self._finish(r, "stop" if stopped else reason)

    def _finish(self, r, reason):
        r.finish_reason = reason

    def _retire(self, r, publish):
        """``r`` leaves the batch: publish what it computed (prompt and
        output, the positions that have K/V), give its blocks back, report."""
        if r in self._running:
            self._running.remove(r)
        if r.caches is not None:
            if publish and self.reuse_prefixes:
                have = r.caches[0].seq_len
                ids = (r.prompt_ids + r.output_ids)[:have]
                try:
                    self.pool.publish(r.caches, np.asarray(ids, dtype=np.int64), salt=r.tenant)
                except Exception:             # publishing is an optimisation
                    pass
            for c in r.caches:
                c.close()
            r.caches = None
        if r.finish_reason is not None:
            if self.metrics is not None:
                self.metrics.finished(r, time.monotonic() - r.arrived)
            r.emit("done", r.finish_reason)
        self._cv.notify_all()

    def _fail(self, r, exc):
        r.finish_reason = None
        r.cancelled = True
        self._retire(r, publish=False)
        r.emit("error", exc)

    # -- threads mode ----------------------------------------------------------

    def _thread_main(self, r):
        """``mode="threads"``: one request, batch 1, in its own thread; its
        K/V in its reservation (``threads_cache="ferrox"``) or in a
        ``DynamicCache`` (``"dynamic"``)."""
        if self.threads_cache == "dynamic":
            cache = DynamicCache(config=self.model.config)

            def forward(tokens):
                out = self.model(input_ids=torch.tensor([tokens], dtype=torch.long),
                                 cache=cache, use_cache=True, logits_to_keep=1)
                return out.logits[0, -1, :]

            def length():
                return cache.get_seq_length()
        else:
            def forward(tokens):
                return self._forward([r], [tokens])[0]

            def length():
                return r.caches[0].seq_len
        try:
            with torch.inference_mode():
                while not r.cancelled and r.finish_reason is None and not self._stopping:
                    have = length()
                    if have < len(r.prompt_ids):
                        chunk = r.prompt_ids[have:have + self.prefill_chunk]
                        logits = forward(chunk)
                        if have + len(chunk) == len(r.prompt_ids):
                            self._accept(r, r.sampling.pick(logits))
                    else:
                        t0 = time.perf_counter()
                        logits = forward([r.output_ids[-1]])
                        dt = time.perf_counter() - t0
                        self._step_ema = dt if self._step_ema is None else 0.9 * self._step_ema + 0.1 * dt
                        self._accept(r, r.sampling.pick(logits))
        except Exception as e:
            with self._cv:
                self._fail(r, e)
            return
        finally:
            with self._cv:
                self._threads = [t for t in self._threads if t is not threading.current_thread()]
        with self._cv:
            self._retire(r, publish=r.finish_reason is not None)
            if r.finish_reason is None:
                r.emit("done", "cancelled")
                self._count("cancelled_running")
