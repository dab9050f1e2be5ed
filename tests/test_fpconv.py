"""f16/bf16 <-> f32 conversions: every variant equals the scalar reference bit for bit, and the values
equal numpy's IEEE conversions (round to nearest even)."""

import numpy as np
import pytest

import mcf
from mcf._core import _fpconv as F
from mcf.io import aligned_empty

pytestmark = pytest.mark.forced_variants  # .ci/run runs this file once per forced kernel variant

IMPLS = mcf.kernel_info()["supported"]
ALL16 = np.arange(65536, dtype=np.uint32).astype(np.uint16)


def specials32():
    rng = np.random.default_rng(0)
    r = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    edge = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0x00000001, 0x33000000,
                     0x33000001, 0x387FC000, 0x38800000, 0x477FE000, 0x477FEFFF, 0x477FF000, 0x3F808000,
                     0x3F818000, 0x7F7FFFFF], dtype=np.uint32)
    return np.concatenate([edge, r]).view(np.float32)


@pytest.mark.parametrize("impl", IMPLS)
def test_f16_to_f32_every_pattern(impl):
    got = F.f16_to_f32(ALL16, impl=impl).view(np.uint32)
    assert np.array_equal(got, F.f16_to_f32(ALL16, impl="scalar").view(np.uint32))
    want = ALL16.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    assert np.array_equal(got[~nan], want[~nan].view(np.uint32))
    # widening keeps NaN payloads exactly; narrowing back keeps them and sets the quiet bit
    assert np.array_equal(F.f32_to_f16(got.view(np.float32), impl=impl)[nan], ALL16[nan] | 0x200)


@pytest.mark.parametrize("impl", IMPLS)
def test_bf16_to_f32_every_pattern(impl):
    got = F.bf16_to_f32(ALL16, impl=impl).view(np.uint32)
    assert np.array_equal(got, ALL16.astype(np.uint32) << 16)


@pytest.mark.parametrize("impl", IMPLS)
def test_f32_to_f16_rounds_to_nearest_even(impl):
    x = specials32()
    got = F.f32_to_f16(x, impl=impl)
    assert np.array_equal(got, F.f32_to_f16(x, impl="scalar"))
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    nan = np.isnan(x)
    assert np.array_equal(got[~nan], want[~nan])
    assert np.isnan(got[nan].view(np.float16)).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_f32_to_bf16_rounds_to_nearest_even(impl):
    x = specials32()
    got = F.f32_to_bf16(x, impl=impl)
    assert np.array_equal(got, F.f32_to_bf16(x, impl="scalar"))
    u = x.view(np.uint32).astype(np.uint64)
    want = (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF).astype(np.uint16)
    nan = np.isnan(x)
    assert np.array_equal(got[~nan], want[~nan])
    assert np.isnan((got[nan].astype(np.uint32) << 16).view(np.float32)).all()
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="cross-check against ml_dtypes' bfloat16")
    assert np.array_equal(got[~nan], x[~nan].astype(ml_dtypes.bfloat16).view(np.uint16))


@pytest.mark.parametrize("impl", IMPLS)
def test_large_arrays_take_the_streaming_path_with_the_same_bits(impl):
    """Outputs of 8 MiB and more take streaming stores in the vector variants (csrc/simd.h) when aligned,
    plain ones when not: the same bits either way, NaN payloads included."""
    h = np.tile(ALL16, 40)                     # 2.6 M values: 10 MiB of float32, 5 MiB of halves back
    want = F.f16_to_f32(h, impl="scalar")
    got = aligned_empty(h.size * 4, 64).view(np.float32)
    F.f16_to_f32(h, out=got, impl=impl)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    F.bf16_to_f32(h, out=got, impl=impl)
    assert np.array_equal(got.view(np.uint32), h.astype(np.uint32) << 16)
    raw = np.empty(h.size * 4 + 64, np.uint8)
    skew = raw[(-raw.ctypes.data) % 64 + 4:][: h.size * 4].view(np.float32)
    F.f16_to_f32(h, out=skew, impl=impl)
    assert np.array_equal(skew.view(np.uint32), want.view(np.uint32))
    x = np.tile(specials32(), 24)              # 4.8 M values: 9.2 MiB of halves
    halves = aligned_empty(x.size * 2, 64).view(np.uint16)
    F.f32_to_f16(x, out=halves, impl=impl)
    assert np.array_equal(halves, F.f32_to_f16(x, impl="scalar"))
    F.f32_to_bf16(x, out=halves, impl=impl)
    assert np.array_equal(halves, F.f32_to_bf16(x, impl="scalar"))


def test_odd_lengths_and_shapes():
    for n in (0, 1, 7, 8, 9, 15, 16, 17, 33):
        x = np.linspace(-3, 3, n, dtype=np.float32)
        for impl in IMPLS:
            assert np.array_equal(F.f16_to_f32(F.f32_to_f16(x, impl=impl), impl=impl),
                                  x.astype(np.float16).astype(np.float32))
    s = F.f32_to_f16(np.float32(1.5))
    assert s.shape == () and int(s) == 0x3E00
    with pytest.raises(mcf.InvalidArgumentError):
        F.f32_to_f16(np.ones(3, np.float32), impl="nope")
