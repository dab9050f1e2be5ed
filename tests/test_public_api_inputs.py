"""A sweep of the public API: no function changes an array it was handed, and index, length, offset
and count arguments follow numpy's rules (integers, never floats or bools; boolean masks and integer
arrays for index arrays) or raise.

Every function that takes an array is called with the same values in six layouts: C order, Fortran
order, a strided view into a larger array, big-endian, read-only, and a writable ``np.memmap`` of a
file.  The bytes of whatever owns the data (the parent array, the file) must be the same afterwards.
Every integer argument is then given floats (integral ones too), bools and strings, which must raise,
and numpy integers, which must give what the Python int gives."""

from __future__ import annotations

import hashlib
import os
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mcf
import mcf.megacontext as mc
import mcf.conversion.quant_policy
import mcf.megatron as mm
from mcf._core import _kernels as K
from mcf.megatron import sample_index as si
from mcf.container.quant import tensor_error_stats

ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 arrays are a test extra")

LAYOUTS = ["c", "fortran", "strided", "big-endian", "read-only", "memmap"]


class Held:
    """An array in one layout, and what owns its bytes (checked before and after the call)."""

    def __init__(self, values: np.ndarray, layout: str, tmp_path):
        self.values = values
        v = values
        if layout == "c":
            self.array = v.copy(order="C")
            self.owner = self.array
        elif layout == "fortran":
            self.array = np.asfortranarray(v.copy())
            self.owner = self.array
        elif layout == "strided":  # every other element of a larger array, whose gaps must stay as they are
            big = np.zeros((v.shape[0] * 2,) + v.shape[1:], v.dtype) if v.ndim else np.zeros(2, v.dtype)
            big.reshape(-1)[:] = np.arange(big.size) % 97
            if v.ndim:
                big[::2] = v
                self.array = big[::2]
            else:
                self.array = big[:1].reshape(())
            self.owner = big
        elif layout == "big-endian":
            if v.dtype.name == "bfloat16" or v.dtype.itemsize == 1:
                self.array = v.copy()          # no byte order to change
            else:
                self.array = v.astype(v.dtype.newbyteorder(">"))
            self.owner = self.array
        elif layout == "read-only":
            self.array = v.copy()
            self.array.flags.writeable = False
            self.owner = self.array
        elif layout == "memmap":
            path = tmp_path / f"mm-{zlib.crc32(v.tobytes()) & 0xffff}-{v.dtype.str.strip('<>|')}.bin"
            mm_ = np.memmap(path, dtype=v.dtype, mode="w+", shape=v.shape)
            mm_[...] = v
            mm_.flush()
            self.array = mm_
            self.owner = mm_
            self.path = path
        else:  # pragma: no cover
            raise AssertionError(layout)
        self.layout = layout
        self.before = self.digest()

    def digest(self) -> str:
        h = hashlib.sha256(np.ascontiguousarray(self.owner).view(np.uint8).tobytes())
        if self.layout == "memmap":
            self.owner.flush()
            with open(self.path, "rb") as f:
                h.update(f.read())
        return h.hexdigest()

    def unchanged(self) -> bool:
        return self.digest() == self.before


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    """Files the calls read: an MCF file (quantized, F64, F16 tensors), a Megatron dataset, a
    MegaContext tree."""
    d = tmp_path_factory.mktemp("api")
    rng = np.random.default_rng(1)
    w = rng.standard_normal((6, 64)).astype(np.float32)
    with mcf.Writer(d / "m.mcf") as wr:
        wr.add_tensor("q", w, method="k4")
        wr.add_tensor("d", w.astype(np.float64))
        wr.add_tensor("h", w.astype(np.float16))
    with mm.Writer(str(d / "ds"), dtype=np.int32) as wr:
        for k in range(6):
            wr.add_document(np.arange(10 * k, 10 * k + k + 3, dtype=np.int32), [k + 3])
    tree = mc.create(d / "tree", embedding_dim=8, block_size=2, gist_dtype="fp16", vocab_size=100)
    tree.append_tokens(np.arange(16) % 100)
    tree.append_gists(1, rng.standard_normal((8, 8)))
    tree.append_gists(2, rng.standard_normal((4, 8)))
    tree.close()
    payload, _ = mcf.quantize(w, "q4")
    return {"dir": d, "w": w, "payload": payload}


def _new_tree(ctx, name, **kw):
    return mc.create(ctx["dir"] / f"t-{name}-{os.urandom(4).hex()}", embedding_dim=8, block_size=2,
                     vocab_size=100, **kw)


# -- functions that take float arrays -------------------------------------------------------------------
def _writer(ctx, x, **kw):
    with mcf.Writer(ctx["dir"] / f"w-{os.urandom(4).hex()}.mcf") as wr:
        wr.add_tensor("x", x, **kw)


