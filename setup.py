"""Build the compiled parts of mcf.

Switches (environment variables):
  MCF_DEBUG=1     -O0 -g, Cython bounds/wraparound checks on, assertions kept.
  MCF_SANITIZE=1  AddressSanitizer + UndefinedBehaviorSanitizer (run with the ASan runtime preloaded,
                  see docs/reliability.md).
No -march/-mavx flags are ever passed: SIMD variants are selected at run time.
"""
import os

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

DEBUG = os.environ.get("MCF_DEBUG", "") not in ("", "0")
SANITIZE = os.environ.get("MCF_SANITIZE", "") not in ("", "0")

compile_args = ["-std=c11", "-fno-strict-aliasing", "-ffp-contract=off", "-Wall", "-Wno-unused-function"]
link_args = []
macros = [("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]
if DEBUG:
    compile_args += ["-O0", "-g3", "-UNDEBUG"]
    macros.append(("MCF_DEBUG", "1"))
else:
    compile_args += ["-O3"]
if SANITIZE:
    san = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=undefined"]
    compile_args += san + ["-g"]
    link_args += san

directives = {
    "language_level": "3",
    "boundscheck": DEBUG,
    "wraparound": DEBUG,
    "initializedcheck": DEBUG,
    "cdivision": not DEBUG,
    "embedsignature": True,
}


def ext(name, sources):
    return Extension(
        name,
        sources=sources,
        include_dirs=[np.get_include(), "csrc"],
        define_macros=macros,
        extra_compile_args=compile_args,
        extra_link_args=link_args,
    )


extensions = [
    ext("mcf._io", ["mcf/_io.pyx"]),
    ext("mcf._fpconv", ["mcf/_fpconv.pyx", "csrc/fpconv.c", "csrc/fpconv_simd.c", "csrc/cpu.c"]),
    ext("mcf._index", ["mcf/_index.pyx"]),
    ext("mcf._kernels", ["mcf/_kernels.pyx", "csrc/dequant.c", "csrc/quantize.c", "csrc/quant_search.c", "csrc/cpu.c", "csrc/fpconv.c"]),
    ext("mcf.megatron._megatron", ["mcf/megatron/_megatron.pyx"]),
    ext("mcf.megacontext._megacontext", ["mcf/megacontext/_megacontext.pyx", "csrc/megacontext.c", "csrc/fpconv.c"]),
    ext("mcf.bucket._codec", ["mcf/bucket/_codec.pyx", "csrc/lz4block.c"]),
    ext("mcf._gguf", ["mcf/_gguf.pyx", "csrc/gguf_dequant.c", "csrc/cpu.c", "csrc/fpconv.c", "csrc/fpconv_simd.c"]),
]

setup(
    ext_modules=cythonize(extensions, compiler_directives=directives, annotate=False),
)
