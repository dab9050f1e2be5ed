"""Writer.add_tensor(dtype=...) stores the dtype asked for, or refuses: every (array dtype, requested dtype)
pair it accepts is checked here.  Float arrays (F16, BF16, F32, F64) cast among those four with the function
mcf.convert's dtype= uses, so the stored bytes are the ones convert writes for the same values (F64 as a
target, which convert does not offer, is the exact widening); every other pair that would change the dtype
(a float array as FP8, F4 or an integer; an integer or FP8 array as a float; integer to integer) is a
DTypeError, and nothing of the tensor is written."""

import numpy as np
import pytest

import mcf
from mcf._core.dtypes import DType, dtype_info
from mcf.errors import DTypeError, InvalidArgumentError

ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 and float8 arrays are a test extra")
safetensors_numpy = pytest.importorskip("safetensors.numpy", reason="convert's input is written with safetensors")

FLOATS = {"f16": np.float16, "bf16": ml_dtypes.bfloat16, "f32": np.float32, "f64": np.float64}
FLOAT8 = {"f8_e4m3": ml_dtypes.float8_e4m3fn, "f8_e5m2": ml_dtypes.float8_e5m2,
          "f8_e4m3fnuz": ml_dtypes.float8_e4m3fnuz, "f8_e5m2fnuz": ml_dtypes.float8_e5m2fnuz,
          "f8_e8m0": ml_dtypes.float8_e8m0fnu}
INTS = {"i8": np.int8, "u8": np.uint8, "i16": np.int16, "u16": np.uint16, "i32": np.int32, "u32": np.uint32,
        "i64": np.int64, "u64": np.uint64}
SOURCES = {**FLOATS, **FLOAT8, **INTS}
# every dtype add_tensor can be asked for (the quantized ones need add_tensor_bytes: checked below)
TARGETS = [info.name for info in map(dtype_info, DType) if not info.quantized]

# NaN, infinities, signed zero, values beyond F16's and F32's range, subnormals, ties of each rounding
VALUES = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -2.5, 1e300, -1e300, 1e-300, 65504.0,
                   65520.0, 70000.0, 3.5e38, 2.0**-24, 2.0**-25, 2.0**-133, 1 + 2**-11, 1 + 2**-8 + 2**-9,
                   1 + 2**-11 + 2**-40, 3.14159, -448.0, 1e-5], np.float64)


def _source(name):
    if name in FLOATS:
        return VALUES.astype(FLOATS[name]) if name == "f64" else _quiet_cast(VALUES, FLOATS[name])
    if name in FLOAT8:
        return np.arange(256, dtype=np.uint8).view(FLOAT8[name])   # every bit pattern, NaNs included
    info = np.iinfo(INTS[name])
    return np.array([info.min, -1 if info.min else 0, 0, 1, 7, info.max], INTS[name])


def _quiet_cast(x, dt):
    with np.errstate(over="ignore"):
        return x.astype(dt)


def _convert_bytes(tmp_path, arr, target):
    """The bytes mcf.convert(dtype=target) stores for a safetensors tensor holding ``arr``."""
    st = tmp_path / "in.safetensors"
    safetensors_numpy.save_file({"t": arr}, str(st))
    mcf.convert(st, tmp_path / "conv.mcf", dtype=target, resources=False, durable=False)
    with mcf.open(tmp_path / "conv.mcf") as c:
        assert c.info("t").dtype.name == target
        return c.raw("t").tobytes()


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("src", list(SOURCES))
def test_add_tensor_stores_the_requested_dtype_or_refuses(tmp_path, src, target):
    arr = _source(src)
    path = tmp_path / "w.mcf"
    with mcf.Writer(path, durable=False) as w:
        if src != target and not (src in FLOATS and target in FLOATS):
            with pytest.raises(DTypeError, match=f"tensor 'x': cannot store {src} values as {target}"):
                w.add_tensor("x", arr, dtype=target)
        else:
            w.add_tensor("x", arr, dtype=target)
        w.add_tensor("marker", np.zeros(1, np.uint8))   # the refused tensor left nothing behind
    with mcf.open(path) as c:
        if "x" not in c:
            return
        assert c.info("x").dtype.name == target
        got = c.raw("x").tobytes()
        if src == target:
            assert got == np.ascontiguousarray(arr).tobytes()
        elif target == "f64":    # convert offers no f64: widening to it is exact
            assert got == arr.astype(np.float32).astype(np.float64).tobytes()
        else:
            assert got == _convert_bytes(tmp_path, arr, target)
        if target in FLOATS:
            back = c.tensor("x")
            assert back.dtype == np.dtype(FLOATS[target])
            if src in FLOATS:    # NaN stays NaN, infinities and zeros keep their sign
                want = arr.astype(np.float64)
                have = back.astype(np.float64)
                assert np.array_equal(np.isnan(have), np.isnan(want))
                fin = np.isfinite(want) & (want == 0)
                assert np.array_equal(np.signbit(have[fin]), np.signbit(want[fin]))


def test_float8_array_as_f16_is_refused_not_kept(tmp_path):
    """The audit's case: before, the float8 array was stored as float8 with dtype="f16" asked for."""
    a = np.array([1.5, 2.0], np.float32).astype(ml_dtypes.float8_e4m3fn)
    with mcf.Writer(tmp_path / "w.mcf") as w:
        with pytest.raises(DTypeError, match="f8_e4m3 values as f16"):
            w.add_tensor("b", a, dtype="f16")
        w.add_tensor("marker", np.zeros(1, np.uint8))
    with mcf.open(tmp_path / "w.mcf") as c:
        assert "b" not in c


def test_quantized_dtype_needs_add_tensor_bytes(tmp_path):
    with mcf.Writer(tmp_path / "w.mcf") as w:
        with pytest.raises(InvalidArgumentError, match="add_tensor_bytes"):
            w.add_tensor("q", np.zeros((4, 32), np.float32), dtype="q8")
        w.add_tensor("marker", np.zeros(1, np.uint8))
