"""Checkpoints in the three block-scaled conventions (gpt-oss MXFP4, DeepSeek-V3 FP8, ModelOpt NVFP4; built by
tests/_scaled_checkpoints.py with the names, dtypes, shapes and config.json of the real ones): recognised,
decoded against numpy references written from the published layouts (and transformers' own gpt-oss decoder),
packed into MCF without loss (the checkpoint's bytes, through pack and export), GGUF MXFP4 converted with its
values unchanged, and bad inputs refused with an error naming the tensor."""

import json
import os
import re
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import mcf
import mcf.safetensors as mst
import _scaled_checkpoints as S

pytestmark = pytest.mark.forced_variants  # .ci/run runs this file once per forced kernel variant

EXPERTS = "model.layers.0.mlp.experts."
KV_A = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
DOWN = "model.layers.0.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpts")
    return {"gpt-oss": S.gpt_oss(str(d / "gpt-oss-20b")), "deepseek": S.deepseek_v3(str(d / "DeepSeek-V3")),
            "modelopt": S.modelopt_nvfp4(str(d / "Llama-FP4"))}


def st_file(ck):
    return os.path.join(ck, "model.safetensors")


def same(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    assert np.array_equal(np.isnan(a.astype(np.float32)), np.isnan(b.astype(np.float32)))
    bits = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
    m = ~np.isnan(b.astype(np.float32))
    assert np.array_equal(a[m].view(bits), b[m].view(bits))


def references(ck) -> dict:
    """weight name -> float32 values, from the numpy references."""
    f = st_file(ck)
    with open(f, "rb") as fh:
        names = list(json.loads(fh.read(int.from_bytes(fh.read(8), "little"))))
    out = {}
    for n in names:
        if n.endswith("_blocks"):
            out[n[:-7]] = S.mxfp4_reference(S.read_tensor(f, n), S.read_tensor(f, n[:-7] + "_scales"))
        elif n + "_scale_inv" in names:
            out[n] = S.fp8_block_reference(S.read_tensor(f, n).view(np.uint8), S.read_tensor(f, n + "_scale_inv"))
        elif n + "_scale_2" in names:
            out[n] = S.nvfp4_reference(S.read_tensor(f, n), S.read_tensor(f, n + "_scale").view(np.uint8),
                                       S.read_tensor(f, n + "_scale_2"))
    return out


# -- recognition ----------------------------------------------------------------------------------------------

def test_the_three_conventions_are_recognised(ckpts):
    with mst.open_checkpoint(ckpts["gpt-oss"]) as ck:
        w = mst.scaled_weights(ck.tensors)
        assert {n: (s.dtype.name, s.shape, s.convention) for n, s in w.items()} == {
            EXPERTS + "gate_up_proj": ("mxfp4", (4, 128, 64), "gpt-oss mxfp4"),
            EXPERTS + "down_proj": ("mxfp4", (4, 64, 64), "gpt-oss mxfp4")}
        assert w[EXPERTS + "down_proj"].part_names == [EXPERTS + "down_proj_scales", EXPERTS + "down_proj_blocks"]
    with mst.open_checkpoint(ckpts["deepseek"]) as ck:
        w = mst.scaled_weights(ck.tensors)
        assert len(w) == 4 and w[KV_A].dtype.name == "f8_e4m3_b128" and w[KV_A].shape == (136, 200)
        assert "model.layers.0.mlp.gate.weight" not in w          # BF16 router: not quantized
    with mst.open_checkpoint(ckpts["modelopt"]) as ck:
        w = mst.scaled_weights(ck.tensors)
        assert len(w) == 7 and w[DOWN].dtype.name == "nvfp4" and w[DOWN].shape == (64, 96)
        assert sorted(w[DOWN].part_names) == [DOWN, DOWN + "_scale", DOWN + "_scale_2"]   # not input_scale
    for ck, method in ((ckpts["gpt-oss"], "mxfp4"), (ckpts["deepseek"], "fp8"), (ckpts["modelopt"], "modelopt")):
        with open(os.path.join(ck, "config.json")) as f:
            assert json.load(f)["quantization_config"]["quant_method"] == method


@pytest.mark.parametrize("which", ["gpt-oss", "deepseek", "modelopt"])
def test_dequantize_matches_the_references(ckpts, which):
    ck = ckpts[which]
    refs = references(ck)
    assert refs
    for name, want in refs.items():
        same(mst.dequantize(ck, name), want)
        same(mst.dequantize(ck, name, dtype="bfloat16"), want.astype(ml_dtypes.bfloat16))
        with np.errstate(over="ignore"):
            same(mst.dequantize(ck, name, dtype=np.float16), want.astype(np.float16))
        same(mst.dequantize(ck, name, rows=(1, 3)), want[1:3])
    # plain float tensors come back cast; parts are refused, pointing at their weight
    emb = mst.dequantize(ck, "model.embed_tokens.weight")
    assert emb.dtype == np.float32 and emb.shape[0] == 32
    part = next(iter(mst.scaled_weights(mst.open_checkpoint(ck).tensors).values())).part_names[0]
    with pytest.raises(mcf.TensorNotFoundError, match="is a part of the block-scaled weight"):
        mst.dequantize(ck, part)


def test_gpt_oss_decodes_as_transformers_does(ckpts):
    """transformers' own gpt-oss loader (convert_moe_packed_tensors) on the same blocks and scales: the same
    values, in bfloat16 as it loads them (it returns the experts transposed to [E, in, out])."""
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers.integrations.mxfp4")
    f = st_file(ckpts["gpt-oss"])
    for p in ("gate_up_proj", "down_proj"):
        blocks = torch.from_numpy(S.read_tensor(f, EXPERTS + p + "_blocks").copy())
        scales = torch.from_numpy(S.read_tensor(f, EXPERTS + p + "_scales").copy())
        want = tf.convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16).transpose(1, 2).contiguous()
        got = mst.dequantize(ckpts["gpt-oss"], EXPERTS + p, dtype="bfloat16")
        same(got, want.view(torch.uint16).numpy().view(ml_dtypes.bfloat16))


