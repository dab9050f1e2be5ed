"""The compiled backend surface (docs/extending.md): the page's own extension, built outside mcf with the
page's setup.py (Cython's include path ``[mcf.get_include()]``, nothing from mcf for the C compiler), cimports
the I/O core and a kernel, and gives what mcf's Python API gives, over every kind of source and variant."""
import os
import subprocess
import sys

import numpy as np
import pytest

import mcf
import mcf.io
from _doc_blocks import blocks_of
from mcf._core import _fpconv

for _mod in ("Cython", "setuptools"):
    pytest.importorskip(_mod, reason=f"{_mod} (in the test-core extra) is not installed: this environment was "
                                     "not made with pip install -e '.[test-core]'")


def _page_files() -> dict:
    """The files docs/extending.md has its reader save (``<!-- file: NAME -->`` blocks): the extension
    tested here is the page's own, built with the page's setup.py."""
    return {b.file: b.body for b in blocks_of("extending.md") if b.file}


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    d = tmp_path_factory.mktemp("ext")
    files = _page_files()
    for name in ("setup.py", "myext.pyx"):
        (d / name).write_text(files[name])
    # run from the temp dir, against the mcf this process imports (a checkout on PYTHONPATH, or the installed one)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(mcf.__file__))))
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=d, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    sys.path.insert(0, str(d))
    try:
        import myext
    finally:
        sys.path.remove(str(d))
    return myext


def test_get_include_holds_the_pxd_files_and_nothing_else():
    """get_include() returned the directory above the package, all of site-packages in a normal
    install.  It is a directory of mcf's own that holds only the shipped .pxd files."""
    inc = mcf.get_include()
    assert os.path.commonpath([inc, os.path.dirname(mcf.__file__)]) == os.path.dirname(mcf.__file__)
    found = sorted(os.path.relpath(os.path.join(d, f), inc) for d, _, fs in os.walk(inc) for f in fs)
    assert found == [os.path.join("mcf", "_core", "_fpconv.pxd"), os.path.join("mcf", "_core", "_io.pxd")]
    real = [os.path.realpath(p or os.getcwd()) for p in sys.path]
    assert os.path.realpath(inc) not in real and os.path.realpath(os.path.dirname(inc)) not in real


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
