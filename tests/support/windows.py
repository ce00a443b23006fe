"""What a sliding-window pooled cache holds after each operation, by the
rules of ferrox_kv/_window.pxi: the model the window tests check against."""


def ceil(a, b):
    return -(-a // b)


class Rule:
    """What _window.pxi says a windowed pooled cache holds: its first
    position ``base``, its block count ``nb`` and its shared prefix."""

    def __init__(self, bs, window, resv):
        self.bs, self.w, self.resv = bs, window, resv
        self.base, self.nb, self.len, self.shared = 0, resv, 0, 0
        self.pooled = True

    def cap(self):
        return self.base + self.nb * self.bs if self.pooled else self.ccap

    def release(self):
        self.ccap, self.pooled, self.nb = self.cap(), False, 0

    def private_at(self, r):
        return self.shared == 0 or r - self.base >= self.shared * self.bs

    def trim_to(self, n):
        keep = n - self.w + 1
        return self.base if keep <= self.base else keep - keep % self.bs

    def trim_due(self):
        return self.nb > self.resv and self.trim_to(self.len) > self.base

    def plan(self, t):
        """(blocks given back, blocks taken) by an append of t rows."""
        n, bs = self.len, self.bs
        if not self.pooled or t == 0:
            return 0, 0
        if not (n + t > self.cap() or not self.private_at(n) or self.trim_due()):
            return 0, 0
        trim = (self.trim_to(n) - self.base) // bs
        held = max(ceil(n + t - self.base, bs), trim + self.resv)
        return trim, max(held - self.nb, 0)

    def append(self, t):
        n, bs = self.len, self.bs
        if not self.pooled and n + t > self.ccap:      # a new buffer from the window on
            self.base = max(self.base, n - self.w + 1)
            self.ccap = self.base + max(2 * (n + t - self.base), 4)
        if self.pooled and t and (n + t > self.cap() or not self.private_at(n)
                                  or self.trim_due()):
            trim, grow = self.plan(t)
            if not self.private_at(n) and min(ceil(n - self.base + t, bs), self.nb) >= self.shared:
                self.shared = (n - self.base) // bs
            self.shared = max(self.shared - trim, 0)
            self.base += trim * bs
            self.nb += grow - trim
        self.len += t

    def truncate_ok(self, n):
        return n == self.len or n == 0 or max(n - self.w + 1, 0) >= self.base

    def truncate(self, n):
        if n == 0:
            if not self.pooled:
                self.ccap -= self.base
            self.base = 0
        self.len = n

    def fork(self):
        child = Rule(self.bs, self.w, self.resv)
        if not self.pooled:                  # a contiguous cache's fork is its copy
            child.pooled, child.nb, child.base, child.len = False, 0, self.base, self.len
            child.ccap = self.len
            return child
        full, tail = divmod(self.len - self.base, self.bs)
        child.base, child.len, child.shared = self.base, self.len, full
        child.nb = max(self.nb, full + (tail > 0))
        if full > self.shared:
            self.shared = full
        return child

    @classmethod
    def contiguous(cls, window, base=0, length=0, cap=0):
        """A contiguous windowed cache (KvCache(..., window=W), a copy, a
        released one): rows from ``base`` in a buffer of capacity ``cap``."""
        r = cls(1, window, 0)
        r.pooled, r.nb, r.base, r.len, r.ccap = False, 0, base, length, cap
        return r

    def copy(self):
        """copy(): contiguous, the rows from ``base`` on, capacity its length."""
        return Rule.contiguous(self.w, self.base, self.len, self.len)


def assert_rule(c, r):
    assert (c.first_pos, c.blocks_held, c.seq_len) == (r.base, r.nb if r.pooled else 0, r.len)
    assert c.capacity == r.cap()

