"""The timing harness and the results table: numbers a person can read,
``Results`` (the rows every group adds to), ``best_of`` (variants timed
interleaved, after one untimed warm-up pass) and the thread runners. Imports
no other module of the bench."""
from __future__ import annotations

import gc
import math
import os
import sys
import textwrap
import threading
import time

import numpy as np

# ---------------------------------------------------------------------------
# Numbers a person can read: fixed point, sensible units, never 1.2e+04
# ---------------------------------------------------------------------------


def _micro():
    """"µs" where stdout can print it, else "us"."""
    enc = getattr(sys.stdout, "encoding", None) or "ascii"
    try:
        "µ".encode(enc)
    except (UnicodeEncodeError, LookupError):
        return "us"
    return "µs"


def fmt_num(x) -> str:
    """About three significant digits in fixed point: 1234, 123, 12.3, 1.23,
    0.123; below 0.001 ``<0.001``. Never scientific notation."""
    if x is None:
        return ""
    x = float(x)
    if math.isnan(x):
        return "n/a"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    a = abs(x)
    if a == 0:
        return "0"
    if a < 0.0005:
        return "<0.001" if x > 0 else ">-0.001"
    for limit, decimals in ((0.9995, 3), (9.995, 2), (99.95, 1)):
        if a < limit:
            return f"{x:.{decimals}f}"
    return f"{x:.0f}"


TIME_IN = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_TIME = (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9))
_BYTES = (("GiB", 2.0 ** 30), ("MiB", 2.0 ** 20), ("KiB", 2.0 ** 10), ("B", 1.0))
_RATE_B = (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3), ("B/s", 1.0))
_RATE_POS = (("Gpos/s", 1e9), ("Mpos/s", 1e6), ("kpos/s", 1e3), ("pos/s", 1.0))


def _scaled(base, ladder):
    """(value, unit) from a ladder of (unit, size), largest first: the largest
    unit the value reaches (so 1234 us -> 1.23 ms), else the smallest."""
    for unit, size in ladder:
        if abs(base) >= size * 0.9995:
            return base / size, unit
    unit, size = ladder[-1]
    return base / size, unit


def fmt_quantity(value, unit: str) -> str:
    """``value`` in ``unit`` (as measured: "ns/pos", "us/token", "GB/s",
    "MiB", ...) rescaled to the unit that reads best, fixed point:
    ``fmt_quantity(12634, "us/token") == "12.6 ms/token"``."""
    if value is None:
        return ""
    if isinstance(value, (int, np.integer)) and unit == "":
        return str(int(value))
    value = float(value)
    if math.isnan(value) or math.isinf(value) or value == 0:
        return f"{fmt_num(value)} {unit}".strip()
    for family in (_RATE_B, _RATE_POS, _BYTES):
        sizes = dict(family)
        if unit in sizes:
            v, u = _scaled(value * sizes[unit], family)
            return f"{fmt_num(v)} {u}"
    if unit == "x":
        return f"{fmt_num(value)}x"
    head, sep, tail = unit.partition("/")
    if head in TIME_IN:
        v, u = _scaled(value * TIME_IN[head], _TIME)
        if u == "us":
            u = _micro()
        return f"{fmt_num(v)} {u}{sep}{tail}"
    return f"{fmt_num(value)} {unit}".strip()


# ---------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------

def better_for(unit: str) -> str:
    """Which way a ratio of two figures in ``unit`` is good: "higher" for
    rates (".../s") and scalings ("x"), "lower" for times, bytes and counts."""
    return "higher" if unit.endswith("/s") or unit == "x" else "lower"


ROW_DEFAULTS = {"threads": 1}


class Results:
    """Rows of (group, geometry, slug, name, value, unit, ratio, ratio_of,
    better, extra fields). ``slug`` is the row's stable identifier (what
    targets, the plot and JSON readers look rows up by); ``name`` is for
    people; ``better`` ("lower" or "higher", on rows with a ratio) says which
    way the ratio is good: by default from the unit (``better_for``), given
    where the ratio reads the other way (a speed-up of a time)."""

    def __init__(self):
        self.rows = []

    def add(self, group, geometry, slug, name, value, unit, ratio=None, ratio_of=None,
            better=None, **extra):
        if better is None and ratio is not None:
            better = better_for(unit)
        row = {"group": group, "geometry": geometry, "slug": slug, "name": name,
               "value": value, "unit": unit, "ratio": ratio, "ratio_of": ratio_of,
               "better": better}
        row.update(extra)
        self.rows.append(row)
        return row

    def find(self, slug, **where):
        """The first row with this slug whose fields match ``where`` (a row
        without a ``threads`` field ran on one thread)."""
        for r in self.rows:
            if r["slug"] == slug and all(r.get(k, ROW_DEFAULTS.get(k)) == v for k, v in where.items()):
                return r
        return None

    def ratio(self, slug, **where):
        r = self.find(slug, **where)
        return None if r is None else r["ratio"]

    def table(self, group, title="", name_width=50):
        rows = [r for r in self.rows if r["group"] == group]
        if not rows:
            return ""
        geo_w = max(8, max(len(str(r["geometry"])) for r in rows))
        cells = [(str(r["geometry"]), r["name"], fmt_quantity(r["value"], r["unit"]),
                  "" if r["ratio"] is None else fmt_num(r["ratio"]),
                  r.get("better") or "", r["ratio_of"] or "")
                 for r in rows]
        name_w = min(name_width, max(len(c[1]) for c in cells))
        val_w = max(10, max(len(c[2]) for c in cells))
        out = [f"\n== {group}" + (f": {title}" if title else ""),
               f"{'geometry':<{geo_w}}  {'measure':<{name_w}}  {'value':>{val_w}}  "
               f"{'ratio':>7}  {'better':<6}  of"]
        for geo, name, val, ratio, better, of in cells:
            lines = textwrap.wrap(name, name_w, subsequent_indent="  ") or [""]
            out.append(f"{geo:<{geo_w}}  {lines[0]:<{name_w}}  {val:>{val_w}}  {ratio:>7}  "
                       f"{better:<6}  {of}".rstrip())
            out.extend(f"{'':<{geo_w}}  {more}" for more in lines[1:])
        return "\n".join(out)


