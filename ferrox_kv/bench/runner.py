"""The runner, on top of the bench: the registry of groups, the options, and
the run (groups, then the report, the plot and the JSON). Nothing in the
bench imports this module back."""
from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import time

import numpy as np

import ferrox_kv
from ferrox_kv.bench.common import (GEOMETRIES, HF_INSTALL, PLOT_INSTALL, Run, have_hf,
                                    have_matplotlib, have_torch, log, try_import)
from ferrox_kv.bench.harness import Results
from ferrox_kv.bench.report import report
from ferrox_kv.bench.targets import evaluate

# The registry: one module of ferrox_kv.bench.groups per group, in run order.
# A new group is a new module there and its name here.
GROUP_MODULES = ["push", "extend", "pool", "threads", "decode", "attention", "sharing", "memory",
                 "hf", "precision", "capacity", "store"]

GROUPS = {g.slug: g for g in (importlib.import_module(f"ferrox_kv.bench.groups.{m}").GROUP
                              for m in GROUP_MODULES)}

DESCRIPTION = """\
The main job: measures ferrox_kv against the hardware's floor (a C loop doing
the same memory traffic) and against what users write instead (a numpy array,
transformers' DynamicCache, torch's SDPA), then prints a verdict line, one
table per group and the targets. Every figure is a ratio taken in this one run.

Groups that need something not installed here (torch and transformers; the
store's xxhash and redis extras; a redis-server binary) are skipped, and the
report says which and how to get them."""

# JSON schema: 2 added "schema", "verdict", a "better" field on every row and
# "hardware_bound" on every target; everything of 1 is unchanged.
SCHEMA = 2


def skipped_line(groups, torch_ok, hf_ok):
    """The one line that names what this run skips for lack of torch or
    transformers, and how to get it; None when nothing is skipped."""
    if hf_ok:
        return None
    parts = []
    for slug in groups:
        g = GROUPS[slug]
        if g.needs_hf:
            parts.append(f"the {slug} group")
        if g.torch_rows and not torch_ok:
            parts.append(g.torch_rows)
        if g.hf_rows:
            parts.append(g.hf_rows)
    if not parts:
        return None
    missing = "torch and transformers are" if not torch_ok else "transformers is"
    if not torch_ok and try_import("transformers") is not None:
        missing = "torch is"
    return (f"skipped ({missing} not installed): {'; '.join(parts)}. "
            f"To run them: {HF_INSTALL}")


def missing_line(groups):
    """The line that names what the groups skip for other missing pieces
    (an extra, a binary), and how to get them; None when nothing is."""
    parts = [m for m in (GROUPS[slug].missing() for slug in groups) if m]
    if not parts:
        return None
    return "skipped (not installed here): " + "; ".join(parts) + "."


def _int_list(text):
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}")
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"contexts must be positive integers: {text!r}")
    return vals


def _group_list(text):
    vals = [x.strip() for x in text.split(",") if x.strip()]
    bad = [v for v in vals if v not in GROUPS]
    if bad or not vals:
        raise argparse.ArgumentTypeError(
            f"unknown group(s) {', '.join(bad) or '(none)'}; choose from {', '.join(GROUPS)}")
    return vals


def add_arguments(ap):
    """The bench's options (shared by ``ferrox-kv bench`` and
    ``python -m ferrox_kv.bench``)."""
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: short contexts, 3 repetitions (several minutes on "
                         "2 cores; each group logs its progress)")
    ap.add_argument("--json", metavar="FILE", help="write every figure here as JSON")
    ap.add_argument("--plot", metavar="FILE.png",
                    help=f"draw per-token cost against context, push and extend against "
                    f"their floors (needs matplotlib: {PLOT_INSTALL})")
    ap.add_argument("--threads", type=int, default=max(2, os.cpu_count() or 2),
                    help="most threads in the threads group, and the N of the attention and hf "
                         "rows taken at 1 and N threads (default: CPU count, at least 2)")
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), action="append",
                    help="run only this geometry (repeatable); default: all three")
    ap.add_argument("--groups", type=_group_list, default=list(GROUPS),
                    help=f"comma-separated groups to run (default: all: {','.join(GROUPS)})")
    ap.add_argument("--contexts", type=_int_list, default=None, metavar="N,N,...",
                    help="contexts (positions) for the decode, attention and hf groups "
                    "(default: per group; --quick uses short ones)")
    return ap