def _gists(ctx, x, kind):
    with _new_tree(ctx, "g", gist_dtype=kind) as t:
        t.append_tokens(np.zeros(2 * x.shape[0], np.int64))
        t.append_gists(1, x)
        t.write_gists(1, 0, x, checkpoint="again")


def _bucket_ingest(ctx, x, kv_dtype):
    from mcf.bucket import Bucket

    b = Bucket(ctx["dir"] / f"bucket-{os.urandom(4).hex()}")
    k = x[None]                       # [1 head, 6 tokens, 64]: a view in every layout
    meta = b.ingest("m", [(k, x[None]), (k, k)], token_ids=np.arange(x.shape[0]), dtype=kv_dtype)
    b.load(meta["context_id"])


def _assemble(ctx, table):
    with mc.open(ctx["dir"] / "tree") as t:
        t.assemble(mc.plan_tail(t, budget=12, recent_tokens=4), table)
        mc.MeanPool(table).pool_tokens(t.tokens(0, 8), 2, np.float32)


def _focus(ctx, x):
    """Per-entry scores (a strided column of the held array) for a 6-entry plan of the shared tree."""
    with mc.open(ctx["dir"] / "tree") as t:
        mc.focus_plan(t, [(2, 0), (2, 1), (1, 4), (1, 5), (1, 6), (0, 7)], x[:, 0], budget=12, tau_expand=0.2,
                      tau_collapse=0.2)


def _build_gists(ctx, table):
    with _new_tree(ctx, "b", gist_dtype="fp16") as t:
        t.append_tokens(np.arange(8))
        mc.build_gists(t, mc.MeanPool(table))


_H64 = np.cov(np.random.default_rng(6).standard_normal((64, 256)))   # a second moment for 64 columns


def _collect_second_moment(x):
    from mcf.conversion.imatrix import ImportanceCollector

    col = ImportanceCollector(second_moment=True)
    col.add("w", x)
    col.add("v", x)   # equal inputs: the product is reused


FLOAT_CASES = {
    **{f"quantize {m}": (lambda m: lambda ctx, x: mcf.quantize(x, m))(m)
       for m in ("q8", "q4", "k6", "k4", "k3", "k2", "int8", "int4")},
    **{f"quantize {m} clipped": (lambda m: lambda ctx, x: mcf.quantize(x, m, min_clip=-0.3, max_clip=0.2))(m)
       for m in ("q8", "q4", "k6", "k4", "k3", "k2", "int8", "int4")},
    "quantize int8 activations clipped": lambda ctx, x: mcf.quantize(x, "int8", domain=1, min_clip=0.1, max_clip=0.5),
    "quantize threads": lambda ctx, x: mcf.quantize(x, "k3", threads=2),
    **{f"quantize {m} second moment": (lambda m: lambda ctx, x: mcf.quantize(x, m, second_moment=_H64))(m)
       for m in ("q8", "q4", "k6", "k4", "k3", "k2")},
    "quantize k4 second moment clipped": lambda ctx, x: mcf.quantize(x, "k4", second_moment=_H64, min_clip=-0.3,
                                                                      max_clip=0.2),
    "SecondMomentCollector.add": lambda ctx, x: _collect_second_moment(x),
    "Writer.add_tensor": lambda ctx, x: _writer(ctx, x),
    "Writer.add_tensor f16": lambda ctx, x: _writer(ctx, x, dtype="f16"),
    "Writer.add_tensor bf16": lambda ctx, x: _writer(ctx, x, dtype="bf16"),
    "Writer.add_tensor q4 clipped": lambda ctx, x: _writer(ctx, x, method="q4", min_clip=-0.2, max_clip=0.2),
    "Writer.add_tensor int4 clipped": lambda ctx, x: _writer(ctx, x, method="int4", min_clip=-0.2, max_clip=0.1),
    "tensor_error_stats": lambda ctx, x: tensor_error_stats(x, x[::-1]),
    **{f"Bucket.ingest {kv}": (lambda kv: lambda ctx, x: _bucket_ingest(ctx, x, kv))(kv)
       for kv in ("float16", "bfloat16", "float32", "int8")},
    "Tree gists fp16": lambda ctx, x: _gists(ctx, x[:, :8], "fp16"),
    "Tree gists bf16": lambda ctx, x: _gists(ctx, x[:, :8], "bf16"),
    "Tree gists fp32": lambda ctx, x: _gists(ctx, x[:, :8], "fp32"),
    "focus_plan scores": _focus,
}

# embedding tables ([vocab, d]) for MegaContext
TABLE_CASES = {
    "Tree.assemble + MeanPool": _assemble,
    "build_gists": _build_gists,
}


