"""Independent references for the Megatron dataset tests: a plain-numpy reader and a plain-Python writer
written the way Megatron-LM's ``indexed_dataset.py`` does it (struct + ``numpy.frombuffer``, a Python
pointer loop), and Megatron's own compiled ``helpers_cpp`` and GPT index builders taken from the
``megatron-core`` wheel on PyPI (no torch needed: the functions are lifted out of ``gpt_dataset.py``
with ``ast``, and the compiled module is loaded from its file)."""

from __future__ import annotations

import ast
import glob
import importlib.util
import json
import os
import struct
import subprocess
import sys
import zipfile

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
         8: np.uint16}
FAIRSEQ_CODES = {**CODES, 7: np.float64, 9: np.uint32, 10: np.uint64}
MEGATRON_CORE = "megatron-core==0.16.1"


def ref_read(prefix: str, multimodal: bool = False) -> dict:
    """Parse PREFIX.idx like Megatron's _IndexReader; return the arrays and every sequence."""
    with open(prefix + ".idx", "rb") as f:
        data = f.read()
    assert data[:9] == MAGIC
    (version,) = struct.unpack_from("<Q", data, 9)
    assert version == 1
    code = data[17]
    (n,) = struct.unpack_from("<Q", data, 18)
    fairseq = len(data) == 26 + 12 * n
    if fairseq:
        dtype = np.dtype(FAIRSEQ_CODES[code])
        off = 26
        d = 0
    else:
        dtype = np.dtype(CODES[code])
        (d,) = struct.unpack_from("<Q", data, 26)
        off = 34
    lengths = np.frombuffer(data, np.int32, n, off)
    pointers = np.frombuffer(data, np.int64, n, off + 4 * n)
    docs = np.frombuffer(data, np.int64, d, off + 12 * n) if not fairseq else None
    modes = np.frombuffer(data, np.int8, n, off + 12 * n + 8 * d) if multimodal else None
    binary = np.fromfile(prefix + ".bin", dtype=np.uint8)
    seqs = [binary[p:p + ln * dtype.itemsize].view(dtype) for p, ln in zip(pointers.tolist(), lengths.tolist())]
    return {"dtype": dtype, "code": code, "lengths": lengths, "pointers": pointers, "docs": docs, "modes": modes,
            "seqs": seqs, "fairseq": fairseq}


