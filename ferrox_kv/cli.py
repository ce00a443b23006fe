"""The ``ferrox-kv`` command (also ``python -m ferrox_kv``).

    ferrox-kv bench [--quick] [--json FILE] [--plot FILE.png] [--groups ...] ...
    ferrox-kv info
    ferrox-kv serve MODEL_DIR [--kv-gib N | --kv-blocks N] ...   (the [serve] extra)
"""
from __future__ import annotations

import argparse
import os
import platform
import sys


# ---------------------------------------------------------------------------
# info
# ---------------------------------------------------------------------------

def _dist_version(name):
    """The installed version of a distribution, without importing it (torch
    takes seconds to import); None when it is not installed."""
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:      # pragma: no cover
        return None
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def info_lines():
    import numpy as np

    import ferrox_kv
    from ferrox_kv import _core

    lines = [f"ferrox_kv {ferrox_kv.__version__}",
             f"  installed at       {os.path.dirname(os.path.abspath(ferrox_kv.__file__))}",
             f"  extension          {os.path.basename(_core.__file__)}"]
    b = _core.build_info()
    lines += [f"  build              {b['build']}",
              f"  compiler           {b['compiler']}",
              f"  kernel built for   {b['kernel']}"]
    lines += [f"  attention SIMD     {ferrox_kv.simd_path()}   [simd_path()]"]
    lines += [f"    rows of {dt:<10} {ferrox_kv.simd_path(dt).split('; ', 1)[1]}   "
              f"[simd_path({dt!r})]" for dt in ferrox_kv.DTYPES]
    lines += [
              f"  GIL released for   copies of >= {ferrox_kv.gil_release_threshold()} bytes "
              "per call   [gil_release_threshold()]",
              f"  GIL released for   attention over >= "
              f"{ferrox_kv.attend_gil_release_threshold()} context bytes per call   "
              "[attend_gil_release_threshold()]"]
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    cpus = f"{os.cpu_count()}" + (f" ({affinity} usable by this process)"
                                  if affinity is not None and affinity != os.cpu_count() else "")
    lines += ["environment",
              f"  Python             {platform.python_version()} "
              f"({platform.python_implementation()}, {sys.executable})",
              f"  platform           {platform.platform()}",
              f"  CPUs               {cpus}",
              f"  numpy              {np.__version__}"]
    for dist in ("torch", "transformers", "matplotlib"):
        v = _dist_version(dist)
        lines.append(f"  {dist:<18} {v or 'not installed'}")
    if not (_dist_version("torch") and _dist_version("transformers")):
        lines.append("  (ferrox_kv.hf and the bench's hf rows need torch and transformers: "
                     "pip install '.[hf]' from the ferrox_kv checkout)")
    return lines


def cmd_info(args):
    print("\n".join(info_lines()))
    return 0


# ---------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------

def quiet_on_closed_pipe(func, *args):
    """``func(*args)``, then stdout flushed; when the reader of stdout has
    gone (``ferrox-kv info | head``), exit quietly with the status a tool
    killed by SIGPIPE has (141), as command-line tools do."""
    try:
        status = func(*args)
        sys.stdout.flush()
        return status
    except BrokenPipeError:
        # stdout's buffered rest cannot be written: point it at /dev/null so
        # that the interpreter's own flush at exit does not fail again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + 13


def bench_description():
    from ferrox_kv.bench.runner import DESCRIPTION
    return DESCRIPTION


def make_parser(prog="ferrox-kv"):
    from ferrox_kv import bench

    ap = argparse.ArgumentParser(
        prog=prog, description="ferrox_kv: a paged KV cache for transformer inference.")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    b = sub.add_parser("bench", help="the benchmark (the main job): tables, targets, JSON, plot",
                       description=bench_description(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_arguments(b)
    b.set_defaults(func=bench.run)
    i = sub.add_parser("info", help="version, build, SIMD path, GIL thresholds, environment")
    i.set_defaults(func=cmd_info)
    from ferrox_kv.serve import cli as serve_cli     # argparse only; the server loads on run
    s = sub.add_parser("serve", help="an OpenAI-compatible server over a local checkpoint",
                       description=serve_cli.DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    serve_cli.add_arguments(s)
    s.set_defaults(func=serve_cli.run)
    return ap


def main(argv=None, prog=None):
    if prog is None:
        prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "ferrox-kv"
        if prog in ("__main__.py", "-c", "") or prog.endswith(".py"):
            prog = "ferrox-kv"
    args = make_parser(prog).parse_args(argv)
    return quiet_on_closed_pipe(args.func, args)


if __name__ == "__main__":
    sys.exit(main())