def _float_values(dtype):
    rng = np.random.default_rng(5)
    return (rng.standard_normal((6, 64)) * 0.3).astype(dtype)


# bfloat16 has no byte order to change: its big-endian layout would repeat the C one
FLOAT_LAYOUTS = [(dtype, layout) for dtype in (np.float32, np.float16, np.float64, "bf16") for layout in LAYOUTS
                 if not (dtype == "bf16" and layout == "big-endian")]


@pytest.mark.parametrize("dtype,layout", FLOAT_LAYOUTS)
@pytest.mark.parametrize("case", sorted(FLOAT_CASES))
def test_float_array_inputs_are_never_modified(ctx, tmp_path, case, dtype, layout):
    dt = ml_dtypes.bfloat16 if dtype == "bf16" else dtype
    held = Held(_float_values(dt), layout, tmp_path)
    FLOAT_CASES[case](ctx, held.array)
    assert held.unchanged(), f"{case} modified its {layout} {held.values.dtype} input"


@pytest.mark.parametrize("dtype,layout", [(d, lay) for d, lay in FLOAT_LAYOUTS if d is not np.float64])
@pytest.mark.parametrize("case", sorted(TABLE_CASES))
def test_embedding_tables_are_never_modified(ctx, tmp_path, case, dtype, layout):
    dt = ml_dtypes.bfloat16 if dtype == "bf16" else dtype
    table = np.random.default_rng(3).standard_normal((100, 8)).astype(dt)
    held = Held(table, layout, tmp_path)
    TABLE_CASES[case](ctx, held.array)
    assert held.unchanged()


# -- functions that take integer arrays -----------------------------------------------------------------
def _mwriter(ctx, **kw):
    return mm.Writer(str(ctx["dir"] / f"mw-{os.urandom(4).hex()}"), **kw)


def _gather(ctx, ix):
    with mm.open(str(ctx["dir"] / "ds")) as ds:
        ds.gather(ix % 6)


def _add_item(ctx, x):
    with _mwriter(ctx, dtype=np.int64) as w:
        w.add_item(x)


def _add_document(ctx, x):
    with _mwriter(ctx, dtype=np.int64, multimodal=True) as w:
        w.add_document(np.arange(int(x.sum())), x, modes=x % 3)


def _add_documents(ctx, x):
    with _mwriter(ctx, dtype=np.int64) as w:
        w.add_documents(np.arange(int(x.sum())), x)


def _float_dataset(ctx, x):
    with _mwriter(ctx, dtype=np.float32) as w:
        w.add_item(x)


def _sample_index(ctx, x):
    sizes = x + 2
    docs = si.build_document_index(np.arange(x.size), 2, 7)
    si.build_sample_idx(sizes, docs, 4, 2, int(sizes.sum()))
    si.build_gpt_indices(sizes, 4, indices=x % x.size)


def _tree_tokens(ctx, x):
    with _new_tree(ctx, "k", gist_dtype="fp16") as t:
        t.append_tokens(x % 100)


def _tree_gists(ctx, x):
    with mc.open(ctx["dir"] / "tree") as t:
        t.gists(1, x % 8)


def _plan(ctx, x):
    with mc.open(ctx["dir"] / "tree") as t:
        t.assemble(mc.Plan.of(np.stack([np.zeros_like(x), x % 8], axis=1)))


def _read_ranges(ctx, x):
    src = mcf.io.open_source(str(ctx["dir"] / "m.mcf"))
    try:
        out = np.zeros(int(x.sum()) + 8, np.uint8)
        src.read_ranges(x % 7, x, out, np.concatenate([[0], np.cumsum(x, dtype=np.int64)[:-1]]))
    finally:
        src.close()


def _bucket(ctx, x):
    from mcf.bucket import content_hash
    from mcf.bucket.store import prefix_hashes

    content_hash(token_ids=x)
    prefix_hashes("m", x, chunk_tokens=2)


INT_CASES = {
    "IndexedDataset.gather": _gather,
    "megatron Writer.add_item": _add_item,
    "megatron Writer.add_document": _add_document,
    "megatron Writer.add_documents": _add_documents,
    "megatron float dataset add_item": _float_dataset,
    "sample index builders": _sample_index,
    "Tree.append_tokens": _tree_tokens,
    "Tree.gists": _tree_gists,
    "Plan.of + assemble": _plan,
    "Source.read_ranges": _read_ranges,
    "bucket content_hash / prefix_hashes": _bucket,
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint16, np.uint8])
@pytest.mark.parametrize("case", sorted(INT_CASES))
def test_integer_array_inputs_are_never_modified(ctx, tmp_path, case, dtype, layout):
    x = (np.arange(1, 9) * 3 % 7 + 1).astype(dtype)
    held = Held(x, layout, tmp_path)
    INT_CASES[case](ctx, held.array)
    assert held.unchanged(), f"{case} modified its {layout} {x.dtype} input"


