# Sliding-window caches: a pooled cache made with ``window=W`` keeps what
# attention over its last append can still read, and gives earlier blocks
# back to the pool.
#
# Rules (c is claimed by the caller):
# * An append of t rows to a cache of length n makes queries at n..n+t-1;
#   the first of them reads positions from n - W + 1 on. So the append may
#   give back every block wholly before max(0, n - W + 1) (_trim_to): it
#   does so when it needs room anyway (its blocks are full, or a block is
#   shared) or when the cache holds more than its reservation (_trim_due),
#   in the same pool update that takes its new blocks (_make_room_each).
# * The reservation (``resv``) is what an append of up to ``max_chunk`` rows
#   needs: ceil((W + max_chunk - 1) / block_size) + 1 blocks
#   (_window_blocks). A growing cache takes blocks so that it again holds
#   ``resv`` blocks from its new base on: appends of up to ``max_chunk``
#   rows then recycle the cache's own blocks and never need a free one.
# * ``base`` (the first position held) is a multiple of block_size and never
#   exceeds max(0, len - W + 1): truncate refuses to go where it would,
#   except to 0, where the blocks held start over at position 0.
# * Positions before ``base`` are gone: attend, k/v and copies read from
#   ``base`` on; the sequence's ``len`` still counts every position.
# * A contiguous windowed cache (KvCache(..., window=W), or a pooled one's
#   copy) gives rows back when it grows: its new buffer holds the rows from
#   n - W + 1 on, twice what the append needs.
# * Windowed caches take no part in the prefix cache (no hits, no publish):
#   a hit would have to hold the last W positions of the prefix and nothing
#   else, which the prefix index (a chain of every block) does not describe.


cdef Py_ssize_t _window_arg(object window, object max_chunk, object tokens,
                            Py_ssize_t bs) except -1:
    """The window of with_pool / with_pool_many (0: none), validated."""
    if window is None:
        if max_chunk is not None:
            raise ValueError("max_chunk= goes with window=: it sizes a sliding window's "
                             "reservation")
        return 0
    cdef Py_ssize_t w = _positions(window, "window")
    if max_chunk is not None:
        _positions(max_chunk, "max_chunk")
    if tokens is not None:
        raise ValueError(
            "tokens= cannot be used with window=: a sliding-window cache takes no part "
            "in the prefix cache (it gives back the blocks a hit would share)")
    return w


cdef list _window_each(object window, Py_ssize_t count, object max_chunk, object tokens):
    """The windows of with_pool_many's ``count`` caches (0: none), validated,
    when ``window`` is a sequence of one entry (an int >= 1, or None) per
    cache; None when ``window`` is None or one value (_window_arg reads
    that). ``max_chunk`` may come with any such sequence; ``tokens`` only
    with one whose entries are all None."""
    if window is None or isinstance(window, (str, bytes)):
        return None
    try:
        _operator_index(window)
        return None
    except TypeError:
        pass
    try:
        entries = list(window)
    except TypeError:
        raise TypeError(f"window must be an integer, None, or a sequence of {count} of those "
                        f"(one per cache), got {type(window).__name__}") from None
    if len(entries) != count:
        raise ValueError(f"window has {len(entries)} entries for {count} caches: a window "
                         "sequence gives one window (or None) per cache")
    cdef list out = []
    for i, w in enumerate(entries):
        out.append(0 if w is None else _positions(w, f"window[{i}]"))
    if max_chunk is not None:
        _positions(max_chunk, "max_chunk")
    if tokens is not None:
        for i, w in enumerate(out):
            if w:
                raise ValueError(
                    f"tokens= cannot be used with window[{i}]={w}: a sliding-window cache "
                    "takes no part in the prefix cache (it gives back the blocks a hit would "
                    "share); every entry must be None to reuse a prefix")
    return out


