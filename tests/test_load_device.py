"""Loads streamed onto a device through the ring of host buffers (mcf.loaders.device): byte for byte what the
plain CPU load returns, for every dtype and format the loaders read, whatever the ring's size; buffers reused
only once their copies are done; an error mid-stream raises and returns nothing.

Every test runs on each device torch has here: the CPU (the same pipeline, ``ring_bytes=`` sending a CPU load
through it, a thread standing in for the copy stream) and CUDA where there is a GPU.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import weakref
import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is in the test extra (the test-core legs run without it)")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="safetensors is in the test extra")

import _scaled_checkpoints as S  # noqa: E402
import mcf  # noqa: E402
import mcf.torch as mtorch  # noqa: E402
from mcf.loaders import device as ring  # noqa: E402
from mcf.loaders.weights import open_weights  # noqa: E402
from mcf.loading import plan  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device here (torch.cuda.is_available() is False)"))]
# ring sizes: smaller than most tensors, odd, a few tensors per buffer, all of it
RINGS = [(1, 61), (2, 100), (3, 1000), (4, 1 << 20)]


def _rng(tag):
    return np.random.default_rng(zlib.crc32(tag.encode()))


def _bits(t):
    t = t.detach().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1)


def _same_dicts(got, ref, where=""):
    assert list(got) == list(ref), where
    for k in ref:
        a, b = got[k], ref[k]
        assert a.dtype == b.dtype and a.shape == b.shape, (where, k, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(_bits(a), _bits(b)), (where, k)


@pytest.fixture(scope="module")
def every_dtype(tmp_path_factory):
    """One safetensors file holding every element type the loaders return (F4 and complex included), and
    tensors larger than the small rings."""
    rng = _rng("every-dtype")
    t = {}
    for dt, size in (("BF16", 2), ("F16", 2), ("F32", 4), ("F64", 8), ("I8", 1), ("U8", 1), ("I16", 2), ("U16", 2),
                     ("I32", 4), ("U32", 4), ("I64", 8), ("U64", 8), ("BOOL", 1), ("F8_E4M3", 1), ("F8_E5M2", 1),
                     ("F8_E8M0", 1), ("C64", 8)):
        shape = (37, 13) if size <= 2 else (11, 5)
        raw = rng.integers(0, 256, int(np.prod(shape)) * size, dtype=np.uint8)
        if dt == "BOOL":
            raw = raw & 1
        t[dt.lower()] = (dt, shape, raw.tobytes())
    t["f4"] = ("F4", (6, 8), rng.integers(0, 256, 24, dtype=np.uint8).tobytes())
    t["scalar"] = ("F32", (), np.float32(2.5).tobytes())
    t["empty"] = ("F16", (0, 4), b"")
    t["big"] = ("BF16", (300, 50), rng.integers(0, 256, 30000, dtype=np.uint8).tobytes())
    p = tmp_path_factory.mktemp("dtypes") / "every.safetensors"
    S.write_safetensors(str(p), t)
    return str(p)


@pytest.fixture(scope="module")
def mcf_files(tmp_path_factory):
    """An MCF file with plain tensors and quantized ones (k-quants, q4, int4, q8), and a two-shard checkpoint."""
    rng = _rng("device-mcf")
    d = tmp_path_factory.mktemp("mcf")
    p = str(d / "m.mcf")
    with mcf.Writer(p) as w:
        w.add_tensor("emb", rng.standard_normal((64, 48)).astype(np.float32))
        for m in ("k4", "q4", "int4", "q8"):
            w.add_tensor(f"{m}.weight", rng.standard_normal((32, 512)).astype(np.float32), method=m)
        w.add_tensor("half", rng.standard_normal((40, 24)).astype(np.float16))
        w.add_tensor("ids", np.arange(100, dtype=np.int32))
    ck = d / "ck"
    ck.mkdir()
    g = torch.Generator().manual_seed(3)
    parts = [{"a.weight": torch.randn(48, 32, generator=g).bfloat16(), "a.bias": torch.randn(48, generator=g)},
             {"b.weight": torch.randn(32, 48, generator=g).half(), "b.ids": torch.arange(7)}]
    wm = {}
    for i, part in enumerate(parts):
        name = f"model-0000{i + 1}-of-00002.safetensors"
        safetensors_torch.save_file(part, str(ck / name))
        wm.update({n: name for n in part})
    (ck / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return p, str(ck)


@pytest.fixture(scope="module")
def scaled(tmp_path_factory):
    d = tmp_path_factory.mktemp("scaled")
    return {"gpt-oss": S.gpt_oss(str(d / "gpt-oss")), "deepseek": S.deepseek_v3(str(d / "deepseek")),
            "modelopt": S.modelopt_nvfp4(str(d / "modelopt"))}


# -- the same bytes as the plain load ---------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("buffers,nbytes", RINGS)
def test_every_dtype_matches_the_plain_load(every_dtype, device, buffers, nbytes):
    ref = mtorch.load_file(every_dtype)
    got = mtorch.load_file(every_dtype, device=device, ring_buffers=buffers, ring_bytes=nbytes)
    assert all(t.device.type == device for t in got.values())
    _same_dicts(got, ref, (buffers, nbytes))
    got = mtorch.load_file(every_dtype, device, dtype="bfloat16", ring_buffers=buffers, ring_bytes=nbytes)
    _same_dicts(got, mtorch.load_file(every_dtype, dtype="bfloat16"), "cast")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("buffers,nbytes", [(1, 509), (2, 1000), (3, 4096), (4, 1 << 20)])
def test_mcf_plain_quantized_raw_and_casts_match_the_plain_load(mcf_files, device, buffers, nbytes):
    p, ck = mcf_files
    for kw in ({}, {"dtype": "bfloat16"}, {"dtype": "float16"}, {"dtype": torch.float64}, {"dtype": "raw"},
               {"slices": {"*.weight": mcf.Shard(1, 2, dim=1), "*": None}, "dtype": "float32"}):
        got = mtorch.load_file(p, device=device, ring_buffers=buffers, ring_bytes=nbytes, **kw)
        _same_dicts(got, mtorch.load_file(p, **kw), kw)
    for kw in ({}, {"dtype": "float32"}, {"names": ["b.*"]}):
        got = mtorch.load_file(ck, device=device, ring_buffers=buffers, ring_bytes=nbytes, **kw)
        _same_dicts(got, mtorch.load_file(ck, **kw), (ck, kw))


@pytest.mark.parametrize("device", DEVICES)
def test_load_state_dict_tensor_parallel_shares_match(mcf_files, device):
    p, ck = mcf_files
    for path in (p, ck):
        for dim in (0, 1):
            kw = {"tp_rank": 1, "tp_size": 2, "tp_dim": dim, "dtype": "bfloat16"}
            got = mtorch.load_state_dict(path, device=device, ring_buffers=2, ring_bytes=333, **kw)
            _same_dicts(got, mtorch.load_state_dict(path, **kw), (path, dim))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("which", ["gpt-oss", "deepseek", "modelopt"])
def test_block_scaled_weights_decode_into_the_ring(scaled, device, which):
    for nbytes in (512, 1 << 20):
        for kw in ({"dequantize": True}, {"dequantize": torch.bfloat16}, {}):
            got = mtorch.load_file(scaled[which], device=device, ring_buffers=3, ring_bytes=nbytes, **kw)
            _same_dicts(got, mtorch.load_file(scaled[which], **kw), (which, nbytes, kw))


@pytest.mark.parametrize("device", DEVICES)
def test_decoded_stages_larger_than_a_buffer_stream_through_in_pieces(mcf_files, device, monkeypatch):
    """A stage's output is bounded by the staging budget, not by the ring: with buffers smaller than a
    stage, each stage is decoded once and goes up in pieces."""
    p, _ = mcf_files
    want = {kw: mtorch.load_file(p, dtype=kw) for kw in ("float32", "float64")}
    monkeypatch.setattr(plan, "STAGING_BYTES", 8192)
    for kw, ref in want.items():
        _same_dicts(mtorch.load_file(p, device=device, dtype=kw, ring_buffers=2, ring_bytes=3000), ref, kw)


# -- the ring -----------------------------------------------------------------------------------------------------
class _Counting:
    """A source that records each read_into call's bytes, and fails on its ``fail_at``-th call."""

    def __init__(self, source, fail_at=None):
        self.source, self.fail_at = source, fail_at
        self.name = source.name
        self.calls = []

    def read_into(self, offsets, buffers, threads=None, chunk_bytes=None):
        self.calls.append(sum(memoryview(b).nbytes for b in buffers))
        if self.fail_at is not None and len(self.calls) >= self.fail_at:
            raise mcf.MCFIOError(f"{self.name}: read {len(self.calls)} failed (injected)")
        return self.source.read_into(offsets, buffers, threads=threads, chunk_bytes=chunk_bytes)


