"""Build of the ferrox_kv core: the one place that cythonizes.

FERROX_KV_DEBUG=1 builds a debug extension: bounds and initialisation checks
back on, -O0 -g, and AddressSanitizer (run it with the compiler's libasan in
LD_PRELOAD; see .ci/run).
"""
import os

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

DEBUG = os.environ.get("FERROX_KV_DEBUG", "") == "1"

DIRECTIVES = {
    "language_level": 3,
    "boundscheck": DEBUG,
    "wraparound": False,
    "initializedcheck": DEBUG,
    "cdivision": True,
    "embedsignature": True,
    "freethreading_compatible": True,
}

if DEBUG:
    compile_args = ["-O0", "-g", "-fsanitize=address", "-fno-omit-frame-pointer"]
    link_args = ["-fsanitize=address"]
else:
    compile_args = ["-O3"]
    link_args = []

extensions = [
    Extension(
        "ferrox_kv._core",
        ["ferrox_kv/_core.pyx"],
        include_dirs=[numpy.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_2_0_API_VERSION")],
        extra_compile_args=compile_args,
        extra_link_args=link_args,
    )
]

# A debug build keeps its generated C and its objects apart from the release
# build's, so neither ever reuses the other's (different directives, ASan).
setup(
    ext_modules=cythonize(extensions, compiler_directives=DIRECTIVES, force=DEBUG,
                          build_dir="build/debug-c" if DEBUG else None),
    options={"build": {"build_base": "build/debug"}} if DEBUG else {},
)