# -- functions that take payload bytes ------------------------------------------------------------------
def _reopen_all(data):
    with mcf.open(data) as c:
        for n in c:
            c.tensor(n)
            if c.info(n).quantized:
                c.dequantize(n, dtype=np.float16, threads=2)


BYTES_CASES = {
    "mcf.dequantize": lambda ctx, p: mcf.dequantize(p, "q4", (6, 64), threads=2),
    "QTensor": lambda ctx, p: K.QTensor(p, mcf.DType.Q4, 6, 64).rows_into(0, 6, np.empty(6 * 64, np.float32)),
    "Writer.add_tensor_bytes": lambda ctx, p: _bytes_writer(ctx, p),
    "mcf.open(buffer)": lambda ctx, p: _reopen_all(_file_bytes_like(ctx, p)),
}


def _bytes_writer(ctx, p):
    with mcf.Writer(ctx["dir"] / f"b-{os.urandom(4).hex()}.mcf") as wr:
        wr.add_tensor_bytes("q", "q4", (6, 64), p)


def _file_bytes_like(ctx, p):
    """The MCF file's bytes in the same layout as ``p`` (whatever array the caller was handed)."""
    return p


# an MCF file in memory must be one contiguous buffer: a strided view of one is not a file
BYTES_PARAMS = [(case, layout) for case in sorted(BYTES_CASES) for layout in ("c", "strided", "read-only", "memmap")
                if not (case == "mcf.open(buffer)" and layout == "strided")]


@pytest.mark.parametrize("case,layout", BYTES_PARAMS)
def test_payload_inputs_are_never_modified(ctx, tmp_path, case, layout):
    if case == "mcf.open(buffer)":
        values = np.frombuffer((ctx["dir"] / "m.mcf").read_bytes(), np.uint8).copy()
    else:
        values = ctx["payload"]
    held = Held(values, layout, tmp_path)
    BYTES_CASES[case](ctx, held.array)
    assert held.unchanged()


def test_readers_of_memory_never_write_it(ctx):
    """mcf.open, mcf.megatron.open and mcf.gguf.open on writable in-memory buffers leave them as they
    were (the same bytes as bytes objects work too)."""
    from pathlib import Path

    mcf_bytes = bytearray((ctx["dir"] / "m.mcf").read_bytes())
    idx, bin_ = bytearray(Path(str(ctx["dir"] / "ds") + ".idx").read_bytes()), \
        bytearray(Path(str(ctx["dir"] / "ds") + ".bin").read_bytes())
    gguf = bytearray((Path(__file__).parent / "fixtures" / "gguf" / "golden_v3.gguf").read_bytes())
    before = [bytes(b) for b in (mcf_bytes, idx, bin_, gguf)]
    _reopen_all(mcf_bytes)
    _reopen_all(bytes(mcf_bytes))
    with mm.open(idx=idx, bin=bin_) as ds:
        ds.gather(np.arange(len(ds)))
    import mcf.gguf

    for buf in (gguf, bytes(gguf)):
        with mcf.gguf.open(buf) as g:
            for n in g.tensors:
                if g.tensors[n].type.kind in ("float", "quant"):
                    g.dequantize(n)
    assert [bytes(b) for b in (mcf_bytes, idx, bin_, gguf)] == before


def test_open_bytes_means_content_everywhere(ctx, tmp_path):
    """mcf.open(bytes) used to fail as a path with an embedded NUL while mcf.gguf.open(bytes) read the
    content: bytes are content for every reader; a bytes path is refused with a hint."""
    data = (ctx["dir"] / "m.mcf").read_bytes()
    with mcf.open(data) as c:
        assert sorted(c) == ["d", "h", "q"]
    assert mcf.load_file(data)["d"].dtype == np.float64
    assert set(mcf.load_state_dict(data)) == {"d", "h", "q"}
    with pytest.raises(mcf.InvalidArgumentError, match="as str"):
        mcf.open(os.fsencode(str(ctx["dir"] / "m.mcf")))
    with pytest.raises(mcf.FormatError):
        mcf.open(b"not an mcf file at all, and no such path either")


# -- integer arguments: numpy's rules or an error --------------------------------------------------------
def _ds(ctx):
    return mm.open(str(ctx["dir"] / "ds"))


def _tree(ctx):
    return mc.open(ctx["dir"] / "tree")


def _sharded(ctx):
    """The dataset twice, as two shards of one ShardedDataset (12 sequences, 12 documents)."""
    return mm.open([str(ctx["dir"] / "ds"), str(ctx["dir"] / "ds")])


def _call_sharded(fn):
    def run(ctx, v):
        with _sharded(ctx) as ds:
            return fn(ds, v)
    return run


