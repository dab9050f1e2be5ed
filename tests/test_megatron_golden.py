"""Golden Megatron datasets (tests/fixtures/megatron): decoded on every run, ours reproduced byte for byte,
and files written by other tools (fairseq's layout, datatrove) read value for value."""

import os

import numpy as np
import pytest

import mcf.megatron as mm
from _vectors import FIXTURES, load_fixture

pytestmark = pytest.mark.forced_variants  # .ci/run runs this file once per forced kernel variant

GOLDEN_DIR = os.path.join(FIXTURES, "megatron")
mg = load_fixture("megatron/megatron_golden.py")


def read(p):
    with open(p, "rb") as f:
        return f.read()


@pytest.mark.parametrize("name", sorted(mg.GOLDEN))
def test_writer_reproduces_golden_bytes(tmp_path, name):
    mg.GOLDEN[name](str(tmp_path / name))
    for ext in (".idx", ".bin"):
        assert read(str(tmp_path / name) + ext) == read(os.path.join(GOLDEN_DIR, name + ext)), ext


@pytest.mark.parametrize("mmap", [True, False])
def test_golden_u16_decodes(mmap):
    docs = mg.u16_documents()
    with mm.open(os.path.join(GOLDEN_DIR, "megatron_u16"), mmap=mmap) as ds:
        assert (ds.variant, ds.dtype, ds.dtype_code, ds.multimodal) == ("megatron", np.uint16, 8, False)
        assert ds.verify() == []
        seqs = [s for d in docs for s in d]
        assert len(ds) == len(seqs) and ds.num_documents == len(docs)
        for i, s in enumerate(seqs):
            assert ds[i].tolist() == s.tolist()
        assert ds.document_indices.tolist() == np.cumsum([0] + [len(d) for d in docs]).tolist()


@pytest.mark.parametrize("mmap", [True, False])
def test_golden_multimodal_decodes(mmap):
    docs = mg.mm_documents()
    with mm.open(os.path.join(GOLDEN_DIR, "megatron_mm_i32"), mmap=mmap) as ds:
        assert ds.multimodal and ds.dtype == np.int32 and ds.verify() == []
        flat = [x for d in docs for x in d]
        assert ds.sequence_modes.tolist() == [m for _, m in flat]
        assert [ds[i].tolist() for i in range(len(ds))] == [s.tolist() for s, _ in flat]


def test_fairseq_golden_decodes():
    with mm.open(os.path.join(GOLDEN_DIR, "fairseq_u32")) as ds:
        assert ds.variant == "fairseq" and ds.dtype == np.uint32 and ds.dtype_code == 9
        assert [ds[i].tolist() for i in range(len(ds))] == [s.tolist() for s in mg.fairseq_sequences()]
        assert ds.document_indices.tolist() == [0, 1, 2, 3]


def test_datatrove_golden_decodes():
    with mm.open(os.path.join(GOLDEN_DIR, "datatrove_u16")) as ds:
        assert ds.verify() == [] and ds.dtype == np.uint16
        assert [ds[i].tolist() for i in range(len(ds))] == mg.datatrove_documents()
        assert ds.num_documents == 4
