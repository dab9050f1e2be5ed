"""mcf.torch.load_state_dict against safetensors.torch.load_file of the same weights (packed with mcf.pack
from a checkpoint directory the safetensors package wrote), Container.dequantize for quantized tensors,
torch's own casts, concatenation of tensor-parallel shares; data_ptr() against the mappings as the proof
of where plain tensors lie (fresh memory by default, the private copy-on-write mapping with copy=False,
never the shared read-only one), and in-place operations run in a child process that must not crash."""

from __future__ import annotations

import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

import mcf  # noqa: E402
import mcf.torch as mtorch  # noqa: E402
from mcf import InvalidArgumentError  # noqa: E402


def _rng(tag):
    return np.random.default_rng(zlib.crc32(tag.encode()))


def _weights():
    g = torch.Generator().manual_seed(zlib.crc32(b"torch-loading"))
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return {
        "emb.weight": r(96, 64),
        "attn.q.weight": r(64, 64),
        "attn.q.bias": r(64),
        "mlp.up.weight": r(128, 64).half(),
        "mlp.down.weight": r(64, 128).bfloat16(),
        "norm.weight": r(64).bfloat16(),
        "conv.weight": r(8, 4, 3),
        "dbl": r(3, 2).double(),
        "pos.ids": torch.arange(96, dtype=torch.int64).reshape(1, 96),
        "mask.i8": torch.randint(-128, 127, (4, 6), dtype=torch.int8, generator=g),
        "table.u8": torch.randint(0, 255, (5, 7), dtype=torch.uint8, generator=g),
        "counts.i32": torch.randint(-2**31, 2**31 - 1, (6,), dtype=torch.int32, generator=g),
        "small.i16": torch.randint(-2**15, 2**15 - 1, (2, 3), dtype=torch.int16, generator=g),
        "scalar": torch.tensor(1.5),
        "empty": torch.zeros(0, 8),
    }


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    safetensors_torch.save_file(_weights(), str(d / "model.safetensors"))
    out = str(d / "model.mcf")
    mcf.pack(str(d), out)
    return d, out


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    rng = _rng("torch-quantized")
    p = str(tmp_path_factory.mktemp("q") / "q.mcf")
    with mcf.Writer(p) as w:
        for m in ("k4", "q4", "k2", "int4"):
            w.add_tensor(f"{m}.weight", rng.standard_normal((64, 512)).astype(np.float32), method=m)
        w.add_tensor("plain", rng.standard_normal((64, 32)).astype(np.float32))
    return p


def _same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                                 and torch.equal(a.nan_to_num(), b.nan_to_num()))


def test_equals_safetensors_torch(packed):
    d, out = packed
    ref = safetensors_torch.load_file(str(d / "model.safetensors"))
    for copy in (False, True):
        got = mtorch.load_state_dict(out, copy=copy)
        assert sorted(got) == sorted(ref)
        for name in ref:
            _same(got[name], ref[name])
            assert got[name].device.type == "cpu"