def test_load_file_dequantize(ckpts):
    ck = ckpts["gpt-oss"]
    plain = mst.load_file(ck)
    out = mst.load_file(ck, dequantize=True)
    parts = {EXPERTS + p + s for p in ("gate_up_proj", "down_proj") for s in ("_blocks", "_scales")}
    # each weight takes its blocks' place in the storage order; everything else is as stored
    assert list(out) == [n.removesuffix("_blocks") for n in plain if n not in parts or n.endswith("_blocks")]
    for n, a in plain.items():
        if n not in parts:
            assert out[n].dtype == a.dtype and out[n].tobytes() == a.tobytes()
    refs = references(ck)
    for n, want in refs.items():
        same(out[n], want)
    bf = mcf.load_file(ck, dequantize="bfloat16", names=["*experts.down_proj"], slices={"*": mcf.Rows(1, 3)})
    assert list(bf) == [EXPERTS + "down_proj"]
    same(bf[EXPERTS + "down_proj"], refs[EXPERTS + "down_proj"][1:3].astype(ml_dtypes.bfloat16))
    cols = mst.load_file(ckpts["deepseek"], dequantize=True, names=[KV_A], slices={KV_A: mcf.Shard(1, 2, 1)})
    same(cols[KV_A], references(ckpts["deepseek"])[KV_A][:, 100:])
    torch = pytest.importorskip("torch")
    from mcf import torch as mcf_torch

    t = mcf_torch.load_file(ckpts["modelopt"], dequantize=torch.bfloat16)
    assert t[DOWN].dtype == torch.bfloat16 and tuple(t[DOWN].shape) == (64, 96)
    assert DOWN + "_scale" not in t and "model.layers.0.mlp.down_proj.input_scale" in t
    same(t[DOWN].view(torch.uint16).numpy().view(ml_dtypes.bfloat16),
         references(ckpts["modelopt"])[DOWN].astype(ml_dtypes.bfloat16))


# -- into MCF and back ----------------------------------------------------------------------------------------

