"""Build of the ferrox_kv core: the one place that cythonizes.

FERROX_KV_DEBUG=1 builds the AddressSanitizer extension that CI runs the
suite against: the release build's Cython directives (so that the sanitizer
sees what users run, not a bounds-checked variant that stops bad accesses
first) with -O1 -g and -fsanitize=address. Run it with the compiler's
libasan in LD_PRELOAD (see .ci/run). FERROX_KV_BOUNDSCHECK=1 turns Cython's
bounds and initialisation checks back on, with either build.

No -march=native: the wheel must run on any x86-64. The attention kernel
picks its SIMD path at load time (function multi-versioning, see _attn.h).
"""
import glob
import os

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

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

if DEBUG:
    compile_args = ["-O1", "-g", "-fsanitize=address", "-fno-omit-frame-pointer"]
    link_args = ["-fsanitize=address"]
else:
    compile_args = ["-O3"]
    link_args = []
BUILD = (("debug, AddressSanitizer" if DEBUG else "release") + ": " + " ".join(compile_args)
         + (", Cython bounds checks" if BOUNDSCHECK else ""))

extensions = [
    Extension(
        "ferrox_kv._core",
        ["ferrox_kv/_core.pyx"],
        depends=sorted(glob.glob("ferrox_kv/*.pxi") + glob.glob("ferrox_kv/*.h")
                       + ["ferrox_kv/_core.pxd"]),
        include_dirs=[numpy.get_include(), "ferrox_kv"],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_2_0_API_VERSION"),
                       ("FERROX_KV_BUILD", '"' + BUILD + '"')],     # _core.build_info()
        extra_compile_args=compile_args,
        extra_link_args=link_args,
    )
]

# A debug build keeps its generated C and its objects apart from the release
# build's, so neither ever reuses the other's (different flags, ASan).
setup(
    ext_modules=cythonize(extensions, compiler_directives=DIRECTIVES, force=DEBUG,
                          build_dir="build/debug-c" if DEBUG else None),
    options={"build": {"build_base": "build/debug"}} if DEBUG else {},
)