def _call_ds(fn):
    def run(ctx, v):
        with _ds(ctx) as ds:
            return fn(ds, v)
    return run


def _call_tree(fn):
    def run(ctx, v):
        with _tree(ctx) as t:
            return fn(t, v)
    return run


def _call_mcf(fn):
    def run(ctx, v):
        with mcf.open(ctx["dir"] / "m.mcf") as c:
            return fn(c, v)
    return run


def _gpt(ctx, v):
    with _ds(ctx) as ds:
        return si.GPTSamples(ds, 4)[v]


def _qt(ctx, v):
    qt = K.QTensor(ctx["payload"], mcf.DType.Q4, 6, 64)
    out = np.zeros(64 * 6, np.float32)
    qt.rows_into(v, 2, out)
    return out


def _source(fn):
    def run(ctx, v):
        src = mcf.io.open_source(str(ctx["dir"] / "m.mcf"))
        try:
            return fn(src, v)
        finally:
            src.close()
    return run


def _gguf_dequantize(kinds, call):
    def run(ctx, v):
        import mcf.gguf
        from pathlib import Path

        with mcf.gguf.open(str(Path(__file__).parent / "fixtures" / "gguf" / "golden_v3.gguf")) as g:
            name = next(n for n, t in g.tensors.items() if t.type.kind in kinds and t.shape and t.shape[0] > 2)
            return call(g, name, v)
    return run


_gguf_rows = _gguf_dequantize(("float", "quant"), lambda g, name, v: g.dequantize(name, rows=(v, 2)))
_gguf_threads = _gguf_dequantize(("quant",), lambda g, name, v: g.dequantize(name, threads=v))


def _load_multimodal_item(ctx, v):
    with _mwriter(ctx, dtype=np.int64, multimodal=True) as w:
        w.add_item([1, 2], mode=v)