def st_tensors(path) -> dict:
    """name -> (dtype, shape, bytes) of every tensor of a safetensors file or checkpoint directory."""
    out = {}
    with mst.open_checkpoint(path) as ck:
        for n, t in ck.tensors.items():
            out[n] = (t.element.name, tuple(t.shape), bytes(t.file.source.read(t.offset, t.nbytes)))
    return out


@pytest.mark.parametrize("which,dtype", [("gpt-oss", "mxfp4"), ("deepseek", "f8_e4m3_b128"), ("modelopt", "nvfp4")])
def test_pack_keeps_the_bytes_and_export_gives_them_back(ckpts, tmp_path, which, dtype):
    ck = ckpts[which]
    out = tmp_path / "m.mcf"
    mcf.pack(ck, out)
    refs = references(ck)
    with mcf.open(out) as c:
        assert {n for n in c if c.info(n).dtype.name == dtype} == set(refs)
        assert not c.quant_info                                 # the extensions have no QuantInfo record
        assert c.verify() == []
        assert json.loads(c.resource("config.json"))["quantization_config"]
        for n, want in refs.items():
            same(c.dequantize(n), want)
    back = tmp_path / "back"
    mcf.export(out, back)
    assert st_tensors(back) == st_tensors(ck)                  # names, dtypes, shapes and bytes: blocks and scales
    assert (back / "config.json").read_bytes() == Path(ck, "config.json").read_bytes()
    # the decoded export gives the references too (experts of rank 3 included)
    mcf.export(out, tmp_path / "f32.safetensors", dtype="f32")
    dec = mst.load_file(tmp_path / "f32.safetensors")
    for n, want in refs.items():
        same(dec[n], want)
    # and dtype="raw" (payloads as U8 tensors described in __metadata__) converts back to the same file contents
    mcf.export(out, tmp_path / "raw.safetensors", dtype="raw")
    mcf.convert(tmp_path / "raw.safetensors", tmp_path / "again.mcf")
    with mcf.open(out) as a, mcf.open(tmp_path / "again.mcf") as b:
        assert [(n, a.info(n).dtype, a.info(n).shape, a.raw(n).tobytes()) for n in a] == \
            [(n, b.info(n).dtype, b.info(n).shape, b.raw(n).tobytes()) for n in b]


def test_convert_with_a_method_keeps_the_scaled_weights(ckpts, tmp_path):
    """Requantizing a gpt-oss checkpoint quantizes its BF16 matrices; the MXFP4 experts keep their bytes."""
    out = tmp_path / "k4.mcf"
    mcf.convert(ckpts["gpt-oss"], out, method="k4", fast=True)
    with mcf.open(out) as c:
        assert c.info(EXPERTS + "gate_up_proj").dtype.name == "mxfp4"
        assert c.info("model.layers.0.self_attn.q_proj.weight").dtype.name == "k4"
        f = st_file(ckpts["gpt-oss"])
        regions = c.quant_regions(EXPERTS + "gate_up_proj")
        assert regions["data"].tobytes() == S.read_tensor(f, EXPERTS + "gate_up_proj_blocks").tobytes()
        assert regions["scales"].tobytes() == S.read_tensor(f, EXPERTS + "gate_up_proj_scales").tobytes()


