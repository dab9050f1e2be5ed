"""Partial and per-rank loading (names=, slices= with mcf.Rows / mcf.Shard) and mcf.load_file on MCF
files, against independent references: numpy slicing of the whole tensor (safetensors.numpy's load of
it, Container.tensor, Container.dequantize), and the byte count a piece needs computed from its shape
alone (itemsize, or the regions of mcf.quant_layout for a quantized piece).

The byte budget is the issue's: what a load reads from storage (Source.bytes_read, summed over the
shards, counted from after the headers were parsed) is at most 1.05x the bytes of the requested pieces,
for row ranges, shards along dimension 1, a 1/4 tensor-parallel slice of every matrix and names=
subsets, on MCF (plain and quantized) and safetensors files, into numpy arrays and torch tensors.
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mcf
from mcf import Rows, Shard
from mcf.safetensors import open_checkpoint

ml_dtypes = pytest.importorskip("ml_dtypes")
st_numpy = pytest.importorskip("safetensors.numpy")

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": BF16, "f64": np.float64, "i32": np.int32, "u8": np.uint8,
          "i64": np.int64}
METHODS = ("q8", "q4", "k6", "k4", "k3", "k2", "int8", "int4")


def _rng(tag):
    return np.random.default_rng(zlib.crc32(tag.encode()))


def _array(rng, shape, dt):
    if np.dtype(dt).kind in "iu":
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, size=shape, dtype=dt, endpoint=True)
    return rng.standard_normal(shape).astype(dt)


def _cut(spec, shape):
    """The numpy index of a spec, computed here from its definition (not by mcf)."""
    idx = [slice(None)] * len(shape)
    if isinstance(spec, Rows):
        idx[0] = slice(spec.start, spec.stop)
    elif isinstance(spec, Shard):
        d = spec.dim % len(shape)
        k = shape[d] // spec.world
        idx[d] = slice(spec.rank * k, (spec.rank + 1) * k)
    return tuple(idx)


def _same(a, b, what=""):
    a, b = np.asarray(a), np.asarray(b, order="C")   # (ascontiguousarray makes a 0-d array 1-d)
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    assert a.tobytes() == b.tobytes(), what


def _tensor_bytes(t):
    return t.reshape(-1).view(__import__("torch").uint8).numpy().tobytes() if t.numel() else b""


@st.composite
def _plain_case(draw):
    rank = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=rank, max_size=rank)))
    dt = draw(st.sampled_from(sorted(DTYPES)))
    kind = draw(st.sampled_from(["whole", "rows", "shard"]))
    if kind == "rows":
        a = draw(st.integers(0, shape[0]))
        spec = Rows(a, draw(st.integers(a, shape[0])))
    elif kind == "shard":
        dim = draw(st.integers(-rank, rank - 1))
        n = shape[dim]
        world = draw(st.sampled_from([w for w in range(1, 7) if n % w == 0] if n else [1, 2, 3]))
        spec = Shard(draw(st.integers(0, world - 1)), world, dim)
    else:
        spec = None
    return shape, dt, spec, draw(st.sampled_from([None, "float32"]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_plain_case())
def test_plain_slices_equal_numpy_slicing(tmp_path_factory, case):
    """Any Rows / Shard of a row-major tensor, from an MCF file and a safetensors file, numpy and torch,
    equals numpy's slice of the whole tensor (cast to float32 when asked, integers kept)."""
    pytest.importorskip("torch")
    import mcf.torch

    shape, dt, spec, dtype = case
    a = _array(_rng(f"plain-{shape}-{dt}"), shape, DTYPES[dt])
    d = tmp_path_factory.mktemp("plain")
    with mcf.Writer(str(d / "t.mcf")) as w:
        w.add_tensor("t", a)
    st_numpy.save_file({"t": a}, str(d / "t.safetensors"))
    want = a[_cut(spec, shape)]
    if dtype is not None and dt in ("f32", "f16", "bf16", "f64"):
        want = want.astype(np.float32)
    slices = None if spec is None else {"t": spec}
    for path in (d / "t.mcf", d / "t.safetensors"):
        for mmap in (True, False):
            got = mcf.load_file(path, slices=slices, dtype=dtype, mmap=mmap)["t"]
            _same(got, want, (path.name, spec, dtype))
            t = mcf.torch.load_file(path, slices=slices, dtype=dtype, mmap=mmap)["t"]
            assert tuple(t.shape) == want.shape and t.is_contiguous()
            assert _tensor_bytes(t) == np.ascontiguousarray(want).tobytes()
    if dtype is None:
        _same(mcf.safetensors.load_file(d / "t.safetensors", slices=slices, copy=False)["t"], want)