def _through(pieces, wrap):
    """``pieces`` reading through ``wrap(source)`` (one wrapper per source, stages' sources too)."""
    made = {}

    def w(src):
        if id(src) not in made:
            made[id(src)] = wrap(src)
        return made[id(src)]

    out = []
    for p in pieces:
        stages = None if p.stages is None else [
            dataclasses.replace(st, sources=None if st.sources is None else [w(s) for s in st.sources])
            for st in p.stages]
        out.append(dataclasses.replace(p, source=w(p.source), stages=stages))
    return out, list(made.values())


def _pieces(w, **kw):
    return w.pieces(w.order, {}, kw.get("dtype"))


@pytest.mark.parametrize("device", DEVICES)
def test_ring_buffers_are_reused_and_each_read_fits_one_buffer(every_dtype, device, monkeypatch):
    """More bytes than the ring holds: every read goes into one buffer, and only ``ring_buffers`` buffers
    are ever made, however many times they are filled."""
    made = []
    real = ring.aligned_empty
    monkeypatch.setattr(ring, "aligned_empty", lambda n, a=4096: made.append(n) or real(n, a))
    real_empty = torch.empty

    def empty(*a, **k):
        if k.get("pin_memory"):
            made.append(a[0])
        return real_empty(*a, **k)

    monkeypatch.setattr(ring._torch, "empty", empty)
    with open_weights(every_dtype) as w:
        pieces, sources = _through(_pieces(w), _Counting)
        ref = mtorch.load_file(every_dtype)
        total = sum(t.numel() * t.element_size() for t in ref.values())
        got = ring.stream_to_device(pieces, None, device=device, ring_buffers=3, ring_bytes=1024)
    calls = sources[0].calls
    assert total > 8 * 3 * 1024 and len(calls) >= total // 1024 and max(calls) <= 1024
    assert sum(calls) == total
    assert made == [1024] * 3
    for name, t in got.items():
        assert t.dtype == torch.uint8 and t.device.type == device
        assert torch.equal(t.cpu(), _bits(ref[name])), name