def test_plain_fp8_and_f4_tensors_pack_and_export(tmp_path):
    rng = np.random.default_rng(3)
    src = tmp_path / "plain.safetensors"
    t = {f"w.{dt}": (dt, (3, 8), rng.integers(0, 256, 24, dtype=np.uint8).tobytes())
         for dt in ("F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "F8_E8M0")}
    t["w.F4"] = ("F4", (3, 8), rng.integers(0, 256, 12, dtype=np.uint8).tobytes())
    S.write_safetensors(src, t)
    mcf.pack(src, tmp_path / "p.mcf")
    with mcf.open(tmp_path / "p.mcf") as c:
        assert {n: c.info(n).dtype.name for n in c} == {
            "w.F8_E4M3": "f8_e4m3", "w.F8_E5M2": "f8_e5m2", "w.F8_E4M3FNUZ": "f8_e4m3fnuz",
            "w.F8_E5M2FNUZ": "f8_e5m2fnuz", "w.F8_E8M0": "f8_e8m0", "w.F4": "f4"}
        assert c.tensor("w.F8_E4M3").dtype == ml_dtypes.float8_e4m3fn
        with pytest.raises(mcf.DTypeError, match="F4"):
            c.tensor("w.F4")
    mcf.export(tmp_path / "p.mcf", tmp_path / "back.safetensors")
    assert st_tensors(tmp_path / "back.safetensors") == st_tensors(src)
    # torch, from the MCF file: the dtypes and shapes safetensors.torch gives the checkpoint (F4 as
    # float4_e2m1fn_x2, whose shape counts pairs: [3, 4] for 3 x 8 values), the same bytes
    torch = pytest.importorskip("torch")
    storch = pytest.importorskip("safetensors.torch")
    if not hasattr(torch, "float4_e2m1fn_x2"):
        pytest.skip(f"torch {torch.__version__} has no float4_e2m1fn_x2")
    from mcf import torch as mcf_torch

    want = storch.load_file(str(src))
    got = mcf_torch.load_file(tmp_path / "p.mcf")
    assert got["w.F4"].shape == (3, 4) == want["w.F4"].shape
    for n, t in want.items():
        assert got[n].dtype == t.dtype and got[n].shape == t.shape
        assert got[n].view(torch.uint8).numpy().tobytes() == t.view(torch.uint8).numpy().tobytes()


# -- GGUF MXFP4 -------------------------------------------------------------------------------------------------

def write_gguf_mxfp4(path, tensors: dict):
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    for name, blocks in tensors.items():
        w.add_tensor(name, blocks, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_mxfp4_becomes_mcf_mxfp4_with_the_same_values(tmp_path):
    """gpt-oss's GGUF experts (type 39: one E8M0 byte then 16 bytes, element j in the low nibble of byte j and
    element j + 16 in its high nibble) convert to MCF mxfp4 with every value gguf-py decodes, bit for bit (every
    scale byte but 0xFF, 0 included; ggml's +0 for code 0b1000 too), the codes re-ordered, no requantization."""
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(4)
    q_exps = quantize((rng.standard_normal((3, 8, 64)) * 0.1).astype(np.float32), gguf.GGMLQuantizationType.MXFP4)
    q_mat = rng.integers(0, 256, (4, 3 * 17), dtype=np.uint8)
    q_mat.reshape(-1, 17)[:, 0] = [0, 1, 2, 60, 100, 118, 120, 125, 127, 130, 135, 140]   # 2^-127 .. 2^13
    q_big = rng.integers(0, 256, (2, 2 * 17), dtype=np.uint8)
    q_big.reshape(-1, 17)[:, 0] = [200, 250, 253, 254]                  # up to 6 * 2^127: infinity in float32
    src = tmp_path / "gpt-oss.gguf"
    write_gguf_mxfp4(src, {"blk.0.ffn_gate_exps.weight": q_exps, "blk.0.attn_q.weight": q_mat, "big": q_big})
    stats = mcf.convert(src, tmp_path / "o.mcf", report=True)
    assert [(s.stored_as, s.how) for s in stats] == [("mxfp4", "native")] * 3
    with mcf.open(tmp_path / "o.mcf") as c, np.errstate(over="ignore"):
        for name, blocks in (("blk.0.ffn_gate_exps.weight", q_exps), ("blk.0.attn_q.weight", q_mat), ("big", q_big)):
            want = dequantize(blocks, gguf.GGMLQuantizationType.MXFP4)
            assert c.info(name).dtype.name == "mxfp4" and c.info(name).shape == want.shape
            same(c.tensor(name), want.astype(np.float32))
            regions = c.quant_regions(name)
            assert regions["scales"].tobytes() == blocks.reshape(-1, 17)[:, 0].tobytes()   # the E8M0 bytes as they are
    # a method requantizes the rank-2 tensor from its exact values; the expert stack stays mxfp4
    stats = mcf.convert(src, tmp_path / "q8.mcf", method="q8", overrides=["big=none"], report=True)
    assert {s.name: s.stored_as for s in stats} == {"blk.0.ffn_gate_exps.weight": "mxfp4", "blk.0.attn_q.weight": "q8",
                                                   "big": "mxfp4"}


def test_gguf_mxfp4_scale_0xff_is_refused(tmp_path):
    q = np.zeros((2, 2 * 17), np.uint8)
    q.reshape(-1, 17)[:, 0] = [127, 127, 0xFF, 127]
    src = tmp_path / "bad.gguf"
    write_gguf_mxfp4(src, {"blk.0.attn_q.weight": q})
    with pytest.raises(mcf.FormatError, match=r"tensor 'blk.0.attn_q.weight' block \[2\].*0xFF"):
        mcf.convert(src, tmp_path / "o.mcf")
    assert not (tmp_path / "o.mcf").exists()


# -- bad inputs -------------------------------------------------------------------------------------------------

def rewrite(ck, dst, change):
    """A copy of checkpoint ``ck`` with ``change(tensors)`` applied to its {name: (dtype, shape, bytes)}."""
    shutil.copytree(ck, dst)
    t = st_tensors(ck)
    change(t)
    S.write_safetensors(os.path.join(dst, "model.safetensors"), t)
    return str(dst)


def _set(t, name, dtype=None, shape=None, raw=None):
    d, s, r = t[name]
    t[name] = (dtype or d, shape if shape is not None else s, raw if raw is not None else r)


def _scale_byte(t, name, at, value):
    d, s, r = t[name]
    r = bytearray(r)
    r[at] = value
    t[name] = (d, s, bytes(r))


BAD = {
    "gpt-oss scales shape": ("gpt-oss", lambda t: _set(t, EXPERTS + "down_proj_scales", shape=(4, 64, 1),
                                                       raw=bytes(256)),
                             rf"{EXPERTS}down_proj_scales.*scales tensor's shape does not match its blocks"),
    "gpt-oss blocks not 16 bytes": ("gpt-oss", lambda t: _set(t, EXPERTS + "down_proj_blocks", shape=(4, 64, 4, 8)),
                                    rf"{EXPERTS}down_proj_blocks.*16 bytes"),
    "gpt-oss blocks dtype": ("gpt-oss", lambda t: _set(t, EXPERTS + "down_proj_blocks", dtype="I8"),
                             rf"{EXPERTS}down_proj_blocks.*are U8"),
    "deepseek scale_inv shape": ("deepseek", lambda t: _set(t, KV_A + "_scale_inv", shape=(1, 4)),
                                 rf"{KV_A}_scale_inv.*scales tensor's shape does not match its blocks"),
    "nvfp4 block count does not divide": ("modelopt", lambda t: _set(t, DOWN + "_scale", shape=(64, 5), raw=bytes(320)),
                                          rf"{DOWN}_scale.*block count does not divide"),
    "nvfp4 scales rows": ("modelopt", lambda t: _set(t, DOWN + "_scale", shape=(32, 6), raw=bytes(192)),
                          rf"{DOWN}_scale.*does not match its packed weight"),
    "nvfp4 no scale_2": ("modelopt", lambda t: t.pop(DOWN + "_scale_2"), rf"{DOWN}_scale.*no per-tensor scale"),
    "nvfp4 scale_2 shape": ("modelopt", lambda t: _set(t, DOWN + "_scale_2", shape=(2,), raw=bytes(8)),
                            rf"{DOWN}_scale_2.*one F32 value"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_mismatched_parts_are_refused_naming_the_tensor(ckpts, tmp_path, case):
    which, change, pattern = BAD[case]
    bad = rewrite(ckpts[which], tmp_path / "bad", change)
    for call in (lambda: mst.load_file(bad, dequantize=True), lambda: mcf.pack(bad, tmp_path / "o.mcf"),
                 lambda: mst.scaled_weights(mst.open_checkpoint(bad).tensors)):
        with pytest.raises(mcf.FormatError, match=pattern):
            call()
    assert not (tmp_path / "o.mcf").exists()
    mst.load_file(bad)   # the tensors themselves still load as stored


NAN_SCALES = {
    "gpt-oss E8M0 0xFF": ("gpt-oss", EXPERTS + "gate_up_proj_scales", 7, 0xFF, EXPERTS + "gate_up_proj",
                          r"block \[7\]"),
    "nvfp4 E4M3 NaN": ("modelopt", DOWN + "_scale", 3, 0x7F, DOWN, r"block \[3\]"),
    "deepseek F32 NaN": ("deepseek", KV_A + "_scale_inv", 7, 0x7F, KV_A, r"block \[1\]"),   # float32 1, top byte
}


@pytest.mark.parametrize("case", sorted(NAN_SCALES))
def test_a_nan_scale_is_refused_naming_the_scales_tensor_and_block(ckpts, tmp_path, case):
    which, scales, at, value, weight, block = NAN_SCALES[case]

    def change(t):
        _scale_byte(t, scales, at, value)
        if which == "deepseek":
            _scale_byte(t, scales, at - 1, 0xC0)   # 0x7FC00000 at float 1
    bad = rewrite(ckpts[which], tmp_path / "bad", change)
    pattern = rf"tensor '{re.escape(scales)}' {block}.*NaN block scale"
    with pytest.raises(mcf.FormatError, match=pattern):
        mst.dequantize(bad, weight)
    with pytest.raises(mcf.FormatError, match=pattern):
        mst.load_file(bad, dequantize=True)
    with pytest.raises(mcf.FormatError, match=pattern):
        mcf.pack(bad, tmp_path / "o.mcf")
    assert not (tmp_path / "o.mcf").exists()


def test_parts_in_different_shards(ckpts, tmp_path):
    """A sharded checkpoint may put a weight's blocks and its scales in different files: each region is read
    from the shard that holds it (one read plan, several sources), for decoding and for packing."""
    src = st_tensors(ckpts["gpt-oss"])
    d = tmp_path / "sharded"
    d.mkdir()
    first = {n: v for n, v in src.items() if not n.endswith("_scales")}
    second = {n: v for n, v in src.items() if n.endswith("_scales")}
    S.write_safetensors(d / "model-00001-of-00002.safetensors", first)
    S.write_safetensors(d / "model-00002-of-00002.safetensors", second)
    wm = {**{n: "model-00001-of-00002.safetensors" for n in first},
          **{n: "model-00002-of-00002.safetensors" for n in second}}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    refs = references(ckpts["gpt-oss"])
    for n, want in refs.items():
        same(mst.dequantize(d, n), want)
        same(mst.load_file(d, dequantize=True, names=[n], slices={n: mcf.Rows(2, 4)})[n], want[2:4])
    mcf.pack(d, tmp_path / "s.mcf")
    with mcf.open(tmp_path / "s.mcf") as c:
        for n, want in refs.items():
            same(c.tensor(n), want)


def test_a_weight_named_like_another_tensor_is_refused(ckpts, tmp_path):
    bad = rewrite(ckpts["gpt-oss"], tmp_path / "bad",
                  lambda t: t.__setitem__(EXPERTS + "down_proj", ("BF16", (2,), bytes(4))))
    with pytest.raises(mcf.FormatError, match=r"weight 'model.layers.0.mlp.experts.down_proj'.*name of another tensor"):
        mst.load_file(bad, dequantize=True)
    with pytest.raises(mcf.FormatError, match="name of another tensor"):
        mcf.pack(bad, tmp_path / "o.mcf")


def test_export_refuses_a_part_name_taken_by_another_tensor(tmp_path):
    """An MCF file holding mxfp4 ``W`` and a tensor named ``W_scales``: the export cannot name both."""
    p = tmp_path / "clash.mcf"
    with mcf.Writer(p) as w:
        w.add_tensor_bytes("w", "mxfp4", (2, 32), np.zeros(mcf.quant_layout("mxfp4", (2, 32)).nbytes, np.uint8))
        w.add_tensor("w_scales", np.zeros(2, np.float32))
    with pytest.raises(mcf.InvalidArgumentError, match=r"two tensors would be named 'w_scales'.*weight 'w'"):
        mcf.export(p, tmp_path / "out")
    mcf.export(p, tmp_path / "f32.safetensors", dtype="f32")   # decoded, the weight is one tensor: no clash
