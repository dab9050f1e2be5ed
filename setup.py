"""Build the compiled parts of mcf.

Switches (environment variables):
  MCF_DEBUG=1        -O0 -g, Cython bounds/wraparound checks on, assertions kept.
  MCF_SANITIZE=1     AddressSanitizer + UndefinedBehaviorSanitizer (run with the ASan runtime preloaded,
                     see docs/reliability.md).
  MCF_BUILD_JOBS=N   parallel jobs for Cython and the C compiler (default: the CPUs this process may use;
                     ``build_ext -j N`` sets the C compiler's).
No -march/-mavx flags are ever passed: SIMD variants are selected at run time.

Compiling is most of the time a first ``pip install`` takes, so the build does it once and in parallel:

- the C in ``csrc/`` is compiled once, into one static library (``build_clib``: ``libmcf_csrc.a`` in the
  build directory, never installed), which every extension whose C includes a ``csrc`` header links; the
  linker takes from it the objects that extension uses, so each module keeps its own copy of, say,
  ``cpu.c``'s dispatch state, as when every extension compiled those files itself;
- everything is compiled with ``-fvisibility=hidden``: an extension module exports its ``PyInit_*`` and
  nothing else (Python finds that; mcf's modules reach each other through Cython's cross-module C API);
- Cython's utility code (memoryviews, buffer handling, ...) goes into one shared module,
  ``mcf._core._cyutility``, instead of into each of the nine extensions: 40% less C to compile;
- Cython translates the ``.pyx`` files in a process pool;
- the library's files, then the extensions, are compiled in a thread pool, largest first.

Rebuilds: an object is compiled again when its source or any ``csrc/*.h`` is newer (for an extension's
Cython C, when a header it depends on is); an extension that includes a ``csrc`` header is linked again when
the library is newer.  The flags are recorded in the build directory, and a build with other flags
(MCF_DEBUG, MCF_SANITIZE, an edit of the flags below) compiles every object again.
"""
import glob
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_clib import build_clib as _build_clib
from setuptools.command.build_ext import build_ext as _build_ext
from setuptools.errors import SetupError

try:
    from setuptools.modified import newer_group
except ImportError:  # setuptools < 69
    from distutils.dep_util import newer_group

DEBUG = os.environ.get("MCF_DEBUG", "") not in ("", "0")
SANITIZE = os.environ.get("MCF_SANITIZE", "") not in ("", "0")

# -fvisibility=hidden: the C functions are the modules' own (mcf_*, mc_*), never the dynamic linker's
compile_args = ["-std=c11", "-fno-strict-aliasing", "-ffp-contract=off", "-Wall", "-Wno-unused-function",
                "-fvisibility=hidden"]
link_args = []
c_macros = []  # the C library's (it includes no numpy or Python header)
if DEBUG:
    compile_args += ["-O0", "-g3", "-UNDEBUG"]
    c_macros.append(("MCF_DEBUG", "1"))
else:
    # -g0: Python's own CFLAGS carry -g, and debug information for the large Cython-generated files
    # costs about a third of the compile time (and 7x the object size) of a release build
    compile_args += ["-O3", "-g0"]
if SANITIZE:
    san = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=undefined"]
    compile_args += san + ["-g"]
    link_args += san
ext_macros = [("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")] + c_macros

directives = {
    "language_level": "3",
    "boundscheck": DEBUG,
    "wraparound": DEBUG,
    "initializedcheck": DEBUG,
    "cdivision": not DEBUG,
    "embedsignature": True,
}

# The C library: every csrc/*.c, compiled once (-fPIC: it is linked into shared objects).  Every object
# depends on every header (setuptools looks at a source's own time only: an edit of simd.h alone used to
# leave stale kernels in place).
C_LIBRARY = "mcf_csrc"
C_SOURCES = sorted(glob.glob("csrc/*.c"))
HEADERS = sorted(glob.glob("csrc/*.h"))
if not C_SOURCES or not HEADERS:
    raise SetupError(f"no csrc/*.c or csrc/*.h under {os.getcwd()!r}: run setup.py from the project's root")