def test_the_format_modules_are_attributes_of_mcf(packed):
    """``import mcf`` then ``mcf.torch.load_file(...)``, as the docs write it: the format modules load on first
    use (a fresh interpreter, where nothing imported mcf.torch before)."""
    d, out = packed
    code = ("import sys, mcf\n"
            "assert 'mcf.torch' not in sys.modules and 'torch' not in sys.modules\n"
            f"sd = mcf.torch.load_file({str(d / 'model.safetensors')!r})\n"
            f"arrays = mcf.safetensors.load_file({str(d / 'model.safetensors')!r})\n"
            "print(len(sd), len(arrays), mcf.gguf.__name__)\n"
            "try:\n    mcf.no_such_module\nexcept AttributeError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    n = len(_weights())
    assert r.stdout.splitlines() == [f"{n} {n} mcf.gguf", "module 'mcf' has no attribute 'no_such_module'"]


def test_unsigned_16_bit(tmp_path):
    a = _rng("u16").integers(0, 2**16, size=(3, 4), dtype=np.uint16)
    with mcf.Writer(str(tmp_path / "u.mcf")) as w:
        w.add_tensor("u", a)
    t = mtorch.load_state_dict(str(tmp_path / "u.mcf"))["u"]
    want = getattr(torch, "uint16", torch.int16)
    assert t.dtype == want
    assert np.array_equal(t.view(torch.int16).numpy().view(np.uint16), a)


def test_default_tensors_are_the_callers_own(packed):
    """As safetensors.torch.load_file: fresh memory, not the file's mapping, modifiable in place."""
    _, out = packed
    with mcf.open(out) as c:
        whole = c.source.view(0, c.source.size)
        lo, hi = whole.ctypes.data, whole.ctypes.data + whole.nbytes
        sd = mtorch.load_state_dict(c)
        for name, t in sd.items():
            if t.numel():
                assert not lo <= t.data_ptr() < hi, name
        sd["emb.weight"].mul_(2)
    ref = safetensors_torch.load_file(out.replace("model.mcf", "model.safetensors"))
    _same(sd["emb.weight"], ref["emb.weight"] * 2)


def test_zero_copy_tensors_are_private_copy_on_write(packed):
    """copy=False: no tensor lies in the shared read-only mapping (a write there kills the process); they
    lie in a private copy-on-write mapping, so in-place operations work and reach neither the file nor
    another load."""
    _, out = packed
    before = Path(out).read_bytes()
    with mcf.open(out) as c:
        shared = c.source.view(0, c.source.size)
        private = c.source.cow_view(0, c.source.size)
        sd = mtorch.load_state_dict(c, copy=False)
        for name, t in sd.items():
            if t.numel():
                p, n = t.data_ptr(), t.numel() * t.element_size()
                assert not shared.ctypes.data <= p < shared.ctypes.data + shared.nbytes, name
                assert private.ctypes.data <= p and p + n <= private.ctypes.data + private.nbytes, name
        assert private.flags.writeable and not shared.flags.writeable
    ref = safetensors_torch.load_file(out.replace("model.mcf", "model.safetensors"))
    # the tensors keep the private mapping alive after the container is closed
    _same(sd["emb.weight"], ref["emb.weight"])
    for op in (lambda t: t.mul_(2), lambda t: t.add_(1), lambda t: t.copy_(torch.zeros_like(t))):
        op(sd["attn.q.weight"])
    assert not sd["attn.q.weight"].any()
    _same(mtorch.load_state_dict(out, copy=False)["attn.q.weight"], ref["attn.q.weight"])
    with mcf.open(out) as c:
        np.testing.assert_array_equal(c.tensor("attn.q.weight"), ref["attn.q.weight"].numpy())
    assert Path(out).read_bytes() == before


@pytest.mark.parametrize("copy", [True, False])
@pytest.mark.parametrize("share", [False, True])
def test_in_place_ops_never_kill_the_process(packed, copy, share):
    """The audit's crash: mul_, add_ or copy_ on a loaded tensor ended in SIGSEGV (rc 139).  The ops run
    in a child, so a crash fails this test instead of ending the suite."""
    _, out = packed
    tp = ", tp_rank=1, tp_size=2, tp_dim=lambda n, s: 0 if len(s) >= 2 and s[0] % 2 == 0 else None" if share else ""
    code = (f"import torch, mcf.torch\n"
            f"sd = mcf.torch.load_state_dict({out!r}, copy={copy}{tp})\n"
            "for t in sd.values():\n"
            "    t.mul_(2); t.add_(1); t.copy_(torch.zeros_like(t)); t.zero_()\n"
            "print('ok')")
    r = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stderr[-2000:])


def test_numpy_views_refuse_to_become_writable(packed, tmp_path):
    """numpy's read-only flag is what keeps a write off the shared mapping: no zero-copy array handed out
    by a reader may have it lifted (a write would be a SIGSEGV)."""
    _, out = packed
    with mcf.open(out) as c:
        arrays = [c.tensor(n) for n in c.keys() if not c.info(n).dtype.quantized]
        arrays += list(mcf.load_state_dict(c).values())
        arrays += [c.source.view(0, 64), c.source.array(0, np.uint8, 64)]
        for a in arrays:
            if a.size:
                with pytest.raises(ValueError, match="WRITEABLE"):
                    np.asarray(a).setflags(write=True)