class _Slow:
    """A destination whose copies take a while: a ring that refilled a buffer before its copies were done
    would hand the later bytes to the earlier tensor."""

    def __init__(self, dst):
        self.dst = dst

    def copy_(self, src, non_blocking=False):
        time.sleep(0.002)
        return self.dst.copy_(src, non_blocking=non_blocking)


def test_a_buffer_is_refilled_only_once_its_copies_are_done(every_dtype, monkeypatch):
    """Copies far slower than reads, through a ring of two small buffers: every tensor still gets its own
    bytes, in the plan's order."""
    issue = ring._ThreadCopies.issue
    order = []

    def slow_issue(self, pairs):
        order.extend(d.data_ptr() for d, _ in pairs)
        return issue(self, [(_Slow(d), s) for d, s in pairs])

    monkeypatch.setattr(ring._ThreadCopies, "issue", slow_issue)
    ref = mtorch.load_file(every_dtype)
    got = mtorch.load_file(every_dtype, device="cpu", ring_buffers=2, ring_bytes=700)
    _same_dicts(got, ref)
    starts = [t.data_ptr() for t in got.values() if t.numel()]
    firsts = [p for i, p in enumerate(order) if p in starts and p not in order[:i]]
    assert firsts == starts   # each tensor's first copy comes in plan order


def test_destinations_that_exist_are_filled_in_place(mcf_files):
    p, _ = mcf_files
    ref = mtorch.load_file(p, dtype="float16")
    dest = {n: torch.full_like(t, 7) for n, t in ref.items()}
    with open_weights(p) as w:
        pieces = w.pieces(w.order, {}, "F16")
        got = ring.stream_to_device(pieces, dest, device="cpu", ring_buffers=2, ring_bytes=1000)
    assert all(got[n] is dest[n] for n in dest)
    _same_dicts(dest, ref)


@pytest.mark.parametrize("device", DEVICES)
def test_wrong_destinations_are_refused_before_anything_is_read(mcf_files, device):
    p, _ = mcf_files
    with open_weights(p) as w:
        pieces, sources = _through(w.pieces(w.order, {}, "F32"), _Counting)
        fine = {pc.name: torch.empty(pc.shape, dtype=torch.float32, device=device) for pc in pieces}
        bad = {
            "no destination": ({k: v for k, v in fine.items() if k != "half"}, "'half': no destination"),
            "size": ({**fine, "emb": fine["emb"][:-1]}, r"'emb': the destination holds 12096 bytes.*expected 12288"),
            "contiguous": ({**fine, "emb": torch.empty(48, 64, device=device).t()}, "'emb': .*not contiguous"),
            "device": ({**fine, "emb": fine["emb"].to("meta")}, "'emb': the destination is on meta"),
        }
        for dest, pattern in bad.values():
            with pytest.raises(mcf.InvalidArgumentError, match=pattern):
                ring.stream_to_device(pieces, dest, device=device)
        with pytest.raises(mcf.ArgumentTypeError, match="'emb': the destination must be a torch.Tensor"):
            ring.stream_to_device(pieces, {**fine, "emb": np.zeros((64, 48), np.float32)}, device=device)
        with pytest.raises(mcf.ArgumentTypeError, match="destinations must be a mapping"):
            ring.stream_to_device(pieces, [1], device=device)
    assert sources[0].calls == []