def ref_write(prefix: str, documents, dtype, multimodal: bool = False) -> None:
    """Write like Megatron's IndexedDatasetBuilder: ``documents`` is a list of documents, each a list
    of (tokens, mode) sequences; pointers by a Python loop, arrays by ``numpy.array(...).tobytes()``."""
    dtype = np.dtype(dtype)
    code = {np.dtype(v): k for k, v in CODES.items()}[dtype]
    lengths, modes, doc_idx = [], [], [0]
    with open(prefix + ".bin", "wb") as f:
        for doc in documents:
            for tokens, mode in doc:
                arr = np.array(tokens, dtype=dtype)
                f.write(arr.tobytes(order="C"))
                lengths.append(arr.size)
                modes.append(mode)
            doc_idx.append(len(lengths))
    pointers, cur = [], 0
    for ln in lengths:
        pointers.append(cur)
        cur += ln * dtype.itemsize
    with open(prefix + ".idx", "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(np.array(lengths, dtype=np.int32).tobytes(order="C"))
        f.write(np.array(pointers, dtype=np.int64).tobytes(order="C"))
        f.write(np.array(doc_idx, dtype=np.int64).tobytes(order="C"))
        if multimodal:
            f.write(np.array(modes, dtype=np.int8).tobytes(order="C"))


def ref_write_fairseq(prefix: str, sequences, code: int) -> None:
    """fairseq's MMapIndexedDataset writer: no document index."""
    dtype = np.dtype(FAIRSEQ_CODES[code])
    lengths = []
    with open(prefix + ".bin", "wb") as f:
        for s in sequences:
            a = np.array(s, dtype=dtype)
            f.write(a.tobytes())
            lengths.append(a.size)
    pointers, cur = [], 0
    for ln in lengths:
        pointers.append(cur)
        cur += ln * dtype.itemsize
    with open(prefix + ".idx", "wb") as f:
        f.write(MAGIC + struct.pack("<Q", 1) + struct.pack("<B", code) + struct.pack("<Q", len(lengths)))
        f.write(np.array(lengths, dtype=np.int32).tobytes())
        f.write(np.array(pointers, dtype=np.int64).tobytes())


# -- the megatron-core wheel ---------------------------------------------------------------------------
def cache_dir() -> str:
    return os.environ.get("MCF_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mcf")


class OracleLoadError(RuntimeError):
    """The downloaded helpers_cpp does not import on this interpreter."""


class MegatronOracle:
    """``helpers_cpp`` (compiled, from the wheel) and the pure-numpy GPT index builders of
    ``gpt_dataset.py`` (lifted with ast, so torch is not imported)."""

    def __init__(self, so_path: str, gpt_source: str):
        spec = importlib.util.spec_from_file_location("helpers_cpp", so_path)  # PyInit_helpers_cpp
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        self.helpers = mod
        self.so_path = so_path
        tree = ast.parse(gpt_source)
        keep = [n for n in tree.body if isinstance(n, ast.FunctionDef)
                and n.name in ("_build_document_index", "_build_shuffle_index")]
        ns = {"numpy": np}
        exec(compile(ast.Module(body=keep, type_ignores=[]), "megatron/core/datasets/gpt_dataset.py", "exec"), ns)
        self.build_document_index = ns["_build_document_index"]
        self.build_shuffle_index = ns["_build_shuffle_index"]
        # GPTDataset._query_document_sample_shuffle_indices, as a plain function of (self, idx)
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GPTDataset")
        fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef)
                  and n.name == "_query_document_sample_shuffle_indices")
        ns2 = {"numpy": np, "Tuple": tuple}
        exec(compile(ast.Module(body=[fn], type_ignores=[]), "gpt_dataset.py", "exec"), ns2)
        self.query_sample = ns2["_query_document_sample_shuffle_indices"]

    def build_sample_idx(self, sizes, doc_idx, seq, epochs, tpe, drop_last, extra):
        """Megatron's helpers.build_sample_idx wrapper: int32 unless the index would not fit."""
        if max(doc_idx.shape[0], sizes.max()) <= np.iinfo(np.int32).max:
            return self.helpers.build_sample_idx_int32(sizes, doc_idx, seq, epochs, tpe, drop_last, extra)
        return self.helpers.build_sample_idx_int64(sizes, doc_idx, seq, epochs, tpe, drop_last, extra)


def megatron_wheel_dir(scratch) -> str:
    """The directory holding the files mcf's tests take from the megatron-core wheel (``helpers_cpp*.so``,
    ``gpt_dataset.py``, ``indexed_dataset.py``...), downloaded once (``pip download --no-deps``, into the
    directory ``scratch``: the caller's pytest temporary directory) into the mcf cache.  Raises RuntimeError
    when the wheel cannot be had.

    The cache is per interpreter (``megatron-core-0.16.1-cp312``): helpers_cpp is compiled for one
    CPython version, and a copy cached by another interpreter would not import."""
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    dest = os.path.join(cache_dir(), MEGATRON_CORE.replace("==", "-") + f"-{tag}")
    sos = glob.glob(os.path.join(dest, "helpers_cpp*.so"))
    wanted = [os.path.join(dest, n) for n in ("gpt_dataset.py", "indexed_dataset.py")]
    if not sos or not all(os.path.exists(p) for p in wanted):
        tmp = os.fspath(scratch)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", tmp, MEGATRON_CORE]
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
        wheels = glob.glob(os.path.join(tmp, "*.whl"))
        if r.returncode != 0 or not wheels:
            raise RuntimeError(f"could not download {MEGATRON_CORE} for {tag}: {r.stderr.strip()[-400:]}")
        staging = dest + f".partial-{os.getpid()}"
        os.makedirs(staging, exist_ok=True)
        with zipfile.ZipFile(wheels[0]) as z:
            for m in z.namelist():
                base = os.path.basename(m)
                if m.startswith("megatron/core/datasets/") and (base.startswith("helpers_cpp") or base in (
                        "gpt_dataset.py", "helpers.cpp", "indexed_dataset.py")):
                    with z.open(m) as s, open(os.path.join(staging, base), "wb") as d:
                        d.write(s.read())
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        try:
            os.rename(staging, dest)
        except OSError:
            import shutil

            shutil.rmtree(staging, ignore_errors=True)
        sos = glob.glob(os.path.join(dest, "helpers_cpp*.so"))
    if not sos:
        raise RuntimeError(f"{MEGATRON_CORE} has no compiled helpers_cpp for this platform")
    return dest


