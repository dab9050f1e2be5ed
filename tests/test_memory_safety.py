"""No public read path hands out memory whose write kills the process.

Zero-copy arrays over a file lie in its shared, read-only mapping, where a write is a SIGSEGV.  numpy's
read-only flag is what keeps writes away: every such array must be flagged read-only *and* refuse
``setflags(write=True)`` (numpy allows lifting the flag when it can find a writable owner).  The check is
made against the kernel's own account of each address (``/proc/self/maps``), not against what the
readers say of their arrays, for every format's readers: MCF, safetensors, GGUF, Megatron (one dataset
and a sharded view), MegaContext, and the bucket's KV files.  torch tensors are held to the stricter
rule, since torch ignores the flag: none may lie in a read-only mapping at all."""

from __future__ import annotations

import bisect
import sys
from pathlib import Path

import numpy as np
import pytest

import mcf
import mcf.gguf
import mcf.megacontext
import mcf.megatron
from mcf.bucket import Bucket

pytestmark = pytest.mark.skipif(not Path("/proc/self/maps").exists(),
                                reason="needs /proc/self/maps (Linux) to see the kernel's page protections")


class Maps:
    """The process's mappings: (start, end, perms) sorted by start, read once per check."""

    def __init__(self):
        self.rows = []
        for line in Path("/proc/self/maps").read_text().splitlines():
            rng, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in rng.split("-"))
            self.rows.append((lo, hi, perms))
        self.starts = [r[0] for r in self.rows]

    def writable(self, addr: int, nbytes: int) -> bool:
        i = bisect.bisect_right(self.starts, addr) - 1
        assert i >= 0 and self.rows[i][0] <= addr < self.rows[i][1], f"{addr:#x} is in no mapping"
        lo, hi, perms = self.rows[i]
        assert addr + nbytes <= hi or perms[1] == "w", "an array spans two mappings"
        return perms[1] == "w"


def check_arrays(arrays, what):
    maps = Maps()
    seen_read_only = 0
    for i, a in enumerate(arrays):
        a = np.asarray(a)
        if a.size == 0:
            continue
        base = a.__array_interface__["data"][0]
        if maps.writable(base, a.nbytes):
            continue
        seen_read_only += 1
        assert not a.flags.writeable, f"{what}[{i}]: a writeable array over a read-only mapping"
        with pytest.raises(ValueError, match="WRITEABLE"):
            a.setflags(write=True)
    return seen_read_only


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("mapped")
    rng = np.random.default_rng(23)
    w32 = rng.standard_normal((64, 96)).astype(np.float32)
    with mcf.Writer(d / "m.mcf") as w:
        w.add_tensor("w", w32)
        w.add_tensor("h", w32.astype(np.float16))
        w.add_tensor("i", np.arange(100, dtype=np.int32))
        w.add_tensor("q", w32, method="q8")
    import safetensors.numpy
    safetensors.numpy.save_file({"w": w32, "b": np.arange(7, dtype=np.int64)}, str(d / "s.safetensors"))
    for k in range(2):
        with mcf.megatron.Writer(d / f"ds{k}", dtype=np.uint16) as w:
            for i in range(20):
                w.add_document(rng.integers(0, 60000, 50 + i).astype(np.uint16), [50 + i])
    tree = mcf.megacontext.create(d / "tree", embedding_dim=16)
    tree.append_tokens(rng.integers(0, 30000, 2048))
    tree.append_gists(1, rng.standard_normal((64, 16)).astype(np.float16))
    tree.close()
    with Bucket(d / "bucket") as b:
        layers = [(rng.standard_normal((2, 64, 16), dtype=np.float32),
                   rng.standard_normal((2, 64, 16), dtype=np.float32)) for _ in range(2)]
        ctx = b.ingest("m", layers, token_ids=np.arange(64))["context_id"]
    return d, ctx


