"""Build of the ferrox_kv core: the one place that cythonizes.

FERROX_KV_DEBUG=1 builds the AddressSanitizer extension that CI runs the
suite against: the release build's Cython directives (so that the sanitizer
sees what users run, not a bounds-checked variant that stops bad accesses
first) with -O1 -g and -fsanitize=address. Run it with the compiler's
libasan in LD_PRELOAD (see .ci/run). FERROX_KV_BOUNDSCHECK=1 turns Cython's
bounds and initialisation checks back on, with either build.
FERROX_KV_WERROR=1 turns -Wall's warnings (on in every build) into errors.

No -march=native: the wheel must run on any x86-64. The attention kernel
is compiled once per x86-64 level (_attn_base.c, _attn_v3.c, _attn_v4.c)
and picks one at load time (see _simd.h).

The extension's C files compile side by side (ParallelBuildExt), on as
many jobs as the process may use CPUs: FERROX_KV_BUILD_JOBS=N, or
``build_ext -j N``, sets the count.
"""
import glob
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

DEBUG = os.environ.get("FERROX_KV_DEBUG", "") == "1"
BOUNDSCHECK = os.environ.get("FERROX_KV_BOUNDSCHECK", "") == "1"

DIRECTIVES = {
    "language_level": 3,
    "boundscheck": BOUNDSCHECK,
    "wraparound": False,
    "initializedcheck": BOUNDSCHECK,
    "cdivision": True,
    # signatures come from binding (cyfunctions) and, for the classes, from
    # their docstring's first line in the clinic format ("Name(...)\n--\n\n")
    "embedsignature": False,
    "binding": True,
    "freethreading_compatible": True,
}

# Warnings: -Wall on every C file, ours and the one Cython generates (clean
# with gcc and Cython 3.3: no flag silences a class of them).
# FERROX_KV_WERROR=1 makes them errors, for CI.
WARN_ARGS = ["-Wall"] + (["-Werror"] if os.environ.get("FERROX_KV_WERROR", "") == "1" else [])
if DEBUG:
    compile_args = ["-O1", "-g", "-fsanitize=address", "-fno-omit-frame-pointer"] + WARN_ARGS
    link_args = ["-fsanitize=address"]
else:
    compile_args = ["-O3"] + WARN_ARGS
    link_args = []
BUILD = (("debug, AddressSanitizer" if DEBUG else "release") + ": " + " ".join(compile_args)
         + (", Cython bounds checks" if BOUNDSCHECK else ""))

# The C sources next to the Cython module, the slowest first (a job pool
# started on them first finishes soonest).
C_SOURCES = ["ferrox_kv/_attn_base.c", "ferrox_kv/_attn_v4.c", "ferrox_kv/_attn_v3.c",
             "ferrox_kv/_conv.c", "ferrox_kv/_attn.c", "ferrox_kv/_workers.c"]


def _build_jobs(parallel):
    env = os.environ.get("FERROX_KV_BUILD_JOBS", "")
    if env:
        if not env.isdigit() or int(env) < 1:
            sys.exit(f"FERROX_KV_BUILD_JOBS must be a positive integer, got {env!r}")
        return int(env)
    if parallel:
        return int(parallel)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class ParallelBuildExt(build_ext):
    """build_ext that compiles one extension's sources on a pool of jobs
    (setuptools' own -j runs whole extensions side by side, and this
    package has one), printing each file's compile time."""

    def build_extensions(self):
        cc = self.compiler
        jobs = _build_jobs(self.parallel)

        def compile(sources, output_dir=None, macros=None, include_dirs=None, debug=0,
                    extra_preargs=None, extra_postargs=None, depends=None):
            macros, objects, extra_postargs, pp_opts, build = cc._setup_compile(
                output_dir, macros, include_dirs, sources, depends, extra_postargs)
            cc_args = cc._get_cc_args(pp_opts, debug, extra_preargs)
            todo = [obj for obj in objects if obj in build]
            print(f"ferrox_kv: compiling {len(todo)} C files on {jobs} job(s)", flush=True)

            def one(obj):
                src, ext = build[obj]
                t0 = time.perf_counter()
                cc._compile(obj, src, ext, cc_args, extra_postargs, pp_opts)
                print(f"ferrox_kv: {os.path.basename(src)} {time.perf_counter() - t0:.1f} s", flush=True)

            with ThreadPoolExecutor(max_workers=jobs) as pool:
                for _ in pool.map(one, todo):   # re-raises the first failure
                    pass
            return objects

        cc.compile = compile
        super().build_extensions()


extensions = [
    Extension(
        "ferrox_kv._core",
        C_SOURCES[:3] + ["ferrox_kv/_core.pyx"] + C_SOURCES[3:],
        depends=sorted(glob.glob("ferrox_kv/*.pxi") + glob.glob("ferrox_kv/*.h")
                       + C_SOURCES + ["ferrox_kv/_core.pxd"]),
        include_dirs=[numpy.get_include(), "ferrox_kv"],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_2_0_API_VERSION"),
                       ("FERROX_KV_BUILD", '"' + BUILD + '"')],     # _core.build_info()
        extra_compile_args=compile_args,
        extra_link_args=link_args,
        libraries=["dl"] if sys.platform.startswith("linux") else [],   # dlopen (_workers.c), glibc < 2.34
    )
]

# A debug build keeps its generated C and its objects apart from the release
# build's, so neither ever reuses the other's (different flags, ASan).
setup(
    cmdclass={"build_ext": ParallelBuildExt},
    ext_modules=cythonize(extensions, compiler_directives=DIRECTIVES, force=DEBUG,
                          build_dir="build/debug-c" if DEBUG else None),
    options={"build": {"build_base": "build/debug"}} if DEBUG else {},
)