# name -> call(ctx, v), or (call, good value) when 1 is not a valid value there
INTEGER_SLOTS = {
    "ds[i]": _call_ds(lambda ds, v: ds[v]),
    "ds.get(i)": _call_ds(lambda ds, v: ds.get(v)),
    "ds.get(offset)": _call_ds(lambda ds, v: ds.get(0, v)),
    "ds.get(length)": _call_ds(lambda ds, v: ds.get(0, 0, v)),
    "ds.document(k)": _call_ds(lambda ds, v: ds.document(v)),
    "ds.document_sequences(k)": _call_ds(lambda ds, v: list(ds.document_sequences(v))),
    "ds[i:]": _call_ds(lambda ds, v: ds[v:]),
    "ds[:i]": _call_ds(lambda ds, v: ds[:v]),
    "ds[::i]": _call_ds(lambda ds, v: ds[::v]),
    "sharded ds[i]": _call_sharded(lambda ds, v: ds[v]),
    "sharded ds[i:]": _call_sharded(lambda ds, v: ds[v:]),
    "sharded ds[:i]": _call_sharded(lambda ds, v: ds[:v]),
    "sharded ds[::i]": _call_sharded(lambda ds, v: ds[::v]),
    "sharded get(i)": _call_sharded(lambda ds, v: ds.get(v)),
    "sharded get(offset)": _call_sharded(lambda ds, v: ds.get(0, v)),
    "sharded get(length)": _call_sharded(lambda ds, v: ds.get(0, 0, v)),
    "sharded document(k)": _call_sharded(lambda ds, v: ds.document(v)),
    "sharded document_sequences(k)": _call_sharded(lambda ds, v: list(ds.document_sequences(v))),
    "sharded shard(k)": _call_sharded(lambda ds, v: ds.shard(v)[0]),
    "sharded locate(i)": _call_sharded(lambda ds, v: ds.locate(v)),
    "sharded GPTSamples[i]": _call_sharded(lambda ds, v: si.GPTSamples(ds, 4)[v]),
    "separate_final_epoch(num_samples)": (lambda ctx, v: si.separate_final_epoch(v, 2, 36, 4), 12),
    "separate_final_epoch(num_epochs)": (lambda ctx, v: si.separate_final_epoch(12, v, 36, 4), 2),
    "separate_final_epoch(tokens_per_epoch)": (lambda ctx, v: si.separate_final_epoch(12, 2, v, 4), 36),
    "separate_final_epoch(seq_length)": (lambda ctx, v: si.separate_final_epoch(12, 2, 36, v), 4),
    "num_epochs_for(num_samples)": lambda ctx, v: si.num_epochs_for(v, 36, 4),
    "Tree.num_gists(level)": _call_tree(lambda t, v: t.num_gists(v)),
    "Tree.gists(level)": _call_tree(lambda t, v: t.gists(v)),
    "Tree.header(level)": _call_tree(lambda t, v: t.header(v).num_entries),
    "Tree.source(level)": _call_tree(lambda t, v: t.source(v).size),
    "span_of(level)": lambda ctx, v: mc.span_of(v, 3),
    "children_of(level)": lambda ctx, v: list(mc.children_of(v, 3)),
    "parent_of(level)": (lambda ctx, v: mc.parent_of(v, 3), 0),
    "Tree.gists(slice start)": _call_tree(lambda t, v: t.gists(1, slice(v, None))),
    "Tree.gists(slice step)": _call_tree(lambda t, v: t.gists(1, slice(None, None, v))),
    "GPTSamples[i]": _gpt,
    "GPTSamples(seq_length)": (lambda ctx, v: _call_ds(lambda ds, v: len(si.GPTSamples(ds, v)))(ctx, v), 4),
    "build_sample_idx(seq_length)": (lambda ctx, v: si.build_sample_idx(np.full(4, 9, np.int32),
                                                                        np.arange(4, dtype=np.int32), v, 1, 36), 4),
    "build_sample_idx(num_epochs)": lambda ctx, v: si.build_sample_idx(np.full(4, 9, np.int32),
                                                                       np.arange(4, dtype=np.int32), 4, v, 36),
    "build_document_index(num_epochs)": lambda ctx, v: si.build_document_index(np.arange(4), v, 3),
    "build_shuffle_index(num_samples)": lambda ctx, v: si.build_shuffle_index(v, 4, 3),
    "build_gpt_indices(num_samples)": lambda ctx, v: si.build_gpt_indices(np.full(4, 9, np.int32), 4, num_samples=v),
    "Writer.add_item(mode)": _load_multimodal_item,
    "Tree.tokens(start)": _call_tree(lambda t, v: t.tokens(v, 4)),
    "Tree.tokens(stop)": _call_tree(lambda t, v: t.tokens(0, v)),
    "Tree.block(b)": _call_tree(lambda t, v: t.block(v)),
    "Tree.gist(level, i)": _call_tree(lambda t, v: t.gist(1, v)),
    "Tree.assemble(threads)": _call_tree(lambda t, v: t.assemble(mc.plan_tail(t, 12, 4), threads=v).levels),
    "plan_tail(budget)": (_call_tree(lambda t, v: mc.plan_tail(t, v, 4).levels), 12),
    "plan_tail(counts)": (lambda ctx, v: mc.plan_tail((v, 8, 4), 12, 4, block_size=2).levels, 16),
    "focus_plan(budget)": (lambda ctx, v: mc.focus_plan((16, 8, 4), [(2, 0), (2, 1), (2, 2), (2, 3)], [0.9, 0, 0, 0],
                                                        budget=v, tau_expand=0.2, tau_collapse=0.2,
                                                        block_size=2).indices, 5),
    "focus_plan(block_size)": (lambda ctx, v: mc.focus_plan((16, 8, 4), [(2, 0), (2, 1), (2, 2), (2, 3)],
                                                            [0.9, 0, 0, 0], budget=5, tau_expand=0.2,
                                                            tau_collapse=0.2, block_size=v).indices, 2),
    "span_of": lambda ctx, v: mc.span_of(1, v),
    "children_of": lambda ctx, v: list(mc.children_of(1, v)),
    "parent_of": lambda ctx, v: mc.parent_of(0, v),
    "token_offset": lambda ctx, v: mc.token_offset(v, 1),
    "gist_offset": lambda ctx, v: mc.gist_offset(v, 8, 2),
    "Container.dequantize(rows)": _call_mcf(lambda c, v: c.dequantize("q", rows=(v, 3))),
    "Container.dequantize(threads)": _call_mcf(lambda c, v: c.dequantize("q", threads=v)),
    "Container.load(threads)": _call_mcf(lambda c, v: c.load(threads=v)["d"]),
    "mcf.dequantize(rows)": lambda ctx, v: mcf.dequantize(ctx["payload"], "q4", (6, 64), rows=(v, 3)),
    "mcf.dequantize(shape)": (lambda ctx, v: mcf.dequantize(ctx["payload"], "q4", (v, 64)), 6),
    "mcf.quantize(threads)": lambda ctx, v: mcf.quantize(ctx["w"], "q8", threads=v)[0],
    "mcf.quantize(domain)": lambda ctx, v: mcf.quantize(ctx["w"], "int8", domain=v)[0],
    "load_state_dict(tp_rank)": lambda ctx, v: mcf.load_state_dict(ctx["dir"] / "m.mcf", tp_rank=v, tp_size=2)["q"],
    "QTensor.rows_into(r0)": _qt,
    "Source.read(offset)": _source(lambda s, v: s.read(v, 8)),
    "Source.view(size)": _source(lambda s, v: s.view(0, v)),
    "Source.array(offset)": _source(lambda s, v: s.array(v, np.uint8, 4)),
    "gguf dequantize(rows)": _gguf_rows,
    "gguf dequantize(threads)": _gguf_threads,
    "Writer.add_tensor_bytes(shape)": lambda ctx, v: _bytes_writer_shape(ctx, v),
    "megatron Writer(vocab_size)": (lambda ctx, v: _vocab_writer(ctx, v), 1000),
    "megacontext create(embedding_dim)": (lambda ctx, v: _create_tree(ctx, embedding_dim=v), 8),
    "megacontext create(block_size)": (lambda ctx, v: _create_tree(ctx, block_size=v), 4),
    "megacontext create(vocab_size)": (lambda ctx, v: _create_tree(ctx, vocab_size=v), 100),
}