c_library = (C_LIBRARY, {
    "sources": C_SOURCES,
    "depends": HEADERS,
    "include_dirs": ["csrc"],
    "macros": c_macros,
    "cflags": compile_args + ["-fPIC"],
})


def ext(name, suffix=".pyx"):
    """The extension NAME, from its .pyx alone: its C from csrc/ comes from the library."""
    return Extension(
        name,
        sources=[name.replace(".", "/") + suffix],
        include_dirs=[np.get_include(), "csrc"],
        define_macros=ext_macros,
        extra_compile_args=compile_args,
        extra_link_args=link_args,
    )


SHARED_UTILITY = "mcf._core._cyutility"

extensions = [
    ext("mcf._core._io"),                   # csrc/readengine.c
    ext("mcf._core._fpconv"),               # fpconv.c, fpconv_simd.c, cpu.c
    ext("mcf.container._index"),
    ext("mcf._core._kernels"),              # dequant.c, quantize.c, quant_search.c, fpconv.c, yardstick.c, cpu.c
    ext("mcf._core._mx"),                   # mx.c, cpu.c, fpconv.c
    ext("mcf.megatron._megatron"),
    ext("mcf.megacontext._megacontext"),    # megacontext.c and _kernels' C
    ext("mcf.bucket._codec"),               # lz4block.c
    ext("mcf.bucket._pageio"),              # pageio.c, cpu.c
    ext("mcf.gguf._gguf"),                  # gguf_dequant.c, gguf_iq.c, gguf_lowbit.c, fpconv*.c, cpu.c
    # Cython's utility code, shared by the modules above (generated by cythonize, Cython >= 3.1)
    ext(SHARED_UTILITY, ".c"),
]


def build_jobs() -> int:
    env = os.environ.get("MCF_BUILD_JOBS", "").strip()
    if env:
        return max(1, int(env))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def _largest_first(paths):
    return sorted(paths, key=lambda p: -os.path.getsize(p))


# what the objects were compiled with (not the file lists: a new header does not make every object stale)
FLAGS = json.dumps({"compile": compile_args, "link": link_args, "macros": ext_macros,
                    "library": c_library[1]["cflags"]})
_flags_changed = {}  # build_temp -> whether its objects were built with other flags (decided once a run)


def flags_changed(build_temp) -> bool:
    if build_temp not in _flags_changed:
        try:
            with open(os.path.join(build_temp, "mcf-flags.json"), encoding="utf-8") as f:
                _flags_changed[build_temp] = f.read() != FLAGS
        except FileNotFoundError:
            _flags_changed[build_temp] = True
    return _flags_changed[build_temp]


def record_flags(build_temp):
    os.makedirs(build_temp, exist_ok=True)
    with open(os.path.join(build_temp, "mcf-flags.json"), "w", encoding="utf-8") as f:
        f.write(FLAGS)


class build_clib(_build_clib):
    """Compile the library's stale files in a thread pool, then archive them."""

    parallel = None  # build_ext's -j, when build_ext runs this command
    archives = None  # library name -> path of the archive this run wrote or found up to date

    def run(self):
        self.archives = {}
        self.force = self.force or flags_changed(self.build_temp)
        super().run()

    def build_libraries(self, libraries):
        for name, info in libraries:
            sources = info["sources"]
            objects = self.compiler.object_filenames(sources, output_dir=self.build_temp)
            stale = [src for src, obj in zip(sources, objects)
                     if self.force or newer_group([src] + info["depends"], obj)]
            if stale:
                for d in sorted({os.path.dirname(o) for o in objects}):
                    self.mkpath(d)
                compile_one = self.compiler.compile
                kw = dict(output_dir=self.build_temp, macros=info["macros"], include_dirs=info["include_dirs"],
                          extra_postargs=info["cflags"], debug=self.debug)
                with ThreadPoolExecutor(self.parallel or build_jobs()) as pool:
                    for f in [pool.submit(compile_one, [src], **kw) for src in _largest_first(stale)]:
                        f.result()
            archive = self.compiler.library_filename(name, output_dir=self.build_clib)
            if stale and os.path.exists(archive):
                os.remove(archive)  # `ar r` would keep the members of files no longer in the library
            self.compiler.create_static_lib(objects, name, output_dir=self.build_clib, debug=self.debug)
            if not os.path.exists(archive):
                raise SetupError(f"building {name}: {archive} was not written")
            self.archives[name] = archive

    def get_library_names(self):
        return []  # not linked into every extension by name: build_ext links the archive where it is used


