"""float64 -> float16 / bfloat16 is rounded once, from the exact value, on every path that narrows
float64: Writer casts, Container.dequantize, load_state_dict (numpy and torch), convert and export,
MegaContext gists.  Through float32 it rounds twice: 1 + 2**-11 + 2**-40 became 1.0 instead of the next
float16 up (numpy's float64 -> float16 cast gives the latter).  The reference is exact rational
arithmetic (tests/reference.py), so it does not share code or rounding with anything it checks."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mcf
import reference as ref
from mcf._core import _fpconv

pytestmark = pytest.mark.forced_variants  # .ci/run runs this file once per forced kernel variant

ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 arrays are a test extra")

# the issue's value, and values built to sit just past a tie of the first (float32) rounding
TRICKY = np.array([1 + 2**-11 + 2**-40, 1 + 2**-8 + 2**-40, -(1 + 2**-11 + 2**-40), 3 + 2**-9 + 2**-50,
                   2**-20 * (1 + 2**-11 + 2**-45), 65504.0, 65519.99, 65520.0, 1e300, -1e300, 1e-300, 0.0, -0.0,
                   np.inf, -np.inf, 2.0**-24, 2.0**-25, 2.0**-25 * (1 + 2**-30), 3.3961e38, 1.2e-38],
                  np.float64)


def tricky_values(rng, n=512):
    base = rng.standard_normal(n) * 10.0 ** rng.integers(-8, 5, n)
    ties = np.float64(np.float32(base))                       # float32 values ...
    up = ties * (1 + rng.choice([-1.0, 1.0], n) * 2.0 ** -40)   # ... nudged past what float32 can hold
    halfway_f16 = (1 + rng.integers(0, 1024, n) * 2.0**-10 + 2.0**-11) * (1 + 2.0**-40)
    halfway_bf16 = (1 + rng.integers(0, 128, n) * 2.0**-7 + 2.0**-8) * (1 - 2.0**-41)
    return np.concatenate([TRICKY, base, up, halfway_f16, halfway_bf16])


def want_bits(x, kind):
    return ref.exact_round_bits(x, kind)


NUMPY_OUT = {"f16": np.float16, "bf16": ml_dtypes.bfloat16}


def test_the_issue_value():
    x = np.array([1 + 2**-11 + 2**-40])
    with np.errstate(over="ignore"):
        assert _fpconv.f64_to_f16(x).tobytes() == x.astype(np.float16).tobytes()
    assert _fpconv.f64_to_f16(x).view(np.float16)[0] > 1.0
    assert _fpconv.f64_to_bf16(np.array([1 + 2**-8 + 2**-40])).view(ml_dtypes.bfloat16)[0] > 1.0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), kind=st.sampled_from(["f16", "bf16"]))
def test_f64_conversions_round_once_property(seed, kind):
    x = tricky_values(np.random.default_rng(seed), 64)
    conv = _fpconv.f64_to_f16 if kind == "f16" else _fpconv.f64_to_bf16
    assert conv(x).tobytes() == want_bits(x, kind).tobytes()


def _f64_file(path, x):
    with mcf.Writer(path) as w:
        w.add_tensor("w", x.reshape(-1, 8))
        w.add_tensor("v", x[:8])


@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_every_f64_narrowing_path_rounds_once(tmp_path, kind):
    x = tricky_values(np.random.default_rng(7))
    x = x[: x.size // 8 * 8]
    want = want_bits(x, kind)
    src = tmp_path / "f64.mcf"
    _f64_file(src, x)
    # Writer cast
    with mcf.Writer(tmp_path / "cast.mcf") as w:
        w.add_tensor("w", x.reshape(-1, 8), dtype=kind)
    with mcf.open(tmp_path / "cast.mcf") as c:
        assert c.raw("w").tobytes() == want.tobytes()
    # Container.dequantize, whole and by rows
    out_dt = np.float16 if kind == "f16" else np.uint16
    with mcf.open(src) as c:
        assert c.dequantize("w", dtype=out_dt).tobytes() == want.tobytes()
        assert c.dequantize("w", dtype=out_dt, rows=(2, 5)).tobytes() == want.reshape(-1, 8)[2:5].tobytes()
        o = np.empty(x.size, out_dt)
        c.dequantize("w", out=o)
        assert o.tobytes() == want.tobytes()
    # load_state_dict, numpy
    sd = mcf.load_state_dict(src, dtype=kind)
    assert np.ascontiguousarray(sd["w"]).view(np.uint16).tobytes() == want.tobytes()
    # tensor-parallel shares decode the same values
    sd = mcf.load_state_dict(src, dtype=kind, tp_rank=1, tp_size=2)
    assert np.ascontiguousarray(sd["w"]).view(np.uint16).tobytes() == want.reshape(-1, 8)[want.size // 16:].tobytes()
    # export to safetensors
    from safetensors.numpy import load_file

    mcf.export(src, tmp_path / "e.safetensors", dtype=kind)
    got = load_file(str(tmp_path / "e.safetensors"))["w"] if kind == "f16" else None
    if got is not None:
        assert got.view(np.uint16).tobytes() == want.tobytes()
    else:
        import json
        import struct

        raw = (tmp_path / "e.safetensors").read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        h = json.loads(raw[8:8 + n])
        a, b = h["w"]["data_offsets"]
        assert raw[8 + n + a:8 + n + b] == want.tobytes()
    # convert from a float64 safetensors checkpoint
    from safetensors.numpy import save_file

    save_file({"w": x.reshape(-1, 8)}, str(tmp_path / "f64.safetensors"))
    mcf.convert(tmp_path / "f64.safetensors", tmp_path / "conv.mcf", dtype=kind)
    with mcf.open(tmp_path / "conv.mcf") as c:
        assert c.raw("w").tobytes() == want.tobytes()


@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_torch_load_state_dict_rounds_once(tmp_path, kind):
    torch = pytest.importorskip("torch", reason="torch is a test extra")
    import mcf.torch as mt

    x = tricky_values(np.random.default_rng(9))
    x = x[: x.size // 8 * 8]
    src = tmp_path / "f64.mcf"
    _f64_file(src, x)
    sd = mt.load_state_dict(src, dtype=torch.float16 if kind == "f16" else torch.bfloat16)
    got = sd["w"].view(torch.int16).numpy().view(np.uint16)
    assert got.tobytes() == want_bits(x, kind).tobytes()


@pytest.mark.parametrize("gist_dtype,kind", [("fp16", "f16"), ("bf16", "bf16")])
def test_megacontext_gists_round_once(tmp_path, gist_dtype, kind):
    import mcf.megacontext as mc

    d = 8
    x = tricky_values(np.random.default_rng(11))
    n = x.size // d
    x = x[: n * d].reshape(n, d)
    with mc.create(tmp_path / "t", embedding_dim=d, block_size=2, gist_dtype=gist_dtype) as t:
        t.append_tokens(np.zeros(2 * n, np.uint32))
        t.append_gists(1, x)
        got = np.ascontiguousarray(t.gists(1)).view(np.uint16)
        assert got.tobytes() == want_bits(x, kind).tobytes()
        t.write_gists(1, 0, x[::-1].copy(), checkpoint="b")
        got = np.ascontiguousarray(t.gists(1)).view(np.uint16)
        assert got.tobytes() == want_bits(x[::-1], kind).tobytes()
        # big-endian rows are read as their values
        t.write_gists(1, 0, x.astype(">f8"), checkpoint="c")
        assert np.ascontiguousarray(t.gists(1)).view(np.uint16).tobytes() == want_bits(x, kind).tobytes()