def test_ring_arguments_are_checked(mcf_files):
    p, _ = mcf_files
    for kw, pattern in (({"ring_buffers": 0}, "ring_buffers must be >= 1"),
                        ({"ring_bytes": 0}, "ring_bytes must be >= 1"),
                        ({"ring_bytes": 1.5}, "ring_bytes must be an integer"),
                        ({"ring_buffers": True}, "ring_buffers must be an integer")):
        with pytest.raises(mcf.InvalidArgumentError, match=pattern):
            mtorch.load_file(p, device="cpu", **kw)
    with pytest.raises(mcf.InvalidArgumentError, match="copy=False returns views of the file"):
        mtorch.load_file(p, device="cpu", copy=False, ring_bytes=4096)
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(mcf.InvalidArgumentError, match=rf"device='cuda:{n}': torch .* sees {n} CUDA device"):
        mtorch.load_file(p, device=f"cuda:{n}")
    with pytest.raises(mcf.InvalidArgumentError, match="device='gpu0' is not a torch device"):
        mtorch.load_state_dict(p, device="gpu0")


# -- errors mid-stream --------------------------------------------------------------------------------------------
def _threads():
    return {t for t in threading.enumerate() if t.name.startswith("mcf-ring")}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fail_at", [1, 2, 9, 30])
@pytest.mark.parametrize("destinations", ["fresh", "given"])
def test_a_read_failing_mid_stream_raises_and_returns_nothing(every_dtype, device, fail_at, destinations):
    ref = mtorch.load_file(every_dtype)
    with open_weights(every_dtype) as w:
        pieces, sources = _through(_pieces(w), lambda s: _Counting(s, fail_at))
        dest = None if destinations == "fresh" else {
            p.name: torch.empty(p.size * len(p.offsets), dtype=torch.uint8, device=device) for p in pieces}
        alive = []
        if dest is None:
            def dest(p):
                t = torch.empty(p.size * len(p.offsets), dtype=torch.uint8, device=device)
                alive.append(weakref.ref(t))
                return t
        with pytest.raises(mcf.MCFIOError, match=f"read {fail_at} failed"):
            ring.stream_to_device(pieces, dest, device=device, ring_buffers=2, ring_bytes=1024)
    assert len(sources[0].calls) == fail_at   # the stream stopped at the failure
    assert not _threads()
    if destinations == "fresh":
        assert len(alive) == len(ref) and all(r() is None for r in alive)   # nothing partly filled survives


@pytest.mark.parametrize("device", DEVICES)
def test_a_decode_error_mid_stream_raises_naming_the_tensor(scaled, tmp_path, device):
    """A NaN block scale in the second block-scaled weight: the load raises the decoder's error."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(scaled["gpt-oss"], bad)
    f = bad / "model.safetensors"
    raw = bytearray(f.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    name = "model.layers.0.mlp.experts.down_proj_scales"
    start = json.loads(raw[8:8 + n])[name]["data_offsets"][0]
    raw[8 + n + start + 5] = 0xFF
    f.write_bytes(bytes(raw))
    for nbytes in (256, 1 << 20):
        with pytest.raises(mcf.FormatError, match=rf"tensor '{name}' block \[5\].*NaN block scale"):
            mtorch.load_file(str(bad), device=device, dequantize=True, ring_buffers=2, ring_bytes=nbytes)
    assert not _threads()


# -- memory ---------------------------------------------------------------------------------------------------
def test_host_memory_stays_within_the_ring_and_one_staging_budget(mcf_files, monkeypatch):
    """Every host buffer the stream makes (ring buffers, staging, a spilled stage) is counted while it lives:
    the most held at once is the ring plus the staging budget, for a load many times larger than both (the
    budget holds a stage of two rows of the quantized tensors, stored and decoded to float64)."""
    p, _ = mcf_files
    budget = 16384
    monkeypatch.setattr(plan, "STAGING_BYTES", budget)
    ref = mtorch.load_file(p, dtype="float64")
    live = [0, 0]
    real = plan.aligned_empty

    def counted(n, align=4096):
        a = real(n, align)
        live[0] += n
        live[1] = max(live[1], live[0])
        weakref.finalize(a, lambda: live.__setitem__(0, live[0] - n))
        return a

    monkeypatch.setattr(plan, "aligned_empty", counted)
    monkeypatch.setattr(ring, "aligned_empty", counted)
    for buffers, nbytes in ((4, 2048), (2, 6000), (3, 16384)):
        live[1] = 0
        got = mtorch.load_file(p, device="cpu", dtype="float64", ring_buffers=buffers, ring_bytes=nbytes)
        _same_dicts(got, ref)
        total = sum(t.numel() * t.element_size() for t in ref.values())
        assert total > 8 * (buffers * nbytes + budget)
        assert 0 < live[1] <= buffers * nbytes + budget, (buffers, nbytes, live[1])