_CSRC_INCLUDE = re.compile(r'^\s*#\s*include\s+"(\w+\.h)"', re.M)
_CSRC_HEADERS = {os.path.basename(h) for h in HEADERS}


def includes_csrc(ext) -> bool:
    """Whether the extension's C (generated by Cython) includes a csrc/ header."""
    for src in ext.sources:
        with open(src, encoding="utf-8", errors="replace") as f:
            if _CSRC_HEADERS & set(_CSRC_INCLUDE.findall(f.read())):
                return True
    return False


class build_ext(_build_ext):
    """Build the C library first; the extensions whose C includes a csrc/ header link it, are compiled again
    when a header changes and linked again when the library does.  The extensions build in parallel, largest
    first."""

    archive = None  # the C library's path, once build_clib has run

    def finalize_options(self):
        super().finalize_options()
        if not self.parallel:
            self.parallel = build_jobs()

    def run(self):
        self.force = self.force or flags_changed(self.build_temp)
        clib = self.distribution.get_command_obj("build_clib")
        clib.parallel = self.parallel
        clib.force = clib.force or self.force
        self.run_command("build_clib")  # nothing when `build` ran it already
        archive = (self.get_finalized_command("build_clib").archives or {}).get(C_LIBRARY)
        if archive is None:
            raise SetupError(f"build_clib did not build {C_LIBRARY}, the C library the extensions link")
        for e in self.extensions:
            if any(s.startswith("csrc/") for s in e.sources):
                raise SetupError(f"{e.name} lists {e.sources}: csrc/ files belong to the library only "
                                 "(each is compiled once)")
            if includes_csrc(e):  # linked by path: the linker's up-to-date check then sees the archive
                e.depends = sorted(set(e.depends) | set(HEADERS) | {archive})
                e.extra_objects = [archive]
        self.archive = archive
        super().run()
        record_flags(self.build_temp)

    def build_extensions(self):
        self.extensions.sort(key=lambda e: -sum(os.path.getsize(s) for s in e.sources))
        compile_all = self.compiler.compile

        def compile_stale(sources, output_dir=None, depends=None, **kw):
            """Compile the sources whose object is missing or older than the source or a header: a newer
            library alone relinks an extension, without compiling its (large) C again."""
            objects = self.compiler.object_filenames(sources, output_dir=output_dir)
            deps = [d for d in depends or () if d != self.archive]
            stale = [s for s, o in zip(sources, objects) if self.force or newer_group([s] + deps, o)]
            if stale:
                compile_all(stale, output_dir=output_dir, depends=depends, **kw)
            return objects

        self.compiler.compile = compile_stale
        try:
            super().build_extensions()
        finally:
            self.compiler.compile = compile_all


# Cython's output (mcf/**/*.c) is shared by every build in this tree, but it is written for one numpy's
# declarations (numpy/__init__.pxd) and one Cython: a file generated under numpy 1.x does not compile against
# numpy 2.x's headers, and cythonize, which compares timestamps, keeps it.  The stamp names what generated
# the files; a build under anything else generates them again.
GENERATED_STAMP = os.path.join("mcf", ".cython-generated")
GENERATED_BY = f"Cython {__import__('Cython').__version__}, numpy {np.__version__}\n"


def generated_by_another() -> bool:
    try:
        with open(GENERATED_STAMP, encoding="utf-8") as f:
            return f.read() != GENERATED_BY
    except FileNotFoundError:
        return True


_regenerate = generated_by_another()
ext_modules = cythonize(extensions, compiler_directives=directives, annotate=False, nthreads=build_jobs(),
                        shared_utility_qualified_name=SHARED_UTILITY, force=_regenerate)
if _regenerate:
    with open(GENERATED_STAMP, "w", encoding="utf-8") as f:
        f.write(GENERATED_BY)

setup(
    ext_modules=ext_modules,
    libraries=[c_library],
    cmdclass={"build_clib": build_clib, "build_ext": build_ext},
)
