"""The compiled backend surface (docs/extending.md): an extension built outside mcf, against the installed
package with ``include_dirs=[mcf.get_include(), numpy.get_include()]``, cimports the I/O core and a
kernel, and gives what mcf's Python API gives."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import mcf
import mcf.io
from mcf._core import _fpconv

for _mod in ("Cython", "setuptools"):
    pytest.importorskip(_mod, reason=f"{_mod} (in the test-core extra) is not installed: this environment was "
                                     "not made with pip install -e '.[test-core]'")

# The extension reads bfloat16 values from a Source (the mapped bytes through its base pointer when
# there is one, else copy_to), checking the range first, and widens them with mcf's kernel.
PYX = textwrap.dedent('''
    # cython: language_level=3
    from libc.stdint cimport uint16_t
    from libc.stdlib cimport malloc, free
    from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING

    from mcf._core._io cimport Source
    from mcf._core._fpconv cimport resolve_impl, bf16_to_f32_n

    def bf16_as_f32(Source src, offset, count, impl=None):
        """float32 bytes of ``count`` bfloat16 values at ``offset`` of ``src``."""
        src.check_range(offset, 2 * count)          # raises mcf.OutOfBoundsError / ClosedError
        cdef int im = resolve_impl(impl)            # raises mcf.InvalidArgumentError
        cdef size_t n = count, off = offset
        out = PyBytes_FromStringAndSize(NULL, 4 * n)
        cdef float* dst = <float*>PyBytes_AS_STRING(out)
        cdef uint16_t* tmp
        if src.base != NULL and off % 2 == 0:       # mapped or in memory, aligned: no copy
            src.pin()                               # keeps the mapping alive without the GIL
            try:
                with nogil:
                    bf16_to_f32_n(<const uint16_t*>(src.base + off), dst, n, im)
            finally:
                src.unpin()
            return out
        tmp = <uint16_t*>malloc(2 * n + 2)
        if tmp == NULL:
            raise MemoryError()
        try:
            src.copy_to(off, 2 * n, tmp)            # pread or file object
            with nogil:
                bf16_to_f32_n(tmp, dst, n, im)
        finally:
            free(tmp)
        return out
''')

SETUP = textwrap.dedent('''
    import mcf, numpy
    from Cython.Build import cythonize
    from setuptools import Extension, setup

    setup(name="mcf_ext_probe", ext_modules=cythonize(
        [Extension("mcf_ext_probe", ["mcf_ext_probe.pyx"], include_dirs=[mcf.get_include(), numpy.get_include()],
                   extra_compile_args=["-O0", "-g0"])],
        include_path=[mcf.get_include()], quiet=True))
''')


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    d = tmp_path_factory.mktemp("ext")
    (d / "mcf_ext_probe.pyx").write_text(PYX)
    (d / "setup.py").write_text(SETUP)
    # run from the temp dir, so `mcf` is the installed package and not a checkout next to the test
    env = dict(os.environ, PYTHONPATH="")
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=d, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    sys.path.insert(0, str(d))
    try:
        import mcf_ext_probe
    finally:
        sys.path.remove(str(d))
    return mcf_ext_probe


def test_get_include_holds_the_pxd_files():
    inc = mcf.get_include()
    for name in ("_io.pxd", "_fpconv.pxd"):
        assert os.path.isfile(os.path.join(inc, "mcf", "_core", name)), name


@pytest.mark.parametrize("mode", ["mmap", "pread", "memory", "fileobj"])
def test_external_extension_reads_and_converts(probe, tmp_path, mode):
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 1 << 16, 1001, dtype=np.uint16)
    data = b"\x00" * 6 + bits.tobytes() + b"\x01"  # values at an even offset, a stray byte after them
    path = tmp_path / "bits.bin"
    path.write_bytes(data)
    want = _fpconv.bf16_to_f32(bits)
    f = open(path, "rb")
    if mode == "memory":
        src = mcf.io.open_source(data)
    elif mode == "fileobj":
        src = mcf.io.open_source(f)
    else:
        src = mcf.io.open_source(str(path), mmap=(mode == "mmap"))
    with f, src:
        assert src.mode == mode
        for impl in mcf.kernel_info()["supported"]:
            got = np.frombuffer(probe.bf16_as_f32(src, 6, bits.size, impl), np.float32)
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
        # odd offset: the copy path
        got = np.frombuffer(probe.bf16_as_f32(src, 7, 1), np.float32)
        want1 = _fpconv.bf16_to_f32(np.frombuffer(data[7:9], np.uint16))
        assert got.view(np.uint32)[0] == want1.view(np.uint32)[0]
        with pytest.raises(mcf.OutOfBoundsError):
            probe.bf16_as_f32(src, 6, bits.size + 1)
        with pytest.raises(mcf.InvalidArgumentError):
            probe.bf16_as_f32(src, 6, 1, "avx3")
    with pytest.raises(mcf.ClosedError):
        probe.bf16_as_f32(src, 6, 1)
