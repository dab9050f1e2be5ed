"""Our own golden files (tests/fixtures): decoded on every run, and reproduced byte for byte."""

import os

import numpy as np
import pytest

import mcf
from _vectors import FIXTURES, load_fixture

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
            lay = mcf.quant_layout(method, shape, domain)
            for r in lay.regions:
                got = c.quant_regions(name)[r.name]
                assert got.tobytes() == buf[r.offset:r.offset + r.size].tobytes()
        assert np.array_equal(c.tensor("z.plain"), np.arange(6, dtype="<f4").reshape(2, 3))