def test_module_load_state_dict(packed):
    _, out = packed
    lin = torch.nn.Linear(64, 64)
    sd = mtorch.load_state_dict(out, names=["attn.q.weight", "attn.q.bias"])
    lin.load_state_dict({"weight": sd["attn.q.weight"], "bias": sd["attn.q.bias"]})
    lin.weight.data.mul_(0.5)            # the module owns a copy: the mapping is untouched
    _same(sd["attn.q.weight"] * 0.5, lin.weight.data)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, "bfloat16"])
def test_dtype_casts_floats_like_torch(packed, dtype):
    d, out = packed
    ref = safetensors_torch.load_file(str(d / "model.safetensors"))
    got = mtorch.load_state_dict(out, dtype=dtype)
    tdt = torch.bfloat16 if dtype == "bfloat16" else dtype
    for name, r in ref.items():
        if r.is_floating_point():
            # reference: torch's own round-to-nearest-even cast (through float32 for a float64 source)
            want = (r.float() if r.dtype == torch.float64 and tdt != torch.float64 else r).to(tdt)
            _same(got[name], want)
        else:
            _same(got[name], r)


def test_quantized_decoded_into_the_destination(quantized):
    with mcf.open(quantized) as c:
        for tdt, ndt in ((None, np.float32), (torch.float16, np.float16), (torch.bfloat16, "bf16")):
            sd = mtorch.load_state_dict(c, dtype=tdt)
            for name in ("k4.weight", "q4.weight", "k2.weight", "int4.weight"):
                t = sd[name]
                if ndt == "bf16":
                    want = c.dequantize(name, dtype=np.uint16)   # bf16 bit patterns
                    assert t.dtype == torch.bfloat16
                    assert np.array_equal(t.view(torch.int16).numpy().view(np.uint16), want)
                else:
                    _same(t, torch.from_numpy(c.dequantize(name, dtype=ndt)))


@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("tp_dim", [0, 1])
def test_tp_shares_concatenate(packed, quantized, tp_size, tp_dim):
    for path in (packed[1], quantized):
        with mcf.open(path) as c:
            names = [n for n in c.keys() if n not in ("scalar", "empty")
                     and (len(c.info(n).shape) < 2 or c.info(n).shape[tp_dim] % tp_size == 0)]
        full = mtorch.load_state_dict(path, names=names, dtype=torch.bfloat16)
        parts = [mtorch.load_state_dict(path, names=names, dtype=torch.bfloat16, tp_rank=r, tp_size=tp_size,
                                        tp_dim=tp_dim, threads=2) for r in range(tp_size)]
        for name, whole in full.items():
            if whole.dim() < 2:
                for p in parts:
                    _same(p[name], whole)
            else:
                _same(torch.cat([p[name] for p in parts], dim=tp_dim), whole)
                assert all(p[name].is_contiguous() for p in parts)


def test_device_move_after_decode(packed, quantized):
    sd = mtorch.load_state_dict(quantized, device="meta", dtype=torch.float16)
    assert all(t.device.type == "meta" for t in sd.values())
    assert sd["k4.weight"].shape == (64, 512) and sd["k4.weight"].dtype == torch.float16


def test_bad_arguments(packed):
    _, out = packed
    with pytest.raises(InvalidArgumentError):
        mtorch.load_state_dict(out, tp_rank=1, tp_size=1)
    with pytest.raises(mcf.DTypeError):
        mtorch.load_state_dict(out, dtype=torch.int32)
    with pytest.raises(mcf.TensorNotFoundError):
        mtorch.load_state_dict(out, names=["missing"])


def test_missing_torch_names_the_package():
    code = ("import sys; sys.modules['torch'] = None\n"
            "try:\n    import mcf.torch\nexcept ImportError as e:\n    print('ERR', e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "ERR" in r.stdout and "'torch'" in r.stdout and "pip install" in r.stdout, r.stdout + r.stderr
