"""Loads into memory the caller holds: ``mcf.load_into`` (numpy arrays), ``mcf.torch.load_into`` (tensors) and
``mcf.torch.load_model`` on plain torch modules (transformers models: test_load_model_hf.py).

Each destination keeps its memory (same object, same address, nothing of its size allocated), gets exactly
what the copying loaders return for the same tensor (cast or decoded into its dtype), and every refusal
(names, shapes, dtypes, overlaps, read-only memory) comes before a byte is written."""

from __future__ import annotations

import os
import sys
import tracemalloc

import ml_dtypes
import numpy as np
import pytest

import mcf
from mcf.gguf import open as open_gguf

sys.path.insert(0, os.path.dirname(__file__))
import _scaled_checkpoints as scaled  # noqa: E402

torch = pytest.importorskip("torch", reason="torch is in the test extra")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="safetensors is in the test extra")


def _tensors(seed=0):
    rng = np.random.default_rng(seed)
    return {"emb": rng.standard_normal((64, 32)).astype(np.float32),
            "proj": rng.standard_normal((32, 48)).astype(np.float32),
            "norm": rng.standard_normal(48).astype(np.float32),
            "steps": np.arange(5, dtype=np.int64)}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The same tensors as a float32 and a bfloat16 safetensors file, a two-shard checkpoint, an MCF file and
    an MCF file with emb and proj quantized (q8)."""
    from safetensors.numpy import save_file

    d = tmp_path_factory.mktemp("into")
    t = _tensors()
    save_file(t, str(d / "f32.safetensors"))
    bf = {k: (v.astype(ml_dtypes.bfloat16) if v.dtype == np.float32 else v) for k, v in t.items()}
    save_file(bf, str(d / "bf16.safetensors"))
    ck = d / "ckpt"
    ck.mkdir()
    save_file({"emb": t["emb"], "steps": t["steps"]}, str(ck / "model-00001-of-00002.safetensors"))
    save_file({"proj": t["proj"], "norm": t["norm"]}, str(ck / "model-00002-of-00002.safetensors"))
    import json

    (ck / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        "emb": "model-00001-of-00002.safetensors", "steps": "model-00001-of-00002.safetensors",
        "proj": "model-00002-of-00002.safetensors", "norm": "model-00002-of-00002.safetensors"}}))
    mcf.convert(str(d / "f32.safetensors"), str(d / "plain.mcf"))
    mcf.convert(str(d / "f32.safetensors"), str(d / "q8.mcf"), method="q8")
    return d


def _zeros_like(ref: dict, dtype=None) -> dict:
    return {k: np.zeros(v.shape, dtype or v.dtype) for k, v in ref.items()}


# -- numpy -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("src", ["f32.safetensors", "ckpt", "plain.mcf"])
def test_numpy_fills_every_array_in_place(files, src):
    ref = mcf.load_file(str(files / src))
    dest = _zeros_like(ref)
    before = {k: (id(v), v.ctypes.data) for k, v in dest.items()}
    assert mcf.load_into(dest, str(files / src)) == ([], [])
    for k, v in dest.items():
        assert (id(v), v.ctypes.data) == before[k]
        np.testing.assert_array_equal(v, ref[k])


def _count_staging(monkeypatch) -> list:
    """Record every staging buffer a load allocates (the fill's own, and the executor's decode staging)."""
    import mcf.loaders.into as into
    import mcf.loading.plan as plan

    sizes = []
    for mod, name in ((into, "aligned_bytes"), (plan, "aligned_empty")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda n, *a, _real=real: sizes.append(n) or _real(n, *a))
    return sizes


def test_numpy_load_allocates_nothing_of_the_arrays_size(tmp_path, monkeypatch):
    """Nothing is staged (the C allocations) and nothing of the arrays' size is allocated by numpy (traced)."""
    from safetensors.numpy import save_file

    path = str(tmp_path / "big.safetensors")
    save_file({"a": np.ones((512, 1024), np.float32), "b": np.full(300_000, 2, np.int64)}, path)
    dest = _zeros_like(mcf.load_file(path))
    total = sum(v.nbytes for v in dest.values())
    mcf.load_into(dest, path)   # warm: imports, caches
    staged = _count_staging(monkeypatch)
    tracemalloc.start()
    try:
        mcf.load_into(dest, path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < total / 64, (peak, total)
    assert staged == []
    assert dest["a"].all() and (dest["b"] == 2).all()


def test_numpy_cast_and_decode_into_the_arrays_dtype(files):
    bf16 = str(files / "bf16.safetensors")
    ref = mcf.load_file(bf16, dtype=np.float32)
    dest = _zeros_like(ref)
    mcf.load_into(dest, bf16)
    for k in ref:
        np.testing.assert_array_equal(dest[k], ref[k])
    half = {k: np.zeros(v.shape, np.float16 if v.dtype == np.float32 else v.dtype) for k, v in ref.items()}
    mcf.load_into(half, str(files / "f32.safetensors"))
    ref16 = mcf.load_file(str(files / "f32.safetensors"), dtype=np.float16)
    for k in ref16:
        np.testing.assert_array_equal(half[k], ref16[k])
    q8 = str(files / "q8.mcf")
    for dt in (np.float32, ml_dtypes.bfloat16, np.float64):
        ref = mcf.load_file(q8, dtype=dt)
        dest = {k: np.zeros(v.shape, v.dtype) for k, v in ref.items()}
        mcf.load_into(dest, q8)
        for k in ref:
            np.testing.assert_array_equal(dest[k], ref[k])


def test_numpy_names_slices_and_mapping(files):
    path = str(files / "f32.safetensors")
    t = _tensors()
    part = {"E": np.zeros((16, 32), np.float32), "P": np.zeros((32, 24), np.float32)}
    missing, unexpected = mcf.load_into(part, path, names=["emb", "proj"],
                                        slices={"emb": mcf.Shard(1, 4), "proj": mcf.Shard(1, 2, dim=1)},
                                        mapping={"emb": "E", "proj": "P"})
    assert (missing, unexpected) == ([], [])
    np.testing.assert_array_equal(part["E"], t["emb"][16:32])
    np.testing.assert_array_equal(part["P"], t["proj"][:, 24:])
    dest = {"layer.norm": np.zeros(48, np.float32)}
    out = mcf.load_into(dest, path, mapping=lambda n: "layer." + n if n == "norm" else None)
    assert out == ([], [])
    np.testing.assert_array_equal(dest["layer.norm"], t["norm"])


def test_numpy_strict_names_every_missing_and_unexpected_and_writes_nothing(files):
    path = str(files / "f32.safetensors")
    dest = {"emb": np.zeros((64, 32), np.float32), "extra.a": np.zeros(3, np.float32),
            "extra.b": np.zeros(3, np.float32)}
    with pytest.raises(mcf.LoadMismatchError) as e:
        mcf.load_into(dest, path)
    msg = str(e.value)
    assert isinstance(e.value, RuntimeError)
    for n in ("'extra.a'", "'extra.b'", "'proj'", "'norm'", "'steps'"):
        assert n in msg, n
    assert not dest["emb"].any()
    missing, unexpected = mcf.load_into(dest, path, strict=False)
    assert missing == ["extra.a", "extra.b"] and sorted(unexpected) == ["norm", "proj", "steps"]
    np.testing.assert_array_equal(dest["emb"], _tensors()["emb"])


def test_numpy_wrong_shape_is_refused_whatever_strict(files):
    path = str(files / "f32.safetensors")
    dest = _zeros_like(_tensors())
    dest["proj"] = np.zeros((48, 32), np.float32)
    dest["norm"] = np.zeros(47, np.float32)
    for strict in (True, False):
        with pytest.raises(mcf.LoadMismatchError) as e:
            mcf.load_into(dest, path, strict=strict)
        assert "'proj' is (32, 48), the destination is (48, 32)" in str(e.value)
        assert "'norm' is (48,), the destination is (47,)" in str(e.value)
        assert not any(v.any() for v in dest.values())


@pytest.mark.parametrize("name,dtype", [("emb", np.int32), ("steps", np.float32), ("emb", np.uint16)])
def test_numpy_dtype_that_cannot_cast_is_refused(files, name, dtype):
    dest = _zeros_like(_tensors())
    dest[name] = np.zeros(dest[name].shape, dtype)
    with pytest.raises(mcf.DTypeError, match=repr(name)):
        mcf.load_into(dest, str(files / "f32.safetensors"))
    assert not any(v.any() for v in dest.values())


def test_numpy_duplicate_mapping_targets_are_refused(files):
    dest = {"x": np.zeros(48, np.float32)}
    with pytest.raises(mcf.InvalidArgumentError, match="'norm' and 'steps' both map to the destination 'x'|"
                                                       "'steps' and 'norm' both map"):
        mcf.load_into(dest, str(files / "f32.safetensors"), names=["norm", "steps"], mapping=lambda n: "x")


def test_numpy_strided_view_is_filled_through_staging(files, monkeypatch):
    import mcf.loaders.into as into

    monkeypatch.setattr(into, "STAGING_BYTES", 4096)   # several batches
    staged = _count_staging(monkeypatch)
    t = _tensors()
    base = np.full((64, 64), -1, np.float32)
    big = np.full((48, 3), -1, np.float32)
    dest = {"emb": base[:, ::2], "norm": big[:, 1]}
    assert not dest["emb"].flags.c_contiguous
    mcf.load_into(dest, str(files / "f32.safetensors"), names=["emb", "norm"])
    np.testing.assert_array_equal(base[:, ::2], t["emb"])
    assert (base[:, 1::2] == -1).all()
    np.testing.assert_array_equal(big[:, 1], t["norm"])
    assert (big[:, [0, 2]] == -1).all()
    assert staged == [64 * 32 * 4, 48 * 4]   # one staging buffer per strided destination


def test_numpy_read_only_array_is_refused(files):
    dest = _zeros_like(_tensors())
    dest["norm"].setflags(write=False)
    with pytest.raises(mcf.InvalidArgumentError, match="'norm' is read-only"):
        mcf.load_into(dest, str(files / "f32.safetensors"))
    assert not dest["emb"].any()


def test_numpy_bad_destinations_are_refused(files):
    path = str(files / "f32.safetensors")
    with pytest.raises(mcf.ArgumentTypeError):
        mcf.load_into([np.zeros(3)], path)
    with pytest.raises(mcf.ArgumentTypeError, match="'norm' must be a numpy array"):
        mcf.load_into({"norm": [0.0] * 48}, path, names=["norm"])
    with pytest.raises(mcf.DTypeError, match="big-endian"):
        mcf.load_into({"norm": np.zeros(48, ">f4")}, path, names=["norm"])
    with pytest.raises(mcf.TensorNotFoundError, match="'nope'"):
        mcf.load_into({"norm": np.zeros(48, np.float32)}, path, names=["norm"], mapping={"nope": "norm"})
    with pytest.raises(mcf.ArgumentTypeError, match="mapping"):
        mcf.load_into({"norm": np.zeros(48, np.float32)}, path, names=["norm"], mapping=["norm"])


def test_numpy_same_array_twice_is_filled_once_and_overlaps_are_refused(files):
    path = str(files / "f32.safetensors")
    t = _tensors()
    shared = np.zeros(48, np.float32)
    assert mcf.load_into({"norm": shared, "norm.tied": shared}, path, names=["norm"]) == ([], [])
    np.testing.assert_array_equal(shared, t["norm"])
    # both names in the checkpoint: filled once, the second name is unexpected (safetensors' load_model rule)
    out = mcf.load_into({"norm": shared, "other": shared}, path, names=["norm", "steps"],
                        mapping={"steps": "other"}, strict=False)
    assert out == ([], ["steps"])
    base = np.zeros(100, np.float32)
    with pytest.raises(mcf.InvalidArgumentError, match="overlap"):
        mcf.load_into({"norm": base[:48], "x": base[40:88]}, path, names=["norm"], strict=False)


def test_numpy_gguf(tmp_path):
    gguf = pytest.importorskip("gguf", reason="gguf-py writes the test file (in the test extra)")
    rng = np.random.default_rng(3)
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    q = rng.standard_normal((16, 64)).astype(np.float32)
    w.add_tensor("q", gguf.quants.quantize(q, gguf.GGMLQuantizationType.Q8_0),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("h", rng.standard_normal((8, 32)).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    dest = {"q": np.zeros((16, 64), np.float32), "h": np.zeros((8, 32), np.float32)}
    assert mcf.load_into(dest, str(tmp_path / "m.gguf")) == ([], [])
    with open_gguf(str(tmp_path / "m.gguf")) as g:
        np.testing.assert_array_equal(dest["q"], g.dequantize("q"))
        np.testing.assert_array_equal(dest["h"], g.array("h").astype(np.float32))
        rows = {"q": np.zeros((4, 64), np.float16)}
        mcf.load_into(rows, g, names=["q"], slices={"q": mcf.Rows(4, 8)})
        np.testing.assert_array_equal(rows["q"], g.dequantize("q", np.float16)[4:8])


@pytest.mark.parametrize("make", [scaled.deepseek_v3, scaled.gpt_oss, scaled.modelopt_nvfp4])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_numpy_block_scaled_weights_decode_into_the_arrays(tmp_path, make, dtype):
    d = make(str(tmp_path / "ck"))
    ref = mcf.load_file(d, dequantize=dtype)
    dest = {k: np.zeros(v.shape, v.dtype) for k, v in ref.items()}
    assert mcf.load_into(dest, d, dequantize=True) == ([], [])
    for k in ref:
        np.testing.assert_array_equal(dest[k].reshape(-1).view(np.uint8), ref[k].reshape(-1).view(np.uint8),
                                      err_msg=k)


# -- torch tensors ------------------------------------------------------------------------------------------------
def test_torch_fills_tensors_in_place_without_staging(files, monkeypatch):
    staged = _count_staging(monkeypatch)
    path = str(files / "bf16.safetensors")
    ref = mcf.torch.load_file(path)
    dest = {k: torch.zeros_like(v) for k, v in ref.items()}
    before = {k: (id(v), v.data_ptr(), v.untyped_storage().data_ptr()) for k, v in dest.items()}
    assert mcf.torch.load_into(dest, path) == ([], [])
    assert staged == []
    for k, v in dest.items():
        assert (id(v), v.data_ptr(), v.untyped_storage().data_ptr()) == before[k]
        assert torch.equal(v, ref[k])


def test_torch_float32_from_bf16_is_the_cast_copy(files):
    path = str(files / "bf16.safetensors")
    sd = safetensors_torch.load_file(path)
    dest = {k: torch.zeros(v.shape, dtype=torch.float32 if v.is_floating_point() else v.dtype) for k, v in sd.items()}
    mcf.torch.load_into(dest, path)
    for k, v in sd.items():
        want = torch.zeros_like(dest[k])
        want.copy_(v)
        assert torch.equal(dest[k], want), k


def test_torch_strided_view_and_meta_tensor(files):
    path = str(files / "f32.safetensors")
    t = _tensors()
    holder = torch.full((32, 64), -1.0)
    view = holder.T   # (64, 32), not contiguous
    assert mcf.torch.load_into({"emb": view}, path, names=["emb"]) == ([], [])
    assert torch.equal(holder, torch.from_numpy(t["emb"]).T)
    with pytest.raises(mcf.InvalidArgumentError, match="meta device"):
        mcf.torch.load_into({"norm": torch.empty(48, device="meta")}, path, names=["norm"])
    with pytest.raises(mcf.ArgumentTypeError):
        mcf.torch.load_into({"norm": np.zeros(48, np.float32)}, path, names=["norm"])


def test_torch_in_place_fill_is_seen_by_autograd(files):
    """A tensor a graph saved and the load then changed in place: backward refuses it, as after copy_."""
    w = torch.zeros(48, requires_grad=True)
    y = (w * w).sum()
    mcf.torch.load_into({"norm": w}, str(files / "f32.safetensors"), names=["norm"])
    assert torch.equal(w.detach(), torch.from_numpy(_tensors()["norm"]))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_torch_cuda_meta_module_on_device(tied_file):
    original, path = tied_file
    with torch.device("meta"):
        m = _Tied()
    m.register_buffer("cache", torch.zeros(4), persistent=False)
    assert mcf.torch.load_model(m, path, device="cuda") == ([], [])
    assert m.emb.weight.device.type == "cuda" and m.head.weight is m.emb.weight
    for k, v in original.state_dict().items():
        assert torch.equal(m.state_dict()[k].cpu(), v), k


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_torch_cuda_destination_through_the_ring(files, monkeypatch):
    streamed = _count_streams(monkeypatch)
    path = str(files / "bf16.safetensors")
    ref = mcf.torch.load_file(path)
    dest = {k: torch.zeros(v.shape, dtype=torch.float32 if v.is_floating_point() else v.dtype, device="cuda")
            for k, v in ref.items() if k != "emb"}
    dest["strided"] = torch.zeros(32, 64, device="cuda").T   # staged on the CPU and copied in
    ptrs = {k: v.data_ptr() for k, v in dest.items()}
    assert mcf.torch.load_into(dest, path, mapping={"emb": "strided"}) == ([], [])
    assert [d for d, _ in streamed] == ["cuda"] and sorted(streamed[0][1]) == ["norm", "proj", "steps"]
    for k, v in dest.items():
        assert v.data_ptr() == ptrs[k]
        assert torch.equal(v.cpu(), ref["emb" if k == "strided" else k].to(v.dtype)), k


# -- through the ring of host buffers (a GPU's path, run on the CPU with a ring's settings) ---------------------
def _count_streams(monkeypatch) -> list:
    """Record each stream through the ring: (device type, the pieces' names)."""
    import mcf.loaders.torch_into as torch_into

    calls, real = [], torch_into.stream_to_device

    def spy(pieces, destinations, **kw):
        calls.append((torch.device(kw["device"]).type, [p.name for p in pieces]))
        return real(pieces, destinations, **kw)

    monkeypatch.setattr(torch_into, "stream_to_device", spy)
    return calls


@pytest.mark.parametrize("src,dtype", [("f32.safetensors", None), ("bf16.safetensors", torch.float32),
                                       ("f32.safetensors", torch.bfloat16), ("ckpt", torch.float16),
                                       ("q8.mcf", torch.float32), ("q8.mcf", torch.bfloat16)])
@pytest.mark.parametrize("ring", [(1, 61), (3, 1000)])
def test_torch_ring_fills_what_the_plain_path_fills(files, monkeypatch, src, dtype, ring):
    """load_into with a ring's settings streams every contiguous tensor through the ring (casts and quantized
    MCF tensors decoded into its buffers): the same bytes as the plain fill, in the same memory."""
    path = str(files / src)
    sd = mcf.torch.load_file(path)
    shapes = {k: (v.shape, dtype if dtype is not None and v.is_floating_point() else v.dtype) for k, v in sd.items()}
    plain = {k: torch.zeros(s, dtype=d) for k, (s, d) in shapes.items()}
    mcf.torch.load_into(plain, path)
    streamed = _count_streams(monkeypatch)
    dest = {k: torch.zeros(s, dtype=d) for k, (s, d) in shapes.items()}
    ptrs = {k: v.data_ptr() for k, v in dest.items()}
    assert mcf.torch.load_into(dest, path, ring_buffers=ring[0], ring_bytes=ring[1]) == ([], [])
    assert [d for d, _ in streamed] == ["cpu"] and sorted(streamed[0][1]) == sorted(sd)
    for k in sd:
        assert dest[k].data_ptr() == ptrs[k]
        assert torch.equal(dest[k], plain[k]), k


def test_torch_ring_load_model_refit_meta_and_strided(tied_file, files, monkeypatch):
    """load_model through the ring: a refit keeps every data_ptr, a meta model gets its memory and then the
    ring fills it, both equal to the plain load; a strided view still goes through staging."""
    original, path = tied_file
    streamed = _count_streams(monkeypatch)
    refit = _Tied()
    ptrs = {k: v.data_ptr() for k, v in refit.state_dict().items()}
    assert mcf.torch.load_model(refit, path, ring_buffers=2, ring_bytes=500) == ([], [])
    with torch.device("meta"):
        meta = _Tied()
    meta.register_buffer("cache", torch.zeros(4), persistent=False)
    assert mcf.torch.load_model(meta, path, device="cpu", ring_bytes=4096) == ([], [])
    assert len(streamed) == 2
    assert refit.head.weight is refit.emb.weight and meta.head.weight is meta.emb.weight
    for k, v in original.state_dict().items():
        assert refit.state_dict()[k].data_ptr() == ptrs[k]
        assert torch.equal(refit.state_dict()[k], v) and torch.equal(meta.state_dict()[k], v), k
    holder = torch.full((32, 64), -1.0)
    view = holder.T
    norm = torch.zeros(48)
    assert mcf.torch.load_into({"emb": view, "norm": norm}, str(files / "f32.safetensors"), names=["emb", "norm"],
                               ring_buffers=1, ring_bytes=64) == ([], [])
    assert streamed[-1] == ("cpu", ["norm"])
    assert torch.equal(holder, torch.from_numpy(_tensors()["emb"]).T)
    assert torch.equal(norm, torch.from_numpy(_tensors()["norm"]))


def test_torch_ring_refusals_come_before_anything_is_written(files, tied_file):
    path = str(files / "f32.safetensors")
    dest = {k: torch.zeros(v.shape, dtype=torch.float32 if v.dtype == np.float32 else torch.int64)
            for k, v in _tensors().items()}
    for bad, err in (({"ring_bytes": 0}, mcf.InvalidArgumentError), ({"ring_buffers": "4"}, mcf.InvalidArgumentError)):
        with pytest.raises(err, match="ring_"):
            mcf.torch.load_into(dest, path, **bad)
    dest["extra"] = torch.zeros(3)
    with pytest.raises(mcf.LoadMismatchError, match="'extra'"):
        mcf.torch.load_into(dest, path, ring_bytes=100)
    with pytest.raises(mcf.InvalidArgumentError, match="torch"):
        mcf.torch.load_model(_Tied(), tied_file[1], ring_bytes=100, device="nope")
    assert not any(t.any() for t in dest.values())


# -- torch modules --------------------------------------------------------------------------------------------------
class _Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(64, 32)
        self.proj = torch.nn.Linear(32, 48)
        self.head = torch.nn.Linear(32, 64, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.ones(48))
        self.register_buffer("cache", torch.zeros(4), persistent=False)

    def forward(self, ids):
        return self.head(self.emb(ids)) + self.proj(self.emb(ids)).sum()


@pytest.fixture(scope="module")
def tied_file(tmp_path_factory):
    torch.manual_seed(0)
    m = _Tied()
    with torch.no_grad():
        m.scale.uniform_()
    path = str(tmp_path_factory.mktemp("tied") / "tied.safetensors")
    safetensors_torch.save_model(m, path)   # keeps one name of the tied pair
    return m, path


def test_load_model_matches_safetensors_load_model(tied_file):
    original, path = tied_file
    ours, theirs = _Tied(), _Tied()
    ptrs = {k: v.data_ptr() for k, v in ours.state_dict().items()}
    assert mcf.torch.load_model(ours, path) == ([], [])
    assert sorted(safetensors_torch.load_model(theirs, path)[0]) == []
    for k, v in theirs.state_dict().items():
        assert torch.equal(ours.state_dict()[k], v), k
        assert ours.state_dict()[k].data_ptr() == ptrs[k]
    assert ours.head.weight is ours.emb.weight


def test_load_model_meta_module_gets_memory_once(tied_file):
    original, path = tied_file
    with torch.device("meta"):
        m = _Tied()
    m.proj.bias.requires_grad_(False)
    m.register_buffer("cache", torch.zeros(4), persistent=False)   # a real non-persistent buffer stays
    assert mcf.torch.load_model(m, path) == ([], [])
    assert m.head.weight is m.emb.weight and not m.emb.weight.is_meta
    assert isinstance(m.emb.weight, torch.nn.Parameter) and m.emb.weight.requires_grad
    assert not m.proj.bias.requires_grad
    assert "scale" in m.state_dict() and "cache" not in m.state_dict()
    for k, v in original.state_dict().items():
        assert torch.equal(m.state_dict()[k], v), k


def test_load_model_strict_refusal_leaves_the_model_untouched(tied_file, tmp_path):
    original, path = tied_file
    sd = safetensors_torch.load_file(path)
    sd["unknown.weight"] = torch.zeros(3)
    del sd["proj.bias"]
    bad = str(tmp_path / "bad.safetensors")
    safetensors_torch.save_file(sd, bad)
    with torch.device("meta"):
        m = _Tied()
    with pytest.raises(mcf.LoadMismatchError, match=r"missing \(1.*'proj.bias'(.|\n)*unexpected \(1.*'unknown.weight'"):
        mcf.torch.load_model(m, bad)
    assert all(v.is_meta for v in m.state_dict().values())
    real = _Tied()
    with pytest.raises(RuntimeError) as want:
        safetensors_torch.load_model(_Tied(), bad)
    assert "proj.bias" in str(want.value) and "unknown.weight" in str(want.value)
    theirs = _Tied()
    assert mcf.torch.load_model(real, bad, strict=False) == (["proj.bias"], ["unknown.weight"])
    missing, unexpected = safetensors_torch.load_model(theirs, bad, strict=False)
    assert (sorted(missing), sorted(unexpected)) == (["proj.bias"], ["unknown.weight"])


def test_load_model_both_tied_names_in_the_file(tied_file, tmp_path):
    original, path = tied_file
    sd = {k: v.clone() for k, v in original.state_dict().items()}   # both emb.weight and head.weight
    both = str(tmp_path / "both.safetensors")
    safetensors_torch.save_file(sd, both)
    ours, theirs = _Tied(), _Tied()
    got = mcf.torch.load_model(ours, both, strict=False)
    want = safetensors_torch.load_model(theirs, both, strict=False)
    assert (sorted(got[0]), sorted(got[1])) == (sorted(want[0]), sorted(want[1])) == ([], ["head.weight"])
    assert torch.equal(ours.emb.weight, original.emb.weight) and ours.head.weight is ours.emb.weight


def test_load_model_meta_non_persistent_buffer_is_refused(tied_file):
    _, path = tied_file
    with torch.device("meta"):
        m = _Tied()
    with pytest.raises(mcf.InvalidArgumentError, match="'cache'.*init_empty_weights"):
        mcf.torch.load_model(m, path)
    assert all(v.is_meta for v in m.state_dict().values())
    assert mcf.torch.load_model(m, path, strict=False) == (["cache"], [])
    assert m.cache.is_meta and not m.proj.weight.is_meta