def load_megatron_oracle(scratch) -> MegatronOracle:
    """Download the megatron-core wheel for this interpreter once (:func:`megatron_wheel_dir`) and load its
    helpers.  Raises RuntimeError when the wheel cannot be had, OracleLoadError (also a RuntimeError) when its
    compiled helper does not load here."""
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    dest = megatron_wheel_dir(scratch)
    sos = glob.glob(os.path.join(dest, "helpers_cpp*.so"))
    gpt = os.path.join(dest, "gpt_dataset.py")
    with open(gpt, encoding="utf-8") as f:
        src = f.read()
    try:
        return MegatronOracle(sos[0], src)
    except ImportError as exc:
        raise OracleLoadError(f"{os.path.basename(sos[0])} (from {MEGATRON_CORE}) does not load on "
                              f"Python {tag}: {exc}") from None


def load_megatron_builder(scratch):
    """Megatron-LM's own ``IndexedDatasetBuilder`` (with its ``_IndexReader``, ``_IndexWriter`` and ``DType``),
    lifted with ``ast`` out of the wheel's ``indexed_dataset.py`` so that neither torch nor the rest of
    megatron.core is imported: ``add_index`` and ``finalize`` (what ``tools/merge_datasets.py`` calls) run as
    written there.  Its logging is a no-op, and so is its ``gc.collect()`` after each ``add_index`` (it only
    frees memory, and a thousand full collections would take the test's seconds).  Raises RuntimeError when
    the wheel cannot be had."""
    import enum
    import shutil
    import types
    import typing
    from collections.abc import Iterable
    from itertools import accumulate

    path = os.path.join(megatron_wheel_dir(scratch), "indexed_dataset.py")
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    names = {"DType", "_IndexWriter", "_IndexReader", "IndexedDatasetBuilder", "get_idx_path", "get_bin_path"}
    keep = []
    for n in tree.body:
        if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name in names:
            keep.append(n)
        elif isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "_INDEX_HEADER" for t in n.targets):
            keep.append(n)
    ns = {"numpy": np, "struct": struct, "shutil": shutil, "os": os, "time": __import__("time"), "Enum": enum.Enum,
          "Iterable": Iterable, "accumulate": accumulate, "TracebackType": types.TracebackType,
          "gc": types.SimpleNamespace(collect=lambda: 0), "logging": __import__("logging"), "logger": None,
          "log_single_rank": lambda *a, **k: None, "lru_cache": __import__("functools").lru_cache,
          "torch": types.SimpleNamespace(Tensor=object),
          "MultiStorageClientFeature": types.SimpleNamespace(is_enabled=lambda: False),
          **{k: getattr(typing, k) for k in ("List", "Optional", "Tuple", "Type", "Union")}}
    exec(compile(ast.Module(body=keep, type_ignores=[]), "megatron/core/datasets/indexed_dataset.py", "exec"), ns)
    return types.SimpleNamespace(**{k: ns[k] for k in names})


def run_datatrove(tmp_path, name: str, texts, tokenizer_file: str, eos) -> tuple:
    """datatrove's own tokenizer step (``JsonlReader`` + ``MegatronDocumentTokenizer``, one task) on
    ``texts`` written as JSON lines under ``tmp_path``: ``(the JSON lines' path, the output's prefix)``."""
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.tokens.megatron_tokenizer import MegatronDocumentTokenizer

    inp = tmp_path / f"{name}-in"
    inp.mkdir()
    with open(inp / "docs.jsonl", "w", encoding="utf-8") as f:
        for d in texts:
            f.write(json.dumps({"text": d}) + "\n")
    LocalPipelineExecutor(
        pipeline=[JsonlReader(str(inp)),
                  MegatronDocumentTokenizer(output_folder=str(tmp_path / name), tokenizer_name_or_path=tokenizer_file,
                                            eos_token=eos)],
        tasks=1, workers=1, logging_dir=str(tmp_path / f"{name}-logs")).run()
    return str(inp / "docs.jsonl"), str(tmp_path / name / "00000_tokens")
