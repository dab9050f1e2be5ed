"""Build the compiled parts of mcf.

Switches (environment variables):
  MCF_DEBUG=1        -O0 -g, Cython bounds/wraparound checks on, assertions kept.
  MCF_SANITIZE=1     AddressSanitizer + UndefinedBehaviorSanitizer (run with the ASan runtime preloaded,
                     see docs/reliability.md).
  MCF_BUILD_JOBS=N   parallel jobs for Cython and the C compiler (default: the CPUs this process may use).
No -march/-mavx flags are ever passed: SIMD variants are selected at run time.

The build is parallel because compiling is most of the time a first ``pip install`` takes: Cython
translates the eight ``.pyx`` files in a process pool, then every distinct C file is compiled once, in
a thread pool (``csrc/cpu.c`` and ``csrc/fpconv.c`` serve several extensions; setuptools' own
``--parallel`` would compile them once per extension, concurrently, into the same object file), and the
extensions are linked from those objects.
"""
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext as _build_ext

DEBUG = os.environ.get("MCF_DEBUG", "") not in ("", "0")
SANITIZE = os.environ.get("MCF_SANITIZE", "") not in ("", "0")

compile_args = ["-std=c11", "-fno-strict-aliasing", "-ffp-contract=off", "-Wall", "-Wno-unused-function"]
link_args = []
macros = [("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]
if DEBUG:
    compile_args += ["-O0", "-g3", "-UNDEBUG"]
    macros.append(("MCF_DEBUG", "1"))
else:
    # -g0: Python's own CFLAGS carry -g, and debug information for the large Cython-generated files
    # costs about a third of the compile time (and 7x the object size) of a release build
    compile_args += ["-O3", "-g0"]
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
    ext("mcf._kernels", ["mcf/_kernels.pyx", "csrc/dequant.c", "csrc/quantize.c", "csrc/cpu.c", "csrc/fpconv.c"]),
    ext("mcf.megatron._megatron", ["mcf/megatron/_megatron.pyx"]),
    ext("mcf.megacontext._megacontext", ["mcf/megacontext/_megacontext.pyx", "csrc/megacontext.c", "csrc/fpconv.c"]),
    ext("mcf.bucket._codec", ["mcf/bucket/_codec.pyx", "csrc/lz4block.c"]),
    ext("mcf._gguf", ["mcf/_gguf.pyx", "csrc/gguf_dequant.c", "csrc/cpu.c", "csrc/fpconv.c", "csrc/fpconv_simd.c"]),
]



def build_jobs() -> int:
    env = os.environ.get("MCF_BUILD_JOBS", "").strip()
    if env:
        return max(1, int(env))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


class build_ext(_build_ext):
    """Compile every distinct source of the extensions that need building once, in parallel, then let
    setuptools link each extension from those objects."""

    def build_extensions(self):
        jobs = build_jobs()
        todo = {}  # object file -> (source, compile keyword arguments)
        for e in self.extensions:
            sources = sorted(e.sources)  # what build_extension compiles, in its order
            if not (self.force or _newer_group(sources + e.depends, self.get_ext_fullpath(e.name), "newer")):
                continue
            kw = dict(output_dir=self.build_temp, macros=e.define_macros[:] + [(u,) for u in e.undef_macros],
                      include_dirs=e.include_dirs, debug=self.debug, extra_postargs=e.extra_compile_args or [],
                      depends=e.depends)
            for src in sources:
                obj = self.compiler.object_filenames([src], output_dir=self.build_temp)[0]
                if obj in todo and todo[obj][1] != kw:  # one object, two sets of flags: build it per extension
                    return super().build_extensions()
                todo[obj] = (src, kw)
        if jobs > 1 and len(todo) > 1:
            compile_one = self.compiler.compile
            with ThreadPoolExecutor(jobs) as pool:
                # largest first, so the long compiles do not end up last on one worker
                order = sorted(todo.values(), key=lambda job: -os.path.getsize(job[0]))
                for f in [pool.submit(compile_one, [src], **kw) for src, kw in order]:
                    f.result()
            done = set(todo)

            def compile_cached(sources, output_dir=None, **kw):
                objs = self.compiler.object_filenames(sources, output_dir=output_dir)
                missing = [s for s, o in zip(sources, objs) if o not in done]
                if missing:
                    compile_one(missing, output_dir=output_dir, **kw)
                return objs

            self.compiler.compile = compile_cached
            try:
                return super().build_extensions()
            finally:
                self.compiler.compile = compile_one
        return super().build_extensions()


def _newer_group(sources, target, missing):
    try:
        from setuptools.modified import newer_group
    except ImportError:  # setuptools < 69
        from distutils.dep_util import newer_group
    return newer_group(sources, target, missing)


setup(
    ext_modules=cythonize(extensions, compiler_directives=directives, annotate=False, nthreads=build_jobs()),
    cmdclass={"build_ext": build_ext},
)