def test_mcf_and_safetensors_views(files):
    d, _ = files
    with mcf.open(d / "m.mcf") as c:
        arrays = [c.tensor(n) for n in ("w", "h", "i")] + list(mcf.load_state_dict(c).values())
        arrays += list(mcf.load_state_dict(c, tp_rank=1, tp_size=2).values())
        arrays += [c.source.view(0, 64), c.source.array(8, np.uint32, 4)]
        assert check_arrays(arrays, "mcf") >= 5
    from mcf.safetensors import open_checkpoint
    with open_checkpoint(d / "s.safetensors") as ck:
        arrays = [ck.tensors[n].array() for n in ck.sorted_names()]
        assert check_arrays(arrays, "safetensors") == 2


def test_megatron_views(files):
    d, _ = files
    with mcf.megatron.open(d / "ds0") as ds:
        arrays = [ds[3], ds.get(4, 2, 10), ds.document(5), ds[2:5] if not isinstance(ds[2:5], list) else ds[2],
                  ds.sequence_lengths, ds.sequence_pointers, ds.document_indices]
        assert check_arrays(arrays, "megatron") >= 5
    sharded = mcf.megatron.open([str(d / "ds0"), str(d / "ds1")])
    try:
        assert check_arrays([sharded[3], sharded[25], sharded.document(30)], "sharded") == 3
    finally:
        sharded.close()


def test_megacontext_views(files):
    d, _ = files
    with mcf.megacontext.open(d / "tree") as t:
        arrays = [t.tokens(), t.tokens(100, 300), t.block(3), t.gists(1), t.gist(1, 5), t.gists(1, raw=True)]
        assert check_arrays(arrays, "megacontext") >= 3


def test_bucket_views(files):
    d, ctx = files
    with Bucket(d / "bucket") as b:
        arrays = [x for kv in b.load(ctx) for x in kv]
        with b.open(ctx) as f:
            arrays += [x for kv in f.load() for x in kv]
        check_arrays(arrays, "bucket")


def test_gguf_views(tmp_path):
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    w.add_tensor("w", np.arange(256, dtype=np.float32).reshape(8, 32))
    w.add_tensor("h", np.arange(64, dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with mcf.gguf.open(tmp_path / "t.gguf") as g:
        assert check_arrays([g.raw("w"), g.array("w"), g.raw("h"), g.array("h")], "gguf") >= 2


def test_torch_tensors_never_lie_in_a_read_only_mapping(files):
    torch = pytest.importorskip("torch")
    import mcf.torch

    d, _ = files
    for copy in (True, False):
        for kw in ({}, {"tp_rank": 0, "tp_size": 2}, {"dtype": torch.float32}):
            sd = mcf.torch.load_state_dict(d / "m.mcf", copy=copy, **kw)
            maps = Maps()
            for name, t in sd.items():
                assert maps.writable(t.data_ptr(), t.numel() * t.element_size()), (copy, kw, name)
        # the safetensors drop-in and mcf.load_file's torch flavour, on both formats, whole and in pieces
        for path in (d / "m.mcf", d / "s.safetensors"):
            for kw in ({}, {"slices": {"w": mcf.Rows(1, 5)}}, {"slices": {"w": mcf.Shard(1, 2, 1)}}):
                sd = mcf.torch.load_file(path, copy=copy, **kw)
                maps = Maps()
                for name, t in sd.items():
                    assert maps.writable(t.data_ptr(), t.numel() * t.element_size()), (path, copy, kw, name)
    assert sys.modules["mcf.torch"]


def test_numpy_loaders_hand_out_read_only_views_only(files):
    """copy=False views of the new loaders lie in the shared mapping: flagged read-only, not liftable."""
    d, _ = files
    import mcf.safetensors

    arrays = list(mcf.safetensors.load_file(d / "s.safetensors", copy=False).values())
    arrays += list(mcf.load_file(d / "m.mcf", copy=False).values())
    arrays += list(mcf.load_file(d / "s.safetensors", copy=False, slices={"w": mcf.Rows(2, 9)}).values())
    assert check_arrays(arrays, "loaders") >= 5