cdef inline Py_ssize_t _window_blocks(Py_ssize_t window, Py_ssize_t max_chunk,
                                      Py_ssize_t bs) noexcept nogil:
    """Blocks an append of up to ``max_chunk`` rows to a window-``window``
    cache can need at once: rows n - window + 1 .. n + max_chunk - 1, which
    straddle at most one more block than they fill."""
    return _blocks_for(window + max_chunk - 1, bs) + 1


cdef inline Py_ssize_t _reserved_blocks(Py_ssize_t full, Py_ssize_t window, Py_ssize_t max_chunk,
                                        Py_ssize_t bs) noexcept nogil:
    """What one cache reserves: ``full`` blocks (its whole length, at least
    1), or with a window (> 0) at most what the window needs."""
    return max(min(full, _window_blocks(window, max_chunk, bs)), 1) if window else full


cdef inline Py_ssize_t _trim_to(Cache* c, Py_ssize_t n) noexcept nogil:
    """The base an append to a cache of length ``n`` may move to: the start
    of the block holding max(0, n - window + 1) (a contiguous cache: that
    position), never below the current base (windowed caches only)."""
    cdef Py_ssize_t bs = c.pool.block_size if c.pool != NULL else 1, keep = n - c.window + 1
    if keep <= c.base:
        return c.base
    return keep - keep % bs


cdef inline bint _trim_due(Cache* c) noexcept nogil:
    """Whether an append must go through _make_room_each to give blocks back
    although it has room: the cache holds more than its reservation (after
    an append longer than max_chunk) and a block has left the window."""
    return (c.window != 0 and c.pool != NULL and c.n_blocks > c.resv
            and _trim_to(c, c.len) > c.base)


cdef int _check_truncate(Cache* c, Py_ssize_t n) except -1:
    """ValueError when truncating a windowed cache to ``n`` positions would
    need rows it has given back (an append at n reads from n - window + 1).
    Truncating to 0 needs no row: the cache starts over at position 0."""
    if c.window == 0 or n == c.len or n == 0 or max(n - c.window + 1, 0) >= c.base:
        return 0
    raise ValueError(
        f"cannot truncate to {n}: this cache has a sliding window of {c.window} and "
        f"has given back positions before {c.base}; an append at {n} positions would "
        f"read from position {max(n - c.window + 1, 0)} (truncate to at least "
        f"{c.base + c.window - 1}, or to 0 to start over)")


cdef Py_ssize_t _attend_window(Cache** cs, Py_ssize_t n, Py_ssize_t w, bint given,
                               bint batched) except -1:
    """The window one attention call applies (0: none): ``w`` when
    ``given``, which must not exceed any windowed cache's own, else the
    caches' own window (one for all of them)."""
    cdef Py_ssize_t i
    if not given:
        w = cs[0].window
        for i in range(1, n):
            if cs[i].window != w:
                raise ValueError(
                    f"caches[{i}] has window {cs[i].window or None} and caches[0] "
                    f"{w or None}: pass window= explicitly to attend caches of different "
                    "windows together")
        return w
    for i in range(n):
        if cs[i].window and w > cs[i].window:
            raise ValueError(
                f"window={w} is larger than the sliding window {cs[i].window} of "
                + (f"caches[{i}]" if batched else "the cache")
                + ": it has given back the positions such a window would read")
    return w


cdef int _check_held(Cache* c, Py_ssize_t q_len, Py_ssize_t w, Py_ssize_t start,
                     str name) except -1:
    """ValueError when attention of the last ``q_len`` positions with window
    ``w`` (0: none) from ``start`` would read a position the cache gave back."""
    cdef Py_ssize_t lo = 0 if w == 0 else c.len - q_len - w + 1
    if lo < start:
        lo = start
    if lo < c.base:
        raise ValueError(
            f"{name} holds positions from {c.base} on (its sliding window of {c.window} "
            f"gave the rest back), but {q_len} queries"
            + (f" with window {w}" if w else " without a window")
            + f" read from position {max(lo, 0)}")
    return 0
