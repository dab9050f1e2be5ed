"""Fuzz targets: one function per parser, shared by the libFuzzer harness (``fuzz/run.py``) and the short
in-process replay of the test suite (``tests/test_fuzz_short.py``).

Each target takes raw bytes, parses them with the real reader and reads everything the reader offers.
The contract under test: any input either works or raises an :class:`mcf.MCFError`.  Any other exception
(a stray ``struct.error``, ``IndexError``, ``MemoryError``...) propagates out of the target and is a crash;
a segfault or a sanitizer report is a crash of the process; the harness adds the 1 s hang limit and the
RSS limit.

Multi-file formats (Megatron ``.idx`` + ``.bin``, a MegaContext tree) take one input cut into parts at
:data:`SPLIT`, so that libFuzzer's mutations (which copy and insert byte runs) can still move bytes between
files.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import zlib
from pathlib import Path

import numpy as np

import mcf
import mcf.gguf  # noqa: F401  (imported here, inside atheris.instrument_imports, to be instrumented)
import mcf.megacontext as mc
import mcf.megatron as mt
from mcf.safetensors.reader import SafetensorsFile
from mcf.bucket import _npz as _bucket_npz  # noqa: F401  (instrumented, as above)
from mcf.bucket import store as _bucket_store  # noqa: F401  (instrumented, as above)
from mcf.bucket.kvfile import KVFile
from mcf.conversion import tokenize as _tokenize  # noqa: F401  (instrumented, as above)

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
VECTORS = ROOT / "tests" / "vectors"
REGRESSIONS = ROOT / "tests" / "fuzz_regressions"

MAX_SEED = 160 * 1024  # larger vectors slow every execution down for no new code reached
SPLIT = b"\n@@mcf-fuzz-part@@\n"
CTX_FILES = ("metadata.json", "LOD0.ctx", "LOD1.ctx", "LOD2.ctx")


def join_parts(*parts: bytes) -> bytes:
    return SPLIT.join(parts)


def split_parts(data: bytes, n: int) -> list:
    """``n`` parts of ``data`` (missing parts are empty, extra separators stay in the last part)."""
    parts = data.split(SPLIT, n - 1)
    return parts + [b""] * (n - len(parts))


# ------------------------------------------------------------------------------------------------
# MCF: header, directory, TensorIndex, ModelInfo, QuantInfo, resources, every tensor, dequantize
# ------------------------------------------------------------------------------------------------
def _read_mcf(c) -> None:
    for name in c:
        t = c.info(name)
        c.raw(name).tobytes()
        if t.quantized:
            c.quant_layout(name)
            c.quant_record(name)
            for arr in c.quant_regions(name).values():
                arr.tobytes()
            c.dequantize(name)
            if len(t.shape) == 2 and t.shape[0] > 1:
                c.dequantize(name, rows=(1, t.shape[0]), dtype=np.float16)
        else:
            np.asarray(c.tensor(name)).tobytes()
            if t.dtype.family == "float":
                c.to_float32(name)
                c.dequantize(name)
    _ = c.quant_info, c.model_info
    for fname in c.resources:
        c.resource_text(fname)
        if fname.endswith(".json"):
            c.resource_json(fname)
    for s in c.sections:
        c.section_bytes(s.type)
    c.verify()


def _each_mcf_error(fn, *args) -> None:
    """Run ``fn``; an MCFError ends it quietly (later reads may still be tried by the caller)."""
    try:
        fn(*args)
    except mcf.MCFError:
        pass


def _read_opened(opener, read, *, quiet: bool = False) -> None:
    """``read(opener())``, the object closed afterwards.  A refusal to open (an MCFError) ends it quietly;
    one from ``read`` too where ``quiet``, else it propagates (the target reads its parts one by one)."""
    try:
        obj = opener()
    except mcf.MCFError:
        return
    try:
        read(obj)
    except mcf.MCFError:
        if not quiet:
            raise
    finally:
        obj.close()


def mcf_container(data: bytes) -> None:
    _read_opened(lambda: mcf.open(memoryview(data)), _read_container)


def _read_container(c) -> None:
    # each accessor separately, so that one bad section does not hide the decoding of the others
    for name in list(c):
        _each_mcf_error(_read_one_tensor, c, name)
    _each_mcf_error(_read_mcf, c)


def _read_one_tensor(c, name) -> None:
    t = c.info(name)
    if t.quantized:
        c.dequantize(name)
    else:
        np.asarray(c.tensor(name)).tobytes()


# ------------------------------------------------------------------------------------------------
# Megatron .idx + .bin
# ------------------------------------------------------------------------------------------------
def _read_megatron(ds) -> None:
    n = len(ds)
    _ = ds.variant, ds.dtype, ds.multimodal
    _ = ds.sequence_lengths, ds.sequence_pointers, ds.document_indices, ds.sequence_modes
    for i in range(min(n, 64)):
        ds[i].tobytes()
    if n:
        ds[-1].tobytes()
        ds.get(0, 0, 1) if len(ds[0]) else None
        ds.gather(np.arange(min(n, 16), dtype=np.int64))[0].tobytes()
        ds[0:min(n, 8)]
    for k in range(min(ds.num_documents, 16)):
        ds.document(k).tobytes()
    _ = ds.num_tokens
    ds.verify()


def megatron(data: bytes) -> None:
    idx, binary = split_parts(data, 2)
    for validate in (True, False):
        for multimodal in (None, True):
            _read_opened(lambda: mt.IndexedDataset(memoryview(idx), memoryview(binary), validate=validate,
                                                   multimodal=multimodal), _read_megatron, quiet=True)


# ------------------------------------------------------------------------------------------------
# MegaContext tree: metadata.json + LOD0/1/2.ctx (written to a per-process scratch directory)
# ------------------------------------------------------------------------------------------------
_scratch: list = []


def _tree_dir() -> str:
    if not _scratch:
        # on tmpfs when there is one: the r+ open fsyncs its repairs, which on a disk makes this target
        # 3x slower (2.8 vs 0.85 ms per input measured) without reaching any other code
        shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        _scratch.append(tempfile.mkdtemp(prefix="mcf-fuzz-ctx-", dir=shm))
        atexit.register(shutil.rmtree, _scratch[0], True)
    return _scratch[0]


def _read_tree(t) -> None:
    _ = t.metadata, t.model_name, t.vocab_size, t.counts, t.committed_counts, t.ingestion_complete
    for level in range(3):
        t.header(level)
        n = t.num_gists(level) if level else t.num_blocks
        if level:
            t.checkpoint_ranges(level)
            if n:
                t.gist(level, 0).tobytes()
                t.gist(level, n - 1).tobytes()
                t.gists(level).tobytes()
        elif n:
            t.block(0).tobytes()
            t.block(n - 1).tobytes()
    t.tokens().tobytes()
    t.assemble(t.plan_tail(200, 40))
    t.info()


def megacontext(data: bytes) -> None:
    d = _tree_dir()
    for fname, part in zip(CTX_FILES, split_parts(data, len(CTX_FILES))):
        with open(os.path.join(d, fname), "wb") as f:
            f.write(part)
    for mode in ("r", "r+"):
        try:
            with mc.open(d, mode) as t:
                _read_tree(t)
        except mcf.MCFError:
            pass
    for prob in mc.verify(d, deep=True):
        if not isinstance(prob.error, mcf.MCFError):
            raise TypeError(f"verify listed a non-MCFError problem: {prob.error!r}")


# ------------------------------------------------------------------------------------------------
# safetensors header (the import path of mcf.pack)
# ------------------------------------------------------------------------------------------------
def safetensors(data: bytes) -> None:
    _read_opened(lambda: SafetensorsFile(memoryview(data)), _read_safetensors, quiet=True)


def _read_safetensors(f) -> None:
    for t in f.tensors.values():
        np.asarray(t.array()).tobytes()


# ------------------------------------------------------------------------------------------------
# MCB (kv_data.mcb): header, chunk table, compressed chunks, int8 scales
# ------------------------------------------------------------------------------------------------
def bucket(data: bytes) -> None:
    # the default decompression limit: what a user gets
    _read_opened(lambda: KVFile(memoryview(data)), _read_kv, quiet=True)


def _read_kv(f) -> None:
    _ = f.shape, f.dtype
    for kw in ({}, {"verify": False}, {"layers": 0, "tokens": 1}, {"dequantize": False}):
        try:
            for k, _v in f.load(**kw):
                np.asarray(k if not isinstance(k, tuple) else k[0]).tobytes()
        except mcf.MCFError:
            pass
    f.verify()


# ------------------------------------------------------------------------------------------------
# the bucket directory: registry.json, registry.journal, models/<id>.json, contexts/<id>/metadata.json
# (+ its kv_data.mcb), opened with mcf.bucket.store.Bucket in a scratch directory
# ------------------------------------------------------------------------------------------------
BUCKET_CTX = "ctx_" + "0" * 31 + "1"   # the seeds' context directory (ids in the JSON may say otherwise)
BUCKET_FILES = ("registry.json", "registry.journal", "models/m.json", f"contexts/{BUCKET_CTX}/metadata.json",
                f"contexts/{BUCKET_CTX}/kv_data.mcb")
_FIXED_TIME = 1_790_000_000.0


def _scratch_dir(key: str) -> str:
    """A per-process scratch directory on tmpfs when there is one (these targets write files)."""
    d = os.path.join(_tree_dir(), key)
    os.makedirs(d, exist_ok=True)
    return d


def bucket_dir(data: bytes) -> None:
    from mcf.bucket.store import Bucket

    root = _scratch_dir("bucket")
    shutil.rmtree(root)
    for rel, part in zip(BUCKET_FILES, split_parts(data, len(BUCKET_FILES))):
        p = os.path.join(root, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.write(part)

    def calls(b):
        yield lambda: b.registry()
        yield lambda: b.discover("m")
        yield lambda: b.discover("m", include_expired=True, force_scan=True)
        yield lambda: b.model("m")
        yield lambda: b.lookup(BUCKET_CTX)
        yield lambda: b.load(BUCKET_CTX, record_access=False)
        yield lambda: b.check_compatible(BUCKET_CTX, "m")
        yield lambda: b.lookup_prefix("m", list(range(600)))
        yield lambda: b.scan()
        yield lambda: b.rebuild(emit=False)
        yield lambda: b.discover("m")

    try:
        b = Bucket(root, clock=lambda: _FIXED_TIME, create=False)
    except mcf.MCFError:
        return
    for call in calls(b):
        try:
            call()
        except mcf.MCFError:
            pass


# ------------------------------------------------------------------------------------------------
# the bucket server's upload: an .npz of k and v read by mcf.bucket._npz (no decompression bomb, float or
# integer data, k and v alike), then every array read in full
# ------------------------------------------------------------------------------------------------
def bucket_npz(data: bytes) -> None:
    from mcf.bucket._npz import read_kv_npz

    p = os.path.join(_scratch_dir("bucket_npz"), "body.npz")
    with open(p, "wb") as f:
        f.write(data)
    with open(p, "rb") as f:
        try:
            arrays = read_kv_npz(f, limit=64 << 20, name="body")
        except mcf.MCFError:
            return
        with arrays:
            for k, v in arrays.layers():
                np.asarray(k).tobytes()
                np.asarray(v).tobytes()


def _bucket_npz_seeds() -> list:
    import io

    r = np.random.default_rng(11)
    k = r.standard_normal((2, 2, 6, 4)).astype(np.float32)
    out = []
    for save, kk, vv in ((np.savez, k, k + 1), (np.savez_compressed, k.astype(np.float16), k.astype(np.float16)),
                         (np.savez, np.asfortranarray(k.astype(np.int16)), k.astype(np.int16)),
                         (np.savez_compressed, k[:, :, :0], k[:, :, :0])):
        bio = io.BytesIO()
        save(bio, k=kk, v=vv)
        out.append(bio.getvalue())
    return out


def _bucket_dir_seeds() -> list:
    """Small buckets made with the public API (fixed clock and content, so fixed bytes), their one
    context moved to BUCKET_CTX; file stamps (inode, mtime) replaced by constants."""
    import re

    from mcf.bucket.store import Bucket

    out = []
    for k, (ttl, tokens, compression) in enumerate([(None, True, "lz4"), (3600.0, False, "none"),
                                                    (None, False, "zstd")]):
        with tempfile.TemporaryDirectory() as d:
            b = Bucket(d, clock=lambda: _FIXED_TIME)
            if k != 1:
                b.register_model("m", architecture="llama", num_layers=2)
            kv = np.arange(2 * 8 * 4, dtype=np.float32).reshape(2, 8, 4) / 7
            kw = {"token_ids": list(range(8))} if tokens else {"content": f"seed {k}"}
            if k == 0:
                b.prefix_chunk_tokens = 4
            cid = b.ingest("m", [(kv, kv + 1), (kv - 1, kv)], ttl=ttl, compression=compression, **kw)["context_id"]
            parts = []
            for rel in BUCKET_FILES:
                p = os.path.join(d, rel.replace(BUCKET_CTX, cid))
                raw = Path(p).read_bytes() if os.path.exists(p) else b""
                raw = raw.replace(cid.encode(), BUCKET_CTX.encode())
                raw = re.sub(rb"\[\d+,\s*\d+,\s*\d+\]", b"[1,1,1]", raw)
                if rel == "registry.journal":  # lines are "<crc32 of the body, 8 hex> <body>": re-sign them
                    raw = b"".join(b"%08x " % zlib.crc32(line[9:]) + line[9:] + b"\n"
                                   for line in raw.splitlines() if len(line) > 9)
                parts.append(raw)
            out.append(join_parts(*parts))
    return out


# ------------------------------------------------------------------------------------------------
# the Megatron tokenizer's input: JSON lines (or text, or either compressed), read by iter_documents
# ------------------------------------------------------------------------------------------------
def jsonl(data: bytes) -> None:
    from mcf.conversion import tokenize

    d = _scratch_dir("jsonl")
    fast = tokenize._orjson
    for name, key, decoder in (("in.jsonl", "text", fast), ("in.jsonl", "t", None), ("in.txt", "text", fast)):
        p = os.path.join(d, name)
        with open(p, "wb") as f:
            f.write(data)
        tokenize._orjson = decoder  # None: the json module, what users without orjson get
        try:
            for doc in tokenize.iter_documents(p, json_key=key, position=[0]):
                if not isinstance(doc, (str, list)):
                    raise TypeError(f"iter_documents yielded {type(doc).__name__}")
        except mcf.MCFError:
            pass
        finally:
            tokenize._orjson = fast


def _jsonl_seeds() -> list:
    import gzip
    import json

    lines = b"".join(json.dumps(o).encode() + b"\n" for o in (
        {"text": "hello world"}, {"text": ["one sentence.", "two"], "t": "x"}, {"text": "\u00e9\u4e2d\ud83d\ude00"},
        {"id": 3, "text": ""}))
    out = [lines, lines.replace(b"\n", b"\r\n") + b"\n\n", gzip.compress(lines, mtime=0)]
    try:
        import zstandard

        out.append(zstandard.ZstdCompressor().compress(lines))
    except ImportError:
        pass
    return out


# ------------------------------------------------------------------------------------------------
# GGUF (mcf.gguf): header, metadata, tensor infos, every tensor decoded, conversion to MCF
# ------------------------------------------------------------------------------------------------
def gguf(data: bytes) -> None:
    import mcf.gguf as G
    import mcf.conversion.gguf as GC

    def read(g) -> None:
        _ = g.metadata, g.version, g.alignment
        for name in list(g):
            t = g.info(name)
            _each_mcf_error(lambda n=name: g.raw(n).tobytes())
            if t.ggml_type in G.SUPPORTED_TYPES:
                _each_mcf_error(lambda n=name: g.dequantize(n).tobytes())
                if len(t.shape) >= 2 and t.shape[0] > 1:
                    _each_mcf_error(lambda n=name, r=t.shape[0]: g.dequantize(n, rows=(1, r), dtype=np.float16))
            _each_mcf_error(lambda n=name: np.asarray(g.array(n)).tobytes())
        _each_mcf_error(GC.model_info, g)
        _each_mcf_error(GC.metadata_json, g)
        out = os.path.join(_scratch_dir("gguf"), "out.mcf")
        _each_mcf_error(GC.convert_gguf, memoryview(data), out)
        if os.path.exists(out):
            with mcf.open(out) as c:
                _read_mcf(c)

    _read_opened(lambda: G.open(memoryview(data)), read)


def _gguf_seeds() -> list:
    """Small files written by gguf-py's GGUFWriter: float tensors, the ggml quants gguf-py can
    quantize, and the K-quants (random blocks) with every metadata value type."""
    import gguf as gg

    Q = gg.GGMLQuantizationType
    r = np.random.default_rng(zlib.crc32(b"gguf-seeds"))
    x = r.standard_normal((4, 256)).astype(np.float32)

    def one(fill) -> bytes:
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "s.gguf")
            w = gg.GGUFWriter(p, "llama")
            fill(w)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
            w.close()
            return Path(p).read_bytes()

    def floats(w):
        w.add_block_count(2)
        w.add_context_length(128)
        w.add_string("general.name", "seed")
        w.add_array("tokenizer.ggml.tokens", ["a", "b", "\u00e9"])
        w.add_array("x.ints", [1, -2, 3])
        w.add_bool("x.flag", True)
        w.add_float32("x.eps", 1e-5)
        w.add_uint64("x.big", 2**40)
        w.add_tensor("t.f32", x)
        w.add_tensor("t.f16", x.astype(np.float16))
        w.add_tensor("t.bf16", gg.quants.quantize(x, Q.BF16), raw_dtype=Q.BF16)
        w.add_tensor("t.f64", x[:1].astype(np.float64))
        w.add_tensor("t.i32", np.arange(16, dtype=np.int32))

    def quants(w):
        w.add_string("general.name", "quants")
        for q in (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1):
            w.add_tensor(f"t.{q.name}", gg.quants.quantize(x, q), raw_dtype=q)

    def kquants(w):
        w.add_custom_alignment(64)
        for q in (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_K):
            block, size = gg.GGML_QUANT_SIZES[q]
            raw = r.integers(0, 256, (2, 256 // block * size), dtype=np.uint8)
            w.add_tensor(f"t.{q.name}", raw, raw_dtype=q)

    return [one(floats), one(quants), one(kquants)]


# ------------------------------------------------------------------------------------------------
# importance matrices (mcf.conversion.imatrix): llama.cpp's GGUF imatrix and legacy .dat
# ------------------------------------------------------------------------------------------------
def imatrix(data: bytes) -> None:
    from mcf.conversion.imatrix import read_imatrix

    p = os.path.join(_scratch_dir("imatrix"), "in.imatrix")
    with open(p, "wb") as f:
        f.write(data)
    try:
        imat = read_imatrix(p)
    except mcf.MCFError:
        return
    for v in imat.values():  # what the quantizer does with an entry
        if v.ndim == 1 and 0 < v.shape[0] <= 4096:
            _each_mcf_error(lambda v=v: mcf.quantize(np.ones((2, v.shape[0]), np.float32), "k4", importance=v))


def _imatrix_seeds() -> list:
    """Our writer's GGUF, a llama-imatrix-style GGUF written by gguf-py (in_sum, 3-D expert entries), a
    legacy .dat with and without its trailer."""
    import struct

    import gguf as gg

    from mcf.conversion.imatrix import ImportanceCollector

    r = np.random.default_rng(zlib.crc32(b"imatrix-seeds"))
    out = []
    with tempfile.TemporaryDirectory() as d:
        col = ImportanceCollector()
        col.add("blk.0.attn_q.weight", r.standard_normal((5, 64)).astype(np.float32))
        col.add("blk.0.ffn_down.weight", r.standard_normal((3, 40)).astype(np.float32))
        p = os.path.join(d, "a.gguf")
        col.write(p, datasets=["calib.txt"], chunk_count=2, chunk_size=64)
        out.append(Path(p).read_bytes())
        p = os.path.join(d, "b.gguf")
        w = gg.GGUFWriter(p, arch="")
        w.kv_data[0].pop("general.architecture", None)
        w.add_string("general.type", "imatrix")
        w.add_array("imatrix.datasets", ["wiki"])
        w.add_uint32("imatrix.chunk_count", 3)
        w.add_uint32("imatrix.chunk_size", 512)
        w.add_tensor("blk.0.attn_k.weight.in_sum", r.random((1, 32)).astype(np.float32))
        w.add_tensor("blk.0.attn_k.weight.in_sum2", r.random((1, 32)).astype(np.float32))
        w.add_tensor("blk.0.attn_k.weight.counts", np.array([[7.0]], np.float32))
        w.add_tensor("blk.0.ffn_up_exps.weight.in_sum2", r.random((3, 16)).astype(np.float32))
        w.add_tensor("blk.0.ffn_up_exps.weight.counts", np.array([[1.0], [0.0], [2.0]], np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        out.append(Path(p).read_bytes())
    legacy = [struct.pack("<i", 2)]
    for name, ncall, n in (("blk.0.attn_v.weight", 4, 16), ("output.weight", 0, 8)):
        legacy += [struct.pack("<i", len(name)), name.encode(), struct.pack("<ii", ncall, n),
                   r.random(n).astype("<f4").tobytes()]
    out.append(b"".join(legacy))
    out.append(b"".join(legacy) + struct.pack("<ii", 5, 4) + b"wiki")
    return out


TARGETS = {
    "bucket": bucket,
    "imatrix": imatrix,
    "gguf": gguf,
    "bucket_dir": bucket_dir,
    "bucket_npz": bucket_npz,
    "jsonl": jsonl,
    "mcf": mcf_container,
    "megatron": megatron,
    "megacontext": megacontext,
    "safetensors": safetensors,
}


# ------------------------------------------------------------------------------------------------
# seed corpora: the golden fixtures and vectors
# ------------------------------------------------------------------------------------------------
def _safetensors_seeds() -> list:
    import json
    import struct

    def one(header: dict, payload: bytes) -> bytes:
        h = json.dumps(header).encode()
        return struct.pack("<Q", len(h)) + h + payload

    return [
        one({"__metadata__": {"format": "pt"}, "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
             "b": {"dtype": "BF16", "shape": [3], "data_offsets": [16, 22]}}, bytes(range(22))),
        one({"x": {"dtype": "I8", "shape": [], "data_offsets": [0, 1]}}, b"\x07"),
        one({}, b""),
    ]


def seeds(target: str) -> list:
    """The seed inputs of ``target`` (bytes), from the committed golden fixtures and vectors."""
    if target == "mcf":
        files = sorted(FIXTURES.glob("*.mcf")) + sorted((VECTORS / "mantle" / "files").glob("*.mcf"))
        return [p.read_bytes() for p in files if p.stat().st_size <= MAX_SEED]
    if target == "megatron":
        d = FIXTURES / "megatron"
        return [join_parts(p.read_bytes(), p.with_suffix(".bin").read_bytes()) for p in sorted(d.glob("*.idx"))]
    if target == "megacontext":
        d = FIXTURES / "megacontext"
        return [join_parts(*((t / f).read_bytes() for f in CTX_FILES))
                for t in sorted(p for p in d.iterdir() if p.is_dir())]
    if target == "bucket":
        return [p.read_bytes() for p in sorted((FIXTURES / "bucket").glob("*.mcb"))]
    built = {"safetensors": _safetensors_seeds, "bucket_dir": _bucket_dir_seeds, "bucket_npz": _bucket_npz_seeds,
             "jsonl": _jsonl_seeds, "gguf": _gguf_seeds, "imatrix": _imatrix_seeds}   # seeds written on the fly
    if target in built:
        return built[target]()
    raise KeyError(target)


def regressions(target: str) -> list:
    """Every input that ever made ``target`` fail (``tests/fuzz_regressions/<target>/``)."""
    d = REGRESSIONS / target
    return sorted(p for p in d.iterdir() if p.is_file()) if d.is_dir() else []