# ---------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------

def best_of(variants, reps):
    """Run each (name, setup, run) once untimed, then ``reps`` times timed,
    interleaved; return the best seconds of each. ``setup()`` makes fresh
    state (untimed) that ``run`` receives. The warm-up pass brings the
    allocator, the CPU caches and lazily built state to what the timed
    passes will see, whatever ran before this call, so a group timed alone
    and the same group inside a full run measure the same thing."""
    best = {name: float("inf") for name, _, _ in variants}
    for rep in range(reps + 1):
        for name, setup, run in variants:
            state = setup()
            gc.disable()
            t0 = time.perf_counter()
            run(state)
            dt = time.perf_counter() - t0
            gc.enable()
            if rep:
                best[name] = min(best[name], dt)
            del state
    return best


def rows(n, width, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, width), dtype=np.float32)


def start_together(n, fn, timeout=None):
    """Run ``fn(i)`` on ``n`` threads that a barrier releases together, and
    wait for them (each join at most ``timeout`` seconds). Returns the wall
    seconds from the release until the last one finished, and what the
    threads raised (a list, empty when every one finished cleanly). A thread
    still running when its join timed out is a ``RuntimeError``. The bench's
    runs and the tests' threads both start here."""
    barrier = threading.Barrier(n + 1)
    errors = []

    def body(i):
        try:
            barrier.wait()
            fn(i)
        except BaseException as e:  # handed to the caller
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    barrier.wait()
    t0 = time.perf_counter()
    for th in threads:
        th.join(timeout)
    dt = time.perf_counter() - t0
    if any(th.is_alive() for th in threads):
        raise RuntimeError(f"a thread did not finish within {timeout} s")
    return dt, errors


def run_threads(n, fn):
    """Start n threads running fn(i) together; return wall seconds (the first
    exception a thread raised is raised here)."""
    dt, errors = start_together(n, fn)
    if errors:
        raise errors[0]
    return dt


def loops_for(fn, target_s):
    """How many calls of fn(0) take about target_s (one untimed warm-up call)."""
    fn(0)
    t0 = time.perf_counter()
    fn(0)
    return max(1, int(target_s / max(time.perf_counter() - t0, 1e-7)))


def thread_counts(max_threads):
    counts = [1]
    while counts[-1] * 2 <= max_threads:
        counts.append(counts[-1] * 2)
    if counts[-1] != max_threads:
        counts.append(max_threads)
    return counts


def scaling(works, counts, reps, progress=None):
    """For each (name, fn(i)) of ``works``: best seconds of ``counts`` threads
    each running fn, thread counts and works interleaved within every
    repetition (so a slow spell of a shared machine hits all of them).
    ``progress(done, total, name, threads)``, when given, is called before
    each timed run."""
    best = {(name, t): float("inf") for name, _ in works for t in counts}
    total, done = reps * len(works) * len(counts), 0
    for _ in range(reps):
        for name, fn in works:
            for t in counts:
                if progress is not None:
                    progress(done, total, name, t)
                best[name, t] = min(best[name, t], run_threads(t, fn))
                done += 1
    return best


def usable_cpus():
    """The CPUs this process may run on (its affinity), else os.cpu_count()."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def rss():
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


def llc_bytes(root="/sys/devices/system/cpu/cpu0/cache"):
    """The size of the largest CPU cache (sysfs), or 256 MiB where unknown."""
    sizes = []
    try:
        names = os.listdir(root)
    except OSError:
        names = []
    for name in names:
        try:
            with open(os.path.join(root, name, "size")) as f:
                text = f.read().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text[:-1] if scale > 1 else text
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes) if sizes else 256 << 20


_EVICT = []


def evict_caches():
    """Reads a buffer of twice the largest cache's size (at most 2 GiB,
    allocated on first use), one float per 64-byte line, split over one
    thread per usable CPU (numpy sums without the GIL), so that a call timed
    next finds none of its own data in a CPU cache, the other cores' private
    caches included. A model's decode meets each layer's K/V that way: the
    other layers' weights and rows went through every core's caches since
    the step before. The "from memory" rows of the bench time single calls
    after it."""
    if not _EVICT:
        _EVICT.append(np.ones(min(2 * llc_bytes(), 2 << 30) // 4, np.float32))
    parts = np.array_split(_EVICT[0][::16], usable_cpus())
    sums = [0.0] * len(parts)

    def read(i):
        sums[i] = float(parts[i].sum())
    readers = [threading.Thread(target=read, args=(i,)) for i in range(1, len(parts))]
    for t in readers:
        t.start()
    read(0)
    for t in readers:
        t.join()
    return sum(sums)


def best_from_memory(calls, reps):
    """Microseconds of one call of each (name, fn) of ``calls``, each call
    timed alone after ``evict_caches``, interleaved, best of 2 * reps + 1
    (single calls vary more than loops of them). The bench's "from memory"
    rows."""
    timed = best_of([(name, evict_caches, lambda _, fn=fn: fn()) for name, fn in calls], 2 * reps + 1)
    return {k: v * 1e6 for k, v in timed.items()}