def _vocab_writer(ctx, v):
    w = _mwriter(ctx, vocab_size=v)
    dt = w.dtype
    w.abort()
    return dt


def _create_tree(ctx, **kw):
    args = {"embedding_dim": 8, "block_size": 2, **kw}
    with mc.create(ctx["dir"] / f"c-{os.urandom(4).hex()}", **args) as t:
        return t.embedding_dim, t.block_size, t.vocab_size


def _bytes_writer_shape(ctx, v):
    with mcf.Writer(ctx["dir"] / f"s-{os.urandom(4).hex()}.mcf") as wr:
        wr.add_tensor_bytes("x", "u8", (v, 4), np.zeros(4 * 1, np.uint8))


def bad_integers(good: int) -> list:
    """Values that are not integers, though Python's int() or Cython would turn them into ``good``."""
    out = [float(good), good + 0.5, np.float64(good), np.float32(good), str(good), complex(good)]
    if good in (0, 1):
        out += [bool(good), np.bool_(good)]
    return out


def good_integers(good: int) -> list:
    return [t(good) for t in (np.int8, np.uint8, np.int16, np.int64, np.uint64, np.intp)
            if np.iinfo(t).min <= good <= np.iinfo(t).max]


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(np.asarray(a), np.asarray(b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("slot", sorted(INTEGER_SLOTS))
def test_integer_arguments_refuse_floats_and_bools(ctx, slot):
    call = INTEGER_SLOTS[slot]
    call, good = call if isinstance(call, tuple) else (call, 1)
    want = call(ctx, good)
    for v in good_integers(good):
        assert _same(call(ctx, v), want), (slot, v)
    for v in bad_integers(good):
        with pytest.raises(mcf.MCFError):
            call(ctx, v)


# index arrays: numpy's meaning of a boolean mask and of integer arrays; floats refused
def _idx_gather(ctx, ix):
    with _ds(ctx) as ds:
        return ds.gather(ix)[0]


def _idx_gists(ctx, ix):
    with _tree(ctx) as t:
        return t.gists(1, ix)


def _idx_gpt(ctx, ix):
    return si.build_gpt_indices(np.full(6, 9, np.int32), 4, indices=ix)[0]


INDEX_SLOTS = {"IndexedDataset.gather": (_idx_gather, 6), "Tree.gists": (_idx_gists, 8),
               "build_gpt_indices(indices)": (_idx_gpt, 6)}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(slot=st.sampled_from(sorted(INDEX_SLOTS)), data=st.data())
def test_index_arrays_follow_numpy(ctx, slot, data):
    call, n = INDEX_SLOTS[slot]
    mask = np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    if not mask.any():
        mask[0] = True
    positions = np.flatnonzero(mask)
    want = call(ctx, positions)
    assert _same(call(ctx, mask), want)                       # a mask selects, as in numpy
    assert _same(call(ctx, mask.tolist()), want)              # as a list of bools too
    for dt in (np.int8, np.uint16, np.int32, np.uint64):
        assert _same(call(ctx, positions.astype(dt)), want)
    with pytest.raises(mcf.MCFError):
        call(ctx, positions.astype(np.float64))               # floats are refused, even integral ones
    with pytest.raises(mcf.MCFError):
        call(ctx, mask[:-1])                                  # a mask of the wrong length
    if slot != "build_gpt_indices(indices)":                   # negative ids: Megatron has none there
        assert _same(call(ctx, positions - n), want)          # negative indices count from the end


@pytest.mark.parametrize("case", ["add_document", "add_documents", "read_ranges"])
def test_length_arrays_refuse_floats(ctx, case):
    """``lengths=[2.9, 3.9]`` was stored as [2, 3]."""
    bad = [[2.9, 3.9], np.array([2.0, 3.0]), [True, True], ["2", "3"]]
    for lengths in bad:
        with pytest.raises(mcf.MCFError):
            if case == "add_document":
                with _mwriter(ctx, dtype=np.int64) as w:
                    w.add_document(np.arange(5), lengths)
            elif case == "add_documents":
                with _mwriter(ctx, dtype=np.int64) as w:
                    w.add_documents(np.arange(5), lengths)
            else:
                src = mcf.io.open_source(str(ctx["dir"] / "m.mcf"))
                try:
                    src.read_ranges([0, 8], lengths, np.zeros(16, np.uint8), [0, 8])
                finally:
                    src.close()


# -- output arrays ---------------------------------------------------------------------------------------
def test_to_float32_out_must_be_float32(ctx):
    """``to_float32(out=<float16>)`` wrote float16 (70000 became inf) for F32/F64 tensors and raised
    for F16/BF16 ones: ``out`` must be float32 in every case, and is filled and returned."""
    with mcf.open(ctx["dir"] / "m.mcf") as c:
        for name in ("d", "h"):
            want = c.to_float32(name)
            for bad in (np.empty(want.size, np.float16), np.empty(want.size, np.float64),
                        np.empty(want.size, ">f4"), np.empty(want.size + 1, np.float32),
                        np.empty(want.shape[::-1], np.float32).T, [0.0] * want.size):
                with pytest.raises(mcf.InvalidArgumentError):
                    c.to_float32(name, out=bad)
            for out in (np.empty(want.shape, np.float32), np.empty(want.size, np.float32)):
                assert c.to_float32(name, out=out) is out and out.tobytes() == want.tobytes()
    with mcf.Writer(ctx["dir"] / "big.mcf") as wr:
        wr.add_tensor("x", np.array([70000.0, 1e40], np.float64))
    with mcf.open(ctx["dir"] / "big.mcf") as c:
        out = np.empty(2, np.float32)
        c.to_float32("x", out=out)
        assert out[0] == 70000.0 and np.isinf(out[1])


def test_big_endian_is_named_not_called_a_wrong_dtype(ctx):
    """A ``>f4`` array used to be refused as "must be float32, got >f4"."""
    with mcf.open(ctx["dir"] / "m.mcf") as c:
        for call in (lambda: c.dequantize("q", out=np.empty((6, 64), ">f4")),
                     lambda: c.dequantize("d", dtype=">f4"),
                     lambda: c.to_float32("d", out=np.empty(6 * 64, ">f4")),
                     lambda: mcf.dequantize(ctx["payload"], "q4", (6, 64), dtype=">f2")):
            with pytest.raises(mcf.InvalidArgumentError, match="big-endian"):
                call()
    with _tree(ctx) as t:
        with pytest.raises(mcf.InvalidArgumentError, match="big-endian"):
            t.assemble(mc.plan_tail(t, 12, 4), np.zeros((100, 8), np.float32), out=np.empty((12, 8), ">f4"))
    # inputs in big-endian order are read as their values
    x = np.random.default_rng(2).standard_normal((2, 40)).astype(">f4")
    with mcf.Writer(ctx["dir"] / "be.mcf") as wr:
        wr.add_tensor("x", x)
    with mcf.open(ctx["dir"] / "be.mcf") as c:
        assert np.array_equal(c.tensor("x"), x) and c.tensor("x").dtype == np.dtype("<f4")


def test_every_writer_refuses_a_url(ctx, tmp_path, monkeypatch):
    """Remote files are read-only: every writer given a URL raises InvalidArgumentError before it
    creates anything (mcf.export used to create a local directory named "https:").  The Megatron writer
    (and merge, tokenize) write to object stores (tests/test_megatron_remote.py) and refuse the other URLs."""
    monkeypatch.chdir(tmp_path)
    src = str(ctx["dir"] / "m.mcf")
    from _vectors import MANTLE_MODEL
    from mcf.bucket import write_kv

    calls = [lambda u: mcf.Writer(u + "/x.mcf"), lambda u: mm.Writer(u + "/x"),
             lambda u: mcf.export(src, u + "/x.safetensors"), lambda u: mcf.export(src, u + "/dir"),
             lambda u: mcf.convert(MANTLE_MODEL, u + "/x.mcf"), lambda u: mcf.pack(MANTLE_MODEL, u + "/x.mcf"),
             lambda u: mcf.conversion.quant_policy.quantize_file(src, u + "/x.mcf", "q8"),
             lambda u: mc.create(u + "/tree", embedding_dim=4),
             lambda u: write_kv(u + "/kv.mcb", [(np.zeros((1, 2, 4), np.float16),) * 2])]
    for url in ("https://example.invalid/m", "s3://bucket/m", "memory://m"):
        for call in calls:
            if url.startswith("s3:") and call is calls[1]:
                continue
            with pytest.raises(mcf.InvalidArgumentError, match="remote"):
                call(url)
    assert os.listdir(tmp_path) == []