def run(args):
    """Run the bench for parsed ``args``; return the exit status. Refuses
    (status 2, before any work) options it cannot honour."""
    if args.threads < 1:
        print("--threads must be >= 1", file=sys.stderr)
        return 2
    if args.plot and not have_matplotlib():
        print(f"--plot needs matplotlib, which is not installed: {PLOT_INSTALL} "
              "(or run without --plot)", file=sys.stderr)
        return 2
    geos = args.geometry or list(GEOMETRIES)
    groups = [g for g in GROUPS if g in args.groups]     # registry order
    q = args.quick
    needs_torch = any(GROUPS[g].needs_hf or GROUPS[g].torch_rows or GROUPS[g].hf_rows
                      for g in groups)
    torch_ok = have_torch() if needs_torch else False
    hf_ok = have_hf() if needs_torch else False
    skipped = skipped_line(groups, torch_ok, hf_ok) if needs_torch else None
    other = missing_line(groups)
    if other:
        skipped = other if skipped is None else skipped + "\n" + other

    res = Results()
    t_start = time.perf_counter()
    log(f"ferrox_kv {ferrox_kv.__version__}, numpy {np.__version__}, "
        f"{os.cpu_count()} CPUs, groups {','.join(groups)}, geometries {geos}"
        f"{' (quick)' if q else ''}")
    r = Run(res=res, args=args, geos=geos, quick=q, reps=3 if q else 9, torch_ok=torch_ok,
            hf_ok=hf_ok, contexts=args.contexts)
    for slug in groups:
        g = GROUPS[slug]
        if g.needs_hf and not hf_ok:
            continue
        g.run(r)

    evaluated = evaluate([t for slug in groups for t in GROUPS[slug].targets(res)], res)
    header = (f"ferrox_kv {ferrox_kv.__version__} bench: {os.cpu_count()} CPUs, "
              f"attention SIMD path {ferrox_kv.simd_path()}{', quick run' if q else ''}")
    text, targets = report(res, [GROUPS[s] for s in groups], evaluated, header, skipped)
    print(text)
    elapsed = time.perf_counter() - t_start
    print(f"\n(ran {elapsed:.0f} s; ratios are from this one run; 'of' names the denominator,"
          " 'better' which way is good)")
    if args.plot:
        from ferrox_kv.bench.plot import plot
        plot(res, args.plot, evaluated, ferrox_kv.__version__)
        print(f"plot: {args.plot}")
    if args.json:
        doc = {
            "schema": SCHEMA,
            "ferrox_kv": ferrox_kv.__version__,
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                        "python": platform.python_version(), "numpy": np.__version__,
                        "processor": platform.processor() or platform.machine(),
                        "simd_path": ferrox_kv.simd_path()},
            "args": {k: v for k, v in vars(args).items() if k != "func"},
            "gil_release_bytes": ferrox_kv.gil_release_threshold(),
            "attend_gil_release_bytes": ferrox_kv.attend_gil_release_threshold(),
            "elapsed_s": elapsed,
            "skipped": skipped,
            "verdict": text.splitlines()[0],
            "results": res.rows,
            "targets": targets,
        }
        if torch_ok:
            doc["machine"]["torch"] = sys.modules["torch"].__version__
        if hf_ok:
            doc["machine"]["transformers"] = sys.modules["transformers"].__version__
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        log(f"wrote {args.json}")
    return 0


def main(argv=None, prog="python -m ferrox_kv.bench"):
    """``python -m ferrox_kv.bench``: the same as ``ferrox-kv bench``."""
    from ferrox_kv.cli import quiet_on_closed_pipe

    ap = argparse.ArgumentParser(prog=prog, description=DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    args = ap.parse_args(argv)
    return quiet_on_closed_pipe(run, args)
