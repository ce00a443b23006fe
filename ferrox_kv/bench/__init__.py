"""The main job: ``ferrox-kv bench`` (also ``python -m ferrox_kv bench`` and,
as before, ``python -m ferrox_kv.bench``).

Measures ferrox_kv against the hardware's floor (a C loop doing the same
memory traffic with no Python per row) and against what users write instead
(a numpy array managed by hand, transformers' ``DynamicCache``, torch's SDPA
over contiguous tensors), and prints a verdict line (targets met, missed, and
how many misses the hardware imposes), one table per group, then the targets.
Every figure is a ratio taken in the same run (these machines are shared and
noisy): each variant is timed several times, interleaved with the others, and
the best time of each is kept.

    ferrox-kv bench [--quick] [--json FILE] [--plot FILE.png] [--groups push,extend,...]
                    [--threads N] [--geometry NAME] [--contexts 512,2048,8192]

Groups that need torch/transformers (``hf``; the SDPA and DynamicCache rows
of ``attention`` and ``decode``) are skipped without them, with one line that
says so and how to install them. ``--plot`` without matplotlib is refused
before any work.

The package, bottom to top: ``common`` (geometries, block size, legend,
optional dependencies, the ``Group`` record) and ``harness`` (timing,
``Results``); ``targets`` (goals as data; why a target is missed is in
benchmarks/NOTES.md under its slug); ``llama`` (the hf model); one module per
group in ``groups/``, each with its targets; ``report`` and ``plot``; and
``runner``, which lists the groups (``GROUP_MODULES``) and runs them.
"""
from ferrox_kv.bench.harness import Results, fmt_num, fmt_quantity

__all__ = ["Results", "fmt_num", "fmt_quantity", "GROUPS", "add_arguments", "main", "run"]

# The runner (and with it every group) is imported on first use, so that a
# group module imported alone loads only the modules below it.
_RUNNER = ("GROUPS", "GROUP_MODULES", "add_arguments", "main", "run", "skipped_line")


def __getattr__(name):
    if name in _RUNNER:
        from ferrox_kv.bench import runner
        return getattr(runner, name)
    raise AttributeError(f"module 'ferrox_kv.bench' has no attribute {name!r}")
