"""What every group shares and nothing else: the geometries, the block size,
the legend, the log line, the optional dependencies, the torch layout the
SDPA baselines are given (``heads_first``), and the two records a group is
made of (``Group``) and run with (``Run``). Imports no other module of the
bench."""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Callable

# name: (n_kv_heads, head_dim, layers)
GEOMETRIES = {
    "llama8b": (8, 128, 32),     # Llama-3-8B: 8 KV heads x 128, 32 layers
    "small": (2, 64, 32),
    "wide": (32, 128, 32),
}
BLOCK_SIZE = 16
# hints name commands that work from the checkout (the package is not on an index)
HF_INSTALL = "pip install '.[hf]' (from the ferrox_kv checkout)"
PLOT_INSTALL = "pip install '.[plot]' (from the ferrox_kv checkout)"
STORE_INSTALL = "pip install '.[store]' (from the ferrox_kv checkout)"
REDIS_INSTALL = "pip install '.[redis]' (from the ferrox_kv checkout)"

# the attention group: Llama-3-8B's attention (32 query heads over 8 KV heads x 128)
ATTN_HEADS, ATTN_KV_HEADS, ATTN_DIM = 32, 8, 128

LEGEND = """\
How to read this: every ratio is taken within this one run (variants timed
several times, interleaved, best kept, after one untimed warm-up pass); "of"
names the denominator and "better" says which way is good for that row.
  geometries   KV heads x head_dim x layers: llama8b 8x128x32 (Llama-3-8B),
               small 2x64x32, wide 32x128x32. attention and hf: 32 query heads
               over 8 KV heads x 128.
  [cached]     thread runs whose working set stays in the CPU caches: what
               limits them is ferrox's own overhead (GIL, locks).
  [stream]     thread runs that stream MiBs through DRAM: memory bandwidth
               limits them.
  floor        a C loop doing the same memory traffic with no Python per row
               (memcpy into fresh memory for copies; one read pass over K and V
               for attention): the hardware limit."""


def log(msg):
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# Optional dependencies
# ---------------------------------------------------------------------------

def try_import(name):
    try:
        return __import__(name)
    except Exception:   # ImportError, or a broken install: either way, not usable
        return None


def have_torch():
    return try_import("torch") is not None


def heads_first(torch, x, dtype=None):
    """(T, H, D) float32 numpy rows as the contiguous (1, H, T, D) torch
    tensor DynamicCache hands attention, converted to ``dtype`` if given."""
    t = torch.from_numpy(x.transpose(1, 0, 2).copy())[None]
    return t if dtype is None else t.to(dtype)


def have_hf():
    if not have_torch() or try_import("transformers") is None:
        return False
    try:
        from transformers import DynamicCache  # noqa: F401
    except Exception:
        return False
    return True


def have_matplotlib():
    return try_import("matplotlib") is not None


class Threads:
    """torch and ferrox_kv's attention both on ``n`` threads for the block
    (every comparison runs the baseline at the thread count of the row it is
    compared with); both restored after. The context value is torch, or
    None without it."""

    def __init__(self, n=1):
        self.n = n
        self.torch = try_import("torch")

    def __enter__(self):
        import ferrox_kv
        self.old_ferrox = ferrox_kv.set_num_threads(self.n)
        if self.torch is not None:
            self.old = self.torch.get_num_threads()
            self.torch.set_num_threads(self.n)
        return self.torch

    def __exit__(self, *exc):
        import ferrox_kv
        ferrox_kv.set_num_threads(self.old_ferrox)
        if self.torch is not None:
            self.torch.set_num_threads(self.old)


class Torch1(Threads):
    """One thread of torch and one of ferrox_kv for the block."""

    def __init__(self):
        super().__init__(1)


def thread_counts(args):
    """The thread counts the attention and hf rows run at: 1 and the
    bench's ``--threads`` (the CPUs by default), when that is more."""
    n = getattr(args, "threads", 1) or 1
    return [1] if n <= 1 else [1, n]


def thread_tag(n):
    """What names a row or target taken at ``n`` threads begin with ("" at
    one thread)."""
    return "" if n == 1 else f"[{n} threads] "


# ---------------------------------------------------------------------------
# A group, and what its runner gets
# ---------------------------------------------------------------------------

@dataclass
class Run:
    """What a group's runner gets."""
    res: object          # harness.Results
    args: argparse.Namespace
    geos: list
    quick: bool
    reps: int
    torch_ok: bool       # torch importable
    hf_ok: bool          # torch and transformers importable
    contexts: list | None


@dataclass
class Group:
    """One group of the bench: its module defines ``GROUP = Group(...)``."""
    slug: str
    title: str
    run: Callable[[Run], None]
    targets: Callable = lambda res: []   # (Results) -> [targets.Target] this run has rows for
    needs_hf: bool = False     # the whole group needs torch and transformers
    torch_rows: str = ""       # rows skipped without torch (said in the skipped line)
    hf_rows: str = ""          # rows skipped without transformers
    # what of the group this environment skips for other reasons, and how to
    # get it (None: nothing); said in the report's skipped line
    missing: Callable[[], str | None] = lambda: None
