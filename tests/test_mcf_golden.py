"""Our own golden files (tests/fixtures): decoded on every run, and reproduced byte for byte."""

import os

import numpy as np
import pytest

import mcf
from _vectors import FIXTURES, load_fixture

pytestmark = pytest.mark.forced_variants  # .ci/run runs this file once per forced kernel variant

golden = load_fixture("mcf_golden.py")


def read(p):
    with open(p, "rb") as f:
        return f.read()


@pytest.mark.parametrize("fname", sorted(golden.GOLDEN))
def test_writer_reproduces_golden_bytes(tmp_path, fname):
    out = tmp_path / fname
    golden.GOLDEN[fname](str(out))
    assert read(out) == read(os.path.join(FIXTURES, fname))


@pytest.mark.parametrize("mmap", [True, False])
def test_golden_plain_decodes(mmap):
    with mcf.open(os.path.join(FIXTURES, "golden_plain.mcf"), mmap=mmap) as c:
        assert c.verify() == []
        for name, (dt, a) in golden.plain_tensors().items():
            t = c.info(name)
            assert t.dtype.name == dt
            assert t.shape == a.shape
            assert c.raw(name).tobytes() == a.tobytes()
        assert c.info("t.alias_of_f32").offset == c.info("t.f32").offset
        mi = c.model_info
        assert (mi.model_name, mi.base_model, mi.arch, mi.rope_type) == ("golden-plain", "none", mcf.Arch.QWEN,
                                                                         mcf.RopeType.YARN)
        assert (mi.vocab_size, mi.train_context, mi.rope_freq_base, mi.rope_scale) == (32000, 1024, 10000.0, 4.0)
        assert mi.extras == {"a.u32": 7, "b.f32": 0.5, "c.str": "héllo"}
        assert c.resources == {"config.json": b'{"model_type": "qwen2"}\n', "merges.txt": b"#version: 0.2\n"}


@pytest.mark.parametrize("mmap", [True, False])
def test_golden_quant_decodes(mmap):
    with mcf.open(os.path.join(FIXTURES, "golden_quant.mcf"), mmap=mmap) as c:
        assert c.verify() == []
        payloads = golden.quant_payloads()
        assert {r.name for r in c.quant_info} == set(payloads)
        for name, (method, shape, buf, domain) in payloads.items():
            t = c.info(name)
            assert (t.dtype.name, t.shape) == (method, shape)
            assert c.raw(name).tobytes() == buf.tobytes()
            rec = c.quant_record(name)
            assert (rec.domain, rec.min_clip, rec.max_clip) == (domain, -1.25, 1.25)
            lay = mcf.quant_layout(method, shape, domain=domain)
            for r in lay.regions:
                got = c.quant_regions(name)[r.name]
                assert got.tobytes() == buf[r.offset:r.offset + r.size].tobytes()
        assert np.array_equal(c.tensor("z.plain"), np.arange(6, dtype="<f4").reshape(2, 3))


@pytest.mark.parametrize("mmap", [True, False])
def test_golden_extensions_decode(mmap):
    """mcf's extension dtypes, committed: every FP8 / E8M0 byte as ml_dtypes converts it, every F4 pair, and the
    block formats as the numpy references of tests/_scaled_checkpoints.py decode their payloads."""
    import ml_dtypes

    import _scaled_checkpoints as S

    ml = {"f8_e4m3": ml_dtypes.float8_e4m3fn, "f8_e5m2": ml_dtypes.float8_e5m2, "f8_e8m0": ml_dtypes.float8_e8m0fnu,
          "f8_e4m3fnuz": ml_dtypes.float8_e4m3fnuz, "f8_e5m2fnuz": ml_dtypes.float8_e5m2fnuz}
    with mcf.open(os.path.join(FIXTURES, "golden_extensions.mcf"), mmap=mmap) as c:
        assert c.verify() == [] and c.quant_info == []
        for name, (dtype, shape, buf) in golden.extension_tensors().items():
            t = c.info(name)
            assert (t.dtype.name, t.shape, c.raw(name).tobytes()) == (dtype, shape, buf.tobytes())
            if dtype == "f4":
                want = np.stack([buf & 15, buf >> 4], -1).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
            elif dtype in ml:
                want = buf.view(ml[dtype]).astype(np.float32)
            else:
                want = S.payload_reference(dtype, shape, buf)
            got = c.dequantize(name)
            nan = np.isnan(want.reshape(-1))
            assert np.array_equal(np.isnan(got.reshape(-1)), nan)
            assert got.reshape(-1)[~nan].tobytes() == want.reshape(-1)[~nan].tobytes()
