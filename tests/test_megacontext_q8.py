"""q8 gist rows and the hybrid policy: the row layout against a plain-numpy decoder, MCF's own q8
quantizer (mcf.quantize) as the byte reference, the error bound, assembly of mixed fp16/q8 levels against
a numpy assembly, every SIMD variant, malformed files, and snapshots/refresh/CLI on q8 trees."""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mcf
import mcf.megacontext as mc
from mcf.megacontext import _megacontext as _mc
from mcf.megacontext._layout import q8_row_bytes

D = 80          # not a multiple of 32: the last block of every row is padded
K = 32


# -- the plain-numpy reference ----------------------------------------------------------------------------
def row_bytes(raw):
    """Stored rows (``gists(raw=True)``: [n] or 0-d of the level's raw_gist_dtype) as [n, row_bytes] uint8."""
    raw = np.ascontiguousarray(raw).reshape(-1)
    return raw.view(np.uint8).reshape(raw.shape[0], raw.dtype.itemsize)


def ref_decode(raw, d):
    """Decode stored q8 rows [n, row_bytes] with numpy: f16 scales (subnormals flushed, as MCF's decoder
    does), int8 codes, x = scale * q in float32."""
    raw = row_bytes(raw) if raw.dtype.kind == "V" else np.asarray(raw, dtype=np.uint8)
    nb = -(-d // 32)
    assert raw.shape[1] == 34 * nb
    bits = np.ascontiguousarray(raw[:, :2 * nb]).view("<u2")
    scales = np.where((bits & 0x7C00) == 0, np.float32(0), bits.view("<f2").astype(np.float32))
    codes = raw[:, 2 * nb:].view(np.int8).reshape(-1, nb, 32).astype(np.float32)
    return (scales[:, :, None] * codes).reshape(-1, nb * 32)[:, :d].astype(np.float32)


def mc_q8_ref_bytes(x):
    """MCF's q8 payload of ``x`` re-laid out per row (scales, then codes): what a q8 gist row holds."""
    payload, _ = mcf.quantize(x, "q8")
    lay = mcf.quant_layout("q8", x.shape)
    reg = {r.name: r for r in lay.regions}
    nb = lay.blocks_per_row
    s = payload[reg["scales"].offset:reg["scales"].offset + reg["scales"].size].reshape(len(x), 2 * nb)
    c = payload[reg["data"].offset:reg["data"].offset + reg["data"].size].reshape(len(x), 32 * nb)
    return np.concatenate([s, c], axis=1)


def ref_single_pass(x):
    """The textbook q8 quantizer (scale = absmax / 127 rounded to f16, codes = round(x / scale)):
    MCF's search quantizer is never worse than it."""
    n, d = x.shape
    nb = -(-d // 32)
    p = np.zeros((n, nb * 32), np.float32)
    p[:, :d] = x
    b = p.reshape(n, nb, 32)
    s = (np.abs(b).max(axis=2) / 127).astype(np.float16).astype(np.float32)
    q = np.where(s[:, :, None] > 0, np.clip(np.rint(b / np.where(s > 0, s, 1)[:, :, None]), -127, 127), 0)
    return (s[:, :, None] * q).reshape(n, -1)[:, :d]


def supported_impls():
    from mcf._core._kernels import resolve_impl

    out = []
    for v in ("scalar", "avx2", "avx512", "neon"):
        try:
            resolve_impl(v)
        except mcf.InvalidArgumentError:
            continue
        out.append(v)
    return out


def make(path, policy, *, d=D, tokens=K * K * 3 + 40, seed=0, **kw):
    """A tree of ``policy`` with random float32 gists; returns (tree, lod1 float32, lod2 float32)."""
    rng = np.random.default_rng(seed)
    t = mc.create(path, embedding_dim=d, gist_dtype=policy, **kw)
    t.append_tokens(rng.integers(0, 1000, tokens))
    g1 = rng.standard_normal((tokens // K, d)).astype(np.float32)
    g2 = rng.standard_normal((len(g1) // K, d)).astype(np.float32) * 3
    t.append_gists(1, g1, checkpoint="c")
    t.append_gists(2, g2)
    return t, g1, g2


# -- layout and quantizer ---------------------------------------------------------------------------------
def test_row_layout_and_sizes(tmp_path):
    assert [q8_row_bytes(d) for d in (1, 32, 33, 384, 4096)] == [34, 34, 68, 408, 4352]
    assert mc.gist_offset(3, 384, "q8") == 64 + 3 * 408 and mc.gist_offset(3, 384, 2) == 64 + 3 * 768
    t, g1, g2 = make(tmp_path / "t", "hybrid")
    with t:
        assert t.gist_dtype_of(1).name == "fp16" and t.gist_dtype_of(2).name == "q8"
        assert t.gist_offset(5, level=2) == 64 + 5 * q8_row_bytes(D)
        assert os.path.getsize(tmp_path / "t" / "LOD2.ctx") == 64 + len(g2) * q8_row_bytes(D)
        assert os.path.getsize(tmp_path / "t" / "LOD1.ctx") == 64 + len(g1) * D * 2
        raw = (tmp_path / "t" / "LOD2.ctx").read_bytes()
        assert struct.unpack_from("<H", raw, 12)[0] == 4           # dtype_code 4 = q8 in the header
        assert np.array_equal(row_bytes(t.gists(2, raw=True)), np.frombuffer(raw[64:], np.uint8).reshape(len(g2), -1))
        assert t.gists(2, raw=True).dtype == mc.raw_gist_dtype("q8", D) == t.raw_gist_dtype(2)
        assert t.info()["gist_dtype"] == {"LOD1": "fp16", "LOD2": "q8"}
        assert "LOD1 fp16 + LOD2 q8" in repr(t)
    meta = json.loads((tmp_path / "t" / "metadata.json").read_text())
    assert meta["gist_dtype"] == {"LOD1": "fp16", "LOD2": "q8"}
    assert meta["levels"]["LOD2"]["file_size_bytes"] == 64 + len(g2) * q8_row_bytes(D)


def test_q8_bytes_are_mcf_q8_and_decode_matches_numpy(tmp_path):
    """The stored scales and codes are exactly those mcf.quantize(rows, "q8") writes, row by row."""
    t, g1, g2 = make(tmp_path / "t", "q8")
    with t:
        raw = row_bytes(t.gists(1, raw=True))
        assert np.array_equal(raw, mc_q8_ref_bytes(g1))
        payload, _ = mcf.quantize(g1, "q8")
        nb = -(-D // 32)
        dec = t.gists(1)
        assert dec.dtype == np.float32 and dec.shape == g1.shape
        assert np.array_equal(dec, ref_decode(raw, D))
        assert np.array_equal(dec, mcf.dequantize(payload, "q8", g1.shape))
        # padding codes past d are zero
        assert not raw[:, 2 * nb:].reshape(len(g1), nb, 32)[:, -1, D % 32:].any()
        # gathers, single rows and slices agree
        ix = np.array([5, 0, 5, len(g1) - 1])
        assert np.array_equal(t.gists(1, ix), dec[ix])
        assert np.array_equal(t.gist(1, 7), dec[7]) and np.array_equal(t.gists(1, slice(3, 20, 4)), dec[3:20:4])
        assert np.array_equal(row_bytes(t.gist(1, 7, raw=True))[0], raw[7])
        assert np.array_equal(row_bytes(t.gists(1, [7, 2], raw=True)), raw[[7, 2]])
        stored = t.gists(1, raw=True)
        assert np.array_equal(stored["q8_scales"].view("<u2"), raw[:, :2 * nb].copy().view("<u2"))
        assert np.array_equal(stored["q8_codes"].view(np.uint8), raw[:, 2 * nb:])


def assert_codes_of_their_scale(raw, x, d):
    """The error rule of a q8 row, from its stored bytes: each value is its code times its block's
    scale, the code being x / scale rounded to nearest and clamped to -128..127 (the scale has either sign:
    docs/quantization.md).  So a value is within half a step, or, where the search picked a scale that
    clips the block's largest values (it trades their error for a smaller one on the other 31), decoded as
    the extreme code on its side: 127 steps, or 128 with the scale's sign opposite to the value's."""
    nb = -(-d // 32)
    raw = row_bytes(raw)
    s = np.repeat(raw[:, :2 * nb].copy().view(np.float16).astype(np.float32), 32, axis=1)[:, :d]
    codes = raw[:, 2 * nb:].copy().view(np.int8)[:, :d].astype(np.float32)
    dec = ref_decode(raw, d)
    # MCF's decoder reads a subnormal (or zero) f16 scale as 0; the quantizer stores one only when the
    # smallest normal scale 2^-14 would round every value of the block to 0 as well, so all are below
    # half of that step
    flushed = np.abs(s) < 2.0 ** -14
    assert (dec[flushed] == 0).all() and (np.abs(x[flushed]) <= 2.0 ** -15 * (1 + 1e-3)).all()
    s, codes, x, dec = s[~flushed], codes[~flushed], x[~flushed], dec[~flushed]
    assert np.array_equal(dec, s * codes)
    err = np.abs(dec - x)
    steps = x / s
    inside = (steps >= -128.5) & (steps <= 127.5)
    assert (err[inside] <= np.abs(s[inside]) * (0.5 + 1e-4)).all()  # + the f32 rounding of x / s and s * code
    assert (codes[~inside] == np.where(steps[~inside] > 0, 127, -128)).all()


def test_error_bound_and_never_worse_than_single_pass(tmp_path):
    t, g1, g2 = make(tmp_path / "t", "q8", seed=3)
    with t:
        for g, lvl in ((g1, 1), (g2, 2)):
            dec = t.gists(lvl)
            nb = -(-D // 32)
            pad = np.zeros((len(g), nb * 32), np.float32)
            pad[:, :D] = g
            amax = np.abs(pad.reshape(len(g), nb, 32)).max(axis=2)
            err = np.abs(dec - g)
            per_block = np.zeros((len(g), nb * 32), np.float32)
            per_block[:, :D] = err
            assert_codes_of_their_scale(t.gists(lvl, raw=True), g, D)
            # about one step of the single-pass scale absmax/127 (the search's scale may clip a little)
            assert (per_block.reshape(len(g), nb, 32).max(axis=2) <= amax / 127 * 1.05 + 1e-12).all()
            assert ((dec - g) ** 2).sum() <= ((ref_single_pass(g) - g) ** 2).sum() * (1 + 1e-6)
            rel = np.linalg.norm(dec - g) / np.linalg.norm(g)
            assert rel < 0.01


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(d=st.integers(1, 100), n=st.integers(1, 40), scale=st.floats(1e-3, 1e3), seed=st.integers(0, 2**31))
def test_round_trip_property(tmp_path_factory, d, n, scale, seed):
    rng = np.random.default_rng(seed)
    path = tmp_path_factory.mktemp("q")
    x = (rng.standard_normal((n, d)) * scale).astype(np.float32)
    x[rng.random((n, d)) < 0.1] = 0.0
    with mc.create(path / "a", embedding_dim=d, gist_dtype="q8") as a, \
            mc.create(path / "b", embedding_dim=d, gist_dtype="q8") as b:
        a.append_tokens(np.zeros(n * 32, np.uint32))
        b.append_tokens(np.zeros(n * 32, np.uint32))
        a.append_gists(1, x)
        raw = a.gists(1, raw=True)
        assert np.array_equal(a.gists(1), ref_decode(raw, d))
        assert_codes_of_their_scale(raw, x, d)
        b.append_gists(1, raw)                       # stored rows copy as they are
        assert np.array_equal(b.gists(1, raw=True), raw)
        b.write_gists(1, 0, x.astype(np.float64), checkpoint="again")   # float64 in, same bytes out
        assert np.array_equal(b.gists(1, raw=True), raw)


# -- assembly ---------------------------------------------------------------------------------------------
def ref_assembly(t, plan, table, out_dtype):
    rows = []
    for level, index in plan:
        if level == 0:
            rows.extend(table[t.block(index)].astype(np.float32))
        elif t.gist_dtype_of(level).quantized:
            rows.append(ref_decode(t.gist(level, index, raw=True)[None], t.embedding_dim)[0])
        else:
            rows.append(t.gist(level, index).astype(np.float32))
    return np.stack(rows).astype(out_dtype)


@pytest.mark.parametrize("policy", ["q8", "hybrid", {1: "q8", 2: "bf16"}])
@pytest.mark.parametrize("out_dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("mmap", [True, False])
def test_assembly_equals_numpy(tmp_path, policy, out_dtype, mmap):
    t, g1, g2 = make(tmp_path / "t", policy, vocab_size=1000)
    t.close()
    rng = np.random.default_rng(1)
    table = rng.standard_normal((1000, D)).astype(np.float32)
    with mc.open(tmp_path / "t", mmap=mmap) as r:
        t_, n1, n2 = r.counts
        plan = mc.Plan.of([(2, 0), (2, 1)] + [(1, i) for i in range(64, n1)] + [(0, b) for b in range(n1, -(-t_ // K))])
        wc = r.assemble(plan, table, dtype=out_dtype)
        want = ref_assembly(r, plan, table, out_dtype)
        assert wc.embeddings.dtype == np.dtype(out_dtype)
        assert np.array_equal(wc.embeddings.view(np.uint8), want.view(np.uint8))
        # without a table: the gist rows alone, float32 by default when a level is q8
        g = r.assemble(plan).gists
        assert g.dtype == np.float32
        assert np.array_equal(g, ref_assembly(r, [(lv, i) for lv, i in plan if lv], table, np.float32))
        g16 = r.assemble(plan, dtype=np.float16).gists
        assert np.array_equal(g16, g.astype(np.float16))
        # random plans, several threads
        many = mc.Plan.of([(2, i % n2) for i in range(50)] + [(1, i % n1) for i in range(300)])
        for threads in (1, 3):
            wc = r.assemble(many, table, dtype=out_dtype, threads=threads)
            assert np.array_equal(wc.embeddings.view(np.uint8),
                                  ref_assembly(r, many, table, out_dtype).view(np.uint8))


def test_every_simd_variant_gives_the_same_bytes(tmp_path, monkeypatch):
    t, g1, g2 = make(tmp_path / "t", "hybrid", d=384, tokens=K * K * 2, vocab_size=1000, seed=5)
    rng = np.random.default_rng(2)
    table = rng.standard_normal((1000, 384)).astype(np.float16)
    plan = mc.Plan.of([(2, 0), (2, 1)] + [(1, i) for i in range(30)])
    results = {}
    with t:
        for impl in supported_impls():
            monkeypatch.setenv("MCF_FORCE_IMPL", impl)
            wc = t.assemble(plan, table, dtype=np.float32)
            results[impl] = (wc.embeddings.tobytes(), t.gists(2).tobytes(),
                             t.assemble(plan, table).embeddings.tobytes(), _mc.quantize_q8(g1).tobytes())
        raw2 = t.gists(2, raw=True)
        monkeypatch.setenv("MCF_FORCE_IMPL", "no-such-variant")
        with pytest.raises(mcf.InvalidArgumentError, match="MCF_FORCE_IMPL"):
            t.assemble(plan, table)
        monkeypatch.delenv("MCF_FORCE_IMPL")
    assert "scalar" in results
    first = results["scalar"]
    for impl, r in results.items():
        assert r == first, impl
    assert np.array_equal(np.frombuffer(first[1], np.float32).reshape(-1, 384), ref_decode(raw2, 384))
    assert np.array_equal(np.frombuffer(first[3], np.uint8).reshape(len(g1), -1), mc_q8_ref_bytes(g1))



# -- writes and validation --------------------------------------------------------------------------------
def test_write_errors(tmp_path):
    t, g1, g2 = make(tmp_path / "t", "q8")
    with t:
        bad = np.ones((1, D), np.float32)
        bad[0, 3] = np.nan
        with pytest.raises(mcf.InvalidArgumentError, match="NaN or Inf"):
            t.write_gists(1, 0, bad, checkpoint=None)
        with pytest.raises(mcf.InvalidArgumentError, match="too large"):
            t.write_gists(1, 0, np.full((1, D), 1e300), checkpoint=None)
        with pytest.raises(mcf.InvalidArgumentError, match="too large"):
            t.write_gists(1, 0, np.full((1, D), 1e30, np.float32), checkpoint=None)
        with pytest.raises(mcf.InvalidArgumentError, match="shape"):
            t.write_gists(1, 0, np.ones((1, D + 1), np.float32), checkpoint=None)
        raw = t.gists(1, slice(0, 1), raw=True).copy()
        raw["q8_scales"][0, 0] = np.inf                # an Inf scale
        with pytest.raises(mcf.InvalidArgumentError, match="block scale"):
            t.write_gists(1, 0, raw, checkpoint=None)
        with pytest.raises(mcf.InvalidArgumentError, match="raw_gist_dtype"):
            t.write_gists(1, 0, row_bytes(raw), checkpoint=None)       # bytes that do not say what they are
        with pytest.raises(mcf.InvalidArgumentError, match="q8"):
            t.write_gists(1, 0, row_bytes(raw)[:, :-1].copy().view(f"V{raw.dtype.itemsize - 1}")[:, 0], checkpoint=None)
        assert np.array_equal(t.gists(1), ref_decode(t.gists(1, raw=True), D))   # nothing was written
    for policy in ("int4", "uint32", {1: "fp16"}, {1: "fp16", 3: "q8"}, {1: "fp16", 2: "int4"}):
        with pytest.raises(mcf.InvalidArgumentError):
            mc.create(tmp_path / f"x{len(str(policy))}", embedding_dim=8, gist_dtype=policy)


def test_malformed_q8_files(tmp_path):
    t, g1, g2 = make(tmp_path / "t", "hybrid")
    t.close()
    lod2 = tmp_path / "t" / "LOD2.ctx"
    good = lod2.read_bytes()
    # wrong file size for q8 rows: the count no longer fits
    lod2.write_bytes(good[:-5])
    with pytest.raises(mcf.TruncatedError, match="num_entries"):
        mc.open(tmp_path / "t")
    # an unknown dtype code
    lod2.write_bytes(good[:12] + struct.pack("<H", 9) + good[14:])
    with pytest.raises(mcf.FormatError) as e:
        mc.open(tmp_path / "t")
    assert e.value.field == "dtype_code" and "4 (q8)" in str(e.value)
    # a header that says fp16 where metadata.json says q8: the rows no longer fit, and the dtypes differ
    lod2.write_bytes(good[:12] + struct.pack("<H", 1) + good[14:])
    assert any(p.severity == "error" for p in mc.verify(tmp_path / "t"))
    with pytest.raises(mcf.MCFError):
        mc.open(tmp_path / "t")
    lod2.write_bytes(good)
    small, _, _ = make(tmp_path / "s", "hybrid", tokens=K * 4)       # no LOD2 gists: any row size fits
    small.close()
    s2 = (tmp_path / "s" / "LOD2.ctx").read_bytes()
    (tmp_path / "s" / "LOD2.ctx").write_bytes(s2[:12] + struct.pack("<H", 1) + s2[14:])
    problems = mc.verify(tmp_path / "s")
    assert [p.severity for p in problems] == ["error"] and "LOD2's gist dtype differs" in str(problems[0])
    with pytest.raises(mcf.FormatError, match="LOD2's gist dtype differs"):
        mc.open(tmp_path / "s")
    # metadata.json with an unknown policy
    mpath = tmp_path / "t" / "metadata.json"
    meta = json.loads(mpath.read_text())
    for g in ("hybrid", {"LOD1": "fp16"}, {"LOD1": "fp16", "LOD2": "int8"}, 4):
        mpath.write_text(json.dumps(dict(meta, gist_dtype=g)))
        with pytest.raises(mcf.FormatError, match="gist_dtype"):
            mc.open(tmp_path / "t")
    mpath.write_text(json.dumps(meta))
    assert mc.verify(tmp_path / "t", deep=True) == []
    # a NaN scale on disk: deep verify names the gist
    with open(lod2, "r+b") as f:
        f.seek(64 + q8_row_bytes(D) + 2)
        f.write(struct.pack("<H", 0x7E00))
    problems = mc.verify(tmp_path / "t", deep=True)
    assert [p.severity for p in problems] == ["warning"] and "gist 1 holds a q8 block scale" in str(problems[0])


def test_snapshot_restore_refresh_and_build_gists(tmp_path):
    t, g1, g2 = make(tmp_path / "t", "hybrid")
    with t:
        snap = t.snapshot(tmp_path / "snap")
        before = (t.gists(1, raw=True).copy(), t.gists(2, raw=True).copy())
        r = mc.open(tmp_path / "t")
        t.append_tokens(np.zeros(K * K, np.uint32))
        t.append_gists(1, np.ones((K, D), np.float32))
        t.append_gists(2, np.ones((1, D), np.float32))
        assert r.refresh() == t.counts
        assert np.abs(r.gists(2)[-1] - 1).max() <= 1 / 127
        r.close()
    assert mc.verify(snap, deep=True) == []
    mc.restore(snap, tmp_path / "t")
    with mc.open(tmp_path / "t") as back:
        assert np.array_equal(back.gists(1, raw=True), before[0]) and np.array_equal(back.gists(2, raw=True), before[1])
    # build_gists pools LOD2 from decoded LOD1 rows and quantizes what it appends
    table = np.random.default_rng(0).standard_normal((50, D)).astype(np.float32)
    with mc.create(tmp_path / "g", embedding_dim=D, gist_dtype={1: "q8", 2: "q8"}) as g:
        g.append_tokens(np.arange(K * K * 2) % 50)
        assert mc.build_gists(g, mc.MeanPool(table)) == (64, 2)
        want1 = table[g.tokens()].reshape(64, K, D).mean(axis=1)
        assert np.abs(g.gists(1) - want1).max() <= np.abs(want1).max() / 127
        want2 = g.gists(1).reshape(2, K, D).astype(np.float64).mean(axis=1)
        assert np.abs(g.gists(2) - want2).max() <= np.abs(want2).max() / 127


def test_cli_hybrid(tmp_path, capsys):
    from mcf.cli import main

    ids = tmp_path / "ids.bin"
    ids.write_bytes(np.arange(K * K * 2, dtype="<u4").tobytes())
    assert main(["ctx", "ingest", str(tmp_path / "t"), str(ids), "--ids", "--embedding-dim", "64", "--no-gists",
                 "--dtype", "hybrid", "-q"]) == 0
    capsys.readouterr()
    assert main(["ctx", "info", str(tmp_path / "t")]) == 0
    out = capsys.readouterr().out
    assert "d=64 LOD1 fp16 + LOD2 q8" in out and "q8" in out
    assert main(["ctx", "info", str(tmp_path / "t"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["gist_dtype"] == {"LOD1": "fp16", "LOD2": "q8"} and info["files"]["LOD2"]["entry_bytes"] == 68
    with pytest.raises(SystemExit):
        main(["ctx", "ingest", str(tmp_path / "u"), str(ids), "--ids", "--embedding-dim", "64", "--dtype", "int8"])


# -- raw rows carry their dtype ----------------------------------------------------------------------------
@pytest.mark.parametrize("d", [17, 34])            # an fp16/bf16 row of d = 17 or 34 is as wide as a q8 row
@pytest.mark.parametrize("policy", ["fp16", "bf16"])
def test_raw_rows_of_another_dtype_are_refused(tmp_path, d, policy):
    assert d * 2 == q8_row_bytes(d)
    rng = np.random.default_rng(d)
    x = rng.standard_normal((2, d)).astype(np.float32)
    with mc.create(tmp_path / "f", embedding_dim=d, gist_dtype=policy) as f, \
            mc.create(tmp_path / "q", embedding_dim=d, gist_dtype="q8") as q:
        for t in (f, q):
            t.append_tokens(np.zeros(2 * K, np.uint32))
        f.append_gists(1, x)
        raw = f.gists(1, raw=True)
        assert raw.dtype == f.raw_gist_dtype(1) and raw.dtype != q.raw_gist_dtype(1) and raw.shape == (2,)
        assert policy in str(raw.dtype)                                     # the dtype says what the bytes are
        assert np.array_equal(raw[policy].view(np.uint8), f.gists(1).view(np.uint8))
        for rows in (raw, raw[0], f.gist(1, 0, raw=True), raw.view(np.uint8).reshape(2, -1)):
            with pytest.raises(mcf.InvalidArgumentError, match=policy if rows.dtype != np.uint8 else "raw_gist_dtype"):
                q.append_gists(1, rows)
            with pytest.raises(mcf.InvalidArgumentError):
                f.append_gists(1, row_bytes(rows) if rows.dtype != np.uint8 else rows)   # bytes without a dtype
        assert q.num_gists(1) == 0 and f.num_gists(1) == 2
        # rows of the tree's own stored dtype are copied as they are, at either level of a tree of that dtype
        with mc.create(tmp_path / "g", embedding_dim=d, gist_dtype=policy) as g:
            g.append_tokens(np.zeros(2 * K, np.uint32))
            g.append_gists(1, raw)
            assert np.array_equal(g.gists(1, raw=True), raw)
            g.write_gists(1, 1, f.gist(1, 0, raw=True), checkpoint="c")
            assert g.gists(1, raw=True)[1] == raw[0]
        q.append_gists(1, x)
        qraw = q.gists(1, raw=True)
        assert qraw.dtype.names == ("q8_scales", "q8_codes") and qraw.dtype.itemsize == q8_row_bytes(d)
        with pytest.raises(mcf.InvalidArgumentError, match="q8"):
            f.write_gists(1, 0, qraw, checkpoint=None)


def test_fp16_raw_rows_do_not_pass_as_q8(tmp_path):
    """The report's case: fp16 bits read as scales and codes stored a gist off by up to 198."""
    x = np.linspace(-3, 3, 17, dtype=np.float32)[None]
    with mc.create(tmp_path / "f", embedding_dim=17, gist_dtype="fp16") as f, \
            mc.create(tmp_path / "q", embedding_dim=17, gist_dtype="q8") as q:
        f.append_tokens(np.zeros(K, np.uint32))
        q.append_tokens(np.zeros(K, np.uint32))
        f.append_gists(1, x)
        with pytest.raises(mcf.InvalidArgumentError):
            q.append_gists(1, f.gists(1, raw=True))
        assert q.num_gists(1) == 0
