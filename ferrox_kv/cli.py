"""The ``ferrox-kv`` command (also ``python -m ferrox_kv``).

    ferrox-kv bench [--quick] [--json FILE] [--plot FILE.png] [--groups ...] ...
    ferrox-kv info
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import struct
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


def _elf_sections(path):
    """{name: bytes} of the sections of a 64-bit little-endian ELF file that
    ``info`` reads (.comment, .dynstr, .dynamic, .debug_str,
    .debug_line_str); {} for anything else (another format, another OS)."""
    wanted = {".comment", ".dynstr", ".dynamic", ".debug_str", ".debug_line_str"}
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return {}
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return {}
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    if shoff == 0 or shnum == 0 or shoff + shnum * shentsize > len(data):
        return {}

    def header(i):
        # name, type, flags, addr, offset, size
        name, _, flags, _, off, size = struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize)
        return name, flags, off, size

    _, _, str_off, str_size = header(shstrndx)
    names = data[str_off:str_off + str_size]
    out = {}
    for i in range(shnum):
        name_off, flags, off, size = header(i)
        name = names[name_off:names.index(b"\0", name_off)].decode("ascii", "replace")
        if name in wanted and not flags & 0x800:      # skip SHF_COMPRESSED sections
            out[name] = data[off:off + size]
    return out


def build_info(so_path):
    """What the compiled extension says about its own build, read from its
    ELF sections: the compiler (``.comment``), the compiler's command-line
    flags as recorded in the debug info (``DW_AT_producer``, present when it
    was built with -g, as CPython's default CFLAGS do), and whether it links
    AddressSanitizer (a ``libasan`` entry among its needed libraries: the
    debug build). Values are None where the file does not say."""
    sec = _elf_sections(so_path)
    info = {"compiler": None, "flags": None, "asan": None}
    if not sec:
        return info
    comment = sec.get(".comment", b"").split(b"\0")
    comment = [c.decode("utf-8", "replace") for c in comment if c]
    if comment:
        info["compiler"] = "; ".join(dict.fromkeys(comment))
    for name in (".debug_str", ".debug_line_str"):
        m = re.search(rb"GNU C[^\0]*", sec.get(name, b""))
        if m:
            info["flags"] = m.group(0).decode("utf-8", "replace")
            break
    if ".dynstr" in sec:
        info["asan"] = b"libasan" in sec[".dynstr"]
    return info


def info_lines():
    import numpy as np

    import ferrox_kv
    from ferrox_kv import _core

    lines = [f"ferrox_kv {ferrox_kv.__version__}",
             f"  installed at       {os.path.dirname(os.path.abspath(ferrox_kv.__file__))}",
             f"  extension          {os.path.basename(_core.__file__)}"]
    b = build_info(_core.__file__)
    if b["asan"] is None and b["compiler"] is None:
        lines.append("  build              unknown (the extension is not an ELF file this "
                     "command can read)")
    else:
        kind = ("debug, AddressSanitizer (FERROX_KV_DEBUG=1)" if b["asan"] else
                "release (no AddressSanitizer)")
        lines.append(f"  build              {kind}")
        lines.append(f"  compiler           {b['compiler'] or 'unknown'}")
        lines.append(f"  compile flags      {b['flags'] or 'not recorded (built without -g)'}")
    lines += [f"  attention SIMD     {ferrox_kv.simd_path()}   [simd_path()]",
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
                     "pip install 'ferrox_kv[hf]')")
    return lines


def cmd_info(args):
    print("\n".join(info_lines()))
    return 0


# ---------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------

def make_parser(prog="ferrox-kv"):
    from ferrox_kv import bench

    ap = argparse.ArgumentParser(
        prog=prog, description="ferrox_kv: a paged KV cache for transformer inference.")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    b = sub.add_parser("bench", help="the benchmark (the main job): tables, targets, JSON, plot",
                       description=bench.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_arguments(b)
    b.set_defaults(func=bench.run)
    i = sub.add_parser("info", help="version, build, SIMD path, GIL thresholds, environment")
    i.set_defaults(func=cmd_info)
    return ap


def main(argv=None, prog=None):
    if prog is None:
        prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "ferrox-kv"
        if prog in ("__main__.py", "-c", "") or prog.endswith(".py"):
            prog = "ferrox-kv"
    args = make_parser(prog).parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