@st.composite
def _quant_case(draw):
    method = draw(st.sampled_from(METHODS))
    rows = draw(st.integers(1, 24))
    cols = draw(st.sampled_from([32, 64, 96, 256, 300, 512, 768, 1024]))
    kind = draw(st.sampled_from(["rows", "shard0", "shard1", "whole"]))
    if kind == "rows":
        a = draw(st.integers(0, rows))
        spec = Rows(a, draw(st.integers(a, rows)))
    elif kind == "whole":
        spec = None
    else:
        n = rows if kind == "shard0" else cols
        world = draw(st.sampled_from([w for w in (1, 2, 3, 4, 8) if n % w == 0]))
        spec = Shard(draw(st.integers(0, world - 1)), world, 0 if kind == "shard0" else 1)
    return method, rows, cols, spec, draw(st.sampled_from([None, "float16", "bfloat16", "float64"]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_quant_case())
def test_quantized_slices_equal_the_slice_of_the_whole_decode(tmp_path_factory, case):
    """A share of a quantized tensor (rows, block rows, columns on or off block boundaries) decodes to
    exactly the same values as the same slice of Container.dequantize of the whole tensor."""
    method, rows, cols, spec, dtype = case
    a = _rng(f"q-{method}-{rows}-{cols}").standard_normal((rows, cols)).astype(np.float32)
    p = str(tmp_path_factory.mktemp("q") / "q.mcf")
    with mcf.Writer(p) as w:
        w.add_tensor("q", a, method=method)
    out = {None: np.float32, "float16": np.float16, "bfloat16": BF16, "float64": np.float64}[dtype]
    with mcf.open(p) as c:
        whole = c.dequantize("q", np.float32 if out == np.float64 else out)
    want = whole.astype(np.float64) if out == np.float64 else whole
    want = want[_cut(spec, (rows, cols))]
    for mmap in (True, False):
        got = mcf.load_file(p, slices=None if spec is None else {"q": spec}, dtype=dtype, mmap=mmap, threads=2)["q"]
        _same(got, want, (method, rows, cols, spec, dtype))


# -- the byte budget ------------------------------------------------------------------------------------------
# 1024 columns: a quarter of them (256) is a whole k-quant super-block, so every quantized share below is
# a payload of its own (shares off those boundaries read whole rows: tested in test_quantized_slices_...)
LAYERS, COLS = 3, 1024


def _model(rng):
    """A small transformer-shaped state dict: per layer q/k/v/o and up/down matrices and a norm."""
    w = {"emb.weight": rng.standard_normal((96, COLS)).astype(np.float32)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        for n in ("q", "k", "v", "o"):
            w[p + f"attn.{n}.weight"] = rng.standard_normal((128, COLS)).astype(np.float32)
        w[p + "mlp.up.weight"] = rng.standard_normal((256, COLS)).astype(np.float32)
        w[p + "mlp.down.weight"] = rng.standard_normal((96, 2 * COLS)).astype(np.float32)
        w[p + "norm.weight"] = rng.standard_normal((COLS,)).astype(np.float32)
    return w


@pytest.fixture(scope="module")
def model_files(tmp_path_factory):
    """The same weights as: an MCF file of f16, an MCF file quantized (k4, q8, int4 by layer), and a
    safetensors checkpoint of bf16 in three shards with an index."""
    import json

    rng = _rng("byte-budget")
    w = _model(rng)
    d = tmp_path_factory.mktemp("budget")
    with mcf.Writer(str(d / "f16.mcf")) as wr:
        for n, a in w.items():
            wr.add_tensor(n, a.astype(np.float16))
    with mcf.Writer(str(d / "quant.mcf")) as wr:
        for n, a in w.items():
            if a.ndim == 2 and n.startswith("layers."):
                wr.add_tensor(n, a, method=("k4", "q8", "int4")[int(n.split(".")[1])])
            else:
                wr.add_tensor(n, a)
    ck = d / "ck"
    ck.mkdir()
    names = list(w)
    wm = {}
    for k in range(3):
        part = {n: w[n].astype(BF16) for n in names[k::3]}
        st_numpy.save_file(part, str(ck / f"model-0000{k + 1}-of-00003.safetensors"))
        wm.update({n: f"model-0000{k + 1}-of-00003.safetensors" for n in part})
    (ck / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    return w, d


def _tp_plan(world, rank):
    """A 1/world tensor-parallel rank: column-parallel q/k/v/up split their rows (dim 0), row-parallel
    o/down their columns (dim 1), everything else whole."""
    return {"*.attn.[qkv].weight": Shard(rank, world, 0), "*.mlp.up.weight": Shard(rank, world, 0),
            "*.attn.o.weight": Shard(rank, world, 1), "*.mlp.down.weight": Shard(rank, world, 1)}


CASES = {
    "row ranges": dict(slices={"*.weight": Rows(16, 80)}),
    "dim-1 shards": dict(slices={"*norm*": None, "*": Shard(1, 4, 1)}),
    "tensor parallel 1/4": dict(slices=_tp_plan(4, 2)),
    "names subset": dict(names=["layers.1.*", "emb.weight"]),
    "names and a shard": dict(names=["layers.2.mlp.*"], slices={"*": Shard(3, 4, 0)}),
}


def _piece_bytes(shape, stored):
    """Bytes a piece of ``shape`` holds in storage: its values, or for a quantized piece the regions of
    its own payload (mcf.quant_layout; the padding between regions is not data)."""
    if isinstance(stored, str):
        return sum(r.size for r in mcf.quant_layout(stored, shape).regions)
    return math.prod(shape) * np.dtype(stored).itemsize


def _open(kind, d, mmap):
    if kind == "safetensors":
        ck = open_checkpoint(d / "ck", mmap=mmap)
        return ck, [f.source for f in ck.files]
    c = mcf.open(str(d / f"{kind}.mcf"), mmap=mmap)
    return c, [c.source]


def _stored(kind, obj, name):
    if kind == "safetensors":
        return BF16
    t = obj.info(name)
    return t.dtype.name if t.dtype.quantized else t.dtype.numpy


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("kind", ["f16", "quant", "safetensors"])
@pytest.mark.parametrize("dest", ["numpy", "torch"])
@pytest.mark.parametrize("mmap", [False, True])
def test_reads_only_the_bytes_of_the_pieces(model_files, case, kind, dest, mmap):
    w, d = model_files
    kw = CASES[case]
    if dest == "torch":
        pytest.importorskip("torch")
        import mcf.torch as loader
    else:
        loader = mcf
    obj, sources = _open(kind, d, mmap)
    try:
        full = mcf.load_file(obj)
        before = sum(s.bytes_read for s in sources)
        got = loader.load_file(obj, **kw)
        read = sum(s.bytes_read for s in sources) - before
        want = 0
        for name, t in got.items():
            spec = next((s for pat, s in kw.get("slices", {}).items()
                         if __import__("fnmatch").fnmatchcase(name, pat)), None)
            shape = tuple(w[name].shape)
            piece = full[name][_cut(spec, shape)]
            assert tuple(t.shape) == piece.shape, (name, spec)
            if dest == "torch":
                assert _tensor_bytes(t) == np.ascontiguousarray(piece).tobytes(), name
            else:
                _same(t, piece, name)
            want += _piece_bytes(piece.shape, _stored(kind, obj, name))
        assert want <= read <= 1.05 * want, (read, want)
    finally:
        obj.close()


def test_a_quarter_of_every_matrix_reads_a_quarter(model_files):
    """The four ranks of a 1/4 tensor-parallel plan together read the file's matrices once, not four times."""
    w, d = model_files
    total = 0
    for rank in range(4):
        obj, sources = _open("safetensors", d, False)
        try:
            before = sum(s.bytes_read for s in sources)
            mcf.load_file(obj, names=["layers.*.attn.*", "layers.*.mlp.*"], slices=_tp_plan(4, rank))
            total += sum(s.bytes_read for s in sources) - before
        finally:
            obj.close()
    matrices = sum(a.size * 2 for n, a in w.items() if n.startswith("layers.") and a.ndim == 2)
    assert total == matrices


def test_tp_shares_read_only_their_bytes_through_load_state_dict(model_files):
    """The tp_rank/tp_size API of load_state_dict reads only each share's bytes too, quantized tensors
    included (a row share used to read the whole payload when the file was not mapped)."""
    w, d = model_files
    with mcf.open(str(d / "quant.mcf"), mmap=False) as c:
        names = [n for n in c.keys() if c.info(n).dtype.quantized]
        for dim in (0, 1):
            before = c.source.bytes_read
            got = mcf.load_state_dict(c, names=names, tp_rank=1, tp_size=4, tp_dim=dim)
            read = c.source.bytes_read - before
            want = sum(_piece_bytes(got[n].shape, c.info(n).dtype.name) for n in names)
            assert want <= read <= 1.05 * want, (dim, read, want)


@pytest.mark.parametrize("budget", [4096, 1 << 20])
def test_decoding_in_small_staging_batches_gives_the_same_result(model_files, monkeypatch, budget):
    """Casts and quantized tensors are read and decoded in batches of at most STAGING_BYTES of stored
    bytes (a tensor larger than that in several stages): any budget gives the same arrays."""
    from mcf.loading import plan

    w, d = model_files
    want = {kind: mcf.load_file(d / kind, dtype="bfloat16", slices=_tp_plan(4, 3))
            for kind in ("f16.mcf", "quant.mcf", "ck")}
    monkeypatch.setattr(plan, "STAGING_BYTES", budget)
    for kind, ref in want.items():
        got = mcf.load_file(d / kind, dtype="bfloat16", slices=_tp_plan(4, 3), mmap=False)
        assert list(got) == list(ref)
        for n in ref:
            _same(got[n], ref[n], (kind, n))


# -- mcf.load_file on MCF files -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    rng = _rng("mixed")
    p = tmp_path_factory.mktemp("mixed") / "m.mcf"
    arrays = {"a": rng.standard_normal((33, 17)).astype(np.float32), "b": np.arange(7, dtype=np.int16),
              "c": np.float64(2.5), "d": np.zeros((0, 3), np.float16),
              "e": rng.standard_normal((8, 8)).astype(BF16)}
    with mcf.Writer(str(p)) as w:
        for n, a in arrays.items():
            w.add_tensor(n, a)
        w.add_tensor("q", rng.standard_normal((16, 256)).astype(np.float32), method="k4")
    return p, arrays


def test_load_file_decodes_quantized_tensors_or_keeps_them_raw(mixed):
    p, arrays = mixed
    with mcf.open(str(p)) as c:
        order = list(c.keys())
        got = mcf.load_file(p)
        assert list(got) == order
        for n, a in arrays.items():
            _same(got[n], np.asarray(a), n)
        _same(got["q"], c.dequantize("q"), "q")
        raw = mcf.load_file(p, dtype="raw")
        _same(raw["q"], c.raw("q"), "q raw")
        half = mcf.load_file(p, names=["q", "a", "b"], dtype="float16")
        assert list(half) == ["q", "a", "b"]
        _same(half["q"], c.dequantize("q", np.float16), "q f16")
        _same(half["a"], arrays["a"].astype(np.float16), "a f16")
        _same(half["b"], arrays["b"], "b keeps its integers")
    for src in (p.read_bytes(), open(p, "rb")):   # buffers and file objects are told apart by their magic
        try:
            again = mcf.load_file(src)
            assert list(again) == order
            _same(again["q"], got["q"])
        finally:
            if hasattr(src, "close"):
                src.close()


def test_every_result_is_its_own_allocation(mixed):
    """One allocation per tensor, not one arena for all (Container.load used to return views of one arena,
    so keeping any tensor kept every other tensor's memory alive)."""
    p, _ = mixed
    with mcf.open(str(p)) as c:
        for out in (c.load(), mcf.load_file(p), mcf.load_state_dict(p, copy=True)):
            for a in out.values():
                if a.nbytes:
                    owner = a
                    while owner.base is not None:
                        owner = owner.base
                    assert owner.nbytes <= a.nbytes + 4096, owner.nbytes


def test_load_state_dict_takes_slices_or_tp_arguments_not_both(mixed):
    p, _ = mixed
    got = mcf.load_state_dict(p, slices={"a": Rows(3, 9), "q": Shard(1, 2, 1)})
    with mcf.open(str(p)) as c:
        _same(got["a"], c.tensor("a")[3:9])
        _same(got["q"], c.dequantize("q")[:, 128:])
    with pytest.raises(mcf.InvalidArgumentError, match="not both"):
        mcf.load_state_dict(p, slices={"a": Rows(0, 1)}, tp_rank=0, tp_size=2)
    with pytest.raises(mcf.InvalidArgumentError, match="raw payload loads whole"):
        mcf.load_file(p, dtype="raw", slices={"q": Rows(0, 2)})
